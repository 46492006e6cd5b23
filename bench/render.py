#!/usr/bin/env python3
"""Render time and peak memory for 100, 1 000 and 10 000 services x 10 endpoints, both backends.

Each measurement runs in its own child process so that peak RSS belongs to that render alone.
Prints one table; the ratio columns are what to compare across machines (this one is noisy:
2 shared cores), e.g. time against the 1 s target and nft against iptables in the same run.

With `--restore N` (root), a second table sets nfproxy's iptables full-sync payload for N
services against a kube-proxy-layout payload of the same services that this bench writes itself
(see kube_proxy_payload): bytes, and `iptables-legacy-restore` time into a throwaway network
namespace, whole processes, the two payloads interleaved run by run, best and median, and the
restore process's own peak RSS (the iptables backend's cold-start peak is mostly this child's).

    .venv/bin/python bench/render.py [--sizes 100,1000,10000] [--endpoints 10] [--repeat 3]
    .venv/bin/python bench/render.py --sizes '' --restore 3000 --restore-runs 7
    .venv/bin/python bench/render.py --sizes 5000,10000 --repeat 5 --compare-tree /tmp/old-checkout
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET_SECONDS = 1.0


def measure(backend: str, services: int, endpoints: int, root: str = ROOT) -> dict[str, float]:
    """Runs in the child: build the model, then time render + text for both families, with
    the nfproxy of the checkout at `root`."""
    sys.path.insert(0, root)
    from nfproxy.core.model import IPFamily
    from nfproxy.testing import uniform_cluster

    # The backend is imported before the clock starts: import time is not render time.
    if backend == "iptables":
        from nfproxy.backends.iptables import render as iptables

        def text_of(state, f):
            return iptables.render(state, f).restore_text()
    else:
        from nfproxy.backends.nft import render as nft

        def text_of(state, f):
            return nft.render(state, f).script()

    state = uniform_cluster(services, endpoints)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start, cpu = time.perf_counter(), time.process_time()
    text = "".join(text_of(state, f) for f in IPFamily)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"seconds": seconds, "cpu": cpu, "rss_mib": (after - before) / 1024, "bytes": len(text)}


def run_child(backend: str, services: int, endpoints: int, root: str = ROOT) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, __file__, "--child", backend, str(services), str(endpoints), "--root", root],
        capture_output=True, text=True, check=True,
    )
    return json.loads(out.stdout)


def compare_trees(old: str, sizes: list[int], endpoints: int, rounds: int) -> None:
    """This checkout against the one at `old` (e.g. a `git archive` of an earlier commit), in
    one run: each round renders every size with both trees, in alternating order, so that the
    machine's load falls on both alike. Ratios are within a tree (nft/ipt) and across trees
    (this/old), of the best and of the median round; CPU seconds (process time) beside wall
    seconds, since on a shared machine the CPU time is the steadier of the two."""
    old = os.path.abspath(old)
    trees = {"old": old, "this": ROOT}
    print(f"render A/B: this tree {ROOT} against {old}; services x {endpoints} endpoints, both "
          f"families, {rounds} rounds alternating")
    print(f"{'services':>9} {'tree':>5} {'ipt best':>9} {'nft best':>9} {'nft med':>8} {'nft/ipt':>8} "
          f"{'ipt cpu':>8} {'nft cpu':>8} {'cpu n/i':>8} {'nft MiB':>8}")
    med = statistics.median
    for n in sizes:
        runs: dict[str, dict[str, list[dict[str, float]]]] = {t: {"iptables": [], "nft": []} for t in trees}
        for i in range(rounds):
            for tree in (("old", "this") if i % 2 == 0 else ("this", "old")):
                for backend in ("iptables", "nft"):
                    runs[tree][backend].append(run_child(backend, n, endpoints, trees[tree]))

        def best(tree: str, backend: str, field: str = "seconds") -> float:
            return min(r[field] for r in runs[tree][backend])

        for tree in trees:
            nft_wall = [r["seconds"] for r in runs[tree]["nft"]]
            print(f"{n:>9} {tree:>5} {best(tree, 'iptables'):>9.3f} {best(tree, 'nft'):>9.3f} "
                  f"{med(nft_wall):>8.3f} {best(tree, 'nft') / best(tree, 'iptables'):>8.2f} "
                  f"{best(tree, 'iptables', 'cpu'):>8.3f} {best(tree, 'nft', 'cpu'):>8.3f} "
                  f"{best(tree, 'nft', 'cpu') / best(tree, 'iptables', 'cpu'):>8.2f} "
                  f"{max(r['rss_mib'] for r in runs[tree]['nft']):>8.1f}")
        wall = best("this", "nft") / best("old", "nft")
        wall_med = med([r["seconds"] for r in runs["this"]["nft"]]) / med([r["seconds"] for r in runs["old"]["nft"]])
        cpu = best("this", "nft", "cpu") / best("old", "nft", "cpu")
        print(f"{n:>9} nft this/old: wall best {wall:.3f}, wall median {wall_med:.3f}, cpu best {cpu:.3f}")


# ---- kube-proxy's payload, written from its proxier's conventions (not from nfproxy's renderer)


def _kp_hash(text: str) -> str:
    """kube-proxy's chain-name hash: base32 of sha256, first 16 characters."""
    return base64.b32encode(hashlib.sha256(text.encode()).digest()).decode()[:16]


def kube_proxy_payload(state) -> str:
    """What kube-proxy's iptables proxier (v1.30 layout) restores on a full sync of `state`,
    for the services the bench builds (IPv4 TCP ClusterIP, remote endpoints, cluster CIDR
    masquerade): its chain declaration order (top-level chains, then per service its SVC and
    SEP chains), its rule order (KUBE-POSTROUTING and KUBE-MARK-MASQ first, then per service
    the KUBE-SERVICES jump followed by that service's chains, the nodeports rule last), bare
    one-word comments, no endpoint comments past 1 000 endpoints. Jumps from built-in chains
    are not part of kube-proxy's restore (it ensures them with `iptables -C/-I`)."""
    mark = "0x4000"
    cidr = state.node.cluster_cidrs[0] if state.node.cluster_cidrs else ""
    large = sum(len(eps) for eps in state.endpoints.values()) > 1000
    filter_chains = ["KUBE-SERVICES", "KUBE-EXTERNAL-SERVICES", "KUBE-FORWARD", "KUBE-NODEPORTS",
                     "KUBE-PROXY-FIREWALL"]
    nat_chains = ["KUBE-SERVICES", "KUBE-NODEPORTS", "KUBE-POSTROUTING", "KUBE-MARK-MASQ"]
    nat_rules = [
        f"-A KUBE-POSTROUTING -m mark ! --mark {mark}/{mark} -j RETURN",
        f"-A KUBE-POSTROUTING -j MARK --xor-mark {mark}",
        '-A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring SNAT"'
        " -j MASQUERADE --random-fully",
        f"-A KUBE-MARK-MASQ -j MARK --or-mark {mark}",
    ]
    for key, svc in state.services.items():
        eps = state.endpoints.get(key, ())
        name = f"{svc.name.namespace}/{svc.name.name}" + (f":{svc.name.port}" if svc.name.port else "")
        proto = svc.name.protocol.value.lower()
        svc_chain = "KUBE-SVC-" + _kp_hash(name + proto)
        match = f"-m {proto} -p {proto} -d {svc.cluster_ip} --dport {svc.port}"
        nat_rules.append(f'-A KUBE-SERVICES -m comment --comment "{name} cluster IP" {match} -j {svc_chain}')
        nat_chains.append(svc_chain)
        nat_rules.append(f'-A {svc_chain} -m comment --comment "{name} cluster IP" {match} ! -s {cidr} -j KUBE-MARK-MASQ')
        seps = []
        for ep in eps:
            addr = f"{ep.ip}:{ep.port}"
            seps.append((addr, ep.ip, "KUBE-SEP-" + _kp_hash(name + proto + addr)))
        n = len(seps)
        for i, (addr, _, sep) in enumerate(seps):
            comment = "" if large else f' -m comment --comment "{name} -> {addr}"'
            pick = f" -m statistic --mode random --probability {1.0 / (n - i):0.10f}" if i < n - 1 else ""
            nat_rules.append(f"-A {svc_chain}{comment}{pick} -j {sep}")
        for addr, ip, sep in seps:
            nat_chains.append(sep)
            comment = "" if large else f" -m comment --comment {name}"
            nat_rules.append(f"-A {sep}{comment} -s {ip} -j KUBE-MARK-MASQ")
            nat_rules.append(f"-A {sep}{comment} -m {proto} -p {proto} -j DNAT --to-destination {addr}")
    nat_rules.append('-A KUBE-SERVICES -m comment --comment "kubernetes service nodeports; NOTE: this'
                     ' must be the last rule in this chain" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS')
    filter_rules = [
        "-A KUBE-FORWARD -m conntrack --ctstate INVALID -m nfacct --nfacct-name"
        " ct_state_invalid_dropped_pkts -j DROP",
        f'-A KUBE-FORWARD -m comment --comment "kubernetes forwarding rules" -m mark --mark {mark}/{mark} -j ACCEPT',
        '-A KUBE-FORWARD -m comment --comment "kubernetes forwarding conntrack rule"'
        " -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT",
    ]
    out = ["*filter", *(f":{c} - [0:0]" for c in filter_chains), *filter_rules, "COMMIT",
           "*nat", *(f":{c} - [0:0]" for c in nat_chains), *nat_rules, "COMMIT", ""]
    return "\n".join(out)


def _chains(payload: str) -> set[str]:
    return {line[1:].split(" ", 1)[0] for line in payload.splitlines() if line.startswith(":")}


# Runs the restore and reports its wall time and peak RSS. A helper, because Linux carries the
# spawning process's peak into a child's ru_maxrss across exec: spawned from this bench (which
# holds both payloads and the cluster), the restore's figure would be the bench's.
_SPAWN = """
import os, subprocess, sys, time
start = time.perf_counter()
child = subprocess.Popen(sys.argv[1:])
_, status, usage = os.wait4(child.pid, 0)
print(time.perf_counter() - start, usage.ru_maxrss, os.waitstatus_to_exitcode(status))
"""


def _restore_once(path: str) -> tuple[float, float]:
    """One whole `iptables-legacy-restore` process into a fresh namespace: its wall time and its
    peak RSS in MiB (`ip netns exec` execs the restore, so the child's rusage is the restore's)."""
    sys.path.insert(0, ROOT)
    from nfproxy.kernel.nfacct import Nfacct

    ns = f"nfpbench-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        Nfacct(ns).ensure("ct_state_invalid_dropped_pkts")
        with open(path, "rb") as payload:
            out = subprocess.run([sys.executable, "-c", _SPAWN, "ip", "netns", "exec", ns,
                                  "iptables-legacy-restore", "-w", "5", "--noflush"],
                                 stdin=payload, capture_output=True, text=True, check=True)
        elapsed, peak_kib, code = out.stdout.split()
        if int(code):
            raise SystemExit(f"iptables-legacy-restore exited {code}: {out.stderr.strip()}")
        return float(elapsed), int(peak_kib) / 1024
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=True)


def restore_table(services: int, endpoints: int, runs: int) -> None:
    sys.path.insert(0, ROOT)
    from nfproxy.backends.iptables.plan import full_plan
    from nfproxy.core.model import IPFamily
    from nfproxy.testing import uniform_cluster

    state = uniform_cluster(services, endpoints)
    ours = full_plan(state, IPFamily.V4, None).payload.text
    theirs = kube_proxy_payload(state)
    if _chains(ours) != _chains(theirs):
        raise SystemExit("the two payloads declare different chains: the bench's kube-proxy layout is wrong")
    times: dict[str, list[float]] = {"nfproxy": [], "kube-proxy": []}
    peaks: dict[str, list[float]] = {"nfproxy": [], "kube-proxy": []}
    with tempfile.TemporaryDirectory() as tmp:
        paths = {}
        for who, text in (("nfproxy", ours), ("kube-proxy", theirs)):
            paths[who] = os.path.join(tmp, who)
            with open(paths[who], "w") as f:
                f.write(text)
        for i in range(runs):
            order = ("nfproxy", "kube-proxy") if i % 2 == 0 else ("kube-proxy", "nfproxy")
            for who in order:
                elapsed, peak = _restore_once(paths[who])
                times[who].append(elapsed)
                peaks[who].append(peak)
    sizes = {"nfproxy": len(ours.encode()), "kube-proxy": len(theirs.encode())}
    lines = {"nfproxy": ours.count("\n"), "kube-proxy": theirs.count("\n")}
    print(f"iptables payload, {services} services x {endpoints} endpoints, IPv4 full sync; "
          f"iptables-legacy-restore --noflush into a fresh netns, {runs} interleaved runs")
    print(f"{'payload':>11} {'MB':>7} {'lines':>8} {'best s':>7} {'median s':>9} {'restore peak MiB':>17}")
    for who in ("nfproxy", "kube-proxy"):
        print(f"{who:>11} {sizes[who] / 1e6:>7.2f} {lines[who]:>8} {min(times[who]):>7.3f} "
              f"{statistics.median(times[who]):>9.3f} {max(peaks[who]):>17.1f}")
    print(f"{'ratio':>11} {sizes['nfproxy'] / sizes['kube-proxy']:>7.3f} {'':>8} "
          f"{min(times['nfproxy']) / min(times['kube-proxy']):>7.3f} "
          f"{statistics.median(times['nfproxy']) / statistics.median(times['kube-proxy']):>9.3f} "
          f"{max(peaks['nfproxy']) / max(peaks['kube-proxy']):>17.3f}   (target <= 1.05)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="100,1000,10000")
    ap.add_argument("--endpoints", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=3, help="best of N runs per cell")
    ap.add_argument("--restore", type=int, default=0, metavar="N",
                    help="also time iptables-legacy-restore of N services against kube-proxy's payload (root)")
    ap.add_argument("--restore-runs", type=int, default=7)
    ap.add_argument("--compare-tree", metavar="OLD",
                    help="A/B against the checkout at OLD, alternating, --repeat rounds (nothing else runs)")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--root", default=ROOT, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        backend, services, endpoints = args.child
        print(json.dumps(measure(backend, int(services), int(endpoints), args.root)))
        return 0

    sizes = [int(s) for s in args.sizes.split(",") if s]
    if args.compare_tree:
        compare_trees(args.compare_tree, sizes, args.endpoints, args.repeat)
        return 0
    if args.restore:
        restore_table(args.restore, args.endpoints, args.restore_runs)
    if not sizes:
        return 0
    rows = []
    for n in sizes:
        cell = {}
        for backend in ("iptables", "nft"):
            runs = [run_child(backend, n, args.endpoints) for _ in range(args.repeat)]
            best = min(runs, key=lambda r: r["seconds"])
            best["rss_mib"] = max(r["rss_mib"] for r in runs)
            cell[backend] = best
        rows.append((n, cell))

    print(f"render: services x {args.endpoints} endpoints, both families, best of {args.repeat}")
    print(f"{'services':>9} {'backend':>8} {'seconds':>8} {'/target':>8} {'peak MiB':>9} "
          f"{'MiB text':>9} {'nft/ipt':>8} {'x per 10x':>9}")
    prev: dict[str, float] = {}
    for n, cell in rows:
        for backend in ("iptables", "nft"):
            r = cell[backend]
            ratio = cell["nft"]["seconds"] / cell["iptables"]["seconds"]
            growth = r["seconds"] / prev[backend] if backend in prev else float("nan")
            print(f"{n:>9} {backend:>8} {r['seconds']:>8.3f} {r['seconds'] / TARGET_SECONDS:>8.2f} "
                  f"{r['rss_mib']:>9.1f} {r['bytes'] / 2**20:>9.1f} "
                  f"{(ratio if backend == 'nft' else 1.0):>8.2f} {growth:>9.2f}")
        prev = {b: cell[b]["seconds"] for b in cell}
    worst = max(cell[b]["seconds"] for _, cell in rows for b in cell)
    print(f"slowest cell: {worst:.3f} s = {worst / TARGET_SECONDS:.2f} x the 1 s target")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Analysis benchmark: `compare` and `check` at 100, 1 000 and 10 000 services, and the cases
that used to never finish.

Each measurement runs in a fresh Python process (so its peak RSS is its own), on the benchmark
shape of nfproxy/testing.py (IPv4 TCP ClusterIP services, N endpoints each):

- compare: `verify.compare.compare(state)`, the whole command (render both backends, apply the
  nft transaction to the in-memory kernel and read its JSON back, read the iptables restore
  text, walk every probe through both rule sets, kernel and ideal mode at once);
- check nft / check iptables: the rules applied in a throwaway namespace first (not timed), then
  the command itself, `nfproxy check --netns` in its own process (wall time and its peak RSS;
  start-up, report and exit included), and, as `library_s`, its two calls (read the live rules
  back, check them) timed in the measuring process;
- the ratio per x10 of services (target <= 12, i.e. linear), and the targets of issue K
  (compare at 10 000 x 10 < 60 s and < 1 GiB, check < 10 s); seconds are wall time, `cpu_s`
  the measuring process's CPU time (what to compare when the machine is shared);
- pathological inputs of issue J: 40 chains of two rules each (2^40 paths), and `numgen random
  mod 2^32` (and 2^64) looked up in a map (target < 2 s each);
- start-up: `nfproxy trace --from-file` of a small dump, wall time of the whole process
  (target < 0.3 s), and whether the kubernetes client was imported.

Usage: sudo .venv/bin/python bench/analysis.py [--sizes 100,1000,10000] [--endpoints 10]
       [--only compare,check,pathological,startup] [--backends nft,iptables]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure_compare(services: int, endpoints: int) -> dict:
    from nfproxy.testing import uniform_cluster
    from nfproxy.verify.compare import compare

    state = uniform_cluster(services, endpoints)
    start, cpu = time.perf_counter(), time.process_time()
    result = compare(state)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {"seconds": seconds, "peak_mib": _peak_mib(), "cpu_s": round(cpu, 2), "probes": len(result.results),
            "equivalent": result.equivalent}


def measure_check(backend: str, services: int, endpoints: int) -> dict:
    from nfproxy.analysis import dump
    from nfproxy.analysis.check import check
    from nfproxy.kernel import netns
    from nfproxy.testing import uniform_cluster
    from nfproxy.verify.validate import apply_iptables, apply_nft

    state = uniform_cluster(services, endpoints)
    with netns.throwaway("nfp-bench") as ns:
        if backend == "nft":
            apply_nft(state, ns)
        else:
            # iptables-legacy: iptables-nft-restore takes over 10 minutes for 10 000 x 10,
            # and this set-up is not what is measured.
            from nfproxy.kernel.iptables import Flavour

            apply_iptables(state, ns, Flavour.LEGACY)
        del state
        start, cpu = time.perf_counter(), time.process_time()
        source = dump.read_live(backend, ns)
        report = check(source.ruleset, node_ips=["192.168.0.2"])
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        command = check_command(backend, ns)
    # The command is what a user waits for, so it is the table's seconds and peak: start-up,
    # reading, checking, writing the 110 000-line report and the exit. library_s is the two
    # calls inside it, timed here; cpu_s this process's CPU for them (libnftables' listing
    # included, iptables-save's not: a child).
    return {"seconds": command["seconds"], "peak_mib": command["peak_mib"], "library_s": round(seconds, 2),
            "cpu_s": round(cpu, 2), "services": len(report.services), "clean": report.clean,
            "exit": command["exit"]}


# Starts the command from a fresh, small interpreter and prints its peak RSS and exit status.
# Linux carries a process's peak RSS across exec from the address space it replaces, so a
# command forked by this (by then gigabyte-sized) bench would report the bench's peak, not its own.
_LAUNCHER = """
import os, sys
devnull = os.open(os.devnull, os.O_WRONLY)
actions = [(os.POSIX_SPAWN_DUP2, devnull, 1), (os.POSIX_SPAWN_DUP2, devnull, 2)]
pid = os.posix_spawn(sys.argv[1], sys.argv[1:], os.environ, file_actions=actions)
_, status, usage = os.wait4(pid, 0)
print(usage.ru_maxrss, os.waitstatus_to_exitcode(status))
"""


def check_command(backend: str, ns: str) -> dict:
    """`nfproxy check --netns NS` as its own process, its report discarded: wall time (the
    launcher's start-up, ~20 ms, included), and the command's own peak RSS."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "nfproxy", "check", "--backend", backend, "--netns", ns, "--node-ip", "192.168.0.2"]
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", _LAUNCHER, *argv], capture_output=True, text=True, env=env, check=True)
    seconds = time.perf_counter() - start
    maxrss, status = (int(x) for x in done.stdout.split())
    return {"seconds": seconds, "peak_mib": maxrss / 1024, "exit": status}


def chain_cascade(chains: int) -> str:
    """`chains` chains of two rules each: a coin flip and an unconditional jump to the next."""
    lines = ["*nat", ":PREROUTING ACCEPT [0:0]"] + [f":C{i} - [0:0]" for i in range(chains + 1)]
    lines.append("-A PREROUTING -j C0")
    for i in range(chains):
        lines.append(f"-A C{i} -m statistic --mode random --probability 0.5 -j C{i + 1}")
        lines.append(f"-A C{i} -j C{i + 1}")
    lines += [f"-A C{chains} -p tcp -j DNAT --to-destination 10.0.0.1:80", "COMMIT", ""]
    return "\n".join(lines)


def numgen_map(modulus: int) -> dict:
    """nft JSON: a service chain that DNATs to `numgen random mod MODULUS map @eps`."""
    rule = {"family": "ip", "table": "t", "chain": "svc", "expr": [
        {"dnat": {"family": "ip", "addr": {"map": {"key": {"numgen": {"mode": "random", "mod": modulus, "offset": 0}},
                                                     "data": "@eps"}}}}]}
    return {"nftables": [
        {"table": {"family": "ip", "name": "t"}},
        {"map": {"family": "ip", "table": "t", "name": "eps", "type": "integer", "map": "ipv4_addr",
                 "elem": [[0, "10.0.0.1"], [1, "10.0.0.2"]]}},
        {"chain": {"family": "ip", "table": "t", "name": "svc"}},
        {"rule": rule},
    ]}


def measure_pathological(case: str) -> dict:
    from nfproxy.analysis import iptables_save, nft_json
    from nfproxy.analysis.check import check
    from nfproxy.analysis.interpret import Packet, trace

    start = time.perf_counter()
    if case == "40 chains x 2 rules":
        rs = iptables_save.parse(chain_cascade(40), 4)
        paths = trace(rs, Packet("10.1.0.1", "10.96.0.1", 80, "tcp", "outside"))
        report = check(rs)
        detail = f"{sum(p.count for p in paths)} paths, {len(report.services)} services"
    else:
        exponent = int(case.split("^")[1].split()[0])  # "numgen mod 2^32 map"
        rs = nft_json.parse(numgen_map(2**exponent))
        report = check(rs)
        detail = f"{[len(s.endpoints) for s in report.services]} endpoints, {len(report.problems)} problems"
    return {"seconds": time.perf_counter() - start, "peak_mib": _peak_mib(), "detail": detail}


def measure_startup() -> dict:
    dump = ROOT / "tests" / "dumps" / "kube-proxy-iptables-save.txt"
    argv = [sys.executable, "-c", "import sys; from nfproxy.cli.main import main; code = main(sys.argv[1:]); "
            "print('KUBERNETES' if 'kubernetes' in sys.modules else 'lean', file=sys.stderr); sys.exit(code)",
            "trace", "--from-file", str(dump), "10.0.1.1", "172.30.0.41:80/tcp"]
    times = []
    bare = []
    lean = True
    for _ in range(7):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        bare.append(time.perf_counter() - start)
        start = time.perf_counter()
        done = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT)
        times.append(time.perf_counter() - start)
        lean = lean and done.stderr.strip().endswith("lean") and done.returncode == 0
    detail = (f"kubernetes client imported: {not lean}; a bare `python -c pass` takes "
              f"{statistics.median(bare):.3f} s on this machine now (load {os.getloadavg()[0]:.1f})")
    return {"seconds": statistics.median(times), "peak_mib": 0.0, "detail": detail}


def child(kind: str, arg: str, endpoints: int) -> dict:
    """Run one measurement in a fresh interpreter and return what it printed."""
    done = subprocess.run([sys.executable, __file__, "--child", kind, arg, str(endpoints)],
                          capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"{kind} {arg}: failed:\n{done.stderr}")
    return json.loads(done.stdout.splitlines()[-1])


def table(title: str, kind: str, sizes: list[int], endpoints: int, limit_s: float, limit_mib: float | None) -> None:
    print(f"\n{title} ({endpoints} endpoints per service)")
    print(f"{'services':>9} {'seconds':>9} {'peak MiB':>9} {'x10 ratio':>10}  notes")
    previous: dict | None = None
    for n in sizes:
        r = child(kind, str(n), endpoints)
        ratio = ""
        if previous is not None and previous["n"] * 10 == n:
            ratio = f"{r['seconds'] / previous['seconds']:.1f}"
        notes = {k: v for k, v in r.items() if k not in ("seconds", "peak_mib")}
        print(f"{n:>9} {r['seconds']:>9.2f} {r['peak_mib']:>9.0f} {ratio:>10}  {notes}")
        previous = {"n": n, **r}
    if previous is not None:
        ok = previous["seconds"] < limit_s and (limit_mib is None or previous["peak_mib"] < limit_mib)
        mib = f" and {limit_mib:.0f} MiB" if limit_mib else ""
        print(f"target at {previous['n']}: < {limit_s:.0f} s{mib}: {'met' if ok else 'NOT MET'}; ratio per x10 <= 12")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="100,1000,10000")
    p.add_argument("--endpoints", type=int, default=10)
    p.add_argument("--only", default="compare,check,pathological,startup")
    p.add_argument("--backends", default="nft,iptables", help="which backends `check` reads (iptables-legacy-restore "
                   "of 10 000 services holds the host-wide xtables lock for seconds)")
    p.add_argument("--child", nargs=3, metavar=("KIND", "ARG", "ENDPOINTS"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        kind, arg, eps = args.child
        if kind == "compare":
            out = measure_compare(int(arg), int(eps))
        elif kind.startswith("check-"):
            out = measure_check(kind.removeprefix("check-"), int(arg), int(eps))
        elif kind == "pathological":
            out = measure_pathological(arg)
        else:
            out = measure_startup()
        print(json.dumps(out))
        return
    sizes = [int(s) for s in args.sizes.split(",")]
    only = set(args.only.split(","))
    if "compare" in only:
        table("compare", "compare", sizes, args.endpoints, 60, 1024)
    if "check" in only:
        for backend in args.backends.split(","):
            table(f"check --netns, {backend}", f"check-{backend}", sizes, args.endpoints, 10, None)
    if "pathological" in only:
        print("\npathological inputs (target < 2 s each)")
        for case in ("40 chains x 2 rules", "numgen mod 2^32 map", "numgen mod 2^64 map"):
            r = child("pathological", case, 0)
            print(f"  {case:<22} {r['seconds']:>7.3f} s  {r['peak_mib']:>5.0f} MiB  {r['detail']}")
    if "startup" in only:
        r = child("startup", "-", 0)
        print(f"\nstart-up: nfproxy trace --from-file (small dump), median of 7: {r['seconds']:.3f} s "
              f"(target < 0.3 s); {r['detail']}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""How fast can nf_tables take 10 000 services x 10 endpoints, and in which rule layout?

Generates synthetic rule text itself (the renderer's layout is what is being decided) for three
candidate layouts, loads each into a fresh throwaway network namespace, and prints one table:

  a  kube-proxy's: per service chain `numgen random mod N vmap { i : goto endpoint-... }` (an
     anonymous verdict set per service), per endpoint chain with hairpin + dnat rules.
  b  mark carrier: service chain writes a slot into the packet mark (keeping 0x4000: the slot
     values never use bit 14, and a second rule adds 0x4000 when it was already set), then
     `goto dispatch`; ONE rule `meta mark and 0xffffbfff vmap @slots`; endpoint chains put the
     mark back to `meta mark and 0x4000` and do hairpin + dnat.
  s  as c, but one endpoints map per 64 services (`endpoints-<slot // 1024>`): the recommendation.
  c  data map, no endpoint chains: `dnat ip to numgen random mod N offset K map @endpoints`
     with `@endpoints: typeof numgen random mod 1 : ip daddr . tcp dport`; hairpin is one rule
     in nat postrouting, `ct status dnat ip saddr . ip daddr @hairpin` (a set of E . E pairs).

Every layout shares the kube-proxy frame: `services` dispatches by a `service-ips` verdict map,
`mark-for-masquerade` sets 0x4000, `masquerading` in postrouting masquerades marked packets, and
each service chain has the cluster-CIDR masquerade rule.

Ways of loading: `nft -f` (a process), libnftables in-process (context created inside the
namespace), in one transaction or chunks of services; JSON for layout c. Reference:
iptables-legacy-restore / iptables-nft-restore of nfproxy's iptables renderer output.

Then the incremental side on layout c: one-service changes through libnftables in-process at
10 000 and at 100 services, per-command costs, and what each command makes libnftables dump
from the kernel first (strace of `nft -f`, counting NFT_MSG_GET* requests and bytes read).

Each measurement runs in a child process (peak RSS per cell) and its own namespace.

    .venv/bin/python bench/nft_layouts.py                 # everything (~8 minutes on 2 busy cores)
    .venv/bin/python bench/nft_layouts.py --only full --sizes 1000
    .venv/bin/python bench/nft_layouts.py --only incremental,cache,traffic
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from nfproxy.kernel import netns  # noqa: E402

T = "ip nfproxy"
MARK = 0x4000
CLUSTER_CIDR = "10.0.0.0/8"
SLOT_STRIDE = 16  # slots reserved per service: room to grow without moving (see docs)


# --------------------------------------------------------------------------------------------
# Synthetic services: the same addresses as nfproxy/testing.uniform_cluster.


def vip(i: int) -> str:
    return f"172.30.{i >> 8 & 255}.{i & 255}"


def ep_ip(i: int, j: int, gen: int = 0) -> str:
    return f"10.{(i >> 8) & 255}.{i & 255}.{j + 1 + gen * 100}"


def svc_chain(i: int) -> str:
    # As long as the renderer's names (hash prefix + ns/name/proto/port): parse cost scales with it.
    return f"service-{i:08X}-ns-{i % 100}/svc-{i}/tcp/http"


def ep_chain(i: int, j: int) -> str:
    return f"endpoint-{i * 16 + j:08X}-ns-{i % 100}/svc-{i}/tcp/http__{ep_ip(i, j)}/8080"


def slot_b(i: int) -> int:
    """Layout b: slot values avoid bit 14 (0x4000), blocks of 16 never straddle it."""
    s = i * SLOT_STRIDE
    return ((s >> 14) << 15) | (s & 0x3FFF)


def slot_c(i: int) -> int:
    return i * SLOT_STRIDE


STATIC_COMMON = f"""add table {T}
add chain {T} nat-prerouting {{ type nat hook prerouting priority -100 ; }}
add chain {T} nat-output {{ type nat hook output priority -100 ; }}
add chain {T} nat-postrouting {{ type nat hook postrouting priority 100 ; }}
add chain {T} services
add chain {T} mark-for-masquerade
add chain {T} masquerading
add map {T} service-ips {{ type ipv4_addr . inet_proto . inet_service : verdict ; }}
add rule {T} mark-for-masquerade meta mark set meta mark or {MARK:#x}
add rule {T} masquerading meta mark and {MARK:#x} == 0 return
add rule {T} masquerading meta mark set meta mark xor {MARK:#x}
add rule {T} masquerading masquerade fully-random
add rule {T} services ip daddr . meta l4proto . th dport vmap @service-ips
add rule {T} nat-prerouting jump services
add rule {T} nat-output jump services
"""

STATIC = {
    "a": STATIC_COMMON + f"add rule {T} nat-postrouting jump masquerading\n",
    "b": STATIC_COMMON
    + f"""add chain {T} dispatch
add map {T} slots {{ type mark : verdict ; }}
add rule {T} dispatch meta mark and {~MARK & 0xFFFFFFFF:#x} vmap @slots
add rule {T} nat-postrouting jump masquerading
""",
    "c": STATIC_COMMON
    + f"""add map {T} endpoints {{ typeof numgen random mod 1 : ip daddr . tcp dport ; }}
add set {T} hairpin {{ type ipv4_addr . ipv4_addr ; }}
add rule {T} nat-postrouting ct status dnat ip saddr . ip daddr @hairpin jump mark-for-masquerade
add rule {T} nat-postrouting jump masquerading
""",
}
# Layout s ("sharded c"): as c, but the endpoints map is split into one map per SHARD services.
STATIC["s"] = STATIC["c"].replace(
    f"add map {T} endpoints {{ typeof numgen random mod 1 : ip daddr . tcp dport ; }}\n", ""
)
SHARD = 64  # services per endpoints map: slots [64*16*m, 64*16*(m+1)) live in map endpoints-m


def shard_map(i: int) -> str:
    return f"endpoints-{slot_c(i) // (SHARD * SLOT_STRIDE)}"


def masq_rule(i: int) -> str:
    return f"ip daddr {vip(i)} ip saddr != {CLUSTER_CIDR} jump mark-for-masquerade"


def service_text(layout: str, i: int, n: int, gen: int = 0) -> str:
    """Chains, rules and elements of service i (n endpoints), as `nft -f` lines."""
    sc = svc_chain(i)
    out = [f"add chain {T} {sc}\n", f"add rule {T} {sc} {masq_rule(i)}\n"]
    if layout == "a":
        names = [ep_chain(i, j) for j in range(n)]
        for j, c in enumerate(names):  # a goto needs its chain to exist already
            ip = ep_ip(i, j, gen)
            out.append(f"add chain {T} {c}\n")
            out.append(f"add rule {T} {c} ip saddr {ip} jump mark-for-masquerade\n")
            out.append(f"add rule {T} {c} meta l4proto tcp dnat to {ip}:8080\n")
        vmap = " , ".join(f"{j} : goto {c}" for j, c in enumerate(names))
        out.append(f"add rule {T} {sc} numgen random mod {n} vmap {{ {vmap} }}\n")
    elif layout == "b":
        k = slot_b(i)
        out.append(f"add rule {T} {sc} meta mark and {MARK:#x} == 0 meta mark set numgen random mod {n} offset {k} goto dispatch\n")
        out.append(f"add rule {T} {sc} meta mark set numgen random mod {n} offset {k | MARK} goto dispatch\n")
        elems = []
        for j in range(n):
            c, ip = ep_chain(i, j), ep_ip(i, j, gen)
            out.append(f"add chain {T} {c}\n")
            out.append(f"add rule {T} {c} meta mark set meta mark and {MARK:#x}\n")
            out.append(f"add rule {T} {c} ip saddr {ip} jump mark-for-masquerade\n")
            out.append(f"add rule {T} {c} meta l4proto tcp dnat to {ip}:8080\n")
            elems.append(f"{k + j} : goto {c}")
        out.append(f"add element {T} slots {{ {', '.join(elems)} }}\n")
    else:
        k = slot_c(i)
        m = "endpoints" if layout == "c" else shard_map(i)
        if layout == "s" and i % SHARD == 0:
            out.insert(0, f"add map {T} {m} {{ typeof numgen random mod 1 : ip daddr . tcp dport ; }}\n")
        out.append(f"add rule {T} {sc} meta l4proto tcp dnat ip to numgen random mod {n} offset {k} map @{m}\n")
        out.append(f"add element {T} {m} {{ {', '.join(f'{k + j} : {ep_ip(i, j, gen)} . 8080' for j in range(n))} }}\n")
        out.append(f"add element {T} hairpin {{ {', '.join(f'{ep_ip(i, j, gen)} . {ep_ip(i, j, gen)}' for j in range(n))} }}\n")
    out.append(f"add element {T} service-ips {{ {vip(i)} . tcp . 80 : goto {sc} }}\n")
    return "".join(out)


def transactions(layout: str, services: int, n: int, chunk: int, elements_last: bool = True) -> list[str]:
    """The static part, then services in chunks; chunk 0 = everything in one transaction."""
    bodies: list[str] = []
    size = chunk or services
    for start in range(0, services, size):
        lines = "".join(service_text(layout, i, n) for i in range(start, min(services, start + size))).splitlines(True)
        if elements_last:
            # Every rule that binds a map makes the kernel check the map's elements once
            # (nf_tables_bind_set walks it): bind while the maps are still empty.
            lines = [x for x in lines if not x.startswith("add element")] + [x for x in lines if x.startswith("add element")]
        bodies.append("".join(lines))
    if chunk == 0:
        return [STATIC[layout] + bodies[0]]
    return [STATIC[layout], *bodies]


# JSON for layout c (the static part goes in as text: `typeof` declarations do not round-trip
# through nft 1.0.6's JSON, whose listing says only `"type": "integer"`).


def _payload(proto: str, field: str) -> dict:
    return {"payload": {"protocol": proto, "field": field}}


def service_json(i: int, n: int) -> list[dict]:
    sc = svc_chain(i)
    k = slot_c(i)
    table = {"family": "ip", "table": "nfproxy"}
    masq = [
        {"match": {"op": "==", "left": _payload("ip", "daddr"), "right": vip(i)}},
        {"match": {"op": "!=", "left": _payload("ip", "saddr"), "right": {"prefix": {"addr": "10.0.0.0", "len": 8}}}},
        {"jump": {"target": "mark-for-masquerade"}},
    ]
    dnat = [
        {"match": {"op": "==", "left": {"meta": {"key": "l4proto"}}, "right": "tcp"}},
        {"dnat": {"family": "ip", "addr": {"map": {"key": {"numgen": {"mode": "random", "mod": n, "offset": k}}, "data": f"@{shard_map(i)}"}}}},
    ]
    return [
        {"add": {"chain": {**table, "name": sc}}},
        {"add": {"rule": {**table, "chain": sc, "expr": masq}}},
        {"add": {"rule": {**table, "chain": sc, "expr": dnat}}},
        {"add": {"element": {**table, "name": shard_map(i), "elem": [[k + j, {"concat": [ep_ip(i, j), 8080]}] for j in range(n)]}}},
        {"add": {"element": {**table, "name": "hairpin", "elem": [{"concat": [ep_ip(i, j), ep_ip(i, j)]} for j in range(n)]}}},
        {"add": {"element": {**table, "name": "service-ips", "elem": [[{"concat": [vip(i), "tcp", 80]}, {"goto": {"target": sc}}]]}}},
    ]


def json_transactions(services: int, n: int, chunk: int) -> list[str]:
    size = chunk or services
    maps = sorted({shard_map(i) for i in range(services)})
    out = [STATIC["s"] + "".join(f"add map {T} {m} {{ typeof numgen random mod 1 : ip daddr . tcp dport ; }}\n" for m in maps)]
    for start in range(0, services, size):
        cmds = [c for i in range(start, min(services, start + size)) for c in service_json(i, n)]
        cmds = [c for c in cmds if "element" not in c["add"]] + [c for c in cmds if "element" in c["add"]]
        out.append(json.dumps({"nftables": cmds}))
    return out


# --------------------------------------------------------------------------------------------
# Children: one measurement each, in its own namespace.


def _nft_ctx(ns: str):  # noqa: ANN202 - the bindings have no types
    import nftables

    with netns.entered(ns):
        ctx = nftables.Nftables()
    return ctx


def _cmd(ctx, text: str, *, is_json: bool = False) -> None:  # noqa: ANN001
    rc, _out, err = ctx.json_cmd(json.loads(text)) if is_json else ctx.cmd(text)
    if rc != 0:
        raise RuntimeError(f"nft rejected: {str(err)[:2000]}")


def _cpu(who: int) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def _run_child_tool(argv: list[str], stdin: bytes, ns: str) -> tuple[float, float]:
    """Run a tool in `ns`; (seconds, its peak RSS in MiB)."""
    start = time.perf_counter()
    proc = subprocess.Popen(["ip", "netns", "exec", ns, *argv], stdin=subprocess.PIPE, stderr=subprocess.PIPE)
    _out, err = proc.communicate(stdin)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{argv[0]} failed: {err.decode()[:2000]}")
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return seconds, rss


def child_full(layout: str, services: int, n: int, how: str, chunk: int) -> dict:
    """how: nft-f | lib | lib-json | nft-json. Times only the kernel side (text made before)."""
    texts = json_transactions(services, n, chunk) if how.endswith("json") else transactions(layout, services, n, chunk)
    size = sum(len(t) for t in texts)
    with netns.throwaway("nfbench") as ns:
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        cpu0 = _cpu(resource.RUSAGE_SELF)
        if how.startswith("nft"):
            seconds, rss = 0.0, 0.0
            for k, t in enumerate(texts):
                argv = ["nft", "-j", "-f", "-"] if how == "nft-json" and k > 0 else ["nft", "-f", "-"]
                s, r = _run_child_tool(argv, t.encode(), ns)
                seconds += s
                rss = max(rss, r)
        else:
            ctx = _nft_ctx(ns)
            start = time.perf_counter()
            for k, t in enumerate(texts):
                _cmd(ctx, t, is_json=how == "lib-json" and k > 0)
            seconds = time.perf_counter() - start
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - rss0
        cpu = _cpu(resource.RUSAGE_CHILDREN) if how.startswith("nft") else _cpu(resource.RUSAGE_SELF) - cpu0
        check = subprocess.run(["ip", "netns", "exec", ns, "nft", "list", "map", "ip", "nfproxy", "service-ips"],
                               capture_output=True, text=True, check=True).stdout
        if check.count(": goto") != services:
            raise RuntimeError(f"expected {services} service-ips elements, found {check.count(': goto')}")
    return {"seconds": seconds, "rss_mib": rss, "mib": size / 2**20, "cpu": cpu}


def child_iptables(flavour: str, services: int, n: int) -> dict:
    from nfproxy.backends.iptables import render as iptables
    from nfproxy.core.model import IPFamily
    from nfproxy.testing import uniform_cluster

    text = iptables.render(uniform_cluster(services, n), IPFamily.V4).restore_text(with_jumps=True)
    with netns.throwaway("nfbench") as ns:
        seconds, rss = _run_child_tool([f"iptables-{flavour}-restore", "-w", "5", "--noflush"], text.encode(), ns)
    return {"seconds": seconds, "rss_mib": rss, "mib": len(text) / 2**20, "cpu": _cpu(resource.RUSAGE_CHILDREN)}


def change_text(i: int, n: int, gen: int) -> str:
    """Layout s: replace service i's endpoints (generation gen-1 -> gen) in one transaction."""
    sc, k, m = svc_chain(i), slot_c(i), shard_map(i)
    old = [ep_ip(i, j, gen - 1) for j in range(n)]
    new = [ep_ip(i, j, gen) for j in range(n)]
    return (
        f"flush chain {T} {sc}\n"
        f"add rule {T} {sc} {masq_rule(i)}\n"
        f"add rule {T} {sc} meta l4proto tcp dnat ip to numgen random mod {n} offset {k} map @{m}\n"
        f"delete element {T} {m} {{ {', '.join(str(k + j) for j in range(n))} }}\n"
        f"add element {T} {m} {{ {', '.join(f'{k + j} : {ip} . 8080' for j, ip in enumerate(new))} }}\n"
        f"delete element {T} hairpin {{ {', '.join(f'{ip} . {ip}' for ip in old)} }}\n"
        f"add element {T} hairpin {{ {', '.join(f'{ip} . {ip}' for ip in new)} }}\n"
    )


def _probes(n: int) -> dict[str, Callable[[int, int], str]]:
    """Single-command transactions on service i, generation gen (each undoes nothing: all valid)."""
    def spare(i: int) -> int:
        return slot_c(i) + SLOT_STRIDE - 1  # a slot no service uses: added, then deleted

    return {
        "change one service (7 commands)": lambda i, gen: change_text(i, n, gen),
        "add element @endpoints-m": lambda i, gen: f"add element {T} {shard_map(i)} {{ {spare(i)} : {ep_ip(i, 0)} . 8080 }}\n",
        "delete element @endpoints-m": lambda i, gen: f"delete element {T} {shard_map(i)} {{ {spare(i)} }}\n",
        "flush chain": lambda i, gen: f"flush chain {T} {svc_chain(i)}\n",
        "add rule, no set reference": lambda i, gen: f"add rule {T} {svc_chain(i)} {masq_rule(i)}\n",
        "add rule ... map @endpoints": lambda i, gen: (
            f"add rule {T} {svc_chain(i)} meta l4proto tcp dnat ip to numgen random mod {n} offset {slot_c(i)} map @{shard_map(i)}\n"),
        "add chain + rule (new service)": lambda i, gen: (
            f"add chain {T} new-{i}-{gen}\nadd rule {T} new-{i}-{gen} {masq_rule(i)}\n"),
    }


def child_incremental(services: int, n: int, repeat: int) -> dict:
    """Load layout c, then time probes through libnftables in-process (median of `repeat`)."""
    results: dict[str, float] = {}
    with netns.throwaway("nfbench") as ns:
        ctx = _nft_ctx(ns)
        for t in transactions("s", services, n, 2000):
            _cmd(ctx, t)
        gens: Counter[int] = Counter()
        for name, make in _probes(n).items():
            times = []
            for r in range(repeat):
                i = (r * 7919) % services
                gens[i] += 1
                text = make(i, gens[i])
                start = time.perf_counter()
                _cmd(ctx, text)
                times.append(time.perf_counter() - start)
            results[name] = statistics.median(times) * 1000
        # The same change through a fresh `nft -f` process (what a fork-per-sync proxy pays).
        times = []
        for r in range(max(3, repeat // 4)):
            i = (r * 7919 + 1) % services
            gens[i] += 1
            times.append(_run_child_tool(["nft", "-f", "-"], change_text(i, n, gens[i]).encode(), ns)[0])
        results["change one service via nft -f process"] = statistics.median(times) * 1000
        # Check the changes really landed: the last generation of one probed service.
        i = 0
        listed = subprocess.run(["ip", "netns", "exec", ns, "nft", "list", "chain", "ip", "nfproxy", svc_chain(i)],
                                capture_output=True, text=True, check=True).stdout
        if f"map @{shard_map(i)}" not in listed:
            raise RuntimeError(f"service chain lost its dnat rule:\n{listed}")
    return results


_GET = re.compile(r"NFT_MSG_(GET[A-Z]+)")


def child_cache(services: int, n: int) -> dict:
    """Which kernel dumps `nft -f` makes before each command kind (strace), and bytes read."""
    out: dict[str, dict] = {}
    with netns.throwaway("nfbench") as ns:
        ctx = _nft_ctx(ns)
        for t in transactions("s", services, n, 2000):
            _cmd(ctx, t)
        probes = _probes(n)
        probes["add element @service-ips (verdict)"] = lambda i, gen: (
            f"add element {T} service-ips {{ 172.31.0.{gen} . tcp . 80 : goto {svc_chain(i)} }}\n")
        probes["replace rule by handle"] = None  # filled below
        handle_out = subprocess.run(["ip", "netns", "exec", ns, "nft", "-a", "list", "chain", "ip", "nfproxy", svc_chain(5)],
                                    capture_output=True, text=True, check=True).stdout
        handle = re.findall(r"mark-for-masquerade # handle (\d+)", handle_out)[0]
        probes["replace rule by handle"] = lambda i, gen: f"replace rule {T} {svc_chain(5)} handle {handle} {masq_rule(5)}\n"
        gen = 10
        for name, make in probes.items():
            gen += 1
            if name == "change one service (7 commands)":
                text = change_text(3, n, 1)
            elif "element @endpoints" in name:
                text = make(3, 1)
            else:
                text = make(4, gen)
            with tempfile.NamedTemporaryFile("w", suffix=".nft", delete=False) as f:
                f.write(text)
            try:
                start = time.perf_counter()
                proc = subprocess.run(["ip", "netns", "exec", ns, "strace", "-f", "-e", "trace=sendto,sendmsg,recvmsg,recvfrom",
                                       "-s", "8", "nft", "-f", f.name], capture_output=True, text=True)
                seconds = time.perf_counter() - start
            finally:
                os.unlink(f.name)
            if proc.returncode != 0:
                raise RuntimeError(f"{name}: {proc.stderr[-2000:]}")
            gets = Counter(_GET.findall(proc.stderr))
            got = sum(int(m) for m in re.findall(r"^recv(?:msg|from)\(.*= (\d+)$", proc.stderr, re.M))
            out[name] = {"dumps": dict(gets), "kib_read": got / 1024, "ms_under_strace": seconds * 1000}
    return out


# --------------------------------------------------------------------------------------------
# Real traffic through layout c (and b): one service, 3 endpoints.


def traffic(layout: str) -> list[str]:
    """Returns findings; raises AssertionError when the layout misbehaves."""
    import socket

    from nfproxy.verify.sandbox import Sandbox, SandboxSpec, summarize

    node_ip = "192.168.0.2"
    i = 1  # a synthetic service's chain name, VIP and slots; its endpoints are set below
    svc_vip, eps = vip(i), ["10.1.0.1", "10.1.0.2", "10.1.0.3"]
    spec = SandboxSpec.of(
        node_ips=[node_ip],
        clients={"pod": "10.9.0.5", "outside": "192.0.2.10"},
        endpoints={ip: [(8080, "tcp")] for ip in eps},
    )
    sc = svc_chain(i)
    text = STATIC[layout] + f"add chain {T} {sc}\nadd rule {T} {sc} {masq_rule(i)}\n"
    if layout == "s":
        k, m = slot_c(i), shard_map(i)
        text += f"add map {T} {m} {{ typeof numgen random mod 1 : ip daddr . tcp dport ; }}\n"
        text += f"add rule {T} {sc} meta l4proto tcp dnat ip to numgen random mod 3 offset {k} map @{m}\n"
        text += f"add element {T} {m} {{ {', '.join(f'{k + j} : {ip} . 8080' for j, ip in enumerate(eps))} }}\n"
        text += f"add element {T} hairpin {{ {', '.join(f'{ip} . {ip}' for ip in eps)} }}\n"
    else:
        k = slot_b(i)
        text += f"add rule {T} {sc} meta mark and {MARK:#x} == 0 meta mark set numgen random mod 3 offset {k} goto dispatch\n"
        text += f"add rule {T} {sc} meta mark set numgen random mod 3 offset {k | MARK} goto dispatch\n"
        for j, ip in enumerate(eps):
            c = f"endpoint-{j}"
            text += (f"add chain {T} {c}\nadd rule {T} {c} meta mark set meta mark and {MARK:#x}\n"
                     f"add rule {T} {c} ip saddr {ip} jump mark-for-masquerade\n"
                     f"add rule {T} {c} meta l4proto tcp dnat to {ip}:8080\n"
                     f"add element {T} slots {{ {k + j} : goto {c} }}\n")
    text += f"add element {T} service-ips {{ {svc_vip} . tcp . 80 : goto {sc} }}\n"
    findings = []
    with Sandbox(spec) as sb:
        ctx = _nft_ctx(sb.node_ns)
        _cmd(ctx, text)
        count = 600
        pod = sb.connect("pod", svc_vip, 80, "tcp", count, timeout=2.0)
        split = summarize(pod)
        want = {f"{ip}:8080" for ip in eps}
        assert set(split) == want, f"pod client reached {split}"
        assert all(count / 3 * 0.75 < split[e] < count / 3 * 1.25 for e in want), f"uneven split {split}"
        assert {o.source for o in pod} == {"10.9.0.5"}, f"pod client was masqueraded: {summarize(pod, by='source')}"
        findings.append(f"pod client: split {dict(sorted(split.items()))}, source kept 10.9.0.5")
        out = sb.connect("outside", svc_vip, 80, "tcp", 300, timeout=2.0)
        osplit = summarize(out)
        assert set(osplit) == want, f"outside client reached {osplit}"
        assert {o.source for o in out} == {node_ip}, f"outside client not masqueraded: {summarize(out, by='source')}"
        findings.append(f"non-pod client: split {dict(sorted(osplit.items()))}, every source {node_ip} (masqueraded)")
        # Hairpin: an endpoint connecting to its own service. The sandbox's clients cannot own an
        # endpoint address, so open sockets inside the endpoint's namespace by hand.
        seen: Counter[str] = Counter()
        with netns.entered(sb.endpoint_ns(eps[0])):
            for _ in range(60):
                with socket.create_connection((svc_vip, 80), timeout=2.0) as s:
                    s.settimeout(2.0)
                    line = s.makefile("rb").readline().decode().split()
                seen[f"{line[0]} from {line[1]}"] += 1
        self_hits = {k: v for k, v in seen.items() if k.startswith(f"{eps[0]}:")}
        assert self_hits and all(k.endswith(f"from {node_ip}") for k in self_hits), f"hairpin: {seen}"
        others = {k: v for k, v in seen.items() if not k.startswith(f"{eps[0]}:")}
        assert all(k.endswith(f"from {eps[0]}") for k in others), f"non-hairpin masqueraded: {seen}"
        findings.append(f"hairpin from {eps[0]}: {dict(sorted(seen.items()))}")
        # The node itself (nat output hook): reaches the service too.
        node = sb.connect("node", svc_vip, 80, "tcp", 30, timeout=2.0)
        assert set(summarize(node)) == want, f"node reached {summarize(node)}"
        findings.append(f"node itself: {dict(sorted(summarize(node).items()))}")
    return findings


# --------------------------------------------------------------------------------------------
# The parent: runs children, prints tables.


def run_child(*args: str, timeout: float = 900) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["?"])[-1][:200]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


@dataclass(frozen=True, slots=True)
class Cell:
    label: str
    args: tuple[str, ...]
    sizes: tuple[int, ...]


def full_cells(sizes: tuple[int, ...], big: int) -> Iterator[Cell]:
    small = tuple(s for s in sizes if s <= 3000)
    yield Cell("reference: iptables-legacy-restore", ("iptables", "legacy"), sizes)
    # iptables-nft-restore is superlinear here (8 s at 1 000, minutes at 3 000): smallest size only.
    yield Cell("reference: iptables-nft-restore", ("iptables", "nft"), sizes[:1])
    yield Cell("a per-service anonymous vmap, nft -f, 1 txn", ("full", "a", "nft-f", "0"), small)
    yield Cell("a ... libnftables, 1 000-service txns", ("full", "a", "lib", "1000"), small)
    yield Cell("b mark carrier + 1 dispatch vmap, nft -f, 1 txn", ("full", "b", "nft-f", "0"), sizes)
    yield Cell("b ... libnftables, 1 txn", ("full", "b", "lib", "0"), sizes)
    yield Cell("c one shared data map, no endpoint chains, nft -f, 1 txn", ("full", "c", "nft-f", "0"), sizes)
    yield Cell("s data maps sharded by 64 services, nft -f, 1 txn", ("full", "s", "nft-f", "0"), sizes)
    yield Cell("s ... libnftables, 1 txn", ("full", "s", "lib", "0"), sizes)
    yield Cell("s ... libnftables, 1 000-service txns", ("full", "s", "lib", "1000"), sizes)
    yield Cell("s ... libnftables, 2 000-service txns", ("full", "s", "lib", "2000"), sizes)
    yield Cell("s ... JSON, libnftables, 1 txn", ("full", "s", "lib-json", "0"), sizes)
    yield Cell("s ... JSON, nft -j -f, 1 txn", ("full", "s", "nft-json", "0"), sizes)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1000,3000,10000")
    ap.add_argument("--endpoints", type=int, default=10)
    ap.add_argument("--only", default="full,incremental,cache,traffic")
    ap.add_argument("--repeat", type=int, default=20, help="incremental probes per command")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    n = args.endpoints

    if args.child:
        kind, *rest = args.child
        if kind == "full":
            layout, how, chunk, services = rest
            res = child_full(layout, int(services), n, how, int(chunk))
        elif kind == "iptables":
            res = child_iptables(rest[0], int(rest[1]), n)
        elif kind == "incremental":
            res = child_incremental(int(rest[0]), n, args.repeat)
        elif kind == "cache":
            res = child_cache(int(rest[0]), n)
        else:
            res = {"findings": traffic(rest[0])}
        print(json.dumps(res))
        return 0

    sizes = tuple(int(s) for s in args.sizes.split(","))
    only = set(args.only.split(","))
    if "full" in only:
        print(f"## Full load, {n} endpoints per service: wall s / CPU s of the loader (its peak RSS, MiB) [script MiB]")
        print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
        print("| layout / way | " + " | ".join(f"{s} svc" for s in sizes) + " |")
        print("|---|" + "---|" * len(sizes))
        for cell in full_cells(sizes, max(sizes)):
            row = []
            for s in sizes:
                if s not in cell.sizes:
                    row.append("—")
                    continue
                a = cell.args
                r = run_child(*a, str(s))
                row.append(r["error"] if "error" in r else f"{r['seconds']:.2f} / {r.get('cpu', float('nan')):.2f} cpu ({r['rss_mib']:.0f}) [{r['mib']:.1f}]")
            print(f"| {cell.label} | " + " | ".join(row) + " |", flush=True)
    if "incremental" in only:
        big = max(sizes)
        print(f"\n## Incremental, layout s, libnftables in-process: median ms over {args.repeat}")
        r_small = run_child("incremental", "100")
        r_big = run_child("incremental", str(big))
        print(f"| command | 100 svc | {big} svc |\n|---|---|---|")
        for k in r_big:
            print(f"| {k} | {r_small.get(k, float('nan')):.2f} | {r_big[k]:.2f} |" if "error" not in r_big else r_big)
    if "cache" in only:
        big = max(sizes)
        print(f"\n## What `nft -f` dumps before each command, layout s at {big} services (strace)")
        r = run_child("cache", str(big))
        print("| command | kernel dumps requested | KiB read | ms under strace |\n|---|---|---|---|")
        for k, v in r.items():
            if k == "error":
                print(v)
                continue
            print(f"| {k} | {', '.join(f'{d}x{c}' for d, c in sorted(v['dumps'].items()))} | {v['kib_read']:.0f} | {v['ms_under_strace']:.0f} |")
    if "traffic" in only:
        for layout in ("s", "b"):
            r = run_child("traffic", layout, timeout=300)
            print(f"\n## Traffic through layout {layout}: " + ("FAILED " + r["error"] if "error" in r else "ok"))
            for f in r.get("findings", []):
                print(f"- {f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

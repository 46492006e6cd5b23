#!/usr/bin/env python3
"""What the per-endpoint connection counters cost the nft backend, as ratios from one run.

Through `Proxier.sync` in throwaway namespaces, on nfproxy/testing.py's benchmark shape (IPv4
TCP ClusterIP services x N endpoints), with the counters on (the default) and off:

- a full sync of S x N into a fresh namespace;
- a one-service change (one endpoint added to one service) after that full sync;
- the first-connection latency: fresh TCP connections from a pod to one service whose endpoints
  are real servers in a traffic sandbox, beside S - 1 other services (what a counter adds is
  one counter update per new connection, at the map lookup);
- reading the counters back (what a scrape of --metrics-endpoint-connections does), both
  backends.

On and off alternate inside each repetition, so load from the other tenants of the machine
hits both alike; medians are reported.

Usage: sudo .venv/bin/python bench/counters.py [--services 10000] [--endpoints 10] [--repeat 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nfproxy.analysis.counters import read_live_counts  # noqa: E402
from nfproxy.core.model import ClusterState, Endpoint, sort_endpoints  # noqa: E402
from nfproxy.daemon.proxier import Proxier  # noqa: E402
from nfproxy.kernel import netns  # noqa: E402
from nfproxy.kernel.iptables import Flavour  # noqa: E402
from nfproxy.testing import uniform_cluster  # noqa: E402
from nfproxy.verify.sandbox import Sandbox, SandboxSpec  # noqa: E402

MED = statistics.median


def _proxier(backend: str, ns: str, counters: bool) -> Proxier:
    # iptables-legacy: iptables-nft-restore takes minutes at 10 000 services (docs/benchmarks.md).
    proxier = Proxier(backend, netns=ns, flavour=Flavour.LEGACY if backend == "iptables" else None)
    if backend == "nft":
        proxier.backend.endpoint_counters = counters  # type: ignore[attr-defined]
    return proxier


def _with_endpoint(state: ClusterState, i: int) -> ClusterState:
    keys = sorted(state.services, key=lambda k: (k[0].namespace, k[0].name))
    key = keys[(i * 7919) % len(keys)]
    eps = [*state.endpoints[key], Endpoint(ip=f"10.255.{i // 250}.{i % 250 + 1}", port=8080, node_name="node-b")]
    return dataclasses.replace(state, endpoints={**state.endpoints, key: sort_endpoints(eps)})


def syncs(state: ClusterState, counters: bool, changes: int) -> tuple[float, list[float], float]:
    """(full sync seconds, one-service change seconds, counter read seconds) in a fresh namespace."""
    with netns.throwaway("nfp-bench") as ns:
        proxier = _proxier("nft", ns, counters)
        gc.collect()
        t0 = time.perf_counter()
        assert proxier.sync(state).kind == "full"
        full = time.perf_counter() - t0
        current, times = state, []
        for i in range(changes):
            current = _with_endpoint(current, i)
            gc.collect()
            t0 = time.perf_counter()
            assert proxier.sync(current).kind == "partial"
            times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        counted = read_live_counts("nft", ns)
        read = time.perf_counter() - t0
        assert len(counted) == (sum(len(e) for e in current.endpoints.values()) if counters else 0)
        return full, times, read


def first_connections(state: ClusterState, counters: bool, backend: str, n: int) -> float:
    """Median seconds of a fresh TCP connection (connect + the server's line) to one service."""
    key = min(state.services, key=lambda k: (k[0].namespace, k[0].name))
    svc, eps = state.services[key], state.endpoints[key]
    spec = SandboxSpec.of(node_ips=["192.168.0.2"], clients={"pod": "10.244.5.5"},
                          endpoints={ep.ip: [(ep.port, "tcp")] for ep in eps})
    with Sandbox(spec) as sb:
        proxier = _proxier(backend, sb.node_ns, counters)
        assert proxier.sync(state).kind == "full"
        sb.connect("pod", svc.cluster_ip, svc.port, "tcp", 20)  # warm up
        outcomes = sb.connect("pod", svc.cluster_ip, svc.port, "tcp", n, parallel=1)
        assert all(o.ok for o in outcomes), outcomes[:3]
        if counters or backend == "iptables":
            assert sum(c.connections for c in read_live_counts(backend, sb.node_ns)) == n + 20
        return MED(o.seconds for o in outcomes)


def iptables_read(state: ClusterState) -> float:
    with netns.throwaway("nfp-bench") as ns:
        _proxier("iptables", ns, True).sync(state)
        t0 = time.perf_counter()
        counted = read_live_counts("iptables", ns)
        elapsed = time.perf_counter() - t0
        assert len(counted) == sum(len(e) for e in state.endpoints.values())
        return elapsed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--services", type=int, default=10_000)
    ap.add_argument("--endpoints", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--changes", type=int, default=7)
    ap.add_argument("--connections", type=int, default=300, help="per first-connection measure; 0: skip them")
    ap.add_argument("--iptables", action="store_true", help="also time iptables-legacy's first connections")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench/counters.py: needs root (network namespaces)", file=sys.stderr)
        return 1
    S, N = args.services, args.endpoints
    big, one = uniform_cluster(S, N), uniform_cluster(1, N)
    print(f"# counter benchmark: {S} x {N}, IPv4 ClusterIP, one run, {args.repeat} repetitions", flush=True)
    full: dict[bool, list[float]] = {True: [], False: []}
    change: dict[bool, list[float]] = {True: [], False: []}
    reads: list[float] = []
    conn: dict[tuple[str, int, bool], list[float]] = {}
    for r in range(args.repeat):
        for on in (True, False) if r % 2 == 0 else (False, True):
            f, c, rd = syncs(big, on, args.changes)
            full[on].append(f)
            change[on] += c
            if on:
                reads.append(rd)
            print(f"  counters {'on ' if on else 'off'}: full {f:.2f} s, change {MED(c) * 1000:.1f} ms", flush=True)
            for size, state in ((1, one), (S, big)) if args.connections else ():
                conn.setdefault(("nft", size, on), []).append(first_connections(state, on, "nft", args.connections))
                print(f"  counters {'on ' if on else 'off'}: first connection at {size}: "
                      f"{conn[('nft', size, on)][-1] * 1e6:.0f} us", flush=True)
    ipt_read = iptables_read(big)
    print(f"  iptables-legacy: reading the counters {ipt_read * 1e3:.0f} ms", flush=True)
    for size, state in ((1, one), (S, big)) if args.connections and args.iptables else ():
        conn[("iptables", size, True)] = [first_connections(state, True, "iptables", args.connections)]

    def ratio(d: dict[bool, list[float]]) -> float:
        return MED(d[True]) / MED(d[False])

    print()
    print("| measure (nft, counters on vs off) | on | off | on / off |")
    print("|---|---|---|---|")
    print(f"| full sync {S} x {N} (s) | {MED(full[True]):.2f} | {MED(full[False]):.2f} | {ratio(full):.3f} |")
    print(f"| one-service change at {S} (ms) | {MED(change[True]) * 1e3:.1f} | {MED(change[False]) * 1e3:.1f} | {ratio(change):.3f} |")
    for size in (1, S) if args.connections else ():
        on, off = MED(conn[("nft", size, True)]), MED(conn[("nft", size, False)])
        print(f"| first connection, {size} services (us) | {on * 1e6:.0f} | {off * 1e6:.0f} | {on / off:.3f} |")
    print()
    print(f"reading every counter back at {S} x {N}: nft {MED(reads) * 1e3:.0f} ms, iptables {ipt_read * 1e3:.0f} ms")
    for size in (1, S) if args.connections and args.iptables else ():
        print(f"iptables first connection, {size} services: {MED(conn[('iptables', size, True)]) * 1e6:.0f} us (reference)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

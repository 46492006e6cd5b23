"""The conntrack walk after a sync: one dump of a family's UDP table, every entry judged.

In a throwaway namespace, fills the UDP table with N entries sent to S UDP services (each
DNATed to one of its endpoints, `--stale` of them to an endpoint no longer there), then times
what a sync that changed a UDP service port costs the daemon: `sweeps` (pure: the frontends of
the cluster) and `delete_judged` (the dump, the judging, the deletes). Figures:
docs/benchmarks.md, "Conntrack reconciliation". Needs root (a namespace); never touches the
root namespace's table.

    .venv/bin/python -m bench.conntrack_walk --entries 10000 --stale 1000 --runs 5
"""

from __future__ import annotations

import argparse
import resource
import socket
import statistics
import time

from pyroute2.conntrack import Conntrack, NFCTAttrTuple

from nfproxy.core.model import ClusterState, Endpoint, IPFamily, Protocol, ServicePort, ServicePortName, ServiceType
from nfproxy.daemon.conntrack import sweeps
from nfproxy.kernel import conntrack as kct
from nfproxy.kernel import netns
from nfproxy.testing import NODE

V4 = IPFamily.V4


def cluster(services: int) -> ClusterState:
    """UDP services 10.96.x.y:53, one endpoint each (10.244.x.y:5353)."""
    svcs, eps = {}, {}
    for i in range(services):
        svc = ServicePort(name=ServicePortName("bench", f"dns-{i}", "dns", Protocol.UDP), family=V4,
                          type=ServiceType.CLUSTER_IP, cluster_ip=f"10.96.{i >> 8 & 255}.{i & 255}", port=53)
        svcs[svc.key] = svc
        eps[svc.key] = (Endpoint(f"10.244.{i >> 8 & 255}.{i & 255}", 5353, node_name="node-b"),)
    return ClusterState(NODE, svcs, eps)


def fill(ns: str, entries: int, services: int, stale: int, first: int = 0) -> None:
    """`entries` UDP entries from distinct client ports, spread over the services; the first
    `stale` reply from 10.245.x.y (no endpoint)."""
    with netns.entered(ns):
        ct = Conntrack(nfgen_family=socket.AF_INET)
        try:
            for n in range(first, first + entries):
                i = n % services
                client, sport = f"10.250.{n >> 16 & 255}.{n >> 8 & 255}", 1024 + (n & 255)
                dst = f"10.96.{i >> 8 & 255}.{i & 255}"
                reply = f"10.{245 if n - first < stale else 244}.{i >> 8 & 255}.{i & 255}"
                ct.entry(
                    "add", timeout=600,
                    tuple_orig=NFCTAttrTuple(family=socket.AF_INET, saddr=client, sport=sport, daddr=dst,
                                             dport=53, proto=socket.IPPROTO_UDP),
                    tuple_reply=NFCTAttrTuple(family=socket.AF_INET, saddr=reply, sport=5353, daddr=client,
                                              dport=sport, proto=socket.IPPROTO_UDP),
                )
        finally:
            ct.close()


def timed(fn: object) -> tuple[float, float, object]:
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()  # type: ignore[operator]
    return time.perf_counter() - wall, time.process_time() - cpu, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--entries", type=int, default=10_000)
    ap.add_argument("--services", type=int, default=100)
    ap.add_argument("--stale", type=int, default=1_000)
    ap.add_argument("--cluster", type=int, default=10_000, help="UDP services the sweep is built from")
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    state = cluster(max(args.cluster, args.services))
    with netns.throwaway("nfp-bench-ct") as ns:
        fill(ns, args.entries, args.services, 0)
        rows = {"sweeps": [], "walk, nothing stale": [], f"walk, {args.stale} stale": []}
        for run in range(args.runs):
            wall, cpu, found = timed(lambda: sweeps(None, state, ()))
            rows["sweeps"].append((wall, cpu))
            (sweep,) = found  # type: ignore[misc]
            wall, cpu, n = timed(lambda: kct.delete_judged(ns, V4, Protocol.UDP, sweep.stale))
            assert n == 0, n
            rows["walk, nothing stale"].append((wall, cpu))
            fill(ns, args.stale, args.services, args.stale, first=args.entries + run * args.stale)
            wall, cpu, n = timed(lambda: kct.delete_judged(ns, V4, Protocol.UDP, sweep.stale))
            assert n == args.stale, n
            rows[f"walk, {args.stale} stale"].append((wall, cpu))
        assert len(kct.list_flows(ns, V4)) == args.entries
    print(f"{args.entries} UDP entries, sweep of {len(state.services)} UDP services; median of {args.runs} runs")
    for name, samples in rows.items():
        print(f"  {name:24} {statistics.median(w for w, _ in samples) * 1000:8.1f} ms wall "
              f"{statistics.median(c for _, c in samples) * 1000:8.1f} ms CPU")
    print(f"  peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


if __name__ == "__main__":
    main()

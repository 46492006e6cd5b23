"""What the off table (docs/nft-layouts.md, "Chains off the lane") costs and saves, at scale.

One cluster of S services x N endpoints with weights 1:2:7 cycled (every chain on the lane), in
a traffic sandbox, through the proxier, in one run:

- changes, each a partial sync of one service (medians): a port moved off the lane (an
  endpoint of weight 3 added: sum 31 -> 34 = 2 . 17, a prime the lane lacks), a weight change
  of a port already off (34 -> 38), a port moved back (the endpoint removed: 38 -> 31, on the
  lane again), against an endpoint added to an unweighted cluster of the same size;
- first connections (median of `--connections`, `connect()` + the server's line) to a service
  of the same cluster without weights, to it weighted in nfproxy's table with and without an
  off table beside it, and to the port in the off table; the states alternate so that drift
  hits all sides alike.

    sudo .venv/bin/python bench/off_table.py [--services 10000] [--endpoints 10]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from nfproxy.core.changes import Touched  # noqa: E402
from nfproxy.core.model import ClusterState, Endpoint, IPFamily  # noqa: E402
from nfproxy.daemon.proxier import Proxier  # noqa: E402
from nfproxy.kernel import netns  # noqa: E402
from nfproxy.kernel.nft import NftSession  # noqa: E402
from nfproxy.nftables import OFF_TABLE  # noqa: E402
from nfproxy.testing import uniform_cluster  # noqa: E402
from nfproxy.verify.sandbox import Sandbox, SandboxSpec  # noqa: E402

from sync import weighted  # noqa: E402  (bench/sync.py: the pattern cycled over each port's endpoints)

MED = statistics.median


def with_endpoints(state: ClusterState, key, eps) -> ClusterState:  # noqa: ANN001
    return dataclasses.replace(state, endpoints={**state.endpoints, key: tuple(eps)})


def timed(proxier: Proxier, before: ClusterState, after: ClusterState, key) -> float:  # noqa: ANN001
    gc.collect()
    start = time.perf_counter()
    result = proxier.sync(after, touched=Touched(before, frozenset({key})))
    elapsed = time.perf_counter() - start
    assert result.kind == "partial", result
    return elapsed * 1000


def changes(state: ClusterState, repeat: int) -> dict[str, list[float]]:
    """Per iteration, on another service: moved off, changed while off, moved back."""
    keys = sorted(state.services, key=lambda k: (k[0].namespace, k[0].name))
    out: dict[str, list[float]] = {"off": [], "while off": [], "back": []}
    with netns.throwaway("nfp-bench") as ns:
        proxier = Proxier("nft", netns=ns)
        proxier.sync(state)
        current = state
        for i in range(repeat):
            key = keys[(i * 7919 + 11) % len(keys)]
            base = list(current.endpoints[key])
            steps = (
                ("off", [*base, Endpoint(f"10.99.{i}.1", 8080, weight=3)]),  # 31 -> 34
                ("while off", [*base, Endpoint(f"10.99.{i}.1", 8080, weight=7)]),  # 34 -> 38
                ("back", base),  # 38 -> 31
            )
            for label, eps in steps:
                new = with_endpoints(current, key, eps)
                out[label].append(timed(proxier, current, new, key))
                current = new
            proxier.sync(current)  # the stale chains of the move back
    return out


def plain_changes(state: ClusterState, repeat: int) -> list[float]:
    keys = sorted(state.services, key=lambda k: (k[0].namespace, k[0].name))
    times = []
    with netns.throwaway("nfp-bench") as ns:
        proxier = Proxier("nft", netns=ns)
        proxier.sync(state)
        current = state
        for i in range(repeat):
            key = keys[(i * 7919 + 11) % len(keys)]
            new = with_endpoints(current, key, [*current.endpoints[key], Endpoint(f"10.99.{i}.1", 8080)])
            times.append(timed(proxier, current, new, key))
            current = new
    return times


def first_connections(state: ClusterState, n: int, rounds: int) -> dict[str, list[float]]:
    """Median µs per round: to service `a` of the cluster without weights, to `a` weighted
    (nfproxy's table) with no off table, to `a` with an off table holding port `b`, and to `b`
    there."""
    keys = sorted(state.services, key=lambda k: (k[0].namespace, k[0].name))
    a, b = keys[0], keys[1]
    off = with_endpoints(state, b, [*state.endpoints[b], Endpoint(state.endpoints[b][0].ip, 8081, weight=3)])  # 31 -> 34
    eps = {ep.ip for key in (a, b) for ep in off.endpoints[key]}
    spec = SandboxSpec.of(node_ips=["192.168.0.2"], clients={"pod": "10.244.5.5"},
                          endpoints={ip: [(8080, "tcp"), (8081, "tcp")] for ip in eps})
    plain = dataclasses.replace(state, endpoints={k: tuple(dataclasses.replace(e, weight=1) for e in eps)
                                                  for k, eps in state.endpoints.items()})
    out: dict[str, list[float]] = {"nfproxy, no off table": [], "unweighted cluster": [],
                                   "nfproxy, off table beside": [], "off table": []}
    with Sandbox(spec) as sb:
        proxier = Proxier("nft", netns=sb.node_ns)
        proxier.sync(state)

        def probe(key) -> float:  # noqa: ANN001
            svc = state.services[key]
            sb.connect("pod", svc.cluster_ip, svc.port, "tcp", 10)  # warm up
            outcomes = sb.connect("pod", svc.cluster_ip, svc.port, "tcp", n, parallel=1)
            assert all(o.ok for o in outcomes), outcomes[:3]
            return MED(o.seconds for o in outcomes) * 1e6

        for _ in range(rounds):
            proxier.sync(plain)
            out["unweighted cluster"].append(probe(a))
            proxier.sync(state)
            proxier.sync(state)
            assert NftSession(sb.node_ns).list_table("ip", OFF_TABLE, terse=True) is None
            out["nfproxy, no off table"].append(probe(a))
            proxier.sync(off)
            assert NftSession(sb.node_ns).list_table("ip", OFF_TABLE, terse=True) is not None
            out["nfproxy, off table beside"].append(probe(a))
            out["off table"].append(probe(b))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--services", type=int, default=10_000)
    ap.add_argument("--endpoints", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--connections", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    S, N = args.services, args.endpoints
    plain = uniform_cluster(S, N)
    heavy = weighted(plain, [1, 2, 7])
    print(f"# the off table: {S} x {N}, weights 1:2:7 cycled, one run", flush=True)
    plain_ms = plain_changes(plain, args.repeat)
    moves = changes(heavy, args.repeat)
    first = first_connections(heavy, args.connections, args.rounds)
    base = MED(plain_ms)
    print()
    print("| measure | median | against the unweighted change |")
    print("|---|---|---|")
    print(f"| unweighted: an endpoint added (ms) | {base:.2f} | 1 |")
    for label, what in (("off", "a port moved off the lane (sum 31 -> 34)"),
                        ("while off", "a weight change of a port off the lane (34 -> 38)"),
                        ("back", "a port moved back (38 -> 31)")):
        m = MED(moves[label])
        print(f"| weighted: {what} (ms) | {m:.2f} | {m / base:.2f} |")
    ref = MED(first["nfproxy, no off table"])
    print()
    print("| first connection (µs, median of medians) | median | against no off table |")
    print("|---|---|---|")
    for label, values in first.items():
        print(f"| {label} | {MED(values):.1f} | {MED(values) / ref:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

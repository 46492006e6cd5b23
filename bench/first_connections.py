"""First connections through the nft rules of one cluster in several states, taking turns.

One traffic sandbox, S x 10 services, one service probed (`connect()` + the server's line,
sequential, medians per round); before each probe a fresh proxier writes the state's rules (a
full sync, as a restart does), the states' order reversing every round so that the machine's
drift falls on all of them alike. Every state gets a fresh proxier, so that none differs from
another by what ran before it (when only a lane change restarted it, three runs on 2026-12-03
read the old lane's weighted state 1.14-1.38x faster than today's; with a restart for every
state, 1.001 in a two-state run and 1.10 in a four-state one: first connections on that
machine did not resolve 10 %).

- `--compare weights` (default): the cluster unweighted, with 1:2:7 cycled over each service's
  endpoints, and with nine of weight 1 and one of weight 2 (weighted rules, traffic nearly even);
- `--compare lanes`: the lane before 2026-12-03 (67 026 960, 64 per map) against today's, for the
  cluster unweighted and with 1:2:7 (render.LANE/LANES_PER_MAP set for this process only).

Per state: the median of the rounds' medians, their spread, and per endpoint the median and the
number of connections (the weights' split, seen from the client).

    sudo .venv/bin/python bench/first_connections.py [--compare weights|lanes] [--rounds 10] [--connections 300]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from nfproxy.backends.nft import render  # noqa: E402
from nfproxy.core.model import ClusterState  # noqa: E402
from nfproxy.daemon.proxier import Proxier  # noqa: E402
from nfproxy.testing import uniform_cluster  # noqa: E402
from nfproxy.verify.sandbox import Sandbox, SandboxSpec  # noqa: E402

from sync import weighted  # noqa: E402

MED = statistics.median
TODAY = (render.LANE, render.LANES_PER_MAP)
BEFORE = (67_026_960, 64)


def states(compare: str, plain: ClusterState) -> dict[str, tuple[ClusterState, tuple[int, int]]]:
    heavy = weighted(plain, [1, 2, 7])
    if compare == "lanes":
        return {"unweighted, lane before": (plain, BEFORE), "unweighted, lane today": (plain, TODAY),
                "1:2:7, lane before": (heavy, BEFORE), "1:2:7, lane today": (heavy, TODAY)}
    return {"unweighted": (plain, TODAY), "1:2:7 cycled": (heavy, TODAY),
            "nine of 1, one of 2": (weighted(plain, [1] * 9 + [2]), TODAY)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--compare", choices=("weights", "lanes"), default="weights")
    ap.add_argument("--services", type=int, default=10_000)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--connections", type=int, default=300)
    args = ap.parse_args()
    plain = uniform_cluster(args.services, 10)
    cases = states(args.compare, plain)
    key = sorted(plain.services, key=lambda k: (k[0].namespace, k[0].name))[0]
    svc = plain.services[key]
    spec = SandboxSpec.of(node_ips=["192.168.0.2"], clients={"pod": "10.244.5.5"},
                          endpoints={ep.ip: [(8080, "tcp")] for ep in plain.endpoints[key]})
    rounds: dict[str, list[float]] = {name: [] for name in cases}
    per_endpoint: dict[str, dict[str, list[float]]] = {name: collections.defaultdict(list) for name in cases}
    print(f"# first connections: {args.services} x 10, {args.compare}, {args.rounds} rounds of "
          f"{args.connections}, one run", flush=True)
    with Sandbox(spec) as sb:
        for r in range(args.rounds):
            order: Callable = (lambda x: x) if r % 2 == 0 else reversed  # type: ignore[assignment]
            for name in order(list(cases)):
                state, lane = cases[name]
                render.LANE, render.LANES_PER_MAP = lane
                proxier = Proxier("nft", netns=sb.node_ns)  # a restart: the lanes are laid out anew
                proxier.sync(state, full=True)
                proxier.sync(state)  # what the first one left for cleanup
                sb.connect("pod", svc.cluster_ip, svc.port, "tcp", 10)  # warm up
                outcomes = sb.connect("pod", svc.cluster_ip, svc.port, "tcp", args.connections, parallel=1)
                assert all(o.ok for o in outcomes), outcomes[:3]
                rounds[name].append(MED(o.seconds for o in outcomes) * 1e6)
                for o in outcomes:
                    per_endpoint[name][o.endpoint or "?"].append(o.seconds * 1e6)
                print(f"round {r + 1} {name}: {rounds[name][-1]:.1f} µs", flush=True)
    render.LANE, render.LANES_PER_MAP = TODAY
    first = next(iter(cases))
    ref = MED(rounds[first])
    print()
    print(f"| state | first connection (µs, median of the rounds' medians) | rounds' spread | against {first} |")
    print("|---|---|---|---|")
    for name, values in rounds.items():
        print(f"| {name} | {MED(values):.1f} | {min(values):.0f}–{max(values):.0f} | {MED(values) / ref:.3f} |")
    print()
    for name, eps in per_endpoint.items():
        cells = " ".join(f"{ep.split(':')[0].rsplit('.', 1)[-1]}: {MED(v):.0f} µs ({len(v)})" for ep, v in sorted(eps.items()))
        print(f"{name} per endpoint (last octet: median, connections): {cells}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

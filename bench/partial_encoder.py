"""Partial syncs with pyroute2's encoder against nft_wire's, in one run, changes taken in turns.

Three clusters stand side by side, each in its own throwaway namespace, all through the proxier:
S x N unweighted, 100 x N unweighted, and S x N with weights 1:2:7 cycled (bench/sync.py's
weighted cluster). Each round adds one endpoint to one service of each (weight 1; 3 in the
weighted cluster), once with
every message of the batch encoded by pyroute2 (`nft_netlink.build`, what partial syncs sent
until 2026-12-03) and once by `nft_wire.wired` (what they send now); both go through pyroute2's
socket and its acks. In the weighted cluster the change is a move to the off table (sum 31 ->
34 = 2 . 17, which the lane does not divide: docs/nft-layouts.md "Chains off the lane"; until
2026-12-03 the endpoint added there had weight 1, 31 -> 32, off the lane of then). Medians per encoder, and the two ratios the
issues name: 10 000 against 100 (issue K) and weighted against unweighted (issue M).

    sudo .venv/bin/python bench/partial_encoder.py [--services 10000] [--rounds 15]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from nfproxy.core.changes import Touched  # noqa: E402
from nfproxy.core.model import ClusterState, Endpoint  # noqa: E402
from nfproxy.daemon.proxier import Proxier  # noqa: E402
from nfproxy.kernel import netns, nft_wire  # noqa: E402
from nfproxy.kernel import nft_netlink as nn  # noqa: E402
from nfproxy.testing import uniform_cluster  # noqa: E402

from off_table import with_endpoints  # noqa: E402
from sync import weighted  # noqa: E402

ENCODERS = {"pyroute2": lambda m, family: nn.build(m, family, 0), "nft_wire": nft_wire.wired}


class Cluster:
    """One cluster in its namespace, changed one service at a time."""

    def __init__(self, ns: str, state: ClusterState, pick: Callable[[tuple[Endpoint, ...]], bool] | None = None,
                 added_weight: int = 1) -> None:
        """`pick`: which services' endpoints may be changed (all by default); `added_weight`:
        the weight of each endpoint a change adds."""
        self.added_weight = added_weight
        self.proxier = Proxier("nft", netns=ns)
        self.proxier.sync(state)
        self.state = state
        keys = sorted(state.services, key=lambda k: (k[0].namespace, k[0].name))
        self.keys = [k for k in keys if pick is None or pick(state.endpoints[k])]
        self.n = 0

    def change(self) -> float:
        i, self.n = self.n, self.n + 1
        key = self.keys[(i * 7919 + 11) % len(self.keys)]
        added = Endpoint(f"10.99.{i % 250}.{i // 250 + 1}", 8080, weight=self.added_weight)
        new = with_endpoints(self.state, key, [*self.state.endpoints[key], added])
        gc.collect()
        start = time.perf_counter()
        result = self.proxier.sync(new, touched=Touched(self.state, frozenset({key})))
        elapsed = (time.perf_counter() - start) * 1000
        assert result.kind == "partial", result
        self.state = new
        return elapsed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--services", type=int, default=10_000)
    ap.add_argument("--endpoints", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    S, N = args.services, args.endpoints
    shapes = {
        "unweighted": uniform_cluster(S, N),
        "small": uniform_cluster(100, N),
        "weighted (a move)": weighted(uniform_cluster(S, N), [1, 2, 7]),
    }
    print(f"# partial syncs by encoder: {S} x {N} and 100 x {N}, {args.rounds} rounds, one run", flush=True)
    times: dict[tuple[str, str], list[float]] = {(e, s): [] for e in ENCODERS for s in shapes}
    real = nft_wire.wired
    with contextlib.ExitStack() as stack:
        clusters = {name: Cluster(stack.enter_context(netns.throwaway("nfp-enc")), st, added_weight=3 if name.startswith("weighted") else 1)
                    for name, st in shapes.items()}
        try:
            for _ in range(args.rounds):
                for encoder, wired in ENCODERS.items():
                    nft_wire.wired = wired  # type: ignore[assignment]
                    for name, cluster in clusters.items():
                        times[(encoder, name)].append(cluster.change())
        finally:
            nft_wire.wired = real
    print()
    print(f"| encoder | change at {S} (ms) | at 100 (ms) | weighted move at {S} (ms) | {S} / 100 (K) | weighted / unweighted (M) |")
    print("|---|---|---|---|---|---|")
    for encoder in ENCODERS:
        med = {name: statistics.median(times[(encoder, name)]) for name in shapes}
        big, small, move = med["unweighted"], med["small"], med["weighted (a move)"]
        print(f"| {encoder} | {big:.2f} | {small:.2f} | {move:.2f} | {big / small:.2f} | {move / big:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

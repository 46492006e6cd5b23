"""One cluster in a throwaway namespace, changed one service at a time through the proxier: the
harness of bench/weighted_homes.py (it was bench/partial_encoder.py's, removed with the pyroute2
send path it measured)."""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from nfproxy.core.changes import Touched  # noqa: E402
from nfproxy.core.model import ClusterState, Endpoint  # noqa: E402
from nfproxy.daemon.proxier import Proxier  # noqa: E402

from off_table import with_endpoints  # noqa: E402


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

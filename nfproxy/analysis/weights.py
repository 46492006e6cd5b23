"""The intended endpoint weights, from the model: what `check` holds the kernel's shares to.

Rules alone cannot say which split was meant: a cascade printed 0.7/0.6666666667 is a weighted
1:2:7 on purpose or a broken 1:1:1, and an iptables-save threshold keeps 31 bits of a value the
analysis can only bound. So the intent comes from the same ClusterState the rules were rendered
from (`--manifests`), keyed the way check names a selection chain: the service port
(`ns/name:port`), then the endpoint (`ip:port`).
"""

from __future__ import annotations

from collections.abc import Mapping
from fractions import Fraction
from types import MappingProxyType

from nfproxy.core.model import ClusterState

# service port name -> endpoint address -> weight
Weights = Mapping[str, Mapping[str, int]]


def intended_weights(state: ClusterState) -> Weights:
    """Every endpoint's weight per service port (both families: their addresses differ)."""
    out: dict[str, dict[str, int]] = {}
    for (spn, _), endpoints in state.endpoints.items():
        bucket = out.setdefault(str(spn), {})
        for ep in endpoints:
            bucket[ep.address] = ep.weight
    return MappingProxyType({k: MappingProxyType(v) for k, v in out.items()})


def intended_shares(weights: Weights, service: str, endpoints: list[str]) -> dict[str, Fraction] | None:
    """Each endpoint's share of what one selection chain picks among `endpoints` (the ones
    its rules reach: a Local-policy chain reaches only the node's own), or None when the
    model does not know them all (another node's model, or rules older than it)."""
    known = weights.get(service)
    if known is None or any(e not in known for e in endpoints):
        return None
    total = sum(known[e] for e in endpoints)
    if not total:
        return {e: Fraction(0) for e in endpoints}
    return {e: Fraction(known[e], total) for e in endpoints}

"""What a kernel holds of one backend's objects, by name: shared by backends and kernels.

It lives in core because both sides speak it and the kernel layer may import no backend.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Owned:
    """Names of the objects a backend owns that a kernel holds now (nft: chains, sets/maps and
    named counters of its table; iptables: chains in nat and filter, no sets or counters)."""

    chains: frozenset[str] = frozenset()
    sets: frozenset[str] = frozenset()
    counters: frozenset[str] = frozenset()
    # nft: the same names in the second table (nftables.OFF_TABLE); None when there is none.
    off: Owned | None = None

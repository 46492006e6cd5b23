"""The one interface every backend implements, so that the proxier and every command are generic.

A backend is pure: it turns states and their changes into plans, and remembers what the kernel
accepted. The kernel side (nfproxy/kernel/base.py) applies the plans' payloads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from nfproxy.core.changes import Changes
from nfproxy.core.model import ClusterState, IPFamily


@dataclass(frozen=True, slots=True)
class Owned:
    """Names of the objects a backend owns that a kernel holds now.

    nft: chain and set/map names in the table; iptables: chain names in nat and filter, no sets.
    """

    chains: frozenset[str]
    sets: frozenset[str]


@dataclass(frozen=True, slots=True)
class Plan:
    """One family's kernel work for one sync; a backend may subclass it with what it must
    remember once the kernel accepted it."""

    family: IPFamily
    full: bool
    operations: int  # kernel operations, as the sync log and metrics count them
    payload: object  # nft: a Transaction; iptables: a RestorePayload


class Rendered(Protocol):
    def text(self) -> str:
        """`nfproxy render` output for one family."""
        ...


class Backend(Protocol):
    name: str  # "nft" | "iptables": the registry key

    def render(self, state: ClusterState, family: IPFamily) -> Rendered: ...

    def plan(
        self,
        state: ClusterState,
        changes: Changes,
        family: IPFamily,
        *,
        full: bool,
        found: Owned | None,
    ) -> Plan | None:
        """None: nothing to do. Partial when not `full` and the backend holds a belief for the
        family; `found` is what the kernel holds (read before a full plan, to remove strays)."""
        ...

    def accepted(self, plan: Plan) -> None:
        """The kernel took the plan: believe it."""
        ...

    def forget(self) -> None:
        """After a failure: the next plan is full."""
        ...

    def pending(self) -> bool:
        """Stale objects wait for the next sync."""
        ...

    def counts(self) -> dict[IPFamily, dict[str, int]]:
        """What metrics report per family."""
        ...

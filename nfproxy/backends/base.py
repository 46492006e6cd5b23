"""The Backend protocol: what the proxier, validate, compare, lab and the CLI know of a backend.

A backend is pure: it renders a state, and plans a sync (partial from `Changes`, or full) as a
payload its kernel applies atomically. It remembers what it believes the kernel holds only when
told the kernel accepted a plan, and forgets it after a failure so the next plan is full. Which
kernel applies the payload is not its business (kernel/base.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from nfproxy.core.changes import Changes
from nfproxy.core.model import ClusterState, IPFamily
from nfproxy.core.owned import Owned

__all__ = ["Backend", "Owned", "Plan", "Rendered"]


@dataclass(frozen=True, slots=True)
class Plan:
    """One family's sync: `payload` is what the kernel applies (nft: a Transaction; iptables: a
    restore payload); `memo` is what the backend believes once the kernel accepted it.

    `without_cleanup` is the same sync without deleting stale objects, for when the kernel
    refuses a deletion (someone else's rule still jumps to the chain): as kube-proxy, that is a
    cleanup failure, not a failed sync; the deletions wait for the next sync."""

    family: IPFamily
    full: bool
    operations: int  # kernel operations, as the sync log and metrics count them
    payload: object
    memo: object = None
    without_cleanup: Plan | None = None
    why: str = ""  # a full plan the backend chose itself (a partial one could not say it), why


class Rendered(Protocol):
    def text(self) -> str:
        """This family's part of `nfproxy render` output."""


class Backend(Protocol):
    name: str  # the registry key

    def render(self, state: ClusterState, family: IPFamily) -> Rendered: ...

    def plan(
        self, state: ClusterState, changes: Changes, family: IPFamily, *, full: bool, found: Owned | None
    ) -> Plan | None:
        """The next sync of `family`, None when there is nothing to do. Partial when not `full`
        and a belief for the family is held; `found` (read before a full plan) lets a full plan
        remove objects nobody renders any more."""

    def accepted(self, plan: Plan) -> None:
        """The kernel took `plan`: believe it."""

    def forget(self) -> None:
        """After a failure: believe nothing, so every next plan is full."""

    def pending(self) -> bool:
        """True when stale objects wait for the next sync."""

    def counts(self) -> dict[IPFamily, dict[str, int]]:
        """What metrics report per family, as of the last accepted plans."""

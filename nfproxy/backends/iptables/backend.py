"""The iptables Backend: kube-proxy's iptables proxier, as plans for a generic proxier."""

from __future__ import annotations

from nfproxy.backends.base import Owned, Plan
from nfproxy.backends.iptables.plan import (
    Belief,
    IptablesPlan,
    RestorePayload,
    full_plan,
    holds_nothing,
    partial_plan,
)
from nfproxy.backends.iptables.render import IptablesRules, render
from nfproxy.core.changes import Changes
from nfproxy.core.model import ClusterState, IPFamily


class IptablesBackend:
    """Believes, per family, what the kernel holds after the last accepted plan.

    Stale chains are deleted in the very restore that leaves them stale, so nothing is ever
    pending.
    """

    name = "iptables"

    def __init__(self) -> None:
        self._believed: dict[IPFamily, Belief] = {}

    def render(self, state: ClusterState, family: IPFamily) -> IptablesRules:
        return render(state, family)

    def plan(
        self,
        state: ClusterState,
        changes: Changes,
        family: IPFamily,
        *,
        full: bool,
        found: Owned | None,
    ) -> IptablesPlan | None:
        belief = self._believed.get(family)
        if belief is None and holds_nothing(state, family, found):
            return _untouched(family)
        if full or belief is None or changes.node:
            return full_plan(state, family, found)
        return partial_plan(state, changes.of(family), family, belief)

    def accepted(self, plan: Plan) -> None:
        if not isinstance(plan, IptablesPlan):
            raise TypeError(f"not an iptables plan: {plan!r}")
        if plan.belief is None:
            self._believed.pop(plan.family, None)
        else:
            self._believed[plan.family] = plan.belief

    def forget(self) -> None:
        self._believed.clear()

    def pending(self) -> bool:
        return False

    def counts(self) -> dict[IPFamily, dict[str, int]]:
        """Rules per table the kernel holds, per family (metrics' iptables tables)."""
        counts: dict[IPFamily, dict[str, int]] = {}
        for family, belief in self._believed.items():
            top = belief.rules
            nat = sum(len(r) for r in top.nat.values())
            nat += sum(g.rules for g in belief.services.values())
            counts[family] = {"nat": nat, "filter": sum(len(r) for r in top.filter.values())}
        return counts


def _untouched(family: IPFamily) -> IptablesPlan:
    """A family with no service whose kernel holds no KUBE chain: nothing to write, and no
    belief, so the first service of that family gets a full plan (chains and jumps)."""
    return IptablesPlan(family=family, full=False, operations=0, payload=RestorePayload(), belief=None)

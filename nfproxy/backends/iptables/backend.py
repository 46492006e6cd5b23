"""IptablesBackend: today's iptables sync (every sync re-renders, only changed chains are
restored) behind the Backend protocol, in the smallest way. Helper B's fuller class replaces it.
"""

from __future__ import annotations

from dataclasses import dataclass

from nfproxy.backends.base import Owned, Plan
from nfproxy.backends.iptables import render as iptables_render
from nfproxy.backends.iptables.render import IptablesRules, JumpRule
from nfproxy.core.changes import Changes
from nfproxy.core.model import ClusterState, IPFamily


@dataclass(frozen=True, slots=True)
class RestorePayload:
    """One `iptables-restore --noflush` input, and the built-in-chain rules to ensure after it
    (a full sync only: a restore cannot own one rule of INPUT)."""

    text: str
    jumps: tuple[JumpRule, ...] = ()


@dataclass(frozen=True, slots=True)
class IptablesRendered:
    family: IPFamily
    rules: IptablesRules

    def text(self) -> str:
        tool = "iptables-restore" if self.family is IPFamily.V4 else "ip6tables-restore"
        return f"# IPv{self.family.value}: {tool} --noflush\n" + self.rules.restore_text(with_jumps=True)


class IptablesBackend:
    name = "iptables"

    def __init__(self) -> None:
        self._applied: dict[IPFamily, IptablesRules] = {}

    def render(self, state: ClusterState, family: IPFamily) -> IptablesRendered:
        return IptablesRendered(family, iptables_render.render(state, family))

    def plan(
        self, state: ClusterState, changes: Changes, family: IPFamily, *, full: bool, found: Owned | None
    ) -> Plan | None:
        previous = self._applied.get(family)
        if not full and previous is not None and not changes.of(family):
            return None
        new = iptables_render.render(state, family)
        if full or previous is None:
            existing = found.chains if found is not None else frozenset()
            wanted = set(new.nat) | {c for g in new.service_chains.values() for c in g.chains}
            stale = sorted(
                c for c in existing if c.startswith(iptables_render.SERVICE_CHAIN_PREFIXES) and c not in wanted
            )
            payload = RestorePayload(new.restore_text(with_jumps=False, delete_chains=stale), new.jumps)
            return Plan(family, True, payload.text.count("\n"), payload, new)
        changed = [k for k, g in new.service_chains.items() if previous.service_chains.get(k) != g]
        old_chains = {c for g in previous.service_chains.values() for c in g.chains}
        new_chains = {c for g in new.service_chains.values() for c in g.chains}
        gone = sorted(old_chains - new_chains)
        if not changed and not gone and previous.nat == new.nat and previous.filter == new.filter:
            self._applied[family] = new
            return None
        payload = RestorePayload(new.restore_text(with_jumps=False, services=changed, delete_chains=gone))
        return Plan(family, False, payload.text.count("\n"), payload, new)

    def accepted(self, plan: Plan) -> None:
        assert isinstance(plan.memo, IptablesRules)
        self._applied[plan.family] = plan.memo

    def forget(self) -> None:
        self._applied.clear()

    def pending(self) -> bool:
        return False

    def counts(self) -> dict[IPFamily, dict[str, int]]:
        """Rules per table after the last sync, per family (metrics' iptables tables)."""
        counts: dict[IPFamily, dict[str, int]] = {}
        for family, rules in self._applied.items():
            nat = sum(len(r) for r in rules.nat.values()) + sum(len(g.rules) for g in rules.service_chains.values())
            counts[family] = {"nat": nat, "filter": sum(len(r) for r in rules.filter.values())}
        return counts

"""NftBackend: plans nft syncs as Transactions, partial from `Changes` where it can.

Per family it believes one ruleset (the last one the kernel accepted) and the stale objects
that ruleset's transaction emptied but could not yet delete. Pure: the kernel is someone else's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from nfproxy.backends.base import Owned, Plan
from nfproxy.backends.nft import render as nft_render
from nfproxy.backends.nft.render import NftRuleset, ServiceRules
from nfproxy.core.changes import Changes
from nfproxy.core.model import ClusterState, IPFamily
from nfproxy.nftables import Chain, Map, Set, Transaction

log = logging.getLogger("nfproxy.backends.nft")

# Per-service sets a full sync may find left over: affinity sets and endpoint shard maps. The
# static sets are the renderer's own (an unused one is deleted by the full transaction itself;
# cluster-cidrs is kept on purpose, see render._static).
_PER_SERVICE_SETS = (nft_render.AFFINITY_PREFIX, nft_render.SHARD_PREFIX)


@dataclass(frozen=True, slots=True)
class _Belief:
    ruleset: NftRuleset
    stale_chains: tuple[str, ...]
    stale_sets: tuple[str, ...]
    owned: tuple[int, int, int]  # chains, rules and affinity sets of all service ports


def _objects_of(svc: ServiceRules) -> tuple[int, int, int]:
    """Chains, rules and affinity sets one service port owns."""
    return len(svc.chains), sum(len(r) for r in svc.chains.values()), len(svc.affinity_sets)


def _held(b: _Belief) -> Owned:
    """What the kernel holds of ours when it holds what we believe."""
    rs = b.ruleset
    chains = set(rs.chains) | set(b.stale_chains)
    sets = set(rs.sets) | set(rs.shard_users) | set(b.stale_sets)
    for svc in rs.services.values():
        chains.update(svc.chains)
        sets.update(svc.affinity_sets)
    return Owned(frozenset(chains), frozenset(sets))


def strays(new: NftRuleset, found: Owned) -> tuple[list[str], list[str]]:
    """Chains and per-service sets the kernel holds in our table that `new` does not render:
    left by services that vanished while nobody was watching (a restart, a failed sync)."""
    wanted_chains = set(new.chains)
    wanted_sets = set(new.shard_users)
    for svc in new.services.values():
        wanted_chains.update(svc.chains)
        wanted_sets.update(svc.affinity_sets)
    chains = sorted(c for c in found.chains if c not in wanted_chains)
    sets = sorted(s for s in found.sets if s.startswith(_PER_SERVICE_SETS) and s not in wanted_sets)
    return chains, sets


class NftBackend:
    name = "nft"

    def __init__(self, *, endpoint_counters: bool = True) -> None:
        self._beliefs: dict[IPFamily, _Belief] = {}
        # Per-endpoint connection counters (render._Context.counters); off only to measure them.
        self.endpoint_counters = endpoint_counters

    def render(self, state: ClusterState, family: IPFamily) -> NftRuleset:
        return nft_render.render(state, family)

    def plan(
        self, state: ClusterState, changes: Changes, family: IPFamily, *, full: bool, found: Owned | None
    ) -> Plan | None:
        belief = self._beliefs.get(family)
        if not full and belief is not None:
            try:
                return self._partial(belief, state, changes.of(family), family)
            except nft_render.NeedsFullSync as exc:
                log.info("IPv%d: partial sync impossible (%s): full sync", family.value, exc)
                found = _held(belief)  # accurate: it is what the kernel accepted
        return self._full(state, family, found, belief.ruleset if belief is not None else None)

    def _partial(
        self, belief: _Belief, state: ClusterState, keys: frozenset, family: IPFamily
    ) -> Plan | None:
        if not keys and not belief.stale_chains and not belief.stale_sets:
            return None
        previous = belief.ruleset
        new = nft_render.render_update(previous, state, keys)
        d = nft_render.delta(
            previous, new, keys, delete_chains=belief.stale_chains, delete_sets=belief.stale_sets
        )
        chains, rules, sets = belief.owned
        for key in keys:
            if (old := previous.services.get(key)) is not None:
                c, r, a = _objects_of(old)
                chains, rules, sets = chains - c, rules - r, sets - a
            if (cur := new.services.get(key)) is not None:
                c, r, a = _objects_of(cur)
                chains, rules, sets = chains + c, rules + r, sets + a
        memo = _Belief(new, d.stale_chains, d.stale_sets, (chains, rules, sets))
        return Plan(family, False, len(d.transaction), d.transaction, memo,
                    self._without_cleanup(belief, new, keys, family, (chains, rules, sets)))

    @staticmethod
    def _without_cleanup(
        belief: _Belief, new: NftRuleset, keys: frozenset, family: IPFamily,
        owned: tuple[int, int, int],
    ) -> Plan | None:
        """The same partial sync keeping the stale objects (still stale) for the next one."""
        if not belief.stale_chains and not belief.stale_sets:
            return None
        d = nft_render.delta(belief.ruleset, new, keys)
        live_chains = {c for svc in new.services.values() for c in svc.chains}
        live_sets = {a for svc in new.services.values() for a in svc.affinity_sets}
        stale_chains = tuple(sorted({*belief.stale_chains, *d.stale_chains} - live_chains))
        stale_sets = tuple(sorted(
            {*belief.stale_sets, *d.stale_sets} - live_sets - set(new.shard_users)
        ))
        memo = _Belief(new, stale_chains, stale_sets, owned)
        return Plan(family, False, len(d.transaction), d.transaction, memo)

    def _full(
        self, state: ClusterState, family: IPFamily, found: Owned | None, kept: NftRuleset | None = None
    ) -> Plan:
        """`kept`: the ruleset the kernel accepted last; the endpoint maps are then diffed
        against it instead of flushed, so per-endpoint counters survive (render.transaction)."""
        new = nft_render.render(state, family, endpoint_counters=self.endpoint_counters, keep=kept)
        tx = new.transaction(kept)
        # Strays are emptied now and deleted by the next sync, like the stale chains of a
        # partial sync (a rule or element in flight may still name them).
        stray_chains, stray_sets = strays(new, found) if found is not None else ([], [])
        tx = _flushing(tx, stray_chains)
        owned = [_objects_of(svc) for svc in new.services.values()]
        totals = (sum(o[0] for o in owned), sum(o[1] for o in owned), sum(o[2] for o in owned))
        memo = _Belief(new, tuple(stray_chains), tuple(stray_sets), totals)
        return Plan(family, True, len(tx), tx, memo)

    def accepted(self, plan: Plan) -> None:
        assert isinstance(plan.memo, _Belief)
        self._beliefs[plan.family] = plan.memo

    def forget(self) -> None:
        self._beliefs.clear()

    def pending(self) -> bool:
        return any(b.stale_chains or b.stale_sets for b in self._beliefs.values())

    def believed(self, family: IPFamily) -> NftRuleset | None:
        """The ruleset the kernel accepted last for `family` (for tests and tools)."""
        b = self._beliefs.get(family)
        return b.ruleset if b is not None else None

    def counts(self) -> dict[IPFamily, dict[str, int]]:
        """What the kernel holds after the last sync, per family (metrics' nft object kinds)."""
        counts: dict[IPFamily, dict[str, int]] = {}
        for family, b in self._beliefs.items():
            rs = b.ruleset
            chains, rules, affinity_sets = b.owned
            counts[family] = {
                "chains": len(rs.chains) + chains,
                "rules": sum(len(r) for r in rs.chains.values()) + rules,
                "sets": sum(1 for d in rs.sets.values() if isinstance(d, Set)) + affinity_sets,
                "maps": sum(1 for d in rs.sets.values() if isinstance(d, Map)) + len(rs.shard_users),
                "elements": sum(len(e) for e in rs.elements.values()) + len(rs.hairpin_refs),
            }
        return counts


def _flushing(tx: Transaction, chains: list[str]) -> Transaction:
    for name in chains:
        tx.flush(Chain(name))
    tx.check()
    return tx

"""NftBackend: plans nft syncs as Transactions, partial from `Changes` where it can.

Per family it believes one ruleset (the last one the kernel accepted) and the stale objects
that ruleset's transaction emptied but could not yet delete, per table: `nfproxy`, and the off
table (nftables.OFF_TABLE) while ports live there. Pure: the kernel is someone else's.

A sync that touches both tables plans a Transaction per table, in order (a tuple). The kernel
sends them as one nfnetlink batch when its netlink encoder can say all of them: one commit, and
only a table whose rules changed is validated. Otherwise (the sync that creates the off table,
full syncs) each goes atomically in turn, a port written into its new home before it leaves the
old one, so that a connection finds it in one of them at every moment; a failure between them
forces the next sync full, as any failure does.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from nfproxy.backends.base import Owned, Plan
from nfproxy.backends.nft import render as nft_render
from nfproxy.backends.nft.render import NftRuleset, ServiceRules
from nfproxy.core.changes import Changes
from nfproxy.core.model import ClusterState, IPFamily
from nfproxy.nftables import OFF_TABLE, Chain, Counter, Map, Set, Table, Transaction

log = logging.getLogger("nfproxy.backends.nft")

@dataclass(frozen=True, slots=True)
class _Belief:
    ruleset: NftRuleset
    stale_chains: tuple[str, ...]
    stale_sets: tuple[str, ...]
    owned: tuple[int, int, int, int]  # chains, rules, affinity sets and lane elements of all service ports
    off: _Belief | None = None  # the off table's, while it exists (its ruleset is ruleset.off)


def _objects_of(svc: ServiceRules) -> tuple[int, int, int, int]:
    """Chains, rules, affinity sets and endpoint map elements one service port owns."""
    return (len(svc.chains), sum(len(r) for r in svc.chains.values()), len(svc.affinity_sets),
            sum(len(lane.keys) for lane in svc.lanes))


def _held(b: _Belief) -> Owned:
    """What the kernel holds of ours when it holds what we believe."""
    rs = b.ruleset
    chains = set(rs.chains) | set(b.stale_chains)
    sets = set(rs.sets) | set(rs.shard_users) | set(b.stale_sets)
    for svc in rs.services.values():
        chains.update(svc.chains)
        sets.update(svc.affinity_sets)
    off = _held(b.off) if b.off is not None else None
    return Owned(frozenset(chains), frozenset(sets), frozenset(rs.counters), off)


def _totals(rs: NftRuleset) -> tuple[int, int, int, int]:
    owned = [_objects_of(svc) for svc in rs.services.values()]
    return tuple(sum(o[i] for o in owned) for i in range(4))  # type: ignore[return-value]


def _recount(
    owned: tuple[int, int, int, int], previous: NftRuleset | None, new: NftRuleset | None, keys: object
) -> tuple[int, int, int, int]:
    """`owned` (of `previous`) after the ports `keys` became what `new` holds."""
    counts = list(owned)
    for key in keys:  # type: ignore[attr-defined]
        if previous is not None and (old := previous.services.get(key)) is not None:
            counts = [n - d for n, d in zip(counts, _objects_of(old))]
        if new is not None and (cur := new.services.get(key)) is not None:
            counts = [n + d for n, d in zip(counts, _objects_of(cur))]
    return tuple(counts)  # type: ignore[return-value]


def _has_stale(b: _Belief) -> bool:
    return bool(b.stale_chains or b.stale_sets)


def _table_delta(
    belief: _Belief | None, previous: NftRuleset, new: NftRuleset, keys: tuple, cleanup: bool
) -> tuple[Transaction, _Belief]:
    """One table's delta, and what is believed of the table after it. Without `cleanup` the
    stale objects of earlier syncs are kept (still stale) for the next one: the same sync, for
    when the kernel refuses a deletion (Plan.without_cleanup)."""
    stale_chains = belief.stale_chains if belief is not None else ()
    stale_sets = belief.stale_sets if belief is not None else ()
    owned = _recount(belief.owned, previous, new, keys) if belief is not None else _totals(new)
    if cleanup:
        d = nft_render.delta(previous, new, keys, delete_chains=stale_chains, delete_sets=stale_sets)
        return d.transaction, _Belief(new, d.stale_chains, d.stale_sets, owned)
    d = nft_render.delta(previous, new, keys)
    live_chains, live_sets = nft_render.live_again(new, keys)
    chains = tuple(sorted({*stale_chains, *d.stale_chains} - live_chains))
    sets = tuple(sorted({*stale_sets, *d.stale_sets} - live_sets))
    return d.transaction, _Belief(new, chains, sets, owned)


@dataclass(frozen=True, slots=True)
class _Moves:
    """A partial sync's rulesets, rendered once: the off table after the ports that now live
    there entered it (`off1`), nfproxy after every changed port (`main1`: it leaves or
    enters), the off table after the ports that left it (`off2`, None once empty)."""

    entering: tuple
    leaving: tuple
    keys: tuple
    off0: NftRuleset | None
    off1: NftRuleset | None
    main1: NftRuleset
    off2: NftRuleset | None
    created: bool  # off1 is a new table

    @staticmethod
    def of(belief: _Belief, state: ClusterState, routed: dict, family: IPFamily) -> _Moves | nft_render.Cannot:
        main0 = belief.ruleset
        off0 = main0.off
        entering = {k: r for k, r in routed.items() if r is not None and r.table == OFF_TABLE}
        leaving = {k: r for k, r in routed.items() if k not in entering and off0 is not None and k in off0.services}
        off1: NftRuleset | nft_render.Cannot | None = off0
        if entering:
            start = off0 if off0 is not None else nft_render.empty_off(state, family, main0.endpoint_counters)
            off1 = nft_render.update_table(start, state, entering)
        main1 = nft_render.update_table(main0, state, routed)
        for made in (off1, main1):
            if isinstance(made, nft_render.Cannot):
                return made
        off2 = off1
        if leaving:
            assert off1 is not None
            off2 = nft_render.update_table(off1, state, leaving)
            if isinstance(off2, nft_render.Cannot):
                return off2
            off2 = off2 if off2.services else None
        return _Moves(tuple(entering), tuple(leaving), tuple(routed), off0, off1, main1, off2,
                      off0 is None and off1 is not None)

    def plan(self, belief: _Belief, *, cleanup: bool) -> NftPlan:
        """The steps in order, the new home first (one batch, or each atomic in turn: see the
        module's docstring). Stale objects of the off table go with its first step."""
        txs: list[Transaction] = []
        off: _Belief | None = belief.off
        if self.created:
            assert self.off1 is not None
            txs.append(self.off1.transaction())
            off = _Belief(self.off1, (), (), _totals(self.off1))
        elif self.off0 is not None and self.off1 is not None:
            tx, off = _table_delta(belief.off, self.off0, self.off1, self.entering, cleanup)
            txs.append(tx)
        tx, main = _table_delta(belief, belief.ruleset, self.main1, self.keys, cleanup)
        txs.append(tx)
        if self.leaving:
            assert self.off1 is not None and off is not None
            if self.off2 is None:
                txs.append(_drop_off_table(belief.ruleset.nft_family))
                off = None
            else:
                d = nft_render.delta(self.off1, self.off2, self.leaving)
                txs.append(d.transaction)
                off = _Belief(
                    self.off2, tuple(sorted({*off.stale_chains, *d.stale_chains})),
                    tuple(sorted({*off.stale_sets, *d.stale_sets})),
                    _recount(off.owned, self.off1, self.off2, self.leaving),
                )
        memo = dataclasses.replace(main, ruleset=dataclasses.replace(self.main1, off=self.off2), off=off)
        return NftPlan(belief.ruleset.family, False, sum(len(t) for t in txs), _payload(txs), memo)


@dataclass(frozen=True, slots=True)
class NftPlan(Plan):
    """An nft sync, typed: one Transaction, or several applied in order, each atomically (a
    port moving between nfproxy's table and the off table); what the backend believes after."""

    payload: Transaction | tuple[Transaction, ...]
    memo: _Belief | None = None
    without_cleanup: NftPlan | None = None


def _drop_off_table(family: str) -> Transaction:
    """The off table deleted with everything in it: its last port left."""
    tx = Transaction(family, OFF_TABLE)
    tx.delete(Table(family, OFF_TABLE))
    return tx


def _payload(txs: list[Transaction]) -> Transaction | tuple[Transaction, ...]:
    """One Transaction as itself (what a sync that touches one table sends), else a tuple."""
    txs = [tx for tx in txs if tx]
    return txs[0] if len(txs) == 1 else tuple(txs)


@dataclass(frozen=True, slots=True)
class Strays:
    """What the kernel holds in our table that a new ruleset does not render, by kind."""

    chains: tuple[str, ...] = ()
    sets: tuple[str, ...] = ()  # sets and maps alike
    counters: tuple[str, ...] = ()


def strays(new: NftRuleset, found: Owned) -> Strays:
    """Every chain, set, map and named counter of our table that `new` does not render: left by
    services that vanished while nobody was watching (a restart, a failed sync), or by a
    feature turned off (the INVALID-drop counter once drop_invalid is off, the nodeport-ips set
    of an older configuration, a set an older release rendered). A full sync is the one place
    where the table is made exactly what the state renders (issue J.3)."""
    wanted_chains = set(new.chains)
    # unused_sets: the full transaction itself adds and deletes those.
    wanted_sets = set(new.sets) | set(new.unused_sets) | set(new.shard_users)
    for svc in new.services.values():
        wanted_chains.update(svc.chains)
        wanted_sets.update(svc.affinity_sets)
    return Strays(
        tuple(sorted(c for c in found.chains if c not in wanted_chains)),
        tuple(sorted(s for s in found.sets if s not in wanted_sets)),
        tuple(sorted(c for c in found.counters if c not in new.counters)),
    )


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
            partial = self._partial(belief, state, changes.of(family), family)
            if not isinstance(partial, nft_render.Cannot):
                return partial
            log.info("IPv%d: partial sync impossible (%s): full sync", family.value, partial.reason)
            full_plan = self._full(state, family, _held(belief), belief.ruleset)  # held: what the kernel accepted
            return dataclasses.replace(full_plan, why=f"partial sync impossible: {partial.reason}")
        return self._full(state, family, found, belief.ruleset if belief is not None else None)

    def _partial(
        self, belief: _Belief, state: ClusterState, keys: frozenset, family: IPFamily
    ) -> NftPlan | None | nft_render.Cannot:
        stale = _has_stale(belief) or (belief.off is not None and _has_stale(belief.off))
        if not keys and not stale:
            return None
        moved = _Moves.of(belief, state, nft_render.route(state, family, keys), family)
        if isinstance(moved, nft_render.Cannot):
            return moved
        plan = moved.plan(belief, cleanup=True)
        if not stale:
            return plan
        return NftPlan(plan.family, False, plan.operations, plan.payload, plan.memo, moved.plan(belief, cleanup=False))

    def _full(
        self, state: ClusterState, family: IPFamily, found: Owned | None, kept: NftRuleset | None = None
    ) -> NftPlan:
        """`kept`: the ruleset the kernel accepted last; the endpoint maps are then diffed
        against it instead of flushed, so per-endpoint counters survive (render.transaction)."""
        new = nft_render.render(state, family, endpoint_counters=self.endpoint_counters, keep=kept)
        tx, memo = _full_table(new, kept, found)
        txs = [tx]
        if new.off is not None:
            off_tx, off_memo = _full_table(new.off, kept.off if kept is not None else None,
                                           found.off if found is not None else None)
            txs.append(off_tx)
            memo = dataclasses.replace(memo, off=off_memo)
        elif (found.off is not None) if found is not None else (kept is not None and kept.off is not None):
            txs.append(_drop_off_table(new.nft_family))  # its last port left while nobody watched
        # nfproxy first: a port moving into the off table is missing for the off table's
        # transaction (small), not a port moving out for nfproxy's (the whole table).
        return NftPlan(family, True, sum(len(t) for t in txs), _payload(txs) if len(txs) > 1 else tx, memo)

    def accepted(self, plan: Plan) -> None:
        assert isinstance(plan.memo, _Belief)
        self._beliefs[plan.family] = plan.memo

    def forget(self) -> None:
        self._beliefs.clear()

    def pending(self) -> bool:
        return any(_has_stale(b) or (b.off is not None and _has_stale(b.off)) for b in self._beliefs.values())

    def believed(self, family: IPFamily) -> NftRuleset | None:
        """The ruleset the kernel accepted last for `family` (for tests and tools)."""
        b = self._beliefs.get(family)
        return b.ruleset if b is not None else None

    def counts(self) -> dict[IPFamily, dict[str, int]]:
        """What the kernel holds after the last sync, per family (metrics' nft object kinds)."""
        counts: dict[IPFamily, dict[str, int]] = {}
        for family, b in self._beliefs.items():
            counts[family] = _counted(b)
            if b.off is not None:
                off = _counted(b.off)
                counts[family] = {k: v + off[k] for k, v in counts[family].items()}
        return counts


def _counted(b: _Belief) -> dict[str, int]:
    rs = b.ruleset
    chains, rules, affinity_sets, lane_elements = b.owned
    return {
        "chains": len(rs.chains) + chains,
        "rules": sum(len(r) for r in rs.chains.values()) + rules,
        "sets": sum(1 for d in rs.sets.values() if isinstance(d, Set)) + affinity_sets,
        "maps": sum(1 for d in rs.sets.values() if isinstance(d, Map)) + len(rs.shard_users),
        "elements": sum(len(e) for e in rs.elements.values()) + len(rs.hairpin_refs) + lane_elements,
    }


def _full_table(new: NftRuleset, kept: NftRuleset | None, found: Owned | None) -> tuple[Transaction, _Belief]:
    """One table's full transaction. Stray chains and sets are emptied now and deleted by the
    next sync, like the stale chains of a partial sync (a rule or element in flight may still
    name them). Stray counters go at once: only rules name a counter, and this transaction has
    replaced every rule of the table (a rule deleted earlier in a batch no longer holds it)."""
    tx = new.transaction(kept)
    found_strays = strays(new, found) if found is not None else Strays()
    tx = _flushing(tx, found_strays.chains)
    for name in found_strays.counters:
        tx.delete(Counter(name))
    tx.check()
    return tx, _Belief(new, found_strays.chains, found_strays.sets, _totals(new))


def _flushing(tx: Transaction, chains: tuple[str, ...]) -> Transaction:
    for name in chains:
        tx.flush(Chain(name))
    return tx

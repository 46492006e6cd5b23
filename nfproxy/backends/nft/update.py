"""Partial syncs: re-render only the ports that changed (`render_update`, `update_table`) and
say it to the kernel as a delta (`delta`); what cannot be said safely answers `Cannot`."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from itertools import chain as chained
from types import MappingProxyType

from nfproxy import nftables as nft
from nfproxy.backends.nft.names import CLUSTER_IPS_SET, HAIRPIN_SET, OFF_TABLE, TABLE, nft_address
from nfproxy.backends.nft.structure import Element, NftRuleset, ServiceRules, SlotAllocator
from nfproxy.backends.nft.full import (
    Slots,
    build_context,
    empty_off,
    hairpin_pairs,
    home,
    render_service,
    service_order,
    stub_rules,
)
from nfproxy.backends.nft.layered import GONE, Counts, layered
from nfproxy.core.gc_pause import gc_paused
from nfproxy.nftables import text as nft_text
from nfproxy.core.categorize import Routing, categorize
from nfproxy.core.model import ClusterState, Endpoint, IPFamily, ServicePort, ServicePortKey


# --------------------------------------------------------------------------------------------
# Partial syncs: re-render only what changed, and say it to the kernel as a delta.


@dataclass(frozen=True, slots=True)
class Cannot:
    """A partial update that cannot be expressed safely, and why: the caller syncs in full."""

    reason: str


@dataclass(frozen=True, slots=True)
class Route:
    """A changed port as the state has it now, and the table it belongs in (`home`)."""

    service: ServicePort
    endpoints: tuple[Endpoint, ...]
    routing: Routing
    table: str


def route(state: ClusterState, family: IPFamily, keys: Iterable[ServicePortKey]) -> dict[ServicePortKey, Route | None]:
    """Each changed port of `family` with its home; None for a port that is gone."""
    out: dict[ServicePortKey, Route | None] = {}
    for key in keys:
        if key[1] is not family:
            continue
        svc = state.services.get(key)
        if svc is None:
            out[key] = None
            continue
        eps = state.endpoints.get(key, ())
        r = categorize(svc, eps, state.node)
        out[key] = Route(svc, eps, r, home(r, svc.affinity_timeout > 0))
    return out


def render_update(
    previous: NftRuleset, state: ClusterState, keys: Iterable[ServicePortKey]
) -> NftRuleset | Cannot:
    """`previous` with the service ports in `keys` (of this family) rendered again from `state`,
    in both tables (a port whose home changed leaves one and enters the other).

    Equivalent to `render(state, family)` as long as only those ports changed and the node did
    not (the caller checks the node: a changed node means a full render); slot numbers may
    differ, since a port keeps its block while it fits. Contested element keys (an address
    claimed by two services) move between owners in ways only a full render gets right, so
    touching one answers Cannot.
    """
    routed = route(state, previous.family, keys)
    main = update_table(previous, state, routed)
    if isinstance(main, Cannot):
        return main
    off = previous.off
    if off is not None or any(r is not None and r.table == OFF_TABLE for r in routed.values()):
        off = update_table(off or empty_off(state, previous.family, previous.endpoint_counters), state, routed)
        if isinstance(off, Cannot):
            return off
    return dataclasses.replace(main, off=off if off is not None and off.services else None)


def update_table(
    previous: NftRuleset, state: ClusterState, routed: Mapping[ServicePortKey, Route | None]
) -> NftRuleset | Cannot:
    """One table's `render_update`: the ports of `routed` leave it, and those whose home it is
    are rendered into it again. Its `off` is left unset (render_update sets the main table's)."""
    with gc_paused():
        family = previous.family
        table = previous.table
        ctx, _ = build_context(state.node, family, previous.endpoint_counters)
        # The big maps (services, hairpin and cluster-IP counts) are shared with `previous`, not
        # copied: the new ruleset holds only what this sync changes (layered.py). The endpoint
        # and verdict maps are copied when written: the ones a change touches are small.
        services = layered(previous.services)
        service_changes: dict[ServicePortKey, object] = {}
        elements: dict[str, Mapping[str, Element]] = previous.elements.copy()
        copied: dict[str, dict[str, Element]] = {}

        def writable(name: str) -> dict[str, Element]:
            m = copied.get(name)
            if m is None:
                held = elements.get(name)
                m = copied[name] = held.copy() if held is not None else {}
                elements[name] = m
            return m

        contested = previous.contested
        allocator = previous.allocator or SlotAllocator()
        hairpin = Counts(previous.hairpin_refs)
        cluster_ips = Counts(previous.cluster_ip_refs)
        shard_users = previous.shard_users.copy()  # one entry per endpoint map: services / 64
        removed: list[Element] = []
        added: list[Element] = []
        for key in sorted(routed, key=service_order):
            old = services.get(key)
            now = routed[key]
            stub = now is not None and now.table != table and table == TABLE
            if now is not None and now.table != table:
                now = None
            if old is None and now is None and not stub:
                continue
            old_blocks: Mapping[str, tuple[int, int]] = MappingProxyType({})
            if old is not None:
                service_changes[key] = GONE
                removed.extend(old.elements)
                old_blocks = old.blocks
                for ip in old.hairpin:
                    hairpin.add(ip, -1)
                if old.cluster_ip:
                    cluster_ips.add(old.cluster_ip, -1)
                for shard in old.shards:
                    shard_users[shard] -= 1
                    if not shard_users[shard]:
                        del shard_users[shard]
            slots = Slots(allocator, old_blocks, old.lanes if old is not None else ())
            if now is not None or stub:
                if now is not None:
                    rules = render_service(ctx, now.service, now.endpoints, slots, now.routing)
                    if table != TABLE:
                        rules = dataclasses.replace(rules, hairpin=(), cluster_ip="")
                else:
                    away = routed[key]
                    assert away is not None
                    rules = stub_rules(hairpin_pairs(away.routing.reachable, ctx.node.name), nft_address(away.service.cluster_ip))
                service_changes[key] = rules
                added.extend(rules.elements)
                for ip in rules.hairpin:
                    hairpin.add(ip, 1)
                if rules.cluster_ip:
                    cluster_ips.add(rules.cluster_ip, 1)
                for shard in rules.shards:
                    shard_users[shard] = shard_users.get(shard, 0) + 1
            slots.release_unkept()
            allocator = slots.allocator
        # Elements a changed port keeps as they were are left alone: copying a big map (the
        # service-ips map holds every service) costs more than the rest of a partial sync.
        unchanged = set(removed) & set(added)
        if unchanged:
            removed = [r for r in removed if r not in unchanged]
            added = [a for a in added if a not in unchanged]
        for el in removed:
            map_name, elem_key = el.set, el.key
            if (map_name, elem_key) in contested:
                return Cannot(f"element {elem_key} of map {map_name} is claimed by several services")
            writable(map_name).pop(elem_key, None)
        for el in added:
            map_name, elem_key = el.set, el.key
            if (map_name, elem_key) in contested:
                return Cannot(f"element {elem_key} of map {map_name} is claimed by several services")
            target = writable(map_name)
            if elem_key in target:
                return Cannot(f"element {elem_key} of map {map_name} would be claimed twice")
            target[elem_key] = el
        return NftRuleset(
            family=family,
            table=previous.table,
            base_chains=previous.base_chains,
            chains=previous.chains,
            sets=previous.sets,
            unused_sets=previous.unused_sets,
            elements=MappingProxyType(
                {k: v if isinstance(v, MappingProxyType) else MappingProxyType(v) for k, v in elements.items()}
            ),
            services=services.evolve(service_changes),
            contested=contested,
            hairpin_refs=hairpin.result(),
            shard_users=MappingProxyType(shard_users),
            allocator=allocator,
            cluster_ip_refs=cluster_ips.result(),
            counters=previous.counters,
            endpoint_counters=previous.endpoint_counters,
        )


@dataclass(frozen=True, slots=True)
class NftDelta:
    """One partial sync's transaction, and what it leaves for a later one.

    `transaction` is one atomic change; an empty one means there is nothing to send.
    `stale_chains` and `stale_sets` were emptied by this transaction but are still named by the
    previous transaction's elements or rules in flight: they are deleted by the next sync
    (kube-proxy's nftables mode does the same, because deleting a chain in the transaction that
    deletes the last element jumping to it can fail with EBUSY).
    """

    transaction: nft.Transaction
    stale_chains: tuple[str, ...]
    stale_sets: tuple[str, ...]

    def script(self) -> str:
        return nft_text.script(self.transaction)


def live_again(new: NftRuleset, keys: Iterable[ServicePortKey]) -> tuple[set[str], set[str]]:
    """The chains and sets (affinity sets, endpoint maps) of `new` that an earlier sync's stale
    objects might name again. Chain and affinity set names are made from their port's name, so
    only a port rendered again now (`keys`) can bring one back; the endpoint maps are few."""
    chains: set[str] = set()
    sets: set[str] = set(new.shard_users)
    for key in keys:
        svc = new.services.get(key)
        if svc is not None:
            chains.update(svc.chains)
            sets.update(svc.affinity_sets)
    return chains, sets


def delta(
    previous: NftRuleset,
    new: NftRuleset,
    keys: Iterable[ServicePortKey],
    *,
    delete_chains: Iterable[str] = (),
    delete_sets: Iterable[str] = (),
) -> NftDelta:
    """The transaction that turns the kernel's `previous` into `new`, for changed `keys` only.

    `delete_chains`/`delete_sets` are the stale objects an earlier delta left behind; they are
    deleted first unless `new` uses those names again: the sets and maps before the chains, since
    a stale chain was emptied when it went stale (nothing in it names a set any more) while a
    stale verdict map's elements may still name a stale chain, which the kernel then refuses to
    delete (EBUSY).
    """
    tx = nft.Transaction(new.nft_family, new.table)
    keys = tuple(keys)
    live_chains, live_sets = live_again(new, keys) if delete_chains or delete_sets else (set(), set())
    for name in delete_sets:
        if name not in live_sets:
            # Shard maps and affinity sets alike: nft deletes a map by `delete set` too.
            tx.delete(nft.Set(name))
    for name in delete_chains:
        if name not in live_chains:
            tx.delete(nft.Chain(name))

    stale_chains: list[str] = []
    stale_sets: list[str] = [n for n in previous.shard_users if n not in new.shard_users]
    adds: list[nft.Object] = [new.shard_map(n) for n in new.shard_users if n not in previous.shard_users]
    hairpin_ips: set[str] = set()
    cluster_ips: set[str] = set()
    rules_out: list[tuple[bool, nft.Object]] = []  # (flush?, object)
    old_elements: dict[tuple[str, str], Element] = {}
    new_elements: dict[tuple[str, str], Element] = {}
    empty = ServiceRules(MappingProxyType({}), MappingProxyType({}), ())
    for key in keys:
        if key[1] is not new.family:
            continue
        old = previous.services.get(key, empty)
        cur = new.services.get(key, empty)
        if old is cur:
            continue
        for name, aset in cur.affinity_sets.items():
            if name not in old.affinity_sets:
                adds.append(aset)
        stale_sets.extend(name for name in old.affinity_sets if name not in cur.affinity_sets)
        for name, rules in cur.chains.items():
            before = old.chains.get(name)
            if before == rules:
                continue
            if before is None:
                adds.append(nft.Chain(name))
            else:
                rules_out.append((True, nft.Chain(name)))
            rules_out.extend([(False, nft.Rule(name, body)) for body in rules])
        for name in old.chains:
            if name not in cur.chains:
                rules_out.append((True, nft.Chain(name)))
                stale_chains.append(name)
        hairpin_ips.update(old.hairpin)
        hairpin_ips.update(cur.hairpin)
        cluster_ips.update(ip for ip in (old.cluster_ip, cur.cluster_ip) if ip)
        for el in chained(old.elements, old.slot_elements()):
            old_elements[(el.set, el.key)] = el
        for el in chained(cur.elements, cur.slot_elements()):
            new_elements[(el.set, el.key)] = el
    for obj in adds:
        tx.add(obj)
    for flush, obj in rules_out:
        tx.flush(obj) if flush else tx.add(obj)
    # Elements: deletes before adds, so that a changed element (same key, other verdict or
    # comment) is replaced inside the one transaction. Only elements the maps actually hold
    # are deleted: a contested key never reaches here (render_update refused it).
    for (map_name, elem_key), el in old_elements.items():
        if new_elements.get((map_name, elem_key)) != el:
            tx.delete(nft.Element(map_name, elem_key))
    for (map_name, elem_key), el in new_elements.items():
        if old_elements.get((map_name, elem_key)) != el:
            tx.add(el)
    for ip in sorted(hairpin_ips):
        was, now = ip in previous.hairpin_refs, ip in new.hairpin_refs
        if was and not now:
            tx.delete(nft.Element(HAIRPIN_SET, f"{ip} . {ip}"))
        elif now and not was:
            tx.add(nft.Element(HAIRPIN_SET, f"{ip} . {ip}"))
    for ip in sorted(cluster_ips):
        was, now = ip in previous.cluster_ip_refs, ip in new.cluster_ip_refs
        if was and not now:
            tx.delete(nft.Element(CLUSTER_IPS_SET, ip))
        elif now and not was:
            tx.add(nft.Element(CLUSTER_IPS_SET, ip))
    tx.check()
    return NftDelta(tx, tuple(stale_chains), tuple(stale_sets))

"""The nftables backend's structure: endpoint lanes and their slots, a port's rules
(`ServiceRules`) and a family's ruleset (`NftRuleset`), split the way an incremental sync
needs them; text is only one consumer of it (`NftRuleset.script()`)."""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from itertools import chain as chained, repeat
from types import MappingProxyType

from nfproxy import nftables as nft
from nfproxy.backends.nft.names import (
    CLUSTER_IPS_SET,
    HAIRPIN_SET,
    HASHED,
    HASH_ENDPOINTS_MAX,
    HASH_MAP_SIZE,
    LANE,
    LANES_PER_MAP,
    RANGES,
    REJECT_CHAIN,
    SHARD_PREFIX,
    TABLE,
)
from nfproxy.core.gc_pause import gc_paused
from nfproxy.nftables import text as nft_text
from nfproxy.nftables.expr import Body
from nfproxy.core.model import Endpoint, IPFamily, ServicePortKey


REJECT_CHAIN_OBJECT = nft.Chain(REJECT_CHAIN, comment="helper for @no-endpoint-services / @no-endpoint-nodeports")

# --------------------------------------------------------------------------------------------
# The structure.


Declaration = nft.Set | nft.Map


# Elements are nft objects from the start: a full sync queues the very objects a render made.
Element = nft.Element

# The affinity sets of every port without affinity: one empty mapping, not one per port.
NO_SETS: Mapping[str, nft.Set] = MappingProxyType({})


def slot_value(ep: Endpoint) -> str:
    """An endpoint's data in an endpoint map: `address . port`."""
    return f"{ep.ip} . {ep.port}"


@dataclass(frozen=True, slots=True)
class Lane:
    """One endpoint-selecting chain's keys in its endpoint map (`shard`): `keys[i]` is the key
    or range of `endpoints[i]`. The map elements are derived from it when a sync needs them, not
    kept: an idle daemon would otherwise hold an Element and an `address . port` string per
    endpoint (tens of MiB at 10 000 services x 10; docs/benchmarks.md, "The nft belief without
    its endpoint elements"), where a lane holds the render's shared keys (range_keys) and the
    model's own endpoints."""

    chain: str
    block: tuple[int, int]  # (first lane, number of lanes)
    shard: str
    keys: tuple[str, ...]
    endpoints: tuple[Endpoint, ...]

    def values(self) -> Iterator[str]:
        return map(slot_value, self.endpoints)

    def elements(self) -> Iterator[Element]:
        return map(Element, repeat(self.shard), self.keys, self.values())


@dataclass(frozen=True, slots=True)
class ServiceRules:
    """Everything one service port owns, so a sync can rewrite just the ports that changed.

    `chains` is ordered (policy chains, external, firewall, then endpoint chains) and maps a
    chain name to its rules; `affinity_sets` maps set name to its declaration; `elements` are
    the elements this port adds to the shared maps, `lanes` its ranges in the endpoint maps.
    """

    chains: Mapping[str, tuple[Body, ...]]
    affinity_sets: Mapping[str, nft.Set]
    elements: tuple[Element, ...]
    # Empty for ports that keep per-endpoint chains (affinity).
    lanes: tuple[Lane, ...] = ()
    # The endpoint IPs this port adds to the shared hairpin set.
    hairpin: tuple[str, ...] = ()
    # This port's cluster IP, for the shared (reference-counted) cluster-ips set.
    cluster_ip: str = ""

    @property
    def blocks(self) -> Mapping[str, tuple[int, int]]:
        """Chain name -> (first lane, number of lanes)."""
        return {lane.chain: lane.block for lane in self.lanes}

    @property
    def shards(self) -> tuple[str, ...]:
        """The endpoint map of each lane, in the same order."""
        return tuple([lane.shard for lane in self.lanes])

    def slot_elements(self) -> Iterator[Element]:
        """The elements of this port's lanes, after `elements` in a sync."""
        return chained.from_iterable(lane.elements() for lane in self.lanes)


def lane_split(units: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
    """(modulus, range width per endpoint) of a chain whose endpoints hold `units` slots each
    (core.categorize.slot_counts: 1 each, or the weights over their gcd).

    Where the slots divide LANE the chain draws `mod LANE` and endpoint i owns units_i * LANE /
    sum(units) consecutive values: the same exact share as `mod sum(units)`, and a later count
    or weight change that still divides LANE keeps the rule as it is. Otherwise (17 endpoints,
    say) it draws `mod sum(units)` over ranges of units_i values, a rule change when it moves.
    """
    total = sum(units)
    if LANE % total == 0:
        scale = LANE // total
        return LANE, tuple([u * scale for u in units])
    return total, units


def endpoint_choice(units: tuple[int, ...]) -> tuple[int, tuple[int, ...], bool]:
    """(modulus, widths, hashed) of a chain whose endpoints hold `units` slots each: an
    unweighted chain of at most HASH_ENDPOINTS_MAX endpoints draws `mod n` into a hash map (one
    key per endpoint), every other chain its `lane_split` into an interval map."""
    if len(units) <= HASH_ENDPOINTS_MAX and all(u == 1 for u in units):
        return len(units), units, True
    modulus, widths = lane_split(units)
    return modulus, widths, False


def lanes_for(modulus: int) -> int:
    """Lanes a chain drawing `mod modulus` needs: a power of two, so that aligned blocks of
    lanes never straddle a map (LANES_PER_MAP)."""
    lanes = 1 << (max(-(-modulus // LANE), 1) - 1).bit_length()
    if lanes > LANES_PER_MAP:
        raise ValueError(f"a chain of {modulus} endpoint slots does not fit one endpoint map")
    return lanes


_KEYS: dict[tuple[int, tuple[int, ...]], tuple[str, ...]] = {}


def range_keys(offset: int, widths: tuple[int, ...]) -> tuple[str, ...]:
    """The interval keys of consecutive ranges of `widths` from `offset`, as nft lists them (a
    range of one value is that value). Memoised: a cluster has few distinct (lane, split)s."""
    keys = _KEYS.get((offset, widths))
    if keys is None:
        out: list[str] = []
        first = offset
        for w in widths:
            last = first + w - 1
            out.append(f"{first}-{last}" if w > 1 else str(first))
            first = last + 1
        if len(_KEYS) > 4096:
            _KEYS.clear()
        keys = _KEYS[(offset, widths)] = tuple(out)
    return keys


COUNTED = "counted-"


def shard_of(lane: int, proto: str, counted: bool = True, hashed: bool = False) -> str:
    """The data map holding `lane`: an interval map, or a hash map for chains that draw `mod n`
    (`hashed`). One set of maps per protocol: a map's data type names the port's protocol (`tcp
    dport`), and nft refuses a UDP rule reading a TCP port. Maps with per-element counters are
    named apart (`endpoints-counted-tcp-ranges-0`), as are the two forms, and interval maps from
    the single-slot maps of older releases (`endpoints-counted-tcp-0`): nft refuses to redeclare
    an existing map with another spec, so a change of either makes new maps and leaves the old
    ones to the stray cleanup, instead of failing every full sync."""
    form = HASHED if hashed else RANGES
    # Interned: 10 000 ports share a few hundred names.
    return sys.intern(f"{SHARD_PREFIX}{COUNTED if counted else ''}{proto}{form}-{lane // LANES_PER_MAP}")


def _shard_parts(name: str) -> tuple[str, bool, int]:
    """(protocol, hashed, map index) of an endpoint map's name."""
    head, index = name[len(SHARD_PREFIX):].rsplit("-", 1)
    head = head.removeprefix(COUNTED)
    hashed = head.endswith(HASHED)
    return head.removesuffix(HASHED if hashed else RANGES), hashed, int(index)


def _shard_order(name: str) -> tuple[str, int, bool]:
    proto, hashed, index = _shard_parts(name)
    return proto, index, hashed


@dataclass(frozen=True, slots=True)
class SlotAllocator:
    """Where the next block of lanes goes: a bump pointer plus free lists per block size.

    Immutable, so that a ruleset keeps the allocator state it was rendered with and a failed
    sync can simply forget the new one. Blocks are aligned to their size.
    """

    next_slot: int = 0
    free: Mapping[int, tuple[int, ...]] = field(default_factory=lambda: MappingProxyType({}))

    def allocate(self, size: int) -> tuple[int, SlotAllocator]:
        spare = self.free.get(size)
        if spare:
            free = dict(self.free)
            free[size] = spare[1:]
            return spare[0], SlotAllocator(self.next_slot, MappingProxyType(free))
        base = -(-self.next_slot // size) * size
        if base + size > 1 << 32:
            raise ValueError("nft endpoint lanes exhausted (2^32): restart nfproxy to compact them")
        return base, SlotAllocator(base + size, self.free)

    def release(self, base: int, size: int) -> SlotAllocator:
        free = dict(self.free)
        free[size] = (*free.get(size, ()), base)
        return SlotAllocator(self.next_slot, MappingProxyType(free))


@dataclass(frozen=True, slots=True)
class NftRuleset:
    """One family's complete nfproxy table as structure.

    `chains` holds the static chains (base chains first) and their rules; `sets` the static
    set and map declarations, each flushed and refilled from `elements` on a full sync;
    `unused_sets` the static sets this node's configuration does not use, which a full sync
    deletes if an earlier configuration created them. `elements` merges the static elements
    with every service port's (the first service port, in name order, wins a duplicated key);
    the endpoint maps' elements are the ports' lanes (`slots`, `all_elements`).
    """

    family: IPFamily
    table: str
    base_chains: tuple[nft.Chain, ...]
    chains: Mapping[str, tuple[Body, ...]]
    sets: Mapping[str, Declaration]
    unused_sets: Mapping[str, Declaration]
    elements: Mapping[str, Mapping[str, Element]]
    services: Mapping[ServicePortKey, ServiceRules]
    # (map, key) pairs that more than one service port claims: the first one in name order
    # owns the element, and a partial sync that touches one of them falls back to a full one.
    contested: frozenset[tuple[str, str]] = frozenset()
    # Endpoint IP -> number of service ports that put it in the hairpin set.
    hairpin_refs: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    # Endpoint map name -> number of lanes drawn from it; the allocator's state for partial syncs.
    shard_users: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    allocator: SlotAllocator | None = None
    # Cluster IP -> number of service ports that put it in the cluster-ips set.
    cluster_ip_refs: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    # Named counters the static rules use (declared, never reset by a sync).
    counters: tuple[str, ...] = ()
    # Per-endpoint connection counters (see _Context.counters).
    endpoint_counters: bool = True
    # The OFF_TABLE's ruleset (the ports `home` puts there), None when no port lives there.
    off: NftRuleset | None = None

    @property
    def nft_family(self) -> str:
        return "ip" if self.family is IPFamily.V4 else "ip6"

    def shard_map(self, name: str) -> nft.Map:
        """Key: numgen values, ranges of them or (a hash map) single ones (a 32-bit integer:
        `type mark` is refused for a numgen key); data: address . port of the shard's protocol."""
        proto, hashed, _ = _shard_parts(name)
        counted = name.startswith(SHARD_PREFIX + COUNTED)
        return nft.Map(
            name,
            typeof=f"numgen random mod 1 : {self.nft_family} daddr . {proto} dport",
            flags=() if hashed else ("interval",),
            counter=counted,
            size=HASH_MAP_SIZE if hashed else None,
        )

    def slots(self) -> dict[str, dict[str, str]]:
        """Each endpoint map's elements as key -> `address . port`, in the order a render adds
        them (ports in name order): derived from the ports' lanes, which a sync keeps instead."""
        out: dict[str, dict[str, str]] = {}
        for svc in self.services.values():
            for lane in svc.lanes:
                held = out.get(lane.shard)
                if held is None:
                    held = out[lane.shard] = {}
                held.update(zip(lane.keys, lane.values()))
        return out

    def all_elements(self) -> dict[str, Mapping[str, Element]]:
        """Every map's and set's elements by key, the endpoint maps' included (tests, tools)."""
        out: dict[str, Mapping[str, Element]] = dict(self.elements)
        for name, slots in self.slots().items():
            out[name] = {key: Element(name, key, value) for key, value in slots.items()}
        return out

    def transactions(self, kept: NftRuleset | None = None) -> tuple[nft.Transaction, ...]:
        """`transaction` of this table, then of the off table when it has ports."""
        main = self.transaction(kept)
        if self.off is None:
            return (main,)
        return main, self.off.transaction(kept.off if kept is not None else None)

    def text(self) -> str:
        """This family's `nfproxy render` output (backends.base.Rendered)."""
        return self.script()

    def script(self) -> str:
        """The full `nft -f` script (`nfproxy render`): the transaction, as text (then the off
        table's, when it has ports)."""
        text = nft_text.script(self.transaction())
        return text if self.off is None else text + nft_text.script(self.off.transaction())

    def transaction(self, kept: NftRuleset | None = None) -> nft.Transaction:
        """A complete sync as one atomic transaction.

        Valid on a fresh namespace and over an existing `nfproxy` table alike: everything it owns
        is added (a no-op when present) and then flushed before being refilled. Base chains are
        deleted and re-added so that a changed hook or priority cannot fail the transaction.
        Affinity sets are added but never flushed, so client stickiness survives a resync.
        Chains of services that no longer exist are not known here and are left alone (unused,
        unreferenced); removing them needs the kernel's chain list and belongs to the sync.

        `kept`: the ruleset the kernel holds (this one rendered with `keep=kept`). Its endpoint
        maps are then not flushed: only the elements that changed or went are deleted, and
        re-adding an unchanged element is a no-op, so its per-element counter survives the
        full sync. Were the kernel's maps not what `kept` says, the transaction fails (a
        delete of a missing element, an add over a different one) and the caller, forgetting
        what it believed, falls back to the flushing form.
        """
        with gc_paused():  # 250 000 objects at 10 000 services: no reason to scan them
            return self._transaction(kept)

    def _transaction(self, kept: NftRuleset | None = None) -> nft.Transaction:
        tx = nft.Transaction(self.nft_family, self.table)
        comment = "rules for nfproxy" if self.table == TABLE else "rules for nfproxy: weighted ports off the lane"
        tx.add(nft.Table(self.nft_family, self.table, comment=comment))
        for name in self.counters:
            tx.add(nft.Counter(name))
        for bc in self.base_chains:
            tx.add(nft.Chain(bc.name))
            tx.delete(nft.Chain(bc.name))
        for bc in self.base_chains:
            tx.add(bc)
        base_names = {bc.name for bc in self.base_chains}
        for name in self.chains:
            if name in base_names:
                continue
            tx.add(REJECT_CHAIN_OBJECT if name == REJECT_CHAIN else nft.Chain(name))
            tx.flush(nft.Chain(name))
        for decl in self.sets.values():
            tx.add(decl)
            tx.flush(decl)
        for decl in self.unused_sets.values():
            tx.add(decl)
            tx.delete(decl)
        slots = self.slots()
        held = kept.slots() if kept is not None else {}
        for name in sorted(self.shard_users, key=_shard_order):
            shard = self.shard_map(name)
            tx.add(shard)
            if kept is None or name not in kept.shard_users:
                tx.flush(shard)
                continue
            now = slots.get(name, {})
            for key, value in held.get(name, {}).items():
                if now.get(key) != value:
                    tx.delete(nft.Element(name, key))
        for name, rules in self.chains.items():
            tx.add_rules(name, rules)

        for (spn, _family), svc in self.services.items():
            tx.note(f"{spn.namespace}/{spn.name}/{spn.protocol.lower}/{spn.port}")
            for aset in svc.affinity_sets.values():
                tx.add(aset)
            tx.refill(svc.chains)

        # One batch per set: 200 000 elements at 10 000 services, checked and written in bulk.
        if self.hairpin_refs:
            tx.add(nft.Elements(HAIRPIN_SET, tuple([f"{ip} . {ip}" for ip in self.hairpin_refs])))
        if self.cluster_ip_refs:
            tx.add(nft.Elements(CLUSTER_IPS_SET, tuple(self.cluster_ip_refs)))
        for name, elements in self.elements.items():
            if elements:
                tx.add(nft.Elements.of(name, elements.values()))
        for name, values in slots.items():  # after the static maps, as they were declared
            if values:
                tx.add(nft.Elements(name, tuple(values), tuple(values.values())))
        tx.check()
        return tx



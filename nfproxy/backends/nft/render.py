"""The nftables backend: kube-proxy's nftables layout, rendered as structure first and text second.

`render` is pure: it turns a ClusterState into an `NftRuleset` whose parts are exact nft syntax
fragments, split the way an incremental sync needs them. The static part (table, base chains,
top-level chains, map and set declarations) barely ever changes; each service port owns its
chains and affinity sets; map and set elements are keyed by their nft key text so that two
rulesets can be diffed element by element. `NftRuleset.script()` is only one consumer of that
structure: the full `nft -f` script for a first sync (or a forced resync).

Layout, as in kube-proxy's nftables mode (table `nfproxy` instead of `kube-proxy`):
dispatch by verdict maps (`service-ips`, `service-nodeports`) from the nat hooks; no-endpoint
drop/reject and LoadBalancerSourceRanges checks by verdict maps from filter hooks that run before
DNAT; per service port a cluster-policy chain, a local-policy chain, an external-entry chain and
a firewall chain; per endpoint a chain that marks hairpin traffic, records affinity and DNATs.

A weighted port whose chain draws a modulus of its own (`home`) lives in a second table of the
same frame, `nfproxy-off` (`NftRuleset.off`), so that its rule changes make the kernel validate
that small table only; `nfproxy` keeps a stub of it (its hairpin endpoints and cluster IP).
"""

from __future__ import annotations

import dataclasses
import hashlib
import ipaddress
import re
import struct
import sys
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from itertools import chain as chained, repeat
from types import MappingProxyType

from nfproxy import nftables as nft
from nfproxy.backends.nft.layered import GONE, Counts, layered
from nfproxy.core.gc_pause import gc_paused
from nfproxy.nftables import text as nft_text
from nfproxy.nftables.objects import check_comment, check_name, quote_comment
from nfproxy.core.categorize import (
    NoEndpoints,
    PodMatch,
    PodMatchKind,
    Routing,
    categorize,
    firewall_sources,
    localhost_rejects,
    nodeport_cidrs,
    pod_match,
    slot_counts,
    weighted,
)
from nfproxy.core.model import (
    ClusterState,
    Endpoint,
    IPFamily,
    NodeConfig,
    ServicePort,
    ServicePortKey,
    ServicePortName,
)

TABLE = nft.TABLE
OFF_TABLE = nft.OFF_TABLE

# Top-level chains and maps. Service and endpoint chain names always contain a "/", these
# never do: that is how a sync tells its own per-service chains apart from the fixed ones.
SERVICES_CHAIN = "services"
SERVICE_IPS_MAP = "service-ips"
SERVICE_NODEPORTS_MAP = "service-nodeports"
NODEPORT_IPS_SET = "nodeport-ips"
CLUSTER_CIDRS_SET = "cluster-cidrs"
SERVICE_ENDPOINTS_CHECK_CHAIN = "service-endpoints-check"
NODEPORT_ENDPOINTS_CHECK_CHAIN = "nodeport-endpoints-check"
NO_ENDPOINT_SERVICES_MAP = "no-endpoint-services"
NO_ENDPOINT_NODEPORTS_MAP = "no-endpoint-nodeports"
# External and LoadBalancer IPs without endpoints, checked on input and forward only: the node's
# own traffic to them is left alone, as kube-proxy's iptables mode (KUBE-EXTERNAL-SERVICES is not
# hooked on OUTPUT) leaves it, so that both backends agree and the eTP=Local short-circuit for
# the node's own traffic still works. Upstream's nftables mode checks them on output too.
NO_ENDPOINT_EXTERNAL_MAP = "no-endpoint-external-ips"
EXTERNAL_ENDPOINTS_CHECK_CHAIN = "external-endpoints-check"
REJECT_CHAIN = "reject-chain"
FIREWALL_IPS_MAP = "firewall-ips"
FIREWALL_CHECK_CHAIN = "firewall-check"
MARK_MASQ_CHAIN = "mark-for-masquerade"
MASQUERADING_CHAIN = "masquerading"
HAIRPIN_SET = "hairpin"
# Traffic to an allocated cluster IP on a port no service uses is rejected, to an unallocated
# address of the service CIDRs dropped (kube-proxy's nftables mode; not its iptables mode).
CLUSTER_IPS_SET = "cluster-ips"
CLUSTER_IPS_CHECK_CHAIN = "cluster-ips-check"
# Named counter of the conntrack-INVALID drop (the iptables backend's nfacct counter).
INVALID_DROP_COUNTER = "ct_state_invalid_dropped_pkts"
# KubeProxyNFTablesLocalhostNodePorts: node ports on loopback that nobody proxies are rejected
# and counted, per protocol. kube-proxy 1.37 dispatches a verdict map to a chain per protocol;
# here a set of ports per protocol and one rule each do it: no element names a chain, so
# turning the gate off leaves strays a full sync can delete in any order.


def localhost_reject_set(proto: str) -> str:
    return f"localhost-nodeport-reject-{proto}"


def localhost_reject_counter(proto: str) -> str:
    """The named counter the kubeproxy_nftables_localhost_nodeport_rejected_packets_total
    metric reads (upstream's LocalhostNodePortRejectedCounterName)."""
    return f"localhost-nodeport-rejected-{proto}"
# Endpoint lanes: every endpoint-selecting chain owns a lane of LANE consecutive integers in an
# interval data map `endpoints-<proto>-ranges-M` (M = lane // LANES_PER_MAP), draws
# `numgen random mod LANE offset K` and finds its endpoint's address and port in one range per
# endpoint. LANE is divisible by every endpoint count up to 16 (and many above), so adding,
# removing or replacing an endpoint only changes map elements: the kernel does not validate the
# whole table as it does for a new rule. Weighted chains keep their rule while the weight sum
# (over the gcd) divides LANE: 5^2 makes every percentage split such a sum. Why shards, lanes and
# ranges, and why this LANE: docs/design.md ("The nft layout at scale"), bench/lane_coverage.py.
SHARD_PREFIX = "endpoints-"
LANE = 223_423_200  # 2^5 . 3^2 . 5^2 . 7 . 11 . 13 . 31
LANES_PER_MAP = 16  # 16 lanes fit in 32 bits; a map bound by at most 16 rules
_RANGES = "-ranges"

# Per service port / per endpoint name prefixes (kube-proxy's; none longer than 16 characters,
# which is what keeps prefix + hashAndTruncate's 240-character base within nft's 256).
SERVICE_PREFIX = "service-"
LOCAL_PREFIX = "local-"
EXTERNAL_PREFIX = "external-"
FIREWALL_PREFIX = "firewall-"
ENDPOINT_PREFIX = "endpoint-"
AFFINITY_PREFIX = "affinity-"

NAME_LENGTH_MAX = nft.objects.NAME_LENGTH_MAX
_NAME_BASE_LENGTH_MAX = NAME_LENGTH_MAX - 16


# --------------------------------------------------------------------------------------------
# Quoting: every string that reaches the script from the model goes through one of these two.

_ADDRESS_RE = re.compile(r"[0-9A-Fa-f.:/]+")
_IP_CHARS = "0123456789abcdefABCDEF.:"


def nft_name(text: str) -> str:
    """Return `text` unchanged if nft can take it bare as a chain or set name.

    Names are written unquoted (as kube-proxy writes them), so anything else could change the
    meaning of the statement it sits in; refuse it rather than guess an escape.
    """
    if (why := check_name(text)) is not None:
        raise ValueError(why)
    return text


def nft_comment(text: str) -> str:
    """Return `text` as a double-quoted nft comment.

    nft has no escape for `"` inside a string, so the only safe way is a small allow-list. Over-long
    texts are cut instead of refused: a service port name can legally be 143 characters, and a
    comment is only a label, never worth failing a sync for.
    """
    if (why := check_comment(text)) is not None:
        raise ValueError(why)
    return quote_comment(text)


def _address(text: str) -> str:
    """Addresses and CIDRs are spliced into rules bare; make sure one cannot carry syntax."""
    if _ADDRESS_RE.fullmatch(text) is None:
        raise ValueError(f"not an address or CIDR: {text!r}")
    return text


# --------------------------------------------------------------------------------------------
# Names that carry identity (kube-proxy's scheme, so dumps read the same).


# Base32 (RFC 4648) of 10 bits at a time: four lookups encode the 40 bits the hash prefix
# needs, where base64.b32encode (pure Python in 3.11) costs more than the sha256 itself.
_B32 = "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567"
_B32_PAIRS = tuple(a + b for a in _B32 for b in _B32)


_FIRST_8_BYTES = struct.Struct(">Q").unpack_from


def hash_and_truncate(name: str) -> str:
    """`HASH8-name`, cut to 240 characters: the hash keeps truncated names unique and makes
    neighbouring endpoint chains (differing in one digit) visually distinct."""
    n = _FIRST_8_BYTES(hashlib.sha256(name.encode()).digest())[0] >> 24
    p = _B32_PAIRS
    name = f"{p[n >> 30]}{p[(n >> 20) & 1023]}{p[(n >> 10) & 1023]}{p[n & 1023]}-{name}"
    if len(name) > _NAME_BASE_LENGTH_MAX:
        name = name[: _NAME_BASE_LENGTH_MAX - 3] + "..."
    return name


def service_chain_base(spn: ServicePortName) -> str:
    """`HASH-ns/name/proto/port`: "/" cannot occur in any of the parts, so it separates them."""
    return hash_and_truncate(f"{spn.namespace}/{spn.name}/{spn.protocol.lower}/{spn.port}")


def endpoint_chain_base(spn: ServicePortName, ep: Endpoint) -> str:
    """`HASH-ns/name/proto/port__ip/port`; IPv6 colons become dots (colons are not allowed)."""
    ip = ep.ip.replace(":", ".")
    return hash_and_truncate(
        f"{spn.namespace}/{spn.name}/{spn.protocol.lower}/{spn.port}__{ip}/{ep.port}"
    )


# --------------------------------------------------------------------------------------------
# The structure.


Declaration = nft.Set | nft.Map


# Elements are nft objects from the start: a full sync queues the very objects a render made.
Element = nft.Element

# The affinity sets of every port without affinity: one empty mapping, not one per port.
_NO_SETS: Mapping[str, nft.Set] = MappingProxyType({})


def slot_value(ep: Endpoint) -> str:
    """An endpoint's data in an endpoint map: `address . port`."""
    return f"{ep.ip} . {ep.port}"


@dataclass(frozen=True, slots=True)
class Lane:
    """One endpoint-selecting chain's ranges in its endpoint map (`shard`): `keys[i]` is the
    range of `endpoints[i]`. The map elements are derived from it when a sync needs them, not
    kept: at 10 000 services x 10 endpoints the kept elements were 100 000 Elements with their
    `address . port` strings, ~19 MiB of an idle daemon, where a lane holds the render's
    shared keys (range_keys) and the model's own endpoints."""

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

    chains: Mapping[str, tuple[str, ...]]
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


def shard_of(lane: int, proto: str, counted: bool = True) -> str:
    """The interval data map holding `lane`. One set of maps per protocol: a map's data type
    names the port's protocol (`tcp dport`), and nft refuses a UDP rule reading a TCP port.
    Maps with per-element counters are named apart (`endpoints-counted-tcp-ranges-0`), and so
    are interval maps from the single-slot maps of older releases (`endpoints-counted-tcp-0`):
    nft refuses to redeclare an existing map with another spec, so a change of either makes
    new maps and leaves the old ones to the stray cleanup, instead of failing every full sync."""
    # Interned: 10 000 ports share a few hundred names.
    return sys.intern(f"{SHARD_PREFIX}{COUNTED if counted else ''}{proto}{_RANGES}-{lane // LANES_PER_MAP}")


def _shard_order(name: str) -> tuple[str, int]:
    head, index = name[len(SHARD_PREFIX):].rsplit("-", 1)
    return head.removeprefix(COUNTED).removesuffix(_RANGES), int(index)


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
    chains: Mapping[str, tuple[str, ...]]
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
        """Key: ranges of numgen values (a 32-bit integer: `type mark` is refused for a numgen
        key); data: address . port of the shard's protocol."""
        proto = _shard_order(name)[0]
        counted = name.startswith(SHARD_PREFIX + COUNTED)
        return nft.Map(
            name,
            typeof=f"numgen random mod 1 : {self.nft_family} daddr . {proto} dport",
            flags=("interval",),
            counter=counted,
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
            tx.add(_REJECT_CHAIN if name == REJECT_CHAIN else nft.Chain(name))
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


# --------------------------------------------------------------------------------------------
# Rendering.

# Priorities as numbers: nft 1.0.6 only accepts the names "dstnat"/"srcnat" on the prerouting
# and postrouting hooks. For the ip and ip6 families dstnat is -100 and srcnat 100.
BASE_CHAINS = (
    # Filtering runs before DNAT (dstnat - 10) so that it sees the address the client used.
    nft.Chain("filter-prerouting", "filter", "prerouting", "-110"),
    nft.Chain("filter-input", "filter", "input", "-110"),
    nft.Chain("filter-forward", "filter", "forward", "-110"),
    nft.Chain("filter-output", "filter", "output", "-110"),
    # After the node's own DNAT: what is still addressed to a cluster IP matched no service.
    nft.Chain("filter-output-post-dnat", "filter", "output", "-90"),
    nft.Chain("nat-prerouting", "nat", "prerouting", "-100"),
    nft.Chain("nat-output", "nat", "output", "-100"),
    nft.Chain("nat-postrouting", "nat", "postrouting", "100"),
)
# The off table's base chains run one priority step after nfproxy's: a connection's nat hooks
# stop at the first chain that binds it, so a port in either table is DNATed by its own.
OFF_BASE_CHAINS = tuple(
    nft.Chain(c.name, c.type, c.hook, str(int(c.priority or 0) + 1)) for c in BASE_CHAINS
)
_REJECT_CHAIN = nft.Chain(REJECT_CHAIN, comment="helper for @no-endpoint-services / @no-endpoint-nodeports")

# (target, from base chain, gate): kube-proxy's nftablesJumpChains without the cluster-ips-check
# entries. Reject only works from input/forward/output, hence no endpoint checks in prerouting;
# node ports are only checked on input because only locally addressed traffic can reach one.
_JUMPS = (
    (NODEPORT_ENDPOINTS_CHECK_CHAIN, "filter-input", "ct state new "),
    (SERVICE_ENDPOINTS_CHECK_CHAIN, "filter-input", "ct state new "),
    (EXTERNAL_ENDPOINTS_CHECK_CHAIN, "filter-input", "ct state new "),
    (EXTERNAL_ENDPOINTS_CHECK_CHAIN, "filter-forward", "ct state new "),
    (SERVICE_ENDPOINTS_CHECK_CHAIN, "filter-forward", "ct state new "),
    (SERVICE_ENDPOINTS_CHECK_CHAIN, "filter-output", "ct state new "),
    # kube-proxy's nftables mode checks external and LB IPs on output too (its one
    # service-endpoints-check runs from input, forward and output, after DNAT): the node's own packet to an
    # external address no DNAT took is rejected or dropped there, not let out.
    (EXTERNAL_ENDPOINTS_CHECK_CHAIN, "filter-output-post-dnat", "ct state new "),
    (FIREWALL_CHECK_CHAIN, "filter-prerouting", "ct state new "),
    (FIREWALL_CHECK_CHAIN, "filter-output", "ct state new "),
    (SERVICES_CHAIN, "nat-output", ""),
    (SERVICES_CHAIN, "nat-prerouting", ""),
    (MASQUERADING_CHAIN, "nat-postrouting", ""),
    (CLUSTER_IPS_CHECK_CHAIN, "filter-forward", "ct state new "),
    (CLUSTER_IPS_CHECK_CHAIN, "filter-output-post-dnat", "ct state new "),
)

# Base chains whose several `ct state new` checks run from one sub-chain, behind one test: every
# packet of a connection walks the base chain, and only its first needs the checks, so the rest
# walk one rule instead of one per check (docs/nft-layouts.md, "Where a first connection's time
# goes"). Output keeps its rules inline: its checks sit on either side of the node's own DNAT.
NEW_CONNECTION_CHAINS = {"filter-input": "input-new", "filter-forward": "forward-new"}

_NO_ENDPOINT_VERDICT = {NoEndpoints.REJECT: f"goto {REJECT_CHAIN}", NoEndpoints.DROP: "drop"}


def _collapse(cidrs: Iterable[str]) -> tuple[str, ...]:
    """Canonical, non-overlapping CIDRs: an interval set refuses overlapping elements, and a
    canonical text keeps element keys stable from one render to the next."""
    nets = [ipaddress.ip_network(_address(c), strict=False) for c in cidrs]
    return tuple(str(n) for n in ipaddress.collapse_addresses(nets))  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class _Context:
    """Per-render constants, computed once instead of once per service or endpoint."""

    node: NodeConfig
    family: IPFamily
    ipx: str
    addr_type: str
    # Match for "source is a pod" and its negation, "" when no pod CIDR is known.
    from_pod: str
    not_from_pod: str
    mark: str
    # Count each endpoint's new connections (docs/metrics.md): `counter` on the endpoint data
    # maps (one per element, bumped by the lookup) and before each per-endpoint chain's DNAT.
    counters: bool = True
    # Protocols whose node ports are rejected on loopback (core.categorize.localhost_rejects).
    localhost_rejects: frozenset[str] = frozenset()


_IFNAME_RE = re.compile(r"[A-Za-z0-9_.@-]{1,15}")


def _pod_matches(ipx: str, match: PodMatch | None) -> tuple[str, str]:
    """(if from a pod, if not from a pod) as nft matches; ("", "") without a detector."""
    if match is None:
        return "", ""
    if match.kind is PodMatchKind.CIDR:
        cidr = _address(match.value)
        return f"{ipx} saddr {cidr}", f"{ipx} saddr != {cidr}"
    if _IFNAME_RE.fullmatch(match.value) is None:
        raise ValueError(f"not an interface name: {match.value!r}")
    name = match.value + ("*" if match.kind is PodMatchKind.INTERFACE_PREFIX else "")
    return f'iifname "{name}"', f'iifname != "{name}"'


def _context(node: NodeConfig, family: IPFamily, counters: bool = True) -> tuple[_Context, tuple[str, ...]]:
    ipx = "ip" if family is IPFamily.V4 else "ip6"
    from_pod, not_from_pod = _pod_matches(ipx, pod_match(node, family))
    ctx = _Context(
        node=node,
        family=family,
        ipx=ipx,
        addr_type="ipv4_addr" if family is IPFamily.V4 else "ipv6_addr",
        from_pod=from_pod,
        not_from_pod=not_from_pod,
        mark=f"{node.masquerade_mark:#x}",
        counters=counters,
        localhost_rejects=localhost_rejects(node, family),
    )
    return ctx, _collapse(node.service_cidrs_of(family))


def _static(
    ctx: _Context, service_cidrs: tuple[str, ...], table: str = TABLE
) -> tuple[dict[str, tuple[str, ...]], dict[str, Declaration], dict[str, Declaration], dict[str, dict[str, Element]]]:
    ipx, addr = ctx.ipx, ctx.addr_type
    loopback = "127.0.0.0/8" if ctx.family is IPFamily.V4 else "::1"
    nodeports = _collapse(nodeport_cidrs(ctx.node, ctx.family, primary_by_default=True))
    # nfproxy resolves --nodeport-addresses CIDRs in the kernel (an interval set, intersected
    # with "is a local address") instead of listing interface addresses at render time, so the
    # rules stay right when addresses come and go. Loopback is excluded either way, as
    # kube-proxy's nftables mode does: DNAT of 127/8 traffic to a remote pod cannot work.
    nodeport_match = f"fib daddr type local {ipx} daddr != {loopback}"
    if nodeports:
        nodeport_match = f"{ipx} daddr @{NODEPORT_IPS_SET} {nodeport_match}"

    chains: dict[str, list[str]] = {bc.name: [] for bc in BASE_CHAINS}
    # KUBE-FORWARD in the iptables backend drops INVALID packets; keep the two equal (once:
    # the off table's frame is the same but for this rule and its counter).
    if ctx.node.drop_invalid and table == TABLE:
        chains["filter-forward"].append(f"ct state invalid counter name {INVALID_DROP_COUNTER} drop")
    for name in (
        NODEPORT_ENDPOINTS_CHECK_CHAIN,
        SERVICE_ENDPOINTS_CHECK_CHAIN,
        EXTERNAL_ENDPOINTS_CHECK_CHAIN,
        FIREWALL_CHECK_CHAIN,
        SERVICES_CHAIN,
        MASQUERADING_CHAIN,
        MARK_MASQ_CHAIN,
        REJECT_CHAIN,
        CLUSTER_IPS_CHECK_CHAIN,
    ):
        chains[name] = []
    # Hairpin: a pod that reaches its own service and is sent back to itself must be
    # masqueraded or it would answer itself directly. After DNAT to E the source equals E
    # exactly then, so one rule and a set of E . E pairs of this node's endpoints do it, for
    # affinity ports too, as kube-proxy 1.37's nftables mode does with its hairpin-connections
    # set (its iptables mode marks every endpoint, local or not, in its KUBE-SEP chain).
    chains["nat-postrouting"].append(
        f"ct status dnat {ipx} saddr . {ipx} daddr @{HAIRPIN_SET} jump {MARK_MASQ_CHAIN}"
    )
    for target, base, gate in _JUMPS:
        sub = NEW_CONNECTION_CHAINS.get(base) if gate else None
        if sub is None:
            chains[base].append(f"{gate}jump {target}")
            continue
        if sub not in chains:
            chains[sub] = []
            chains[base].append(f"{gate}jump {sub}")
        chains[sub].append(f"jump {target}")
    chains[MARK_MASQ_CHAIN].append(f"meta mark set meta mark or {ctx.mark}")
    chains[MASQUERADING_CHAIN] += [
        f"meta mark and {ctx.mark} == 0 return",
        f"meta mark set meta mark xor {ctx.mark}",
        "masquerade fully-random",
    ]
    chains[REJECT_CHAIN].append("reject")
    chains[CLUSTER_IPS_CHECK_CHAIN] += _cluster_ips_check(ipx, service_cidrs)
    dispatch = f"{ipx} daddr . meta l4proto . th dport vmap"
    chains[FIREWALL_CHECK_CHAIN].append(f"{dispatch} @{FIREWALL_IPS_MAP}")
    chains[SERVICE_ENDPOINTS_CHECK_CHAIN].append(f"{dispatch} @{NO_ENDPOINT_SERVICES_MAP}")
    chains[EXTERNAL_ENDPOINTS_CHECK_CHAIN].append(f"{dispatch} @{NO_ENDPOINT_EXTERNAL_MAP}")
    chains[NODEPORT_ENDPOINTS_CHECK_CHAIN].append(
        f"{nodeport_match} meta l4proto . th dport vmap @{NO_ENDPOINT_NODEPORTS_MAP}"
    )
    chains[SERVICES_CHAIN] += [
        f"{dispatch} @{SERVICE_IPS_MAP}",
        f"{nodeport_match} meta l4proto . th dport vmap @{SERVICE_NODEPORTS_MAP}",
    ]
    for proto in sorted(ctx.localhost_rejects):
        chains[NODEPORT_ENDPOINTS_CHECK_CHAIN].append(
            f"{ipx} daddr {loopback} meta l4proto {proto} th dport @{localhost_reject_set(proto)}"
            f" counter name {localhost_reject_counter(proto)} reject"
        )

    ip_key = f"{addr} . inet_proto . inet_service : verdict"
    port_key = "inet_proto . inet_service : verdict"
    ip_map = nft.Map
    sets: dict[str, Declaration] = {
        FIREWALL_IPS_MAP: ip_map(FIREWALL_IPS_MAP, ip_key, comment="destinations that are subject to LoadBalancerSourceRanges"),
        NO_ENDPOINT_NODEPORTS_MAP: ip_map(
            NO_ENDPOINT_NODEPORTS_MAP, port_key, comment="vmap to drop or reject packets to service nodeports with no endpoints"
        ),
        NO_ENDPOINT_SERVICES_MAP: ip_map(
            NO_ENDPOINT_SERVICES_MAP, ip_key, comment="vmap to drop or reject packets to services with no endpoints"
        ),
        NO_ENDPOINT_EXTERNAL_MAP: ip_map(
            NO_ENDPOINT_EXTERNAL_MAP, ip_key, comment="vmap to drop or reject packets to external IPs with no endpoints"
        ),
        SERVICE_IPS_MAP: ip_map(SERVICE_IPS_MAP, ip_key, comment="ClusterIP, ExternalIP and LoadBalancer IP traffic"),
        SERVICE_NODEPORTS_MAP: ip_map(SERVICE_NODEPORTS_MAP, port_key, comment="NodePort traffic"),
        HAIRPIN_SET: nft.Set(HAIRPIN_SET, f"{addr} . {addr}", comment="endpoint E . E: a pod reaching itself through a service"),
        CLUSTER_IPS_SET: nft.Set(CLUSTER_IPS_SET, addr, comment="Active ClusterIPs"),
    }
    nodeport_decl = nft.Set(
        NODEPORT_IPS_SET, addr, flags=("interval",), comment="CIDRs whose local IPs accept NodePort traffic"
    )
    elements: dict[str, dict[str, Element]] = {
        name: {} for name in sets if name not in (HAIRPIN_SET, CLUSTER_IPS_SET)
    }
    unused: dict[str, Declaration] = {}
    for proto in sorted(ctx.localhost_rejects):  # gone with the gate: deleted as strays
        name = localhost_reject_set(proto)
        sets[name] = nft.Set(name, "inet_service", comment=f"localhost {proto} NodePorts rejected by nfproxy")
        elements[name] = {}
    if nodeports:
        sets[NODEPORT_IPS_SET] = nodeport_decl
        elements[NODEPORT_IPS_SET] = {c: Element(NODEPORT_IPS_SET, c) for c in nodeports}
    else:
        unused[NODEPORT_IPS_SET] = nodeport_decl
    return {k: tuple(v) for k, v in chains.items()}, sets, unused, elements


def _cluster_ips_check(ipx: str, service_cidrs: tuple[str, ...]) -> list[str]:
    """What reaches a cluster IP undispatched: it matched no service port (kube-proxy's
    cluster-ips-check). The drop needs the service CIDRs; the reject does not."""
    rules = [f'{ipx} daddr @{CLUSTER_IPS_SET} reject comment "Reject traffic to invalid ports of ClusterIPs"']
    if service_cidrs:
        rules.append(
            f"{ipx} daddr {{ {', '.join(service_cidrs)} }} drop"
            ' comment "Drop traffic to unallocated ClusterIPs"'
        )
    return rules


def _policy_rules(
    ipx: str,
    masquerade: str,
    chains: list[str],
    sets: list[str],
    affinity: bool,
    counts: tuple[int, ...] | None = None,
) -> tuple[str, ...]:
    """A policy chain: optional masquerade rule, affinity lookups, then one random choice
    (over `counts[i]` consecutive values per endpoint when weighted, one range each, so the
    map holds an element per endpoint whatever the weights: core.categorize.slot_counts)."""
    rules = [masquerade] if masquerade else []
    if affinity:
        rules += [f"{ipx} saddr @{aset} goto {chain}" for chain, aset in zip(chains, sets)]
    if counts is None:
        slots = " , ".join([f"{i} : goto {chain}" for i, chain in enumerate(chains)])
        rules.append(f"numgen random mod {len(chains)} vmap {{ {slots} }}")
        return tuple(rules)
    items, low = [], 0
    for chain, k in zip(chains, counts):
        if k:
            items.append(f"{low}-{low + k - 1} : goto {chain}" if k > 1 else f"{low} : goto {chain}")
            low += k
    rules.append(f"numgen random mod {low} vmap {{ {' , '.join(items)} }}")
    return tuple(rules)


def _pick(
    subset: tuple[Endpoint, ...],
    reachable: tuple[Endpoint, ...],
    chains: list[str],
    sets: list[str],
) -> tuple[list[str], list[str]]:
    """Names of `subset`'s endpoints. categorize hands back the very objects it was given, so
    identity finds them; hashing a frozen Endpoint would cost more than naming it."""
    if subset is reachable:
        return chains, sets
    index = {id(ep): i for i, ep in enumerate(reachable)}
    picked = [index[id(ep)] for ep in subset]
    return [chains[i] for i in picked], [sets[i] for i in picked] if sets else []


class _Slots:
    """Hands out lanes during one render, keeping a chain's previous lanes when they still fit
    (so a partial sync rewrites as few elements as possible)."""

    def __init__(
        self,
        allocator: SlotAllocator,
        previous: Mapping[str, tuple[int, int]] = MappingProxyType({}),
        previous_lanes: Iterable[Lane] = (),
    ) -> None:
        self.allocator = allocator
        self.previous = previous
        self.kept: set[str] = set()
        self._held = (
            {(lane.shard, k): v for lane in previous_lanes for k, v in zip(lane.keys, lane.values())}
            if previous else {}
        )

    def arrange(self, shard: str, keys: tuple[str, ...], endpoints: tuple[Endpoint, ...]) -> tuple[Endpoint, ...]:
        """Endpoint order for a kept lane split as before: endpoints stay on their ranges, new
        ones take the ranges of the ones that went. A pod replaced then changes one element
        instead of shifting every range after it. Any order is the same uniform choice; only
        which endpoint owns which range differs."""
        values = [slot_value(ep) for ep in endpoints]
        owners: dict[str, list[Endpoint]] = {}
        for ep, value in zip(endpoints, values):
            owners.setdefault(value, []).append(ep)
        return tuple([owners[v].pop() for v in self._arranged(shard, keys, values)])

    def _arranged(self, shard: str, keys: tuple[str, ...], values: list[str]) -> list[str]:
        held = self._held
        slots: list[str | None] = [held.get((shard, k)) for k in keys]
        wanted = Counter(values)
        for i, v in enumerate(slots):
            if v is not None and wanted[v] > 0:
                wanted[v] -= 1
            else:
                slots[i] = None
        waiting: list[str] = []
        for v in values:
            if wanted[v] > 0:
                waiting.append(v)
                wanted[v] -= 1
        it = iter(waiting)
        return [v if v is not None else next(it) for v in slots]

    def take(self, chain: str, lanes: int) -> tuple[int, int]:
        prev = self.previous.get(chain)
        if prev is not None and prev[1] == lanes and chain not in self.kept:
            self.kept.add(chain)
            return prev
        base, self.allocator = self.allocator.allocate(lanes)
        return base, lanes

    def release_unkept(self) -> None:
        for chain, (base, size) in self.previous.items():
            if chain not in self.kept:
                self.allocator = self.allocator.release(base, size)


def home(r: Routing, affinity: bool) -> str:
    """The table a service port lives in: OFF_TABLE when a weighted chain of it draws a
    modulus of its own (its weight sum leaves LANE's divisors, or affinity's `mod n` vmap), so
    that the next weight change rewrites a rule there and the kernel validates that small
    table, not the one holding every service (docs/nft-layouts.md, "Chains off the lane")."""
    for subset in (r.cluster, r.local):
        if subset and weighted(subset) and (affinity or lane_split(slot_counts(subset))[0] != LANE):
            return OFF_TABLE
    return TABLE


def _hairpin(reachable: tuple[Endpoint, ...], node_name: str) -> tuple[str, ...]:
    """The endpoint IPs a port puts in the shared hairpin set: its endpoints on this node, as
    kube-proxy's nftables mode fills its hairpin-connections set (only a pod on this node can
    reach its own service through this node's DNAT and be sent back to itself)."""
    for ep in reachable:
        if not ep.ip or ep.ip.strip(_IP_CHARS):
            raise ValueError(f"not an endpoint address: {ep.ip!r}")
    if not node_name:
        return ()
    return tuple(dict.fromkeys(ep.ip for ep in reachable if ep.node_name == node_name))


def _render_service(
    ctx: _Context, svc: ServicePort, endpoints: tuple[Endpoint, ...], slots: _Slots,
    r: Routing | None = None,
) -> ServiceRules:
    if r is None:
        r = categorize(svc, endpoints, ctx.node)
    spn = svc.name
    ipx = ctx.ipx
    proto = spn.protocol.lower
    base = service_chain_base(spn)
    cluster_chain = nft_name(SERVICE_PREFIX + base)
    local_chain = LOCAL_PREFIX + base
    external_chain = EXTERNAL_PREFIX + base
    firewall_chain = FIREWALL_PREFIX + base
    comment = str(spn)
    nft_comment(comment)  # refuse early, not when the script is written
    affinity = svc.affinity_timeout > 0
    cluster_ip = _address(svc.cluster_ip)
    port = svc.port

    reachable = r.reachable
    lanes: list[Lane] = []
    hairpin = _hairpin(reachable, ctx.node.name)

    def selection(chain: str, subset: tuple[Endpoint, ...]) -> str:
        """One random value of the chain's lane, looked up in a shared interval data map
        (one range per endpoint, sized by weight); no per-endpoint chains."""
        kept_before = chain in slots.kept
        modulus, widths = lane_split(slot_counts(subset))
        block = slots.take(chain, lanes_for(modulus))
        shard = shard_of(block[0], proto, ctx.counters)
        offset = (block[0] % LANES_PER_MAP) * LANE
        keys = range_keys(offset, widths)
        if not kept_before and chain in slots.kept and not weighted(subset):
            subset = slots.arrange(shard, keys, subset)
        lanes.append(Lane(chain, block, shard, keys, subset))
        return f"meta l4proto {proto} dnat {ipx} to numgen random mod {modulus} offset {offset} map @{shard}"

    # Affinity needs to know which endpoint a client got, so those ports keep kube-proxy's
    # per-endpoint chains. The hot loop (names once per endpoint) runs only for them.
    ep_chain_names: list[str] = []
    ep_set_names: list[str] = []
    ep_chains: dict[str, tuple[str, ...]] = {}
    affinity_sets: dict[str, nft.Set] = {}
    svc_part = f"{spn.namespace}/{spn.name}/{proto}/{spn.port}__"
    dnat_head = f"meta l4proto {proto} {'counter ' if ctx.counters else ''}dnat to "
    update = f" {{ {ipx} saddr }}"
    addr_type, timeout = ctx.addr_type, svc.affinity_timeout
    sha256 = hashlib.sha256
    pairs = _B32_PAIRS
    unpack = _FIRST_8_BYTES
    for ep in reachable if affinity else ():
        ip = ep.ip
        ep_port = ep.port
        text = f"{svc_part}{ip.replace(':', '.')}/{ep_port}"
        n = unpack(sha256(text.encode()).digest())[0] >> 24
        ep_base = f"{pairs[n >> 30]}{pairs[(n >> 20) & 1023]}{pairs[(n >> 10) & 1023]}{pairs[n & 1023]}-{text}"
        if len(ep_base) > _NAME_BASE_LENGTH_MAX:
            ep_base = ep_base[: _NAME_BASE_LENGTH_MAX - 3] + "..."
        chain = ENDPOINT_PREFIX + ep_base
        if not ip or ip.strip(_IP_CHARS):
            # The rest of the name is the already checked service part and an int: the
            # address is all that can still carry syntax into the chain name and the rules.
            raise ValueError(f"not an endpoint address: {ip!r}")
        ep_chain_names.append(chain)
        dest = f"[{ip}]:{ep_port}" if ":" in ip else f"{ip}:{ep_port}"
        if affinity:
            aset = AFFINITY_PREFIX + ep_base
            ep_set_names.append(aset)
            affinity_sets[aset] = nft.Set(aset, addr_type, flags=("dynamic", "timeout"), timeout=timeout)
            ep_chains[chain] = (f"update @{aset}{update}", dnat_head + dest)
        else:
            ep_chains[chain] = (dnat_head + dest,)

    if ctx.node.masquerade_all:
        masquerade = f"{ipx} daddr {cluster_ip} jump {MARK_MASQ_CHAIN}"
    elif ctx.not_from_pod:
        # Off-cluster sources reaching a cluster IP (a static route to the service range via
        # some node) may be answered from another node: masquerade them.
        masquerade = f"{ipx} daddr {cluster_ip} {ctx.not_from_pod} jump {MARK_MASQ_CHAIN}"
    else:
        masquerade = ""
    internal_local = svc.internal_policy_local
    chains: dict[str, tuple[str, ...]] = {}
    # The masquerade rule goes where cluster-IP traffic enters: the local chain under
    # internalTrafficPolicy=Local, else the cluster chain.
    for chain, subset, masq in (
        (cluster_chain, r.cluster, "" if internal_local else masquerade),
        (local_chain, r.local, masquerade if internal_local else ""),
    ):
        if not subset:
            continue
        if affinity:
            counts = slot_counts(subset) if weighted(subset) else None
            chains[chain] = _policy_rules(ipx, masq, *_pick(subset, reachable, ep_chain_names, ep_set_names), affinity, counts)
        else:
            chains[chain] = (masq, selection(chain, subset)) if masq else (selection(chain, subset),)

    external_no_endpoints = r.external_no_endpoints
    if r.uses_external_chain:
        ext: list[str] = []
        if not svc.external_policy_local:
            # Cluster policy may forward to another node: the reply must come back through us.
            ext.append(f"jump {MARK_MASQ_CHAIN}")
        else:
            # Pods and the node itself reaching an external address behave as if they went out
            # to the load balancer and came back in: neither traffic policy applies to them.
            # (The service chain exists: see ServicePort.uses_cluster_endpoints.)
            if ctx.from_pod:
                ext.append(f'{ctx.from_pod} goto {cluster_chain} comment "short-circuit pod traffic"')
            ext.append(f'fib saddr type local jump {MARK_MASQ_CHAIN} comment "masquerade local traffic"')
            ext.append(f'fib saddr type local goto {cluster_chain} comment "short-circuit local traffic"')
        if external_no_endpoints is None:
            ext.append(f"goto {local_chain if svc.external_policy_local else cluster_chain}")
        chains[external_chain] = tuple(ext)

    if r.fenced:  # with or without endpoints, as kube-proxy's nftables mode
        ranges = [_address(c) for c in firewall_sources(svc, ctx.node)]
        chains[firewall_chain] = (f"{ipx} saddr != {{ {', '.join(ranges)} }} drop",)

    chains.update(ep_chains)

    # Map elements, in kube-proxy's order.
    elements: list[Element] = []

    def element(map_name: str, key: str, value: str, note: str = "") -> None:
        elements.append(Element(map_name, key, value, note))

    suffix = f" . {proto} . {port}"
    internal_no_endpoints = r.internal_no_endpoints
    if internal_no_endpoints is None:
        target = local_chain if internal_local else cluster_chain
        element(SERVICE_IPS_MAP, cluster_ip + suffix, f"goto {target}")
    else:
        element(NO_ENDPOINT_SERVICES_MAP, cluster_ip + suffix, _NO_ENDPOINT_VERDICT[internal_no_endpoints], comment)
    to_external = f"goto {external_chain}"
    no_external = _NO_ENDPOINT_VERDICT[external_no_endpoints] if external_no_endpoints else None
    for ip in svc.external_ips:
        key = _address(ip) + suffix
        if r.has_endpoints:
            element(SERVICE_IPS_MAP, key, to_external)
        if no_external is not None:
            element(NO_ENDPOINT_EXTERNAL_MAP, key, no_external, comment)
    for ip in svc.load_balancer_ips:
        key = _address(ip) + suffix
        if r.has_endpoints:
            element(SERVICE_IPS_MAP, key, to_external)
        if r.fenced:
            element(FIREWALL_IPS_MAP, key, f"goto {firewall_chain}", comment)
        if no_external is not None:
            element(NO_ENDPOINT_EXTERNAL_MAP, key, no_external, comment)
    if svc.node_port:
        key = f"{proto} . {svc.node_port}"
        if r.has_endpoints:
            element(SERVICE_NODEPORTS_MAP, key, to_external)
        if no_external is not None:
            element(NO_ENDPOINT_NODEPORTS_MAP, key, no_external, comment)
        if proto in ctx.localhost_rejects:
            element(localhost_reject_set(proto), str(svc.node_port), "")

    return ServiceRules(
        chains=MappingProxyType(chains),
        affinity_sets=MappingProxyType(affinity_sets) if affinity_sets else _NO_SETS,
        elements=tuple(elements),
        lanes=tuple(lanes),
        hairpin=hairpin,
        cluster_ip=cluster_ip,
    )


def _service_order(key: ServicePortKey) -> tuple[str, str, str, str]:
    spn = key[0]
    return (spn.namespace, spn.name, spn.port, spn.protocol)


def render(
    state: ClusterState, family: IPFamily, *, endpoint_counters: bool = True, keep: NftRuleset | None = None
) -> NftRuleset:
    """Compile one family of `state` into kube-proxy's nftables layout, in table `nfproxy` (and
    `nfproxy-off` for the ports `home` puts there: the result's `off`).
    `endpoint_counters=False` leaves out the per-endpoint counters (to measure their cost).
    `keep` (the ruleset the kernel holds) keeps each chain's slot block and each endpoint's
    slot where they still fit, so that `transaction(kept=keep)` leaves those elements, and
    their counters, alone."""
    with gc_paused():
        return _render(state, family, endpoint_counters, keep)


def _kept_slots(keep: NftRuleset | None) -> _Slots:
    if keep is None or keep.allocator is None:
        return _Slots(SlotAllocator())
    lanes = [lane for svc in keep.services.values() for lane in svc.lanes]
    blocks = {lane.chain: lane.block for lane in lanes}
    return _Slots(keep.allocator, MappingProxyType(blocks), lanes)


class _Build:
    """One table's ruleset being rendered: its static frame and what its ports add."""

    def __init__(self, ctx: _Context, service_cidrs: tuple[str, ...], table: str, keep: NftRuleset | None) -> None:
        self.table = table
        self.chains, self.sets, self.unused, self.elements = _static(ctx, service_cidrs, table)
        self.services: dict[ServicePortKey, ServiceRules] = {}
        self.contested: set[tuple[str, str]] = set()
        self.slots = _kept_slots(keep)
        self.hairpin_refs: dict[str, int] = {}
        self.cluster_ip_refs: dict[str, int] = {}
        self.shard_users: dict[str, int] = {}
        self.counters = tuple(localhost_reject_counter(p) for p in sorted(ctx.localhost_rejects))

    def add(self, key: ServicePortKey, rules: ServiceRules) -> None:
        self.services[key] = rules
        hairpin_refs, elements = self.hairpin_refs, self.elements
        for ip in rules.hairpin:
            hairpin_refs[ip] = hairpin_refs.get(ip, 0) + 1
        if rules.cluster_ip:
            self.cluster_ip_refs[rules.cluster_ip] = self.cluster_ip_refs.get(rules.cluster_ip, 0) + 1
        for shard in rules.shards:
            self.shard_users[shard] = self.shard_users.get(shard, 0) + 1
        for element in rules.elements:
            # A key claimed twice (e.g. one external IP on two services) would make nft fail
            # the whole transaction ("File exists"); the first service port keeps it. (Lanes
            # never share a range: the allocator hands each chain its own.)
            map_name, elem_key = element.set, element.key
            held = elements.get(map_name)
            if held is None:
                held = elements[map_name] = {}
            if elem_key in held:
                self.contested.add((map_name, elem_key))
            else:
                held[elem_key] = element

    def finish(self, family: IPFamily, drop_invalid: bool, endpoint_counters: bool) -> NftRuleset:
        self.slots.release_unkept()
        return NftRuleset(
            family=family,
            table=self.table,
            base_chains=BASE_CHAINS if self.table == TABLE else OFF_BASE_CHAINS,
            chains=MappingProxyType(self.chains),
            sets=MappingProxyType(self.sets),
            unused_sets=MappingProxyType(self.unused),
            elements=MappingProxyType({k: MappingProxyType(v) for k, v in self.elements.items()}),
            services=MappingProxyType(self.services),
            contested=frozenset(self.contested),
            hairpin_refs=MappingProxyType(self.hairpin_refs),
            shard_users=MappingProxyType(self.shard_users),
            allocator=self.slots.allocator,
            cluster_ip_refs=MappingProxyType(self.cluster_ip_refs),
            counters=((INVALID_DROP_COUNTER,) if drop_invalid and self.table == TABLE else ()) + self.counters,
            endpoint_counters=endpoint_counters,
        )


def _render(
    state: ClusterState, family: IPFamily, endpoint_counters: bool = True, keep: NftRuleset | None = None
) -> NftRuleset:
    ctx, service_cidrs = _context(state.node, family, endpoint_counters)
    builds = {TABLE: _Build(ctx, service_cidrs, TABLE, keep)}
    all_endpoints = state.endpoints
    svc_map = state.services
    node = state.node
    # Sorted by plain string tuples: far cheaper than the dataclass ordering at 10 000 services.
    keys = sorted((k for k in svc_map if k[1] is family), key=_service_order)
    for key in keys:
        svc, eps = svc_map[key], all_endpoints.get(key, ())
        r = categorize(svc, eps, node)
        table = home(r, svc.affinity_timeout > 0)
        build = builds.get(table)
        if build is None:
            build = builds[table] = _Build(ctx, service_cidrs, table, keep.off if keep is not None else None)
        rules = _render_service(ctx, svc, eps, build.slots, r)
        if table != TABLE:
            builds[TABLE].add(key, _stub(rules.hairpin, rules.cluster_ip))
            rules = dataclasses.replace(rules, hairpin=(), cluster_ip="")
        build.add(key, rules)
    off = builds.get(OFF_TABLE)
    main = builds[TABLE].finish(family, node.drop_invalid, endpoint_counters)
    if off is None:
        return main
    return dataclasses.replace(main, off=off.finish(family, node.drop_invalid, endpoint_counters))


def _stub(hairpin: tuple[str, ...], cluster_ip: str) -> ServiceRules:
    """What nfproxy's table holds of a port that lives in the off table: its endpoints in the
    `hairpin` set and its cluster IP in `cluster-ips`, no chain, no other element; the off
    table's port holds neither. nfproxy's postrouting marks hairpin traffic whichever table
    DNATed it, and its cluster-ips-check runs first (it would drop what must be rejected: a
    port of the off table's cluster IPs that nobody serves). So a move between the tables
    touches neither set."""
    return ServiceRules(MappingProxyType({}), _NO_SETS, (), hairpin=hairpin, cluster_ip=cluster_ip)


def empty_off(state: ClusterState, family: IPFamily, endpoint_counters: bool = True) -> NftRuleset:
    """The off table's static frame, without ports: where a partial sync starts the table."""
    ctx, service_cidrs = _context(state.node, family, endpoint_counters)
    return _Build(ctx, service_cidrs, OFF_TABLE, None).finish(family, state.node.drop_invalid, endpoint_counters)


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
        ctx, _ = _context(state.node, family, previous.endpoint_counters)
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
        for key in sorted(routed, key=_service_order):
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
            slots = _Slots(allocator, old_blocks, old.lanes if old is not None else ())
            if now is not None or stub:
                if now is not None:
                    rules = _render_service(ctx, now.service, now.endpoints, slots, now.routing)
                    if table != TABLE:
                        rules = dataclasses.replace(rules, hairpin=(), cluster_ip="")
                else:
                    away = routed[key]
                    assert away is not None
                    rules = _stub(_hairpin(away.routing.reachable, ctx.node.name), _address(away.service.cluster_ip))
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
    deleted first unless `new` uses those names again.
    """
    tx = nft.Transaction(new.nft_family, new.table)
    keys = tuple(keys)
    live_chains, live_sets = live_again(new, keys) if delete_chains or delete_sets else (set(), set())
    for name in delete_chains:
        if name not in live_chains:
            tx.delete(nft.Chain(name))
    for name in delete_sets:
        if name not in live_sets:
            # Shard maps and affinity sets alike: nft deletes a map by `delete set` too.
            tx.delete(nft.Set(name))

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

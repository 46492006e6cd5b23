"""The full render: a ClusterState to an `NftRuleset` (static part, per-port chains, maps
and elements), nfproxy's table and the off table."""

from __future__ import annotations

import dataclasses
import ipaddress
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from nfproxy import nftables as nft
from nfproxy.nftables import expr as x
from nfproxy.nftables.expr import Body, body
from nfproxy.backends.nft.names import (
    AFFINITY_PREFIX,
    CLUSTER_IPS_CHECK_CHAIN,
    CLUSTER_IPS_SET,
    ENDPOINT_PREFIX,
    EXTERNAL_PREFIX,
    FIREWALL_CHECK_CHAIN,
    FIREWALL_IPS_MAP,
    FIREWALL_PREFIX,
    HAIRPIN_SET,
    INVALID_DROP_COUNTER,
    IP_CHARS,
    LANE,
    LANES_PER_MAP,
    LOCAL_PREFIX,
    MARK_MASQ_CHAIN,
    MASQUERADING_CHAIN,
    NODEPORT_ENDPOINTS_CHECK_CHAIN,
    NODEPORT_IPS_SET,
    NO_ENDPOINT_NODEPORTS_MAP,
    NO_ENDPOINT_SERVICES_MAP,
    OFF_TABLE,
    REJECT_CHAIN,
    SERVICES_CHAIN,
    SERVICE_ENDPOINTS_CHECK_CHAIN,
    SERVICE_IPS_MAP,
    SERVICE_NODEPORTS_MAP,
    SERVICE_PREFIX,
    TABLE,
    localhost_reject_counter,
    localhost_reject_set,
    nft_address,
    nft_comment,
    nft_name,
    hash_and_truncate,
    service_chain_base,
)
from nfproxy.backends.nft.structure import (
    Declaration,
    Element,
    Lane,
    NO_SETS,
    NftRuleset,
    ServiceRules,
    SlotAllocator,
    endpoint_choice,
    lane_split,
    lanes_for,
    range_keys,
    shard_of,
    slot_value,
)
from nfproxy.core.gc_pause import gc_paused
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
)


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

# The words of the static rules and of most service rules, one object each.
_NEW = (x.Match(x.CT_STATE, "new"),)
_JUMP_MASQ = x.jump(MARK_MASQ_CHAIN)
_MARK_FOR_MASQUERADE = body(_JUMP_MASQ)
_LOCAL_SOURCE = x.Match(x.Fib("saddr"), "local")
_POD_SHORT_CIRCUIT = x.Comment("short-circuit pod traffic")
_LOCAL_MASQUERADE = x.Comment("masquerade local traffic")
_LOCAL_SHORT_CIRCUIT = x.Comment("short-circuit local traffic")
_PORT_KEY = x.Concat((x.L4PROTO, x.TH_DPORT))
_L4PROTO_IS = {proto: x.Match(x.L4PROTO, proto) for proto in ("tcp", "udp", "sctp")}

# (target, from base chain, gate): kube-proxy's nftablesJumpChains without the cluster-ips-check
# entries. Reject only works from input/forward/output, hence no endpoint checks in prerouting;
# node ports are only checked on input because only locally addressed traffic can reach one.
_JUMPS = (
    (NODEPORT_ENDPOINTS_CHECK_CHAIN, "filter-input", _NEW),
    (SERVICE_ENDPOINTS_CHECK_CHAIN, "filter-input", _NEW),
    (SERVICE_ENDPOINTS_CHECK_CHAIN, "filter-forward", _NEW),
    # As kube-proxy's nftables mode, one no-endpoint map for cluster, external and LB IPs,
    # checked on output after the node's own DNAT: a node's packet to an external address that
    # its short-circuit DNATs is not rejected, and one no DNAT took is rejected or dropped.
    (SERVICE_ENDPOINTS_CHECK_CHAIN, "filter-output-post-dnat", _NEW),
    (FIREWALL_CHECK_CHAIN, "filter-prerouting", _NEW),
    (FIREWALL_CHECK_CHAIN, "filter-output", _NEW),
    (SERVICES_CHAIN, "nat-output", ()),
    (SERVICES_CHAIN, "nat-prerouting", ()),
    (MASQUERADING_CHAIN, "nat-postrouting", ()),
    (CLUSTER_IPS_CHECK_CHAIN, "filter-forward", _NEW),
    (CLUSTER_IPS_CHECK_CHAIN, "filter-output-post-dnat", _NEW),
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
    nets = [ipaddress.ip_network(nft_address(c), strict=False) for c in cidrs]
    return tuple(str(n) for n in ipaddress.collapse_addresses(nets))  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class _Context:
    """Per-render constants, computed once instead of once per service or endpoint."""

    node: NodeConfig
    family: IPFamily
    ipx: str
    addr_type: str
    # Match for "source is a pod" and its negation, None when no pod CIDR is known.
    from_pod: x.Match | None
    not_from_pod: x.Match | None
    mark: int
    saddr: x.Payload
    daddr: x.Payload
    # Count each endpoint's new connections (docs/metrics.md): `counter` on the endpoint data
    # maps (one per element, bumped by the lookup) and before each per-endpoint chain's DNAT.
    counters: bool = True
    # Protocols whose node ports are rejected on loopback (core.categorize.localhost_rejects).
    localhost_rejects: frozenset[str] = frozenset()


_IFNAME_RE = re.compile(r"[A-Za-z0-9_.@-]{1,15}")


def _pod_matches(ipx: str, match: PodMatch | None) -> tuple[x.Match | None, x.Match | None]:
    """(if from a pod, if not from a pod) as nft matches; (None, None) without a detector."""
    if match is None:
        return None, None
    if match.kind is PodMatchKind.CIDR:
        cidr = nft_address(match.value)
        saddr = x.payload(ipx, "saddr")
        return x.Match(saddr, cidr), x.Match(saddr, cidr, "!=")
    if _IFNAME_RE.fullmatch(match.value) is None:
        raise ValueError(f"not an interface name: {match.value!r}")
    name = match.value + ("*" if match.kind is PodMatchKind.INTERFACE_PREFIX else "")
    iifname = x.Meta("iifname")
    return x.Match(iifname, name), x.Match(iifname, name, "!=")


def build_context(node: NodeConfig, family: IPFamily, counters: bool = True) -> tuple[_Context, tuple[str, ...]]:
    ipx = "ip" if family is IPFamily.V4 else "ip6"
    from_pod, not_from_pod = _pod_matches(ipx, pod_match(node, family))
    ctx = _Context(
        node=node,
        family=family,
        ipx=ipx,
        addr_type="ipv4_addr" if family is IPFamily.V4 else "ipv6_addr",
        from_pod=from_pod,
        not_from_pod=not_from_pod,
        mark=node.masquerade_mark,
        saddr=x.payload(ipx, "saddr"),
        daddr=x.payload(ipx, "daddr"),
        counters=counters,
        localhost_rejects=localhost_rejects(node, family),
    )
    return ctx, _collapse(node.service_cidrs_of(family))


def _static(
    ctx: _Context, service_cidrs: tuple[str, ...], table: str = TABLE
) -> tuple[dict[str, tuple[Body, ...]], dict[str, Declaration], dict[str, Declaration], dict[str, dict[str, Element]]]:
    addr = ctx.addr_type
    saddr, daddr = ctx.saddr, ctx.daddr
    loopback = "127.0.0.0/8" if ctx.family is IPFamily.V4 else "::1"
    nodeports = _collapse(nodeport_cidrs(ctx.node, ctx.family, primary_by_default=True))
    # nfproxy resolves --nodeport-addresses CIDRs in the kernel (an interval set, intersected
    # with "is a local address") instead of listing interface addresses at render time, so the
    # rules stay right when addresses come and go. Loopback is excluded either way, as
    # kube-proxy's nftables mode does: DNAT of 127/8 traffic to a remote pod cannot work.
    nodeport_match: tuple[x.Statement, ...] = (x.Match(x.Fib("daddr"), "local"), x.Match(daddr, loopback, "!="))
    if nodeports:
        nodeport_match = (x.Lookup(daddr, NODEPORT_IPS_SET), *nodeport_match)

    chains: dict[str, list[Body]] = {bc.name: [] for bc in BASE_CHAINS}
    # KUBE-FORWARD in the iptables backend drops INVALID packets; keep the two equal (once:
    # the off table's frame is the same but for this rule and its counter).
    if ctx.node.drop_invalid and table == TABLE:
        chains["filter-forward"].append(body(x.Match(x.CT_STATE, "invalid"), x.Counter(INVALID_DROP_COUNTER), x.DROP))
    for name in (
        NODEPORT_ENDPOINTS_CHECK_CHAIN,
        SERVICE_ENDPOINTS_CHECK_CHAIN,
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
        body(x.Match(x.CT_STATUS, "dnat"), x.Lookup(x.Concat((saddr, daddr)), HAIRPIN_SET), _JUMP_MASQ)
    )
    for target, base, gate in _JUMPS:
        sub = NEW_CONNECTION_CHAINS.get(base) if gate else None
        if sub is None:
            chains[base].append(body(*gate, x.jump(target)))
            continue
        if sub not in chains:
            chains[sub] = []
            chains[base].append(body(*gate, x.jump(sub)))
        chains[sub].append(body(x.jump(target)))
    chains[MARK_MASQ_CHAIN].append(body(x.MetaSet(x.MARK, x.Bitwise(x.MARK, "or", ctx.mark))))
    chains[MASQUERADING_CHAIN] += [
        body(x.Match(x.Bitwise(x.MARK, "and", ctx.mark), 0), x.RETURN),
        body(x.MetaSet(x.MARK, x.Bitwise(x.MARK, "xor", ctx.mark))),
        body(x.Masquerade(fully_random=True)),
    ]
    chains[REJECT_CHAIN].append(body(x.REJECT))
    chains[CLUSTER_IPS_CHECK_CHAIN] += _cluster_ips_check(daddr, service_cidrs)
    dispatch = x.Concat((daddr, x.L4PROTO, x.TH_DPORT))
    chains[FIREWALL_CHECK_CHAIN].append(body(x.VerdictMap(dispatch, FIREWALL_IPS_MAP)))
    chains[SERVICE_ENDPOINTS_CHECK_CHAIN].append(body(x.VerdictMap(dispatch, NO_ENDPOINT_SERVICES_MAP)))
    chains[NODEPORT_ENDPOINTS_CHECK_CHAIN].append(
        body(*nodeport_match, x.VerdictMap(_PORT_KEY, NO_ENDPOINT_NODEPORTS_MAP))
    )
    chains[SERVICES_CHAIN] += [
        body(x.VerdictMap(dispatch, SERVICE_IPS_MAP)),
        body(*nodeport_match, x.VerdictMap(_PORT_KEY, SERVICE_NODEPORTS_MAP)),
    ]
    for proto in sorted(ctx.localhost_rejects):
        chains[NODEPORT_ENDPOINTS_CHECK_CHAIN].append(body(
            x.Match(daddr, loopback), x.Match(x.L4PROTO, proto), x.Lookup(x.TH_DPORT, localhost_reject_set(proto)),
            x.Counter(localhost_reject_counter(proto)), x.REJECT,
        ))

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


def _cluster_ips_check(daddr: x.Payload, service_cidrs: tuple[str, ...]) -> list[Body]:
    """What reaches a cluster IP undispatched: it matched no service port (kube-proxy's
    cluster-ips-check). The drop needs the service CIDRs; the reject does not."""
    rules = [body(x.Lookup(daddr, CLUSTER_IPS_SET), x.REJECT, x.Comment("Reject traffic to invalid ports of ClusterIPs"))]
    if service_cidrs:
        rules.append(body(x.Match(daddr, x.AnonSet(service_cidrs)), x.DROP, x.Comment("Drop traffic to unallocated ClusterIPs")))
    return rules


def _policy_rules(
    saddr: x.Payload,
    masquerade: Body | None,
    chains: list[str],
    sets: list[str],
    affinity: bool,
    counts: tuple[int, ...] | None = None,
) -> tuple[Body, ...]:
    """A policy chain: optional masquerade rule, affinity lookups, then one random choice
    (over `counts[i]` consecutive values per endpoint when weighted, one range each, so the
    map holds an element per endpoint whatever the weights: core.categorize.slot_counts)."""
    rules = [masquerade] if masquerade else []
    if affinity:
        rules += [body(x.Lookup(saddr, aset), x.goto(chain)) for chain, aset in zip(chains, sets)]
    if counts is None:
        slots = tuple([(i, x.goto(chain)) for i, chain in enumerate(chains)])
        rules.append(body(x.VerdictMap(x.numgen(len(chains)), x.AnonMap(slots))))
        return tuple(rules)
    items: list[tuple[int | x.Range, x.Verdict]] = []
    low = 0
    for chain, k in zip(chains, counts):
        if k:
            items.append((x.Range(low, low + k - 1) if k > 1 else low, x.goto(chain)))
            low += k
    rules.append(body(x.VerdictMap(x.numgen(low), x.AnonMap(tuple(items)))))
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


class Slots:
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


def hairpin_pairs(reachable: tuple[Endpoint, ...], node_name: str) -> tuple[str, ...]:
    """The endpoint IPs a port puts in the shared hairpin set: its endpoints on this node, as
    kube-proxy's nftables mode fills its hairpin-connections set (only a pod on this node can
    reach its own service through this node's DNAT and be sent back to itself)."""
    for ep in reachable:
        if not ep.ip or ep.ip.strip(IP_CHARS):
            raise ValueError(f"not an endpoint address: {ep.ip!r}")
    if not node_name:
        return ()
    return tuple(dict.fromkeys(ep.ip for ep in reachable if ep.node_name == node_name))


def render_service(
    ctx: _Context, svc: ServicePort, endpoints: tuple[Endpoint, ...], slots: Slots,
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
    cluster_ip = nft_address(svc.cluster_ip)
    port = svc.port

    reachable = r.reachable
    lanes: list[Lane] = []
    hairpin = hairpin_pairs(reachable, ctx.node.name)
    l4proto = _L4PROTO_IS.get(proto) or x.Match(x.L4PROTO, proto)

    def selection(chain: str, subset: tuple[Endpoint, ...]) -> Body:
        """One random value of the chain's lane, looked up in a shared data map (a key per
        endpoint in a hash map, or a range per endpoint sized by weight in an interval map); no
        per-endpoint chains."""
        kept_before = chain in slots.kept
        modulus, widths, hashed = endpoint_choice(slot_counts(subset))
        block = slots.take(chain, lanes_for(modulus))
        shard = shard_of(block[0], proto, ctx.counters, hashed)
        offset = (block[0] % LANES_PER_MAP) * LANE
        keys = range_keys(offset, widths)
        if not kept_before and chain in slots.kept and not weighted(subset):
            subset = slots.arrange(shard, keys, subset)
        lanes.append(Lane(chain, block, shard, keys, subset))
        return body(l4proto, x.Dnat(x.MapLookup(x.numgen(modulus, offset), shard), None, ipx))

    # Affinity needs to know which endpoint a client got, so those ports keep kube-proxy's
    # per-endpoint chains. The hot loop (names once per endpoint) runs only for them.
    ep_chain_names: list[str] = []
    ep_set_names: list[str] = []
    ep_chains: dict[str, tuple[Body, ...]] = {}
    affinity_sets: dict[str, nft.Set] = {}
    svc_part = f"{spn.namespace}/{spn.name}/{proto}/{spn.port}__"
    dnat_head = (l4proto, x.COUNTER) if ctx.counters else (l4proto,)
    saddr, daddr = ctx.saddr, ctx.daddr
    addr_type, timeout = ctx.addr_type, svc.affinity_timeout
    for ep in reachable if affinity else ():
        ip = ep.ip
        ep_port = ep.port
        ep_base = hash_and_truncate(f"{svc_part}{ip.replace(':', '.')}/{ep_port}")  # endpoint_chain_base's text
        chain = ENDPOINT_PREFIX + ep_base
        if not ip or ip.strip(IP_CHARS):
            # The rest of the name is the already checked service part and an int: the
            # address is all that can still carry syntax into the chain name and the rules.
            raise ValueError(f"not an endpoint address: {ip!r}")
        ep_chain_names.append(chain)
        dnat = body(*dnat_head, x.Dnat(ip, ep_port))
        if affinity:
            aset = AFFINITY_PREFIX + ep_base
            ep_set_names.append(aset)
            affinity_sets[aset] = nft.Set(aset, addr_type, flags=("dynamic", "timeout"), timeout=timeout)
            ep_chains[chain] = (body(x.SetUpdate(aset, saddr)), dnat)
        else:
            ep_chains[chain] = (dnat,)

    if ctx.node.masquerade_all:
        masquerade: Body | None = body(x.Match(daddr, cluster_ip), _JUMP_MASQ)
    elif ctx.not_from_pod is not None:
        # Off-cluster sources reaching a cluster IP (a static route to the service range via
        # some node) may be answered from another node: masquerade them.
        masquerade = body(x.Match(daddr, cluster_ip), ctx.not_from_pod, _JUMP_MASQ)
    else:
        masquerade = None
    internal_local = svc.internal_policy_local
    chains: dict[str, tuple[Body, ...]] = {}
    # The masquerade rule goes where cluster-IP traffic enters: the local chain under
    # internalTrafficPolicy=Local, else the cluster chain.
    for chain, subset, masq in (
        (cluster_chain, r.cluster, None if internal_local else masquerade),
        (local_chain, r.local, masquerade if internal_local else None),
    ):
        if not subset:
            continue
        if affinity:
            counts = slot_counts(subset) if weighted(subset) else None
            chains[chain] = _policy_rules(saddr, masq, *_pick(subset, reachable, ep_chain_names, ep_set_names), affinity, counts)
        else:
            chains[chain] = (masq, selection(chain, subset)) if masq else (selection(chain, subset),)

    external_no_endpoints = r.external_no_endpoints
    if r.uses_external_chain:
        ext: list[Body] = []
        if not svc.external_policy_local:
            # Cluster policy may forward to another node: the reply must come back through us.
            ext.append(_MARK_FOR_MASQUERADE)
        else:
            # Pods and the node itself reaching an external address behave as if they went out
            # to the load balancer and came back in: neither traffic policy applies to them.
            # (The service chain exists: see ServicePort.uses_cluster_endpoints.)
            to_cluster = x.goto(cluster_chain)
            if ctx.from_pod is not None:
                ext.append(body(ctx.from_pod, to_cluster, _POD_SHORT_CIRCUIT))
            ext.append(body(_LOCAL_SOURCE, _JUMP_MASQ, _LOCAL_MASQUERADE))
            ext.append(body(_LOCAL_SOURCE, to_cluster, _LOCAL_SHORT_CIRCUIT))
        if external_no_endpoints is None:
            ext.append(body(x.goto(local_chain if svc.external_policy_local else cluster_chain)))
        chains[external_chain] = tuple(ext)

    if r.fenced:  # with or without endpoints, as kube-proxy's nftables mode
        ranges = tuple([nft_address(c) for c in firewall_sources(svc, ctx.node)])
        chains[firewall_chain] = (body(x.Match(saddr, x.AnonSet(ranges), "!="), x.DROP),)

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
        key = nft_address(ip) + suffix
        if r.has_endpoints:
            element(SERVICE_IPS_MAP, key, to_external)
        if no_external is not None:
            element(NO_ENDPOINT_SERVICES_MAP, key, no_external, comment)
    for ip in svc.load_balancer_ips:
        key = nft_address(ip) + suffix
        if r.has_endpoints:
            element(SERVICE_IPS_MAP, key, to_external)
        if r.fenced:
            element(FIREWALL_IPS_MAP, key, f"goto {firewall_chain}", comment)
        if no_external is not None:
            element(NO_ENDPOINT_SERVICES_MAP, key, no_external, comment)
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
        affinity_sets=MappingProxyType(affinity_sets) if affinity_sets else NO_SETS,
        elements=tuple(elements),
        lanes=tuple(lanes),
        hairpin=hairpin,
        cluster_ip=cluster_ip,
    )


def service_order(key: ServicePortKey) -> tuple[str, str, str, str]:
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


def _kept_slots(keep: NftRuleset | None) -> Slots:
    if keep is None or keep.allocator is None:
        return Slots(SlotAllocator())
    lanes = [lane for svc in keep.services.values() for lane in svc.lanes]
    blocks = {lane.chain: lane.block for lane in lanes}
    return Slots(keep.allocator, MappingProxyType(blocks), lanes)


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
    ctx, service_cidrs = build_context(state.node, family, endpoint_counters)
    builds = {TABLE: _Build(ctx, service_cidrs, TABLE, keep)}
    all_endpoints = state.endpoints
    svc_map = state.services
    node = state.node
    # Sorted by plain string tuples: far cheaper than the dataclass ordering at 10 000 services.
    keys = sorted((k for k in svc_map if k[1] is family), key=service_order)
    for key in keys:
        svc, eps = svc_map[key], all_endpoints.get(key, ())
        r = categorize(svc, eps, node)
        table = home(r, svc.affinity_timeout > 0)
        build = builds.get(table)
        if build is None:
            build = builds[table] = _Build(ctx, service_cidrs, table, keep.off if keep is not None else None)
        rules = render_service(ctx, svc, eps, build.slots, r)
        if table != TABLE:
            builds[TABLE].add(key, stub_rules(rules.hairpin, rules.cluster_ip))
            rules = dataclasses.replace(rules, hairpin=(), cluster_ip="")
        build.add(key, rules)
    off = builds.get(OFF_TABLE)
    main = builds[TABLE].finish(family, node.drop_invalid, endpoint_counters)
    if off is None:
        return main
    return dataclasses.replace(main, off=off.finish(family, node.drop_invalid, endpoint_counters))


def stub_rules(hairpin: tuple[str, ...], cluster_ip: str) -> ServiceRules:
    """What nfproxy's table holds of a port that lives in the off table: its endpoints in the
    `hairpin` set and its cluster IP in `cluster-ips`, no chain, no other element; the off
    table's port holds neither. nfproxy's postrouting marks hairpin traffic whichever table
    DNATed it, and its cluster-ips-check runs first (it would drop what must be rejected: a
    port of the off table's cluster IPs that nobody serves). So a move between the tables
    touches neither set."""
    return ServiceRules(MappingProxyType({}), NO_SETS, (), hairpin=hairpin, cluster_ip=cluster_ip)


def empty_off(state: ClusterState, family: IPFamily, endpoint_counters: bool = True) -> NftRuleset:
    """The off table's static frame, without ports: where a partial sync starts the table."""
    ctx, service_cidrs = build_context(state.node, family, endpoint_counters)
    return _Build(ctx, service_cidrs, OFF_TABLE, None).finish(family, state.node.drop_invalid, endpoint_counters)



"""Which endpoints serve which traffic: the one decision both backends share.

kube-proxy's CategorizeEndpoints, plus the routing facts every backend derives from it (which
chain internal and external traffic reach, and the verdict when there is nothing to reach). Both
renderers read a `Routing`; neither re-decides eligibility, so they cannot drift apart.
"""

from __future__ import annotations

import enum
import ipaddress
import math
from dataclasses import dataclass

from nfproxy.core.model import (
    NODEPORT_ALL,
    NODEPORT_LOCALHOST,
    NODEPORT_PRIMARY,
    Endpoint,
    IPFamily,
    LocalMode,
    NodeConfig,
    ServicePort,
)


class NoEndpoints(enum.Enum):
    """What happens to traffic that has no endpoint to go to."""

    REJECT = "reject"  # the service has no usable endpoint anywhere
    DROP = "drop"  # endpoints exist, but none on this node under a Local policy


class Topology(enum.Enum):
    NONE = ""
    PREFER_SAME_ZONE = "PreferSameZone"
    PREFER_SAME_NODE = "PreferSameNode"


@dataclass(frozen=True, slots=True)
class Routing:
    service: ServicePort
    # Endpoints of the Cluster-policy chain; empty when no traffic class uses it.
    cluster: tuple[Endpoint, ...]
    # Endpoints of the Local-policy chain; empty when no traffic class uses it.
    local: tuple[Endpoint, ...]
    # Every endpoint some chain can reach: each gets an endpoint chain. Sorted by address.
    reachable: tuple[Endpoint, ...]
    # Any endpoint anywhere is ready, or serving and terminating.
    has_endpoints: bool
    topology: Topology

    @property
    def internal_endpoints(self) -> tuple[Endpoint, ...]:
        return self.local if self.service.internal_policy_local else self.cluster

    @property
    def external_endpoints(self) -> tuple[Endpoint, ...]:
        return self.local if self.service.external_policy_local else self.cluster

    @property
    def internal_no_endpoints(self) -> NoEndpoints | None:
        """Verdict for cluster-IP traffic when it cannot be load-balanced, else None."""
        if not self.has_endpoints:
            return NoEndpoints.REJECT
        if not self.internal_endpoints:
            return NoEndpoints.DROP
        return None

    @property
    def external_no_endpoints(self) -> NoEndpoints | None:
        """Verdict for external traffic (node port, LB, external IP) that is not short-circuited."""
        if not self.has_endpoints:
            return NoEndpoints.REJECT
        if not self.external_endpoints:
            return NoEndpoints.DROP
        return None

    @property
    def uses_external_chain(self) -> bool:
        """The EXT chain exists even without external endpoints, for the short-circuit rules."""
        return self.has_endpoints and self.service.externally_accessible

    @property
    def uses_firewall(self) -> bool:
        """Source ranges enforced while there are endpoints: kube-proxy's iptables mode
        (usesFWChain); with none, every source gets the same REJECT there."""
        return self.has_endpoints and self.fenced

    @property
    def fenced(self) -> bool:
        """LB IPs with source ranges: kube-proxy's nftables mode writes their firewall whether
        or not there are endpoints, so a source outside the ranges is dropped before the
        no-endpoint REJECT (docs/semantics.md, "Documented differences")."""
        return bool(self.service.load_balancer_ips and self.service.load_balancer_source_ranges)


def _topology_mode(endpoints: tuple[Endpoint, ...], node: NodeConfig) -> Topology:
    """Hints are used only when every ready endpoint has them and one matches this node."""
    all_node_hints = all_zone_hints = True
    node_match = zone_match = False
    for ep in endpoints:
        if not ep.ready:
            continue
        if not ep.node_hints:
            all_node_hints = False
        elif node.name in ep.node_hints:
            node_match = True
        if not ep.zone_hints:
            all_zone_hints = False
        elif node.zone in ep.zone_hints:
            zone_match = True
    if all_node_hints and node_match:
        return Topology.PREFER_SAME_NODE
    if all_zone_hints and zone_match:
        return Topology.PREFER_SAME_ZONE
    return Topology.NONE


def _available(ep: Endpoint, mode: Topology, node: NodeConfig) -> bool:
    if mode is Topology.NONE:
        return True
    if mode is Topology.PREFER_SAME_NODE:
        return node.name in ep.node_hints
    return node.zone in ep.zone_hints


def categorize(svc: ServicePort, endpoints: tuple[Endpoint, ...], node: NodeConfig) -> Routing:
    """Split a service port's endpoints by traffic policy, topology and termination state.

    `endpoints` must be sorted by address; every tuple returned keeps that order. A drained
    endpoint (weight 0) takes no new connection: it is left out as if it no longer served, and
    conntrack keeps its established ones (docs/weights.md).
    """
    if any(not e.weight for e in endpoints):
        endpoints = tuple(e for e in endpoints if e.weight)
    cluster: tuple[Endpoint, ...] = ()
    local: tuple[Endpoint, ...] = ()
    has_endpoints = False
    mode = Topology.NONE

    def is_local(ep: Endpoint) -> bool:
        return bool(node.name) and ep.node_name == node.name

    if svc.uses_cluster_endpoints:
        mode = _topology_mode(endpoints, node)
        if mode is Topology.NONE:
            # All ready (the common case): the model's own tuple, which a render keeps.
            cluster = endpoints if all(e.ready for e in endpoints) else tuple(e for e in endpoints if e.ready)
        else:
            cluster = tuple(e for e in endpoints if e.ready and _available(e, mode, node))
        if not cluster:
            # No ready endpoint anywhere (topology would have been dropped otherwise):
            # fall back to endpoints that still serve while terminating.
            cluster = tuple(
                e
                for e in endpoints
                if e.serving and e.terminating and _available(e, mode, node)
            )
        has_endpoints = bool(cluster)

    if not svc.uses_local_endpoints:
        return Routing(svc, cluster, (), cluster, has_endpoints, mode)

    local_ready = False
    local_terminating = False
    for ep in endpoints:
        if ep.ready:
            has_endpoints = True
            local_ready = local_ready or is_local(ep)
        elif ep.serving and ep.terminating:
            has_endpoints = True
            local_terminating = local_terminating or is_local(ep)
    if local_ready:
        local = tuple(e for e in endpoints if is_local(e) and e.ready)
    elif local_terminating:
        local = tuple(e for e in endpoints if is_local(e) and e.serving and e.terminating)

    if not svc.uses_cluster_endpoints:
        return Routing(svc, (), local, local, has_endpoints, mode)

    members = set(cluster) | set(local)
    reachable = tuple(e for e in endpoints if e in members)
    return Routing(svc, cluster, local, reachable, has_endpoints, mode)


# --------------------------------------------------------------------------------------------
# Weights: how both backends split new connections among a chain's endpoints (docs/weights.md).


def weighted(endpoints: tuple[Endpoint, ...]) -> bool:
    """Whether the split is not the uniform one: equal weights render exactly as no weights,
    byte for byte."""
    if not endpoints:
        return False
    first = endpoints[0].weight
    for e in endpoints:
        if e.weight != first:
            return True
    return False


def cascade_order(weights: list[int]) -> list[int]:
    """The order of iptables' statistic cascade, as indices into `weights` (the endpoints in
    address order): heaviest first, ties in address order.

    Every rule's 31-bit threshold is off by up to 2.8e-10; an endpoint's error sums the errors
    of the rules before it, each scaled by the share it passes on. Heaviest first bounds that
    sum by three rules' worth (< 1e-9) for any weights; address order lets 63 light rules in
    front of a heavy endpoint add up to 1.8e-9. Equal weights keep kube-proxy's address order.
    """
    return sorted(range(len(weights)), key=weights.__getitem__, reverse=True)  # stable


def cascade_probabilities(weights: list[int]) -> list[tuple[int, int]]:
    """Rule i of the cascade (weights in `cascade_order`) fires with w_i / (w_i + ... +
    w_{n-1}) of what reaches it, so endpoint i gets w_i / sum(w): (numerator, denominator) per
    rule but the last, which takes the rest unconditionally."""
    rest = sum(weights)
    out: list[tuple[int, int]] = []
    for w in weights[:-1]:
        out.append((w, rest))
        rest -= w
    return out


def slot_counts(endpoints: tuple[Endpoint, ...]) -> tuple[int, ...]:
    """nft numgen slots per endpoint: weights divided by their gcd, so `numgen random mod
    sum(slots)` gives endpoint i exactly w_i / sum(w) (one slot each when unweighted)."""
    if not weighted(endpoints):
        return (1,) * len(endpoints)
    g = math.gcd(*(e.weight for e in endpoints))
    return tuple(e.weight // g for e in endpoints)


# --------------------------------------------------------------------------------------------
# Node-wide decisions both backends spell: made here once, so the two cannot drift apart.


class PodMatchKind(enum.Enum):
    CIDR = "cidr"  # source address in the CIDR
    INTERFACE = "interface"  # arrived on this interface (a bridge)
    INTERFACE_PREFIX = "interface-prefix"  # arrived on an interface whose name starts so


@dataclass(frozen=True, slots=True)
class PodMatch:
    """What "this packet comes from a pod" means: kube-proxy's LocalTrafficDetector.

    It decides both the masquerading of cluster-IP traffic (from outside: masquerade) and the
    eTP=Local short-circuit (pod traffic to an external address goes to the cluster chain).
    """

    kind: PodMatchKind
    value: str


def pod_match(node: NodeConfig, family: IPFamily) -> PodMatch | None:
    """The local-traffic detector of one family, or None when none can be built.

    As kube-proxy: ClusterCIDR and NodeCIDR take the *first* CIDR of the family (kube-proxy
    accepts one per family; one CIDR is also all a single iptables rule can negate), the
    interface modes hold for both families. Under NodeCIDR the sources put the Node object's
    spec.podCIDRs into `cluster_cidrs` (sources.manifests.merge_node).
    """
    mode = node.detect_local_mode
    if mode is LocalMode.BRIDGE_INTERFACE:
        return PodMatch(PodMatchKind.INTERFACE, node.pod_bridge_interface) if node.pod_bridge_interface else None
    if mode is LocalMode.INTERFACE_NAME_PREFIX:
        prefix = node.pod_interface_name_prefix
        return PodMatch(PodMatchKind.INTERFACE_PREFIX, prefix) if prefix else None
    cidrs = node.cluster_cidrs_of(family)
    return PodMatch(PodMatchKind.CIDR, cidrs[0]) if cidrs else None


def nodeport_cidrs(node: NodeConfig, family: IPFamily, *, primary_by_default: bool) -> tuple[str, ...]:
    """CIDRs of the local addresses that accept node ports; () means every local address.

    kube-proxy 1.37's meaning (expandNodePortAddressKeywords, then NewNodePortAddresses):
    `primary` stands for the node's own IPs (host routes; a loopback node IP is skipped),
    `localhost` for 127.0.0.0/8 or ::1/128, `all` for the family's zero CIDR. Left unset,
    kube-proxy's nftables mode defaults to `primary` and its iptables mode to every address:
    `primary_by_default` says which backend asks. Nothing of the family, or a zero CIDR among
    them, is every local address (upstream's MatchAll).
    """
    cidrs = _nodeport_expanded(node, family, primary_by_default)
    if any(ipaddress.ip_network(c, strict=False).prefixlen == 0 for c in cidrs):
        return ()
    return cidrs


def nodeport_loopback(node: NodeConfig, family: IPFamily, *, primary_by_default: bool) -> bool:
    """Whether the node-port addresses name loopback itself (`localhost`, 127.0.0.0/8, ::1/128),
    not merely contain it (`all`): kube-proxy's ContainsExplicitLoopback, which turns on its
    nftables mode's localhost node-port proxy (with KubeProxyNFTablesLocalhostNodePorts)."""
    return any(
        ipaddress.ip_network(c, strict=False).network_address.is_loopback
        for c in _nodeport_expanded(node, family, primary_by_default)
    )


def localhost_rejects(node: NodeConfig, family: IPFamily) -> frozenset[str]:
    """Protocols (lower case) whose node ports the nft backend rejects and counts on loopback.

    kube-proxy 1.37's nftables mode, behind KubeProxyNFTablesLocalhostNodePorts: nothing with
    the gate off; UDP and SCTP when its userspace proxy serves TCP on loopback (the addresses
    name loopback); all three otherwise, so that a localhost node port never silently reaches
    whatever else listens there.
    """
    if not node.nft_localhost_nodeports:
        return frozenset()
    if nodeport_loopback(node, family, primary_by_default=True):
        return frozenset(("udp", "sctp"))
    return frozenset(("tcp", "udp", "sctp"))


def _nodeport_expanded(node: NodeConfig, family: IPFamily, primary_by_default: bool) -> tuple[str, ...]:
    v6 = family is IPFamily.V6
    given = node.nodeport_addresses or ((NODEPORT_PRIMARY,) if primary_by_default else ())
    cidrs: list[str] = []
    for item in given:
        if item == NODEPORT_PRIMARY:
            host = "/128" if v6 else "/32"
            cidrs.extend(ip + host for ip in node.ips_of(family) if not ipaddress.ip_address(ip).is_loopback)
        elif item == NODEPORT_LOCALHOST:
            cidrs.append("::1/128" if v6 else "127.0.0.0/8")
        elif item == NODEPORT_ALL:
            cidrs.append("::/0" if v6 else "0.0.0.0/0")
        elif (":" in item) == v6:
            cidrs.append(item)
    return tuple(dict.fromkeys(cidrs))


def firewall_sources(svc: ServicePort, node: NodeConfig) -> tuple[str, ...]:
    """Sources a LoadBalancer with source ranges accepts: its ranges (of its family), plus its
    own VIPs when a range covers a node IP. A VIP bound locally makes the node's request to it
    arrive with the VIP as source, which must stay allowed when the node itself is."""
    v6 = svc.family is IPFamily.V6
    ranges = tuple(c for c in svc.load_balancer_source_ranges if (":" in c) == v6)
    nets = [ipaddress.ip_network(c, strict=False) for c in ranges]
    node_ips = [ipaddress.ip_address(ip) for ip in node.ips_of(svc.family)]
    if any(ip in net for net in nets for ip in node_ips):
        return ranges + tuple(ip for ip in svc.load_balancer_ips if (":" in ip) == v6)
    return ranges

"""The one service model every backend compiles from.

Values are immutable so a ClusterState can be shared between the sync loop, the renderers and the
analysis without copies, and so two states can be compared to find what changed. Addresses are
kept as validated, canonical strings (what the renderers print), not ipaddress objects: the
sources validate once, the renderers then format 100 000 endpoints without converting back.
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field


class Protocol(str, enum.Enum):
    TCP = "TCP"
    UDP = "UDP"
    SCTP = "SCTP"

    @property
    def lower(self) -> str:
        # str.lower on the member itself: Enum's `.value` descriptor is slow on a hot path.
        return str.lower(self)


class IPFamily(enum.IntEnum):
    V4 = 4
    V6 = 6


class ServiceType(enum.Enum):
    CLUSTER_IP = "ClusterIP"
    NODE_PORT = "NodePort"
    LOAD_BALANCER = "LoadBalancer"


DEFAULT_AFFINITY_TIMEOUT = 10800
MASQUERADE_BIT = 14
MASQUERADE_MARK = 1 << MASQUERADE_BIT
# `--nodeport-addresses primary`: the node's own IPs (kube-proxy's nftables-mode default).
NODEPORT_PRIMARY = "primary"
# KEP-6032 (kube-proxy 1.37): `localhost` is 127.0.0.0/8 and ::1/128, `all` is 0.0.0.0/0 and ::/0.
NODEPORT_LOCALHOST = "localhost"
NODEPORT_ALL = "all"
NODEPORT_KEYWORDS = (NODEPORT_PRIMARY, NODEPORT_LOCALHOST, NODEPORT_ALL)


class LocalMode(str, enum.Enum):
    """How traffic from local pods is recognised (kube-proxy's --detect-local-mode)."""

    CLUSTER_CIDR = "ClusterCIDR"
    NODE_CIDR = "NodeCIDR"
    BRIDGE_INTERFACE = "BridgeInterface"
    INTERFACE_NAME_PREFIX = "InterfaceNamePrefix"


@dataclass(frozen=True, slots=True, order=True)
class ServicePortName:
    """Identity of one port of one service, as kube-proxy names it (protocol kept beside it)."""

    namespace: str
    name: str
    port: str
    protocol: Protocol = field(compare=True)

    def __str__(self) -> str:
        base = f"{self.namespace}/{self.name}"
        return f"{base}:{self.port}" if self.port else base


ServicePortKey = tuple[ServicePortName, IPFamily]


@dataclass(frozen=True, slots=True)
class ServicePort:
    """One port of one service in one IP family: the unit every backend renders."""

    name: ServicePortName
    family: IPFamily
    type: ServiceType
    cluster_ip: str
    port: int
    node_port: int = 0
    external_ips: tuple[str, ...] = ()
    load_balancer_ips: tuple[str, ...] = ()
    load_balancer_source_ranges: tuple[str, ...] = ()
    # ClientIP affinity timeout in seconds; 0 means no session affinity.
    affinity_timeout: int = 0
    external_policy_local: bool = False
    internal_policy_local: bool = False
    health_check_node_port: int = 0

    @property
    def key(self) -> ServicePortKey:
        return (self.name, self.family)

    @property
    def protocol(self) -> Protocol:
        return self.name.protocol

    @property
    def externally_accessible(self) -> bool:
        return bool(self.node_port or self.load_balancer_ips or self.external_ips)

    @property
    def uses_cluster_endpoints(self) -> bool:
        """Whether Cluster-policy endpoints are needed (kube-proxy's UsesClusterEndpoints).

        Any externally accessible port needs them, even under eTP=Local: traffic from pods
        and from the node itself short-circuits to the Cluster chain.
        """
        return not self.internal_policy_local or self.externally_accessible

    @property
    def uses_local_endpoints(self) -> bool:
        return self.internal_policy_local or (
            self.externally_accessible and self.external_policy_local
        )


# Topology hints come in few distinct sets (a zone or two, a node): every endpoint that has the
# same hints shares one frozenset, and every endpoint without hints the empty one. A model read
# from 100 000 slice endpoints otherwise holds 200 000 frozensets (216 bytes each).
NO_HINTS: frozenset[str] = frozenset()
_HINT_SETS: dict[frozenset[str], frozenset[str]] = {}
# Bounded so that hostile hint names cannot grow the table without end; past it sets are not shared.
_MAX_HINT_SETS = 4096


def shared(text: str) -> str:
    """`text` as the one string object equal to it that the model shares.

    Loaders build names, zones and namespaces from decoded JSON or YAML, which makes a new string
    for every occurrence: 100 000 endpoints on one node each carry their own copy of its name.
    Interned, they share one (sys.intern: interned strings are freed with their last user)."""
    return sys.intern(text)


def hint_set(names: Iterable[str]) -> frozenset[str]:
    """The shared frozenset of the non-empty `names` (NO_HINTS when there is none)."""
    found = frozenset(sys.intern(n) for n in names if n)
    if not found:
        return NO_HINTS
    known = _HINT_SETS.get(found)
    if known is not None:
        return known
    if len(_HINT_SETS) < _MAX_HINT_SETS:
        _HINT_SETS[found] = found
    return found


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One backend address of a service port, with the conditions categorisation needs."""

    ip: str
    port: int
    ready: bool = True
    serving: bool = True
    terminating: bool = False
    node_name: str = ""
    zone: str = ""
    zone_hints: frozenset[str] = NO_HINTS
    node_hints: frozenset[str] = NO_HINTS
    # Share of new connections relative to the other endpoints (0-1000; 0 = drained, no new
    # connections): docs/weights.md. Equal weights are the plain uniform choice.
    weight: int = 1

    @property
    def address(self) -> str:
        """`ip:port`, IPv6 bracketed: the string kube-proxy sorts by and hashes."""
        if ":" in self.ip:
            return f"[{self.ip}]:{self.port}"
        return f"{self.ip}:{self.port}"

    @property
    def family(self) -> IPFamily:
        return IPFamily.V6 if ":" in self.ip else IPFamily.V4


@dataclass(frozen=True, slots=True)
class NodeConfig:
    """What the proxy knows about the node it programs."""

    name: str = ""
    ips: tuple[str, ...] = ()
    # Pod CIDRs: traffic to a cluster IP from outside them is masqueraded.
    cluster_cidrs: tuple[str, ...] = ()
    masquerade_all: bool = False
    zone: str = ""
    # CIDRs whose local addresses accept NodePort traffic, and/or "primary" (the node IPs);
    # empty means the backend's default (core.categorize.nodeport_cidrs).
    nodeport_addresses: tuple[str, ...] = ()
    # Node ports are also accepted on 127.0.0.1 (iptables backend only, as kube-proxy).
    localhost_nodeports: bool = True
    # The KubeProxyNFTablesLocalhostNodePorts gate (alpha, off): the nft backend rejects and
    # counts localhost node-port traffic it does not proxy (core.categorize.localhost_rejects).
    nft_localhost_nodeports: bool = False
    # Bit of the packet mark that asks for masquerading (kube-proxy's --iptables-masquerade-bit).
    masquerade_bit: int = MASQUERADE_BIT
    detect_local_mode: LocalMode = LocalMode.CLUSTER_CIDR
    pod_bridge_interface: str = ""
    pod_interface_name_prefix: str = ""
    # False when nf_conntrack_tcp_be_liberal is set: no conntrack-INVALID drop is written.
    drop_invalid: bool = True
    # Service CIDRs (ServiceCIDR objects or --service-cluster-ip-range): the nft backend drops
    # traffic to unallocated addresses in them.
    service_cidrs: tuple[str, ...] = ()

    @property
    def masquerade_mark(self) -> int:
        return 1 << self.masquerade_bit

    def ips_of(self, family: IPFamily) -> tuple[str, ...]:
        return tuple(ip for ip in self.ips if (":" in ip) == (family is IPFamily.V6))

    def cluster_cidrs_of(self, family: IPFamily) -> tuple[str, ...]:
        return tuple(c for c in self.cluster_cidrs if (":" in c) == (family is IPFamily.V6))

    def nodeport_addresses_of(self, family: IPFamily) -> tuple[str, ...]:
        """The explicit CIDRs of one family (without the keywords)."""
        return tuple(
            c
            for c in self.nodeport_addresses
            if c not in NODEPORT_KEYWORDS and (":" in c) == (family is IPFamily.V6)
        )

    def service_cidrs_of(self, family: IPFamily) -> tuple[str, ...]:
        return tuple(c for c in self.service_cidrs if (":" in c) == (family is IPFamily.V6))


@dataclass(frozen=True, slots=True)
class ClusterState:
    """Everything a sync renders: the node, its services and their endpoints.

    `endpoints[key]` is sorted by `Endpoint.address` (string order, as kube-proxy sorts), which
    is the order of the random cascade and of the numgen slots.
    """

    node: NodeConfig = NodeConfig()
    services: Mapping[ServicePortKey, ServicePort] = field(default_factory=dict)
    endpoints: Mapping[ServicePortKey, tuple[Endpoint, ...]] = field(default_factory=dict)

    def service_ports(self, family: IPFamily) -> Iterator[tuple[ServicePort, tuple[Endpoint, ...]]]:
        """Service ports of one family in a stable order (by name), with their endpoints."""
        keys = sorted(k for k in self.services if k[1] is family)
        for key in keys:
            yield self.services[key], self.endpoints.get(key, ())



def sort_endpoints(endpoints: list[Endpoint] | tuple[Endpoint, ...]) -> tuple[Endpoint, ...]:
    return tuple(sorted(endpoints, key=lambda e: e.address))

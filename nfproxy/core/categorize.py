"""Which endpoints serve which traffic: the one decision both backends share.

kube-proxy's CategorizeEndpoints, plus the routing facts every backend derives from it (which
chain internal and external traffic reach, and the verdict when there is nothing to reach). Both
renderers read a `Routing`; neither re-decides eligibility, so they cannot drift apart.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from nfproxy.core.model import Endpoint, NodeConfig, ServicePort


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
        """Source ranges are enforced only while there are endpoints (kube-proxy's usesFWChain):
        with none, every source gets the same REJECT, from both backends alike."""
        return self.has_endpoints and bool(
            self.service.load_balancer_ips and self.service.load_balancer_source_ranges
        )


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

    `endpoints` must be sorted by address; every tuple returned keeps that order.
    """
    cluster: tuple[Endpoint, ...] = ()
    local: tuple[Endpoint, ...] = ()
    has_endpoints = False
    mode = Topology.NONE

    def is_local(ep: Endpoint) -> bool:
        return bool(node.name) and ep.node_name == node.name

    if svc.uses_cluster_endpoints:
        mode = _topology_mode(endpoints, node)
        if mode is Topology.NONE:
            cluster = tuple(e for e in endpoints if e.ready)
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

"""kube-proxy's TestCategorizeEndpoints (pkg/proxy/topology_test.go, v1.37.2), case for case.

`categorize` is nfproxy's CategorizeEndpoints; this table is upstream's, translated: each
endpoint `ip:port` with its readiness, serving, terminating, locality and zone/node hints, the
service's traffic policies, and the cluster, local and reachable endpoints expected. Go's test
endpoints leave `serving` false unless they set it, and so do these.

Left out: "PreferSameNode falls back to same-zone when feature gate disabled".
PreferSameTrafficDistribution is GA and locked on since 1.35, so nfproxy has no way to turn
it off (--feature-gates names it only to say so).

The compat corpus (compat/prefer-same-*.yaml, topology-hints-*.yaml) holds the same decisions
to the rules both backends write; `test_the_corpus_routes_by_node_hints` checks it says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from nfproxy.core.categorize import Topology, categorize
from nfproxy.core.model import (
    Endpoint,
    IPFamily,
    NodeConfig,
    Protocol,
    ServicePort,
    ServicePortName,
    ServiceType,
    sort_endpoints,
)
from tests.scenarios import load_all

NODE = "test-node"


def ep(address: str, *, ready: bool = False, serving: bool = False, terminating: bool = False,
       local: bool = False, zones: tuple[str, ...] = (), nodes: tuple[str, ...] = ()) -> Endpoint:
    ip, port = address.rsplit(":", 1)
    return Endpoint(ip, int(port), ready=ready, serving=serving, terminating=terminating,
                    node_name=NODE if local else "other-node", zone_hints=frozenset(zones),
                    node_hints=frozenset(nodes))


@dataclass(frozen=True)
class Case:
    name: str
    endpoints: tuple[Endpoint, ...]
    cluster: frozenset[str] | None  # None: the service uses no Cluster endpoints
    local: frozenset[str] | None  # None: the service uses no Local endpoints
    reachable: frozenset[str] | None = None  # when both are used (else the one that is)
    only_remote: bool = False  # hasAnyEndpoints although nothing is reachable here
    zone: str | None = None
    node: str = NODE
    internal_local: bool = False
    external_local: bool = False
    node_port: int = 0
    topology: Topology = Topology.NONE
    extra: dict[str, object] = field(default_factory=dict)


def s(*addresses: str) -> frozenset[str]:
    return frozenset(addresses)


A, B, C, D = "10.1.2.3:80", "10.1.2.4:80", "10.1.2.5:80", "10.1.2.6:80"
E0, E1, E2, E3 = "10.0.0.0:80", "10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80"

CASES = [
    Case("should use topology since all endpoints have hints, node has a zone label and there are "
         "endpoints for the node's zone",
         (ep(A, ready=True, zones=("zone-a",)), ep(B, ready=True, zones=("zone-b",)),
          ep(C, ready=True, zones=("zone-c",)), ep(D, ready=True, zones=("zone-a",))),
         cluster=s(A, D), local=None, zone="zone-a", topology=Topology.PREFER_SAME_ZONE),
    Case("externalTrafficPolicy: Local, topology ignored for Local endpoints",
         (ep(A, ready=True, zones=("zone-a",), local=True), ep(B, ready=True, zones=("zone-b",), local=True),
          ep(C, ready=True, zones=("zone-c",)), ep(D, ready=True, zones=("zone-a",))),
         cluster=s(A, D), local=s(A, B), reachable=s(A, B, D), zone="zone-a", external_local=True,
         node_port=8080, topology=Topology.PREFER_SAME_ZONE),
    Case("internalTrafficPolicy: Local, topology ignored for Local endpoints",
         (ep(A, ready=True, zones=("zone-a",), local=True), ep(B, ready=True, zones=("zone-b",), local=True),
          ep(C, ready=True, zones=("zone-c",)), ep(D, ready=True, zones=("zone-a",))),
         cluster=s(A, D), local=s(A, B), reachable=s(A, B, D), zone="zone-a", internal_local=True,
         node_port=8080, topology=Topology.PREFER_SAME_ZONE),
    Case("empty node labels", (ep(A, ready=True, zones=("zone-a",)),), cluster=s(A), local=None),
    Case("empty zone label", (ep(A, ready=True, zones=("zone-a",)),), cluster=s(A), local=None, zone=""),
    Case("node in different zone, no endpoint filtering", (ep(A, ready=True, zones=("zone-a",)),),
         cluster=s(A), local=None, zone="zone-b"),
    Case("unready endpoint",
         (ep(A, ready=True, zones=("zone-a",)), ep(B, ready=True, zones=("zone-b",)),
          ep(C, ready=True, zones=("zone-c",)), ep(D, zones=("zone-a",))),
         cluster=s(A), local=None, zone="zone-a", topology=Topology.PREFER_SAME_ZONE),
    Case("only unready endpoints in same zone (should not filter)",
         (ep(A, zones=("zone-a",)), ep(B, ready=True, zones=("zone-b",)),
          ep(C, ready=True, zones=("zone-c",)), ep(D, zones=("zone-a",))),
         cluster=s(B, C), local=None, zone="zone-a"),
    Case("missing hints, no filtering applied",
         (ep(A, ready=True, zones=("zone-a",)), ep(B, ready=True, zones=("zone-b",)),
          ep(C, ready=True), ep(D, ready=True, zones=("zone-a",))),
         cluster=s(A, B, C, D), local=None, zone="zone-a"),
    Case("multiple hints per endpoint, filtering includes any endpoint with zone included",
         (ep(A, ready=True, zones=("zone-a", "zone-b", "zone-c")), ep(B, ready=True, zones=("zone-b", "zone-c")),
          ep(C, ready=True, zones=("zone-b", "zone-d")), ep(D, ready=True, zones=("zone-c",))),
         cluster=s(A, B, D), local=None, zone="zone-c", topology=Topology.PREFER_SAME_ZONE),
    Case("PreferSameNode available",
         (ep(A, ready=True, zones=("zone-a",), nodes=("node-1",)), ep(B, ready=True, zones=("zone-b",), nodes=("node-2",)),
          ep(C, ready=True, zones=("zone-c",), nodes=("node-3",)), ep(D, ready=True, zones=("zone-a",), nodes=("node-4",))),
         cluster=s(A), local=None, zone="zone-a", node="node-1", topology=Topology.PREFER_SAME_NODE),
    Case("PreferSameNode ignored if some endpoints unhinted",
         (ep(A, ready=True, zones=("zone-a",), nodes=("node-1",)), ep(B, ready=True),
          ep(C, ready=True, zones=("zone-c",), nodes=("node-3",)), ep(D, ready=True, zones=("zone-a",), nodes=("node-4",))),
         cluster=s(A, B, C, D), local=None, zone="zone-a", node="node-1"),
    Case("PreferSameNode falls back to PreferSameZone if no endpoint for node",
         (ep(A, ready=True, zones=("zone-a",), nodes=("node-1",)), ep(B, ready=True, zones=("zone-b",), nodes=("node-2",)),
          ep(C, ready=True, zones=("zone-c",), nodes=("node-3",)), ep(D, ready=True, zones=("zone-a",), nodes=("node-4",))),
         cluster=s(A, D), local=None, zone="zone-a", node="node-0", topology=Topology.PREFER_SAME_ZONE),
    Case("conflicting topology and localness require merging allEndpoints",
         (ep(E0, ready=True, zones=("zone-a",), local=True), ep(E1, ready=True, zones=("zone-b",), local=True),
          ep(E2, ready=True, zones=("zone-a",)), ep(E3, ready=True, zones=("zone-b",))),
         cluster=s(E0, E2), local=s(E0, E1), reachable=s(E0, E1, E2), zone="zone-a",
         external_local=True, node_port=8080, topology=Topology.PREFER_SAME_ZONE),
    Case("internalTrafficPolicy: Local, with empty endpoints", (), cluster=None, local=s(),
         internal_local=True),
    Case("internalTrafficPolicy: Local, but all endpoints are remote",
         (ep(E0, ready=True), ep(E1, ready=True)), cluster=None, local=s(), only_remote=True,
         internal_local=True),
    Case("internalTrafficPolicy: Local, all endpoints are local",
         (ep(E0, ready=True, local=True), ep(E1, ready=True, local=True)), cluster=None,
         local=s(E0, E1), internal_local=True),
    Case("internalTrafficPolicy: Local, some endpoints are local",
         (ep(E0, ready=True, local=True), ep(E1, ready=True)), cluster=None, local=s(E0),
         internal_local=True),
    Case("Cluster traffic policy, endpoints not Ready", (ep(E0), ep(E1)), cluster=s(), local=None),
    Case("Cluster traffic policy, some endpoints are Ready", (ep(E0), ep(E1, ready=True)),
         cluster=s(E1), local=None),
    Case("Cluster traffic policy, all endpoints are terminating",
         (ep(E0, serving=True, terminating=True, local=True), ep(E1, serving=True, terminating=True)),
         cluster=s(E0, E1), local=None),
    Case("iTP: Local, eTP: Cluster, some endpoints local",
         (ep(E0, ready=True, local=True), ep(E1, ready=True)), cluster=s(E0, E1), local=s(E0),
         reachable=s(E0, E1), internal_local=True, node_port=8080),
    Case("iTP: Cluster, eTP: Local, some endpoints local",
         (ep(E0, ready=True, local=True), ep(E1, ready=True)), cluster=s(E0, E1), local=s(E0),
         reachable=s(E0, E1), external_local=True, node_port=8080),
    Case("iTP: Local, eTP: Local, some endpoints local",
         (ep(E0, ready=True, local=True), ep(E1, ready=True)), cluster=s(E0, E1), local=s(E0),
         reachable=s(E0, E1), internal_local=True, external_local=True, node_port=8080),
    Case("iTP: Local, eTP: Local, all endpoints remote",
         (ep(E0, ready=True), ep(E1, ready=True)), cluster=s(E0, E1), local=s(),
         reachable=s(E0, E1), internal_local=True, external_local=True, node_port=8080),
    Case("iTP: Local, eTP: Local, all endpoints remote and terminating",
         (ep(E0, serving=True, terminating=True), ep(E1, serving=True, terminating=True)),
         cluster=s(E0, E1), local=s(), reachable=s(E0, E1), only_remote=True,
         internal_local=True, external_local=True, node_port=8080),
    Case("iTP: Cluster, eTP: Local, with terminating endpoints",
         (ep(E0, ready=True), ep(E1, local=True), ep(E2, serving=True, terminating=True, local=True),
          ep(E3, serving=True, terminating=True)),
         cluster=s(E0), local=s(E2), reachable=s(E0, E2), external_local=True, node_port=8080),
    Case("externalTrafficPolicy ignored if not externally accessible",
         (ep(E0, ready=True), ep(E1, ready=True, local=True)), cluster=s(E0, E1), local=None,
         reachable=s(E0, E1), external_local=True),
    Case("no cluster endpoints for iTP:Local internal-only service",
         (ep(E0, ready=True), ep(E1, ready=True, local=True)), cluster=None, local=s(E1),
         reachable=s(E1), internal_local=True),
    Case("empty endpoints when no service endpoints exist", (), cluster=None, local=None),
    Case("single endpoint not ready, not serving, not terminating", (ep(E0),), cluster=s(),
         local=None, zone="zone-a"),
]


def service(case: Case) -> ServicePort:
    return ServicePort(
        ServicePortName("ns", "svc", "p80", Protocol.TCP), IPFamily.V4,
        ServiceType.NODE_PORT if case.node_port else ServiceType.CLUSTER_IP, "172.30.0.1", 80,
        node_port=case.node_port, internal_policy_local=case.internal_local,
        external_policy_local=case.external_local,
    )


def addresses(endpoints: tuple[Endpoint, ...]) -> frozenset[str]:
    return frozenset(e.address for e in endpoints)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_categorize_endpoints(case: Case) -> None:
    node = NodeConfig(name=case.node, zone=case.zone or "")
    routing = categorize(service(case), sort_endpoints(case.endpoints), node)
    # Go's test reads nil and empty alike for what the service does not use.
    assert addresses(routing.cluster) == (case.cluster or frozenset())
    assert addresses(routing.local) == (case.local or frozenset())
    if case.cluster and not case.local:
        expected_reachable = case.cluster
    elif case.local and not case.cluster:
        expected_reachable = case.local
    else:
        expected_reachable = case.reachable or frozenset()
    assert addresses(routing.reachable) == expected_reachable
    assert routing.has_endpoints == (bool(expected_reachable) or case.only_remote)
    assert routing.topology is case.topology


def test_the_corpus_routes_by_node_hints() -> None:
    """The compat corpus has a port routed by node hints, and ports whose node hints are
    ignored (none for this node; one endpoint without), so both backends' rules are held to
    PreferSameNode's decisions on real packets."""
    modes: dict[str, set[Topology]] = {}
    for scenario in load_all():
        state = scenario.state
        for key, port in state.services.items():
            endpoints = state.endpoints.get(key, ())
            if any(e.node_hints for e in endpoints):
                routing = categorize(port, endpoints, state.node)
                modes.setdefault(scenario.name, set()).add(routing.topology)
    assert Topology.PREFER_SAME_NODE in modes.get("prefer-same-node", set())
    assert modes.get("prefer-same-node-fallback") == {Topology.PREFER_SAME_ZONE, Topology.NONE}
    assert modes.get("prefer-same-node-incomplete") == {Topology.NONE}

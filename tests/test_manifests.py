"""The manifest source: Kubernetes objects in, ClusterState and per-field errors out.

Objects are built as plain dicts (what both YAML and the API source produce) from small valid
templates, then broken one field at a time: the field path used to break an object is the path
the error must name.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from nfproxy.core.model import (
    ClusterState,
    Endpoint,
    IPFamily,
    NodeConfig,
    Protocol,
    ServicePortName,
    ServiceType,
)
from nfproxy.sources.manifests import (
    LoadResult,
    ManifestError,
    NodeInfo,
    ObjectError,
    load,
    load_objects,
    merge_node,
)

HERE = Path(__file__).parent
FIXTURES = HERE / "manifests"
EXAMPLES = HERE.parent / "examples"
NODE_A = NodeConfig(name="node-a")

V4, V6 = IPFamily.V4, IPFamily.V6
TCP, UDP = Protocol.TCP, Protocol.UDP


# ---------------------------------------------------------------------------------------------
# Builders


def service(name: str = "web", namespace: str = "default", **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "clusterIP": "10.96.0.10",
        "ports": [{"name": "http", "port": 80, "protocol": "TCP"}],
    }
    status = spec.pop("status", None)
    body.update(spec)
    obj = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": namespace},
        "spec": body,
    }
    if status is not None:
        obj["status"] = status
    return obj


def endpoint(ip: str, node: str | None = None, **fields: Any) -> dict[str, Any]:
    ep: dict[str, Any] = {"addresses": [ip]}
    if node is not None:
        ep["nodeName"] = node
    ep.update(fields)
    return ep


def endpoint_slice(
    name: str = "web-abc",
    service_name: str = "web",
    endpoints: list[dict[str, Any]] | None = None,
    ports: list[dict[str, Any]] | None = None,
    address_type: str = "IPv4",
    namespace: str = "default",
) -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {"kubernetes.io/service-name": service_name},
        },
        "addressType": address_type,
        "ports": ports
        if ports is not None
        else [{"name": "http", "port": 8080, "protocol": "TCP"}],
        "endpoints": endpoints if endpoints is not None else [endpoint("10.244.0.5", "node-a")],
    }


def node(name: str = "node-a", **extra: Any) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"topology.kubernetes.io/zone": "zone-a"}},
        "spec": {"podCIDR": "10.244.0.0/24", "podCIDRs": ["10.244.0.0/24"]},
        "status": {"addresses": [{"type": "InternalIP", "address": "192.168.0.2"}]},
    }
    obj.update(extra)
    return obj


def spn(
    name: str = "web", port: str = "http", protocol: Protocol = TCP, ns: str = "default"
) -> ServicePortName:
    return ServicePortName(ns, name, port, protocol)


_TOKEN = re.compile(r"([^.\[\]]+)|\[([^\]]+)\]")


def set_path(obj: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """A deep copy of `obj` with `path` (an error field path) set, creating mappings on the way."""
    obj = copy.deepcopy(obj)
    keys: list[str | int] = []
    for name, bracket in _TOKEN.findall(path):
        key = name or bracket
        keys.append(int(key) if key.isdigit() else key)
    target: Any = obj
    for key, following in itertools.pairwise(keys):
        if isinstance(key, str) and key not in target:
            target[key] = [{}] if isinstance(following, int) else {}
        target = target[key]
    target[keys[-1]] = value
    return obj


def drop_path(obj: dict[str, Any], path: str) -> dict[str, Any]:
    obj = copy.deepcopy(obj)
    *parents, last = path.split(".")
    target: Any = obj
    for key in parents:
        target = target[key]
    del target[last]
    return obj


def endpoints_of(result: LoadResult, key: tuple[ServicePortName, IPFamily]) -> list[str]:
    return [e.address for e in result.state.endpoints.get(key, ())]


def fields(result: LoadResult) -> list[str]:
    return [e.field for e in result.errors]


# ---------------------------------------------------------------------------------------------
# The basic translation


def test_cluster_ip_service_with_endpoints():
    result = load_objects([service(), endpoint_slice()], NODE_A)
    assert result.errors == ()
    key = (spn(), V4)
    sp = result.state.services[key]
    assert (sp.type, sp.cluster_ip, sp.port, sp.node_port) == (
        ServiceType.CLUSTER_IP,
        "10.96.0.10",
        80,
        0,
    )
    assert result.state.endpoints[key] == (Endpoint("10.244.0.5", 8080, node_name="node-a"),)


def test_defaults_protocol_tcp_and_namespace_default():
    svc = service(ports=[{"port": 80}])
    del svc["metadata"]["namespace"]
    result = load_objects([svc])
    assert result.errors == ()
    assert list(result.state.services) == [(ServicePortName("default", "web", "", TCP), V4)]


def test_node_port_and_load_balancer_fields():
    svc = service(
        type="LoadBalancer",
        externalTrafficPolicy="Local",
        healthCheckNodePort=32000,
        loadBalancerSourceRanges=[" 198.51.100.0/24 ", "10.1.2.3/8"],
        externalIPs=["203.0.113.7"],
        ports=[{"name": "http", "port": 80, "nodePort": 30080}],
        status={
            "loadBalancer": {
                "ingress": [
                    {"ip": "203.0.113.10"},
                    {"ip": "203.0.113.11", "ipMode": "Proxy"},
                    {"hostname": "lb.example.com"},
                    {"ip": "203.0.113.12", "ipMode": "VIP"},
                ]
            }
        },
    )
    result = load_objects([svc])
    assert result.errors == ()
    sp = result.state.services[(spn(), V4)]
    assert sp.type is ServiceType.LOAD_BALANCER
    assert sp.node_port == 30080
    assert sp.load_balancer_ips == ("203.0.113.10", "203.0.113.12")  # Proxy mode skipped
    assert sp.load_balancer_source_ranges == (
        "198.51.100.0/24",
        "10.0.0.0/8",
    )  # trimmed, normalised
    assert sp.external_ips == ("203.0.113.7",)
    assert sp.external_policy_local and sp.health_check_node_port == 32000


@pytest.mark.parametrize(
    ("svc_type", "external_ips", "local", "health"),
    [
        ("ClusterIP", [], False, 0),
        ("ClusterIP", ["203.0.113.7"], True, 0),  # upstream ExternallyAccessible includes this
        ("NodePort", [], True, 0),
        ("LoadBalancer", [], True, 32000),
    ],
)
def test_external_policy_local_and_health_check_port(svc_type, external_ips, local, health):
    ports = (
        [{"name": "http", "port": 80}]
        if svc_type == "ClusterIP"
        else [{"name": "http", "port": 80, "nodePort": 30080}]
    )
    svc = service(
        type=svc_type,
        externalTrafficPolicy="Local",
        healthCheckNodePort=32000,
        externalIPs=external_ips,
        ports=ports,
    )
    sp = load_objects([svc]).state.services[(spn(), V4)]
    assert (sp.external_policy_local, sp.health_check_node_port) == (local, health)


def test_internal_traffic_policy_local():
    sp = load_objects([service(internalTrafficPolicy="Local")]).state.services[(spn(), V4)]
    assert sp.internal_policy_local


def test_load_balancer_status_ignored_unless_load_balancer():
    svc = service(
        type="NodePort",
        ports=[{"name": "http", "port": 80, "nodePort": 30080}],
        status={"loadBalancer": {"ingress": [{"ip": "203.0.113.10"}]}},
    )
    assert load_objects([svc]).state.services[(spn(), V4)].load_balancer_ips == ()


@pytest.mark.parametrize(
    ("affinity", "expected"),
    [
        ({}, 0),
        ({"sessionAffinity": "None"}, 0),
        ({"sessionAffinity": "ClientIP"}, 10800),
        (
            {
                "sessionAffinity": "ClientIP",
                "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 60}},
            },
            60,
        ),
        (
            {
                "sessionAffinity": "ClientIP",
                "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 86400}},
            },
            86400,
        ),
    ],
)
def test_session_affinity(affinity, expected):
    result = load_objects([service(**affinity)])
    assert result.errors == ()
    assert result.state.services[(spn(), V4)].affinity_timeout == expected


def test_addresses_are_canonicalised():
    svc = service(
        clusterIPs=["FD00:0:0::A"],
        clusterIP="fd00::a",
        ipFamilies=["IPv6"],
        externalIPs=["2001:DB8:0::7"],
    )
    sl = endpoint_slice(address_type="IPv6", endpoints=[endpoint("FD01:0::5")])
    result = load_objects([svc, sl])
    assert result.errors == ()
    sp = result.state.services[(spn(), V6)]
    assert (sp.cluster_ip, sp.external_ips) == ("fd00::a", ("2001:db8::7",))
    assert endpoints_of(result, (spn(), V6)) == ["[fd01::5]:8080"]


# ---------------------------------------------------------------------------------------------
# What kube-proxy skips


@pytest.mark.parametrize(
    "spec",
    [
        {"clusterIP": "None"},
        {"clusterIP": "None", "clusterIPs": ["None"]},
        {"clusterIPs": ["None"]},
        {"type": "ExternalName", "externalName": "db.example.com", "clusterIP": None},
        {"type": "ExternalName", "externalName": "db.example.com"},
        {"clusterIP": None},  # not allocated yet: nothing to match on
        {"clusterIP": ""},
    ],
)
def test_skipped_services_are_not_errors(spec):
    result = load_objects([service(**spec), endpoint_slice()])
    assert result.errors == ()
    assert result.state.services == {}
    assert result.state.endpoints == {}


def test_family_without_cluster_ip_is_skipped():
    svc = service(
        clusterIP="10.96.0.10",
        clusterIPs=["10.96.0.10"],
        ipFamilies=["IPv4", "IPv6"],
        ipFamilyPolicy="PreferDualStack",
    )
    result = load_objects(
        [svc, endpoint_slice(address_type="IPv6", endpoints=[endpoint("fd01::5")])]
    )
    assert result.errors == ()
    assert list(result.state.services) == [(spn(), V4)]
    assert result.state.endpoints == {}


def test_dual_stack_split():
    svc = service(
        clusterIP="fd00::10",
        clusterIPs=["fd00::10", "10.96.0.10"],
        ipFamilies=["IPv6", "IPv4"],
        externalIPs=["203.0.113.7", "2001:db8::7"],
        type="LoadBalancer",
        loadBalancerSourceRanges=["198.51.100.0/24", "2001:db8:1::/48"],
        ports=[{"name": "http", "port": 80, "nodePort": 30080}],
        status={"loadBalancer": {"ingress": [{"ip": "2001:db8::10"}, {"ip": "203.0.113.10"}]}},
    )
    v4 = endpoint_slice("web-v4", endpoints=[endpoint("10.244.0.5")])
    v6 = endpoint_slice("web-v6", address_type="IPv6", endpoints=[endpoint("fd01::5")])
    result = load_objects([svc, v4, v6])
    assert result.errors == ()
    s4, s6 = result.state.services[(spn(), V4)], result.state.services[(spn(), V6)]
    assert (
        s4.cluster_ip,
        s4.external_ips,
        s4.load_balancer_ips,
        s4.load_balancer_source_ranges,
    ) == ("10.96.0.10", ("203.0.113.7",), ("203.0.113.10",), ("198.51.100.0/24",))
    assert (
        s6.cluster_ip,
        s6.external_ips,
        s6.load_balancer_ips,
        s6.load_balancer_source_ranges,
    ) == ("fd00::10", ("2001:db8::7",), ("2001:db8::10",), ("2001:db8:1::/48",))
    assert endpoints_of(result, (spn(), V4)) == ["10.244.0.5:8080"]
    assert endpoints_of(result, (spn(), V6)) == ["[fd01::5]:8080"]


def test_fqdn_slices_are_ignored():
    sl = endpoint_slice(address_type="FQDN", endpoints=[{"addresses": ["db.example.com"]}])
    result = load_objects([service(), sl])
    assert result.errors == ()
    assert result.state.endpoints == {}


def test_other_kinds_and_groups_are_ignored():
    objects = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "x"}},
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "x"},
            "spec": "whatever",
        },
        {
            "apiVersion": "serving.knative.dev/v1",
            "kind": "Service",
            "metadata": {"name": "Not_Valid"},
        },
        {"apiVersion": "v1", "kind": "Endpoints", "metadata": {"name": "web"}},
        service(),
    ]
    result = load_objects(objects)
    assert result.errors == ()
    assert list(result.state.services) == [(spn(), V4)]


def test_unsupported_version_of_our_kind_is_an_error():
    sl = endpoint_slice()
    sl["apiVersion"] = "discovery.k8s.io/v1beta1"
    result = load_objects([sl])
    assert fields(result) == ["apiVersion"]


# ---------------------------------------------------------------------------------------------
# Endpoints: matching, merging, ordering, conditions


def test_ports_match_by_name_and_protocol():
    svc = service(
        ports=[
            {"name": "dns", "port": 53, "protocol": "UDP"},
            {"name": "dns-tcp", "port": 53, "protocol": "TCP"},
        ]
    )
    sl = endpoint_slice(
        ports=[
            {"name": "dns", "port": 5353, "protocol": "UDP"},
            {"name": "dns-tcp", "port": 5354, "protocol": "TCP"},
            {"name": "dns", "port": 9999, "protocol": "TCP"},  # right name, wrong protocol
            {"name": "other", "port": 7777, "protocol": "UDP"},  # no such service port
        ],
        endpoints=[endpoint("10.244.0.5")],
    )
    result = load_objects([svc, sl])
    assert result.errors == ()
    assert endpoints_of(result, (spn(port="dns", protocol=UDP), V4)) == ["10.244.0.5:5353"]
    assert endpoints_of(result, (spn(port="dns-tcp"), V4)) == ["10.244.0.5:5354"]
    assert set(result.state.endpoints) == {
        (spn(port="dns", protocol=UDP), V4),
        (spn(port="dns-tcp"), V4),
    }


def test_unnamed_slice_port_matches_unnamed_service_port():
    svc = service(ports=[{"port": 80}])
    sl = endpoint_slice(ports=[{"port": 8080}], endpoints=[endpoint("10.244.0.5")])
    result = load_objects([svc, sl])
    assert endpoints_of(result, (spn(port=""), V4)) == ["10.244.0.5:8080"]


def test_slice_port_without_number_is_ignored_and_said():
    """The API server accepts a slice port without a number; kube-proxy ignores it with a log
    line ("Ignoring invalid endpoint port"), so that port gets no endpoints from the slice."""
    sl = endpoint_slice(ports=[{"name": "http", "protocol": "TCP"}, {"name": "http", "port": None}])
    result = load_objects([service(), sl])
    assert fields(result) == ["ports[0].port", "ports[1].port"]
    assert "port http/TCP gets no endpoints from this slice" in result.errors[0].message
    assert result.state.endpoints == {}


def test_endpoints_sorted_by_address_string():
    sl = endpoint_slice(
        ports=[{"name": "http", "port": 11}],
        endpoints=[
            endpoint("10.1.1.1"),
            endpoint("10.1.1.2"),
            endpoint("10.1.1.11"),
            endpoint("10.1.1.100"),
        ],
    )
    result = load_objects([service(), sl])
    assert endpoints_of(result, (spn(), V4)) == [
        "10.1.1.100:11",
        "10.1.1.11:11",
        "10.1.1.1:11",
        "10.1.1.2:11",
    ]


def test_slices_are_merged():
    a = endpoint_slice("web-a", endpoints=[endpoint("10.244.0.5"), endpoint("10.244.0.6")])
    b = endpoint_slice("web-b", endpoints=[endpoint("10.244.1.7")])
    other = endpoint_slice("other-a", service_name="other", endpoints=[endpoint("10.244.1.8")])
    elsewhere = endpoint_slice("web-c", namespace="prod", endpoints=[endpoint("10.244.1.9")])
    result = load_objects([service(), a, b, other, elsewhere])
    assert endpoints_of(result, (spn(), V4)) == [
        "10.244.0.5:8080",
        "10.244.0.6:8080",
        "10.244.1.7:8080",
    ]


def test_duplicate_endpoint_last_slice_by_name_wins():
    """Upstream lets a later duplicate replace an earlier one (its slices come in map order);
    walking slices by name makes the winner reproducible: the last by name."""
    a = endpoint_slice("web-a", endpoints=[endpoint("10.244.1.5", "node-b", zone="zone-b")])
    b = endpoint_slice("web-b", endpoints=[endpoint("10.244.1.5", "node-c", zone="zone-c")])
    for order in ([a, b], [b, a]):
        result = load_objects([service(), *order], NODE_A)
        (ep,) = result.state.endpoints[(spn(), V4)]
        assert ep.node_name == "node-c"


GHOST = {"ready": False, "serving": False, "terminating": True}


@pytest.mark.parametrize("ghost_slice", ["web-a", "web-b"])
def test_reused_pod_ip_reaches_the_live_pod_not_the_terminating_ghost(ghost_slice):
    """kubernetes#135266, fixed by #135593: the pod network reused a Terminating pod's IP for a
    new pod; the slices hold both. The live pod wins wherever the ghost is, or the service
    would have no usable endpoint and REJECT."""
    live_slice = "web-b" if ghost_slice == "web-a" else "web-a"
    ghost = endpoint_slice(ghost_slice, endpoints=[endpoint("10.244.1.5", "node-b", conditions=GHOST)])
    live = endpoint_slice(live_slice, endpoints=[endpoint("10.244.1.5", "node-c")])
    (ep,) = load_objects([service(), ghost, live], NODE_A).state.endpoints[(spn(), V4)]
    assert (ep.node_name, ep.ready, ep.terminating) == ("node-c", True, False)


@pytest.mark.parametrize("ghost_first", [True, False])
def test_reused_pod_ip_in_one_slice(ghost_first):
    ghost, live = endpoint("10.244.1.5", "node-b", conditions=GHOST), endpoint("10.244.1.5", "node-c")
    sl = endpoint_slice("web-a", endpoints=[ghost, live] if ghost_first else [live, ghost])
    (ep,) = load_objects([service(), sl], NODE_A).state.endpoints[(spn(), V4)]
    assert (ep.node_name, ep.ready) == ("node-c", True)


def test_duplicate_endpoint_local_one_is_not_preferred():
    """Upstream dropped its "prefer the local duplicate" case in #135593 (it was wrong for an
    endpoint moving between slices); a duplicate is decided by order and termination alone."""
    remote = endpoint_slice("web-b", endpoints=[endpoint("10.244.1.5", "node-b")])
    local = endpoint_slice(
        "web-a", endpoints=[endpoint("10.244.1.5", "node-a", conditions={"ready": False})]
    )
    for order in ([remote, local], [local, remote]):
        (ep,) = load_objects([service(), *order], NODE_A).state.endpoints[(spn(), V4)]
        assert (ep.node_name, ep.ready) == ("node-b", True)


@pytest.mark.parametrize("name", ["1web", "123", "0-a"])
def test_service_name_may_begin_with_a_digit(name):
    """KEP-5311 (Kubernetes 1.36, GA 1.37): Service names are RFC 1123 labels."""
    sl = endpoint_slice(f"{name}-abc", service_name=name, endpoints=[endpoint("10.244.0.5")])
    result = load_objects([service(name), sl])
    assert not result.errors
    key = (spn(name), V4)
    assert endpoints_of(result, key) == ["10.244.0.5:8080"]


def test_only_first_address_is_used():
    sl = endpoint_slice(endpoints=[{"addresses": ["10.244.0.5", "10.244.0.6"]}])
    assert endpoints_of(load_objects([service(), sl]), (spn(), V4)) == ["10.244.0.5:8080"]


@pytest.mark.parametrize(
    ("conditions", "expected"),
    [
        (None, (True, True, False)),
        ({}, (True, True, False)),
        ({"ready": None, "serving": None, "terminating": None}, (True, True, False)),
        (
            {"ready": False},
            (False, True, False),
        ),  # upstream: unset serving is true, not ready's value
        ({"ready": False, "serving": True, "terminating": True}, (False, True, True)),
        ({"ready": False, "serving": False, "terminating": True}, (False, False, True)),
        ({"terminating": True}, (True, True, True)),
    ],
)
def test_condition_defaults(conditions, expected):
    ep = endpoint("10.244.0.5")
    if conditions is not None:
        ep["conditions"] = conditions
    (got,) = load_objects([service(), endpoint_slice(endpoints=[ep])]).state.endpoints[(spn(), V4)]
    assert (got.ready, got.serving, got.terminating) == expected


def test_topology_fields():
    ep = endpoint(
        "10.244.0.5",
        "node-a",
        zone="zone-a",
        hints={
            "forZones": [{"name": "zone-a"}, {"name": "zone-b"}],
            "forNodes": [{"name": "node-a"}],
        },
    )
    (got,) = load_objects([service(), endpoint_slice(endpoints=[ep])]).state.endpoints[(spn(), V4)]
    assert (got.node_name, got.zone) == ("node-a", "zone-a")
    assert got.zone_hints == {"zone-a", "zone-b"} and got.node_hints == {"node-a"}


def test_endpoint_of_the_other_family_is_skipped_and_reported():
    sl = endpoint_slice(endpoints=[endpoint("fd01::5"), endpoint("10.244.0.6")])
    result = load_objects([service(), sl])
    assert fields(result) == ["endpoints[0].addresses[0]"]
    assert endpoints_of(result, (spn(), V4)) == ["10.244.0.6:8080"]


def test_endpoints_without_service_are_dropped():
    result = load_objects([endpoint_slice()])
    assert result.errors == () and result.state.endpoints == {}


# ---------------------------------------------------------------------------------------------
# The node


def test_node_object_fills_node_config():
    result = load_objects([node()])
    assert result.state.node == NodeConfig(
        name="node-a", ips=("192.168.0.2",), cluster_cidrs=("10.244.0.0/24",), zone="zone-a"
    )


def test_flags_win_field_by_field():
    given = NodeConfig(
        name="node-a",
        ips=("192.168.9.9",),
        masquerade_all=True,
        nodeport_addresses=("192.168.0.0/16",),
    )
    got = load_objects([node()], given).state.node
    assert got == NodeConfig(
        name="node-a",
        ips=("192.168.9.9",),
        cluster_cidrs=("10.244.0.0/24",),
        masquerade_all=True,
        zone="zone-a",
        nodeport_addresses=("192.168.0.0/16",),
    )
    given = NodeConfig(name="node-a", cluster_cidrs=("10.0.0.0/8",), zone="zone-z")
    got = load_objects([node()], given).state.node
    assert (got.cluster_cidrs, got.zone, got.ips) == (("10.0.0.0/8",), "zone-z", ("192.168.0.2",))


def test_node_chosen_by_name():
    b = node("node-b", status={"addresses": [{"type": "InternalIP", "address": "192.168.0.3"}]})
    assert load_objects([node(), b], NodeConfig(name="node-b")).state.node.ips == ("192.168.0.3",)
    # Two nodes and no name: neither is guessed.
    assert load_objects([node(), b]).state.node == NodeConfig()
    # A name no Node object has: only the flags.
    assert load_objects([node()], NodeConfig(name="node-x")).state.node == NodeConfig(name="node-x")


def test_node_ips_internal_first_one_per_family():
    n = node(
        status={
            "addresses": [
                {"type": "Hostname", "address": "node-a"},
                {"type": "ExternalIP", "address": "203.0.113.2"},
                {"type": "InternalIP", "address": "192.168.0.2"},
                {"type": "InternalIP", "address": "192.168.0.22"},
                {"type": "ExternalIP", "address": "2001:db8::2"},
            ]
        }
    )
    assert load_objects([n]).state.node.ips == ("192.168.0.2", "2001:db8::2")


def test_node_pod_cidrs_preferred_over_pod_cidr():
    n = node(spec={"podCIDR": "10.244.0.0/24", "podCIDRs": ["10.244.0.0/24", "fd01:0:0:1::/64"]})
    assert load_objects([n]).state.node.cluster_cidrs == ("10.244.0.0/24", "fd01:0:0:1::/64")
    n = node(spec={"podCIDR": "10.244.3.0/24"})
    assert load_objects([n]).state.node.cluster_cidrs == ("10.244.3.0/24",)


def test_node_name_decides_locality_of_duplicates():
    remote = endpoint_slice("web-a", endpoints=[endpoint("10.244.1.5", "node-b")])
    local = endpoint_slice("web-b", endpoints=[endpoint("10.244.1.5", "node-a")])
    # No flags: the one Node object names the node, so node-a's copy is local and wins.
    (ep,) = load_objects([node(), service(), remote, local]).state.endpoints[(spn(), V4)]
    assert ep.node_name == "node-a"


def test_merge_node():
    info = NodeInfo("node-a", "zone-a", ("192.168.0.2",), ("10.244.0.0/24",))
    assert merge_node(None, None) == NodeConfig()
    assert merge_node(None, info) == NodeConfig(
        "node-a", ("192.168.0.2",), ("10.244.0.0/24",), zone="zone-a"
    )
    given = NodeConfig("node-a", ("10.0.0.1",), ("10.0.0.0/8",), True, "z", ("10.0.0.0/8",))
    assert merge_node(given, info) == given


# ---------------------------------------------------------------------------------------------
# Input forms


def test_list_and_typed_lists():
    kubectl_list = {"apiVersion": "v1", "kind": "List", "items": [service(), endpoint_slice()]}
    raw_api_list = {
        "apiVersion": "v1",
        "kind": "ServiceList",
        "items": [
            {
                "metadata": {"name": "api", "namespace": "default"},
                "spec": {"clusterIP": "10.96.0.11", "ports": [{"port": 80}]},
            },
        ],
    }
    result = load_objects([kubectl_list, raw_api_list])
    assert result.errors == ()
    assert set(result.state.services) == {(spn(), V4), (spn("api", ""), V4)}
    assert endpoints_of(result, (spn(), V4)) == ["10.244.0.5:8080"]


def test_list_errors():
    result = load_objects(
        [
            {"apiVersion": "v1", "kind": "List", "items": "nope"},
            {
                "apiVersion": "v1",
                "kind": "List",
                "items": [5, {"apiVersion": "v1", "kind": "List", "items": []}],
            },
            {"apiVersion": "v1", "kind": "List", "items": None},
            ["not", "an", "object"],
            {"metadata": {"name": "x"}},
        ]
    )
    assert [(e.kind, e.field) for e in result.errors] == [
        ("List", "items"),
        ("List", "items[0]"),
        ("List", "items[1]"),
        ("", ""),
        ("", "kind"),
    ]


def test_directory_recursive_sorted_hidden_skipped():
    result = load(FIXTURES / "tree")
    assert result.errors == ()
    assert list(result.state.services) == [(spn(ns="apps"), V4)]
    assert endpoints_of(result, (spn(ns="apps"), V4)) == ["10.244.0.5:8080", "10.244.1.6:8080"]
    assert result.state.node.name == "node-a" and result.state.node.zone == "zone-a"


def test_single_file_list_with_item_line_numbers():
    result = load(FIXTURES / "list.yaml")
    assert [str(e) for e in result.errors] == [
        f"{FIXTURES / 'list.yaml'}:13: Service default/two: spec.ports[0].port:"
        " 70000 is not a valid port (1-65535)"
    ]
    assert list(result.state.services) == [(spn("one", ""), V4)]


def test_broken_yaml_in_one_file():
    result = load(FIXTURES / "broken")
    (error,) = result.errors
    assert error.source == f"{FIXTURES / 'broken' / 'bad.yaml'}:9"
    assert "invalid YAML" in error.message
    assert list(result.state.services) == [(spn("good", ""), V4)]


def test_broken_json_and_non_utf8(tmp_path):
    (tmp_path / "a.json").write_text('{"kind": "Service",\n "x": }')
    (tmp_path / "b.yaml").write_bytes(b"kind: Service\nname: \xff\n")
    (tmp_path / "c.yaml").write_text(json.dumps(service()))
    result = load(tmp_path)
    assert [e.source for e in result.errors] == [
        f"{tmp_path / 'a.json'}:2",
        str(tmp_path / "b.yaml"),
    ]
    assert list(result.state.services) == [(spn(), V4)]


def test_unbuildable_scalars_are_file_errors(tmp_path):
    (tmp_path / "a.yaml").write_text("port: " + "1" * 5000 + "\n")
    (tmp_path / "b.json").write_text('{"port": ' + "1" * 5000 + "}")
    (tmp_path / "c.yaml").write_text("when: 2024-02-30\n")
    (tmp_path / "d.yaml").write_text("kind: Namespace\n")
    result = load(tmp_path)
    assert [Path(e.source.split(":")[0]).name for e in result.errors] == [
        "a.yaml",
        "b.json",
        "c.yaml",
    ]


def test_unsafe_yaml_tags_are_refused(tmp_path):
    (tmp_path / "a.yaml").write_text("!!python/object/apply:os.system ['true']\n")
    (tmp_path / "b.yaml").write_text("kind: Namespace\n")
    result = load(tmp_path)
    assert [e.source for e in result.errors] == [f"{tmp_path / 'a.yaml'}:1"]


def test_load_raises_only_when_nothing_can_be_read(tmp_path):
    with pytest.raises(ManifestError, match="no such file"):
        load(tmp_path / "missing")
    with pytest.raises(ManifestError, match=r"no .*yaml"):
        load(tmp_path)
    (tmp_path / "bad.yaml").write_text("a: [\n")
    with pytest.raises(ManifestError, match="nothing could be read"):
        load(tmp_path)
    (tmp_path / "empty.yaml").write_text("")
    assert load(tmp_path).state == ClusterState()


_NO_OBJECT = {"empty": "", "comments only": "# nothing yet\n", "separators only": "---\n---\n",
              "empty List": "apiVersion: v1\nkind: List\nitems: []\n"}


@pytest.mark.parametrize("text", _NO_OBJECT.values(), ids=_NO_OBJECT.keys())
def test_load_refuses_manifests_without_any_object_when_asked(tmp_path: Path, text: str) -> None:
    from nfproxy.sources.manifests import NoObjects

    (tmp_path / "a.yaml").write_text(text)
    (tmp_path / "b.yml").write_text("")
    assert load(tmp_path).state == ClusterState()  # the library's default: an empty state
    for path in (tmp_path, tmp_path / "a.yaml"):
        with pytest.raises(NoObjects, match=f"^{re.escape(str(path))}: no valid Service, EndpointSlice or Node read"):
            load(path, require_objects=True)
    # One object is enough, even an invalid one: as the daemon's --once, which then syncs.
    (tmp_path / "c.yaml").write_text("apiVersion: v1\nkind: Service\nmetadata: {name: x}\nspec: {ports: nope}\n")
    result = load(tmp_path, require_objects=True)
    assert result.state == ClusterState() and len(result.errors) == 1


@pytest.mark.parametrize("command", ["render", "compare"])
@pytest.mark.parametrize("layout", ["file", "directory"])
@pytest.mark.parametrize("text", _NO_OBJECT.values(), ids=_NO_OBJECT.keys())
def test_render_and_compare_refuse_manifests_without_any_object(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str, layout: str, text: str) -> None:
    """An empty ruleset (or "EQUIVALENT") would pass for a result; `--once` refuses the same input."""
    from nfproxy.cli.main import main

    (tmp_path / "a.yaml").write_text(text)
    path = tmp_path if layout == "directory" else tmp_path / "a.yaml"
    argv = ["render", "--backend", "nft", str(path)] if command == "render" else ["compare", str(path)]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == (f"nfproxy: error: {path}: nothing to {command}: no valid Service, EndpointSlice or Node "
                   "read (no file holds a Kubernetes object)\n")


@pytest.mark.parametrize("command", ["render", "compare"])
def test_render_and_compare_still_take_a_cluster_without_services(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str) -> None:
    from nfproxy.cli.main import main

    (tmp_path / "ns.yaml").write_text("apiVersion: v1\nkind: Namespace\nmetadata: {name: shop}\n")
    argv = ["render", "--backend", "nft", str(tmp_path)] if command == "render" else ["compare", str(tmp_path)]
    assert main(argv) == 0
    out, _ = capsys.readouterr()
    assert out.strip().endswith("EQUIVALENT") if command == "compare" else "add table ip nfproxy" in out


# ---------------------------------------------------------------------------------------------
# Validation: every error names its field; one bad object or entry does not stop the rest


def test_error_string():
    svc = service(
        type="NodePort",
        ports=[{"name": "http", "port": 80}, {"name": "https", "port": 443, "nodePort": 70000}],
    )
    (error,) = load_objects([svc]).errors
    assert error == ObjectError(
        "Service", "default", "web", "spec.ports[1].nodePort", "70000 is not a valid port (1-65535)"
    )
    assert (
        str(error)
        == "Service default/web: spec.ports[1].nodePort: 70000 is not a valid port (1-65535)"
    )


BAD_SERVICE_FIELDS = [
    # (path, value, message fragment[, field reported when not `path`])
    ("metadata.name", None, "required"),
    ("metadata.name", "Web", "not a valid Service name"),
    ("metadata.name", "-web", "not a valid Service name"),
    ("metadata.name", "web.a", "not a valid Service name"),
    ("metadata.name", "w" * 64, "longer than 63"),
    ("metadata.namespace", "Prod", "not a valid DNS label"),
    ("metadata", "web", "expected a mapping"),
    ("spec", ["x"], "expected a mapping"),
    ("spec", None, "required"),
    ("spec.type", "Nodeport", "not one of"),
    ("spec.clusterIP", "10.96.0.300", "not a valid IP address"),
    ("spec.clusterIP", "fe80::1%eth0", "not a valid IP address"),
    ("spec.clusterIP", "::ffff:10.96.0.1", "IPv4-mapped"),
    ("spec.clusterIP", 10, "expected a string"),
    ("spec.clusterIPs", "10.96.0.10", "expected a list"),
    (
        "spec.clusterIPs",
        ["10.96.0.10", "10.96.0.11"],
        "second cluster IP of the same family",
        "spec.clusterIPs[1]",
    ),
    ("spec.clusterIPs", ["10.96.0.11"], "differs from spec.clusterIPs[0]", "spec.clusterIP"),
    ("spec.clusterIPs", ["10.96.0.10", "fd00::1", "fd00::2"], "at most 2"),
    (
        "spec.ipFamilies",
        ["IPv6"],
        "is not an IPv6 address (spec.ipFamilies[0] is IPv6)",
        "spec.clusterIP",
    ),
    ("spec.ipFamilies", ["IPv4", "IPv4"], "duplicate IP family", "spec.ipFamilies[1]"),
    ("spec.ipFamilies[0]", "ipv4", "not one of"),
    ("spec.ports", "80", "expected a list, got string"),
    ("spec.ports", [], "at least one port"),
    ("spec.ports", None, "required"),
    ("spec.ports[0]", "http", "expected a mapping"),
    ("spec.externalIPs", "203.0.113.7", "expected a list"),
    ("spec.externalIPs[0]", "127.0.0.1", "loopback"),
    ("spec.externalIPs[0]", "0.0.0.0", "unspecified"),
    ("spec.externalIPs[0]", "203.0.113.7/32", "not a valid IP address"),
    ("spec.loadBalancerSourceRanges[0]", "10.0.0.0/33", "not a valid CIDR"),
    ("spec.loadBalancerSourceRanges[0]", "10.0.0.0", "not a valid CIDR"),
    # A padded prefix is read as kube-proxy reads it (tests/test_sloppy_ips.py); past 32 it is not.
    ("spec.loadBalancerSourceRanges[0]", "10.0.0.0/033", "not a valid CIDR"),
    ("spec.sessionAffinity", "clientip", "not one of"),
    ("spec.externalTrafficPolicy", "local", "not one of"),
    ("spec.internalTrafficPolicy", "Global", "not one of"),
    ("spec.healthCheckNodePort", 0, "not a valid port"),
    ("status.loadBalancer.ingress[0].ip", "203.0.113.300", "not a valid IP address"),
    ("status.loadBalancer.ingress[0].ipMode", "proxy", "not one of"),
    ("status.loadBalancer", [], "expected a mapping"),
]


@pytest.mark.parametrize("case", BAD_SERVICE_FIELDS, ids=lambda c: f"{c[0]}={c[1]!r:.20}")
def test_service_field_errors_skip_the_service(case):
    path, value, fragment, *reported = case
    base = service(
        type="LoadBalancer",
        ports=[{"name": "http", "port": 80, "nodePort": 30080}],
        status={"loadBalancer": {"ingress": [{"ip": "203.0.113.10"}]}},
    )
    bad = set_path(base, path, value)
    result = load_objects([bad, service("other", clusterIP="10.96.0.11")])
    field = reported[0] if reported else path
    assert field in fields(result), result.errors
    assert any(fragment in e.message for e in result.errors if e.field == field), result.errors
    assert list(result.state.services) == [(spn("other"), V4)]  # the other one still loads


def test_cluster_ip_of_the_wrong_family():
    svc = service(clusterIP=None, clusterIPs=["fd00::10"], ipFamilies=["IPv4"])
    (error,) = load_objects([svc]).errors
    assert (error.field, error.message) == (
        "spec.clusterIPs[0]",
        "fd00::10 is not an IPv4 address (spec.ipFamilies[0] is IPv4)",
    )


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        (0, "1-86400"),
        (86401, "1-86400"),
        ("600", "expected an integer"),
        (True, "expected an integer"),
        (60.5, "expected an integer"),
    ],
)
def test_affinity_timeout_errors(value, fragment):
    svc = service(
        sessionAffinity="ClientIP", sessionAffinityConfig={"clientIP": {"timeoutSeconds": value}}
    )
    (error,) = load_objects([svc]).errors
    assert (
        error.field == "spec.sessionAffinityConfig.clientIP.timeoutSeconds"
        and fragment in error.message
    )


BAD_PORT_FIELDS = [
    ("spec.ports[1].port", None, "required"),
    ("spec.ports[1].port", 0, "not a valid port (1-65535)"),
    ("spec.ports[1].port", 65536, "not a valid port (1-65535)"),
    ("spec.ports[1].port", "443", "expected an integer"),
    ("spec.ports[1].port", 443.0, "expected an integer"),
    ("spec.ports[1].protocol", "HTTP", "not one of"),
    ("spec.ports[1].protocol", "tcp", "not one of"),
    ("spec.ports[1].name", "HTTPS", "not a valid DNS label"),
    ("spec.ports[1].name", "https_alt", "not a valid DNS label"),
    ("spec.ports[1].name", False, "expected a string"),  # YAML 1.1: `name: no`
    ("spec.ports[1].name", "http", "duplicate port name"),
    ("spec.ports[1].port", 80, "duplicate port 80/TCP"),
    ("spec.ports[1].nodePort", 70000, "not a valid port"),
    ("spec.ports[1].nodePort", 30080, "duplicate node port"),
]


@pytest.mark.parametrize(("path", "value", "fragment"), BAD_PORT_FIELDS)
def test_port_errors_skip_only_that_port(path, value, fragment):
    base = service(
        type="NodePort",
        ports=[
            {"name": "http", "port": 80, "nodePort": 30080},
            {"name": "https", "port": 443, "nodePort": 30443},
        ],
    )
    result = load_objects([set_path(base, path, value)])
    assert fields(result) == [path], result.errors
    assert fragment in result.errors[0].message
    assert list(result.state.services) == [(spn(), V4)]  # http still there


def test_node_port_on_cluster_ip_service():
    svc = service(ports=[{"name": "http", "port": 80, "nodePort": 30080}])
    result = load_objects([svc])
    assert fields(result) == ["spec.ports[0].nodePort"]


def test_a_bad_source_range_skips_the_whole_service():
    """Dropping just the bad range would leave the load balancer open to more than intended."""
    svc = service(
        type="LoadBalancer",
        ports=[{"name": "http", "port": 80, "nodePort": 30080}],
        loadBalancerSourceRanges=["198.51.100.0/24", "198.51.100.0/33"],
        status={"loadBalancer": {"ingress": [{"ip": "203.0.113.10"}]}},
    )
    result = load_objects([svc, endpoint_slice()])
    assert fields(result) == ["spec.loadBalancerSourceRanges[1]"]
    assert result.state.services == {} and result.state.endpoints == {}


BAD_SLICE_FIELDS = [
    ("metadata.name", "Web_1", "not a valid DNS subdomain"),
    ("metadata.namespace", "a.b", "not a valid DNS label"),
    ("metadata.labels", ["x"], "expected a mapping"),
    ("metadata.labels[kubernetes.io/service-name]", None, "required label"),
    ("metadata.labels[kubernetes.io/service-name]", "Web", "not a valid Service name"),
    ("addressType", None, "required"),
    ("addressType", "ipv4", "not one of"),
    ("ports", {"name": "http"}, "expected a list"),
    ("endpoints", "10.244.0.5", "expected a list"),
]


@pytest.mark.parametrize(("path", "value", "fragment"), BAD_SLICE_FIELDS)
def test_slice_field_errors_skip_the_slice(path, value, fragment):
    bad = set_path(endpoint_slice("web-a"), path, value)
    good = endpoint_slice("web-b", endpoints=[endpoint("10.244.0.6")])
    result = load_objects([service(), bad, good])
    assert fields(result) == [path], result.errors
    assert fragment in result.errors[0].message
    assert endpoints_of(result, (spn(), V4)) == ["10.244.0.6:8080"]


BAD_SLICE_PORTS = [
    ("ports[0].port", 70000, "not a valid port"),
    ("ports[0].port", "8080", "expected an integer"),
    ("ports[0].protocol", "ICMP", "not one of"),
    ("ports[0].name", "HTTP", "not a valid DNS label"),
    ("ports[0]", 8080, "expected a mapping"),
]


@pytest.mark.parametrize(("path", "value", "fragment"), BAD_SLICE_PORTS)
def test_slice_port_errors_skip_only_that_port(path, value, fragment):
    sl = endpoint_slice(ports=[{"name": "http", "port": 8080}, {"name": "metrics", "port": 9090}])
    svc = service(ports=[{"name": "http", "port": 80}, {"name": "metrics", "port": 9090}])
    result = load_objects([svc, set_path(sl, path, value)])
    assert fields(result) == [path], result.errors
    assert fragment in result.errors[0].message
    assert endpoints_of(result, (spn(port="metrics"), V4)) == ["10.244.0.5:9090"]
    assert endpoints_of(result, (spn(), V4)) == []


def test_duplicate_slice_port():
    sl = endpoint_slice(ports=[{"name": "http", "port": 8080}, {"name": "http", "port": 8081}])
    result = load_objects([service(), sl])
    assert fields(result) == ["ports[1].name"]
    assert endpoints_of(result, (spn(), V4)) == ["10.244.0.5:8080"]


BAD_ENDPOINT_FIELDS = [
    ("endpoints[0].addresses", None, "required"),
    ("endpoints[0].addresses", [], "at least one address"),
    ("endpoints[0].addresses", "10.244.0.5", "expected a list"),
    ("endpoints[0].addresses", ["10.244.0.5"] * 101, "at most 100"),
    ("endpoints[0].addresses[0]", "10.244.0.256", "not a valid IP address"),
    ("endpoints[0].addresses[0]", "127.0.0.1", "loopback"),
    ("endpoints[0].addresses[0]", "169.254.1.1", "link-local"),
    ("endpoints[0].addresses[0]", "224.0.0.1", "multicast"),
    ("endpoints[0].conditions.ready", "true", "expected true or false"),
    ("endpoints[0].conditions.serving", 1, "expected true or false"),
    ("endpoints[0].conditions.terminating", "no", "expected true or false"),
    ("endpoints[0].conditions", [], "expected a mapping"),
    ("endpoints[0].nodeName", "Node_A", "not a valid DNS subdomain"),
    ("endpoints[0].hints.forZones[0].name", "zone/a", "not a valid label value"),
    ("endpoints[0].hints.forZones", {"name": "zone-a"}, "expected a list"),
    ("endpoints[0].hints.forNodes[0].name", "Node-A", "not a valid DNS subdomain"),
    ("endpoints[0]", "10.244.0.5", "expected a mapping"),
]


@pytest.mark.parametrize(("path", "value", "fragment"), BAD_ENDPOINT_FIELDS)
def test_endpoint_errors_skip_only_that_endpoint(path, value, fragment):
    sl = endpoint_slice(
        endpoints=[endpoint("10.244.0.5", "node-a"), endpoint("10.244.0.6", "node-a")]
    )
    result = load_objects([service(), set_path(sl, path, value)])
    assert fields(result) == [path], result.errors
    assert fragment in result.errors[0].message
    assert endpoints_of(result, (spn(), V4)) == ["10.244.0.6:8080"]


@pytest.mark.parametrize("zone", ["zone a", "-zone", "x" * 64])
def test_an_endpoint_zone_that_is_no_label_value_is_reported_and_dropped_not_the_endpoint(zone):
    """The API server does not validate `zone` and kube-proxy keeps the endpoint; nfproxy keeps
    it too, without the zone (only label values reach the model)."""
    sl = endpoint_slice(endpoints=[{**endpoint("10.244.0.5", "node-a"), "zone": zone}, endpoint("10.244.0.6", "node-a")])
    result = load_objects([service(), sl])
    assert fields(result) == ["endpoints[0].zone"], result.errors
    assert "not a valid label value" in result.errors[0].message and "the endpoint is kept" in result.errors[0].message
    assert endpoints_of(result, (spn(), V4)) == ["10.244.0.5:8080", "10.244.0.6:8080"]
    assert [e.zone for e in result.state.endpoints[(spn(), V4)]] == ["", ""]


BAD_NODE_FIELDS = [
    ("metadata.name", "Node_A", "not a valid DNS subdomain"),
    ("metadata.labels[topology.kubernetes.io/zone]", "zone a", "not a valid label value"),
    ("status.addresses[0].address", "192.168.0.300", "not a valid IP address"),
    ("status.addresses[0].type", 4, "expected a string"),
    ("status.addresses", {"type": "InternalIP"}, "expected a list"),
    ("spec.podCIDRs[0]", "10.244.0.0/40", "not a valid CIDR"),
    ("spec.podCIDRs", "10.244.0.0/24", "expected a list"),
]


@pytest.mark.parametrize(("path", "value", "fragment"), BAD_NODE_FIELDS)
def test_node_errors_skip_the_node(path, value, fragment):
    result = load_objects(
        [set_path(node(), path, value)], NodeConfig(name="node-a", masquerade_all=True)
    )
    assert fields(result) == [path], result.errors
    assert fragment in result.errors[0].message
    assert result.state.node == NodeConfig(name="node-a", masquerade_all=True)


def test_pod_cidr_error():
    n = node(spec={"podCIDR": "10.244.0.0/33"})
    assert fields(load_objects([n])) == ["spec.podCIDR"]


def test_duplicate_objects():
    result = load_objects(
        [
            service(),
            service(clusterIP="10.96.0.99"),
            endpoint_slice(),
            endpoint_slice(),
            node(),
            node(),
        ]
    )
    assert [(e.kind, e.field) for e in result.errors] == [
        ("Service", "metadata.name"),
        ("EndpointSlice", "metadata.name"),
        ("Node", "metadata.name"),
    ]
    assert result.state.services[(spn(), V4)].cluster_ip == "10.96.0.10"  # the first one


def test_several_errors_in_one_object_are_all_reported():
    svc = service(type="Bogus", clusterIP="x", externalIPs=["y"])
    assert fields(load_objects([svc])) == ["spec.type", "spec.clusterIP", "spec.externalIPs[0]"]


def test_one_bad_object_does_not_stop_the_others():
    objects = [
        service("a", clusterIP="10.96.0.1"),
        service("b", clusterIP="not-an-ip"),
        endpoint_slice("a-1", service_name="a", endpoints=[endpoint("10.244.0.1")]),
        endpoint_slice("b-1", service_name="b", endpoints=[endpoint("10.244.0.2")]),
        {"apiVersion": "v1", "kind": "Service", "metadata": "garbage"},
        42,
        service("c", clusterIP="10.96.0.3"),
    ]
    result = load_objects(objects)
    assert [(e.name, e.field) for e in result.errors] == [
        ("b", "spec.clusterIP"),
        ("<unnamed>", "metadata"),
        ("<unnamed>", "spec"),
        ("", ""),
    ]
    assert set(result.state.services) == {(spn("a"), V4), (spn("c"), V4)}
    assert endpoints_of(result, (spn("a"), V4)) == ["10.244.0.1:8080"]


# ---------------------------------------------------------------------------------------------
# Hostile input: nothing with rule-syntax characters, or too long, or non-ASCII gets through

HOSTILE = [
    'web"',
    "web\nadd rule ip nat x accept",
    "web;drop",
    "web#",
    "web{",
    "}web",
    "w" * 300,
    "wéb",
    "10.0.0.1\n",
    "10.0.0.0/8;",
    "fe80::1%eth0",
    " 10.0.0.1",
]

HOSTILE_SERVICE_FIELDS = [
    "metadata.name",
    "metadata.namespace",
    "spec.type",
    "spec.clusterIP",
    "spec.clusterIPs[0]",
    "spec.ipFamilies[0]",
    "spec.ports[0].name",
    "spec.ports[0].protocol",
    "spec.ports[0].port",
    "spec.ports[0].nodePort",
    "spec.externalIPs[0]",
    "spec.loadBalancerSourceRanges[0]",
    "spec.sessionAffinity",
    "spec.sessionAffinityConfig.clientIP.timeoutSeconds",
    "spec.externalTrafficPolicy",
    "spec.internalTrafficPolicy",
    "spec.healthCheckNodePort",
    "status.loadBalancer.ingress[0].ip",
    "status.loadBalancer.ingress[0].ipMode",
]
HOSTILE_SLICE_FIELDS = [
    "metadata.name",
    "metadata.namespace",
    "metadata.labels[kubernetes.io/service-name]",
    "addressType",
    "ports[0].name",
    "ports[0].protocol",
    "ports[0].port",
    "endpoints[0].addresses[0]",
    "endpoints[0].conditions.ready",
    "endpoints[0].nodeName",
    "endpoints[0].zone",
    "endpoints[0].hints.forZones[0].name",
    "endpoints[0].hints.forNodes[0].name",
]
HOSTILE_NODE_FIELDS = [
    "metadata.name",
    "metadata.labels[topology.kubernetes.io/zone]",
    "status.addresses[0].address",
    "spec.podCIDRs[0]",
    "spec.podCIDR",
]


# Every string the model holds is a name, label value, address or CIDR: nothing else may appear.
_SAFE = re.compile(r"[A-Za-z0-9._:/-]{0,253}")


def _strings(value: object) -> list[str]:
    """Every string inside a model value (dataclasses, mappings, tuples, sets)."""
    if isinstance(value, str):
        return [value]
    if dataclasses.is_dataclass(value):
        return [s for f in dataclasses.fields(value) for s in _strings(getattr(value, f.name))]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in _strings(k) + _strings(v)]
    if isinstance(value, (tuple, list, set, frozenset)):
        return [s for item in value for s in _strings(item)]
    return []


def _hostile_base(kind: str) -> dict[str, Any]:
    if kind == "Service":
        return service(
            type="LoadBalancer",
            clusterIPs=["10.96.0.10"],
            ipFamilies=["IPv4"],
            externalTrafficPolicy="Local",
            healthCheckNodePort=32000,
            sessionAffinity="ClientIP",
            sessionAffinityConfig={"clientIP": {"timeoutSeconds": 60}},
            ports=[{"name": "http", "port": 80, "nodePort": 30080}],
            status={"loadBalancer": {"ingress": [{"ip": "203.0.113.10"}]}},
        )
    if kind == "EndpointSlice":
        return endpoint_slice(
            endpoints=[
                endpoint(
                    "10.244.0.5",
                    "node-a",
                    zone="zone-a",
                    hints={"forZones": [{"name": "zone-a"}], "forNodes": [{"name": "node-a"}]},
                )
            ]
        )
    base = node()
    base["spec"] = {"podCIDR": "10.244.0.0/24"}  # without podCIDRs, so spec.podCIDR is read
    return base


def _hostile_cases():
    for kind, paths in (
        ("Service", HOSTILE_SERVICE_FIELDS),
        ("EndpointSlice", HOSTILE_SLICE_FIELDS),
        ("Node", HOSTILE_NODE_FIELDS),
    ):
        for path in paths:
            for value in HOSTILE:
                yield pytest.param(kind, path, value, id=f"{kind}-{path}-{value[:12]!r}")


@pytest.mark.parametrize(("kind", "path", "value"), list(_hostile_cases()))
def test_hostile_strings_are_rejected(kind, path, value):
    base = _hostile_base(kind)
    other = service("other", clusterIP="10.96.0.11")
    assert load_objects([other, base]).errors == ()  # the base itself is fine
    result = load_objects([other, set_path(base, path, value)])
    assert path in fields(result), result.errors
    assert all(_SAFE.fullmatch(text) for text in _strings(result.state)), result.state
    for error in result.errors:
        text = str(error)
        assert "\n" not in text and len(text) < 400, text


def test_unused_annotations_and_labels_are_never_copied():
    evil = 'x"; flush ruleset\n#{}' + "é" * 100
    svc = service()
    svc["metadata"]["annotations"] = {
        "evil": evil,
        "kubectl.kubernetes.io/last-applied-configuration": evil,
    }
    svc["metadata"]["labels"] = {"app": evil}
    svc["spec"]["selector"] = {"app": evil}
    svc["spec"]["ports"][0]["targetPort"] = evil
    sl = endpoint_slice(endpoints=[endpoint("10.244.0.5", targetRef={"name": evil}, hostname=evil)])
    sl["metadata"]["labels"]["app"] = evil
    sl["ports"][0]["appProtocol"] = evil
    result = load_objects([svc, sl, node(metadata={"name": "node-a", "annotations": {"a": evil}})])
    assert result.errors == ()
    assert "flush" not in repr(result.state)


def test_error_identity_of_a_hostile_name_is_one_line():
    (error,) = load_objects([service(name="web\nService default/ok: fine")]).errors
    assert "\n" not in str(error) and error.name.startswith("'")


# ---------------------------------------------------------------------------------------------
# The bundled example cluster


def test_examples_load_without_errors():
    result = load(EXAMPLES)
    assert result.errors == ()
    state = result.state
    assert state.node == NodeConfig(
        name="node-a", ips=("192.168.0.2",), cluster_cidrs=("10.244.0.0/24",), zone="zone-a"
    )
    services = {str(k[0]): sp for k, sp in state.services.items()}
    eps = {str(k[0]): state.endpoints.get(k, ()) for k in state.services}

    clusterip = [
        n for n, sp in services.items() if sp.type is ServiceType.CLUSTER_IP and len(eps[n]) == 3
    ]
    assert clusterip, "a ClusterIP service with 3 endpoints"
    assert any(sp.type is ServiceType.NODE_PORT and sp.node_port for sp in services.values())
    lbs = [n for n, sp in services.items() if sp.type is ServiceType.LOAD_BALANCER]
    assert any(
        services[n].load_balancer_source_ranges
        and services[n].external_policy_local
        and services[n].load_balancer_ips
        and services[n].health_check_node_port
        and {e.node_name == "node-a" for e in eps[n]} == {True, False}
        for n in lbs
    ), "an eTP=Local LoadBalancer with source ranges and local and remote endpoints"
    assert any(sp.affinity_timeout for sp in services.values())
    assert any(not eps[n] for n in services), "a service without endpoints"
    dns = {
        (sp.protocol, sp.port) for n, sp in services.items() if n.startswith("kube-system/kube-dns")
    }
    assert {(Protocol.UDP, 53), (Protocol.TCP, 53)} <= dns
    assert any(sp.external_ips for sp in services.values())

    for ip in (sp.cluster_ip for sp in services.values()):
        assert ip.startswith("10.96.")
    for endpoint_list in eps.values():
        for ep in endpoint_list:
            assert ep.ip.startswith("10.244.0." if ep.node_name == "node-a" else "10.244.1.")


def test_examples_have_a_multi_slice_service():
    """Checked on the objects: the merged state does not say which slice an endpoint came from."""
    slices_per_service: dict[str, int] = {}
    for path in sorted(EXAMPLES.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            for obj in doc.get("items", [doc]) if doc else ():
                if obj.get("kind") == "EndpointSlice":
                    name = obj["metadata"]["labels"]["kubernetes.io/service-name"]
                    slices_per_service[name] = slices_per_service.get(name, 0) + 1
    assert max(slices_per_service.values()) >= 2


# ---------------------------------------------------------------------------------------------
# Whatever the input, no traceback and nothing unsafe in the model

_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)
_ALL_PATHS = (
    [
        ("Service", p)
        for p in HOSTILE_SERVICE_FIELDS
        + ["spec", "spec.ports", "spec.ports[0]", "status", "metadata"]
    ]
    + [
        ("EndpointSlice", p)
        for p in HOSTILE_SLICE_FIELDS
        + ["endpoints", "endpoints[0]", "ports", "endpoints[0].hints", "metadata.labels"]
    ]
    + [
        ("Node", p)
        for p in HOSTILE_NODE_FIELDS + ["status", "status.addresses", "spec", "metadata.labels"]
    ]
)


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(_ALL_PATHS), _json)
def test_any_value_anywhere_is_handled(target, value):
    kind, path = target
    result = load_objects(
        [service("other", clusterIP="10.96.0.11"), set_path(_hostile_base(kind), path, value)]
    )
    assert all(_SAFE.fullmatch(text) for text in _strings(result.state))
    for error in result.errors:
        assert "\n" not in str(error)


@settings(max_examples=200, deadline=None)
@given(st.lists(_json, max_size=4))
def test_any_document_is_handled(documents):
    result = load_objects(documents)
    assert result.state.services == {}


def test_node_with_two_pod_cidrs_of_one_family_is_rejected() -> None:
    """Both backends must see one pod CIDR per family, as the API server guarantees."""
    node = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": "node-a"},
        "spec": {"podCIDRs": ["10.244.0.0/24", "10.245.0.0/24"]},
    }
    result = load_objects([node])
    assert [(e.kind, e.field) for e in result.errors] == [("Node", "spec.podCIDRs")]
    assert "more than one IPv4 CIDR" in result.errors[0].message
    assert result.state.node.cluster_cidrs == ()
    ok = load_objects([{**node, "spec": {"podCIDRs": ["10.244.0.0/24", "fd00:10::/64"]}}])
    assert ok.errors == () and ok.state.node.cluster_cidrs == ("10.244.0.0/24", "fd00:10::/64")


# ---------------------------------------------------------------------------------------------
# Files that must not be read: FIFOs, devices, loops, oversized (issue J.1)


def _good_tree(tmp_path: Path) -> Path:
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "a.yaml").write_text(yaml.safe_dump_all([service(), endpoint_slice()]))
    return tree


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "loop", "too-big", "directory"])
def test_files_that_must_not_be_read_stop_the_load_naming_them(tmp_path: Path, kind: str) -> None:
    import os

    tree = _good_tree(tmp_path)
    bad = tree / "b.yaml"
    if kind == "fifo":
        os.mkfifo(bad)
        message = "a FIFO, not a regular file"
    elif kind == "dev-zero":
        bad.symlink_to("/dev/zero")
        message = "a character device, not a regular file"
    elif kind == "loop":
        bad.symlink_to(tree / "c.yaml")
        (tree / "c.yaml").symlink_to(bad)
        message = "symlink loop"
    elif kind == "too-big":
        bad.write_text("# padding\n" * 200)
        message = "larger than the 1000-byte limit"
    else:
        bad.symlink_to(tmp_path)  # os.walk lists it as a directory and never enters it
        assert len(load(tree, max_bytes=1000).state.services) == 1
        return
    with pytest.raises(ManifestError, match=re.escape(f"{bad}")) as caught:
        load(tree, max_bytes=1000)
    assert message in str(caught.value)
    # The same file given as the path itself.
    with pytest.raises(ManifestError, match=re.escape(message)):
        load(bad, max_bytes=1000)


@pytest.mark.parametrize(
    "backend,given", [("nft", "directory"), ("iptables", "directory"), ("nft", "zero.yaml")]
)
def test_render_refuses_a_fifo_or_dev_zero_with_status_2(tmp_path: Path, backend: str, given: str) -> None:
    import os

    from tests.conftest import run_cli_forked

    tree = _good_tree(tmp_path)
    os.mkfifo(tree / "pipe.yaml")
    (tree / "zero.yaml").symlink_to("/dev/zero")
    path = tree if given == "directory" else tree / given
    # A hang is the bug this guards against: the timeout fails the test instead of blocking it.
    code, out, err = run_cli_forked(["render", "--backend", backend, str(path)], timeout=60)
    assert code == 2, err
    assert "Traceback" not in err and out == ""
    named = "pipe.yaml" if given == "directory" else "zero.yaml"
    assert named in err and "not a regular file" in err, err


# ---------------------------------------------------------------------------------------------
# Objects meant for another proxy (issue H.3)


def _labelled(obj: dict[str, Any], key: str, value: str = "") -> dict[str, Any]:
    obj = copy.deepcopy(obj)
    obj["metadata"].setdefault("labels", {})[key] = value
    return obj


@pytest.mark.parametrize(
    "label", ["service.kubernetes.io/service-proxy-name", "service.kubernetes.io/headless"]
)
def test_objects_labelled_for_another_proxy_or_headless_are_skipped(label: str) -> None:
    other = service("other", clusterIP="10.96.0.11")
    other_slice = endpoint_slice("other-1", "other")
    result = load_objects(
        [_labelled(service(), label, "cilium"), endpoint_slice(), other, _labelled(other_slice, label)]
    )
    assert result.errors == ()
    # The labelled Service is gone; so are the labelled slice's endpoints (any value counts).
    assert [k[0].name for k in result.state.services] == ["other"]
    assert result.state.endpoints == {}
    # Without the label both are proxied.
    plain = load_objects([service(), endpoint_slice(), other, other_slice])
    assert sorted(k[0].name for k in plain.state.services) == ["other", "web"]
    assert len(plain.state.endpoints) == 2


def test_base_60_numbers_are_strings_as_kubectl_reads_them(tmp_path: Path) -> None:
    """YAML 1.1 reads `port: 1:20` as 80 (base 60); kubectl's go-yaml reads a string, which the
    API server refuses. A port written so is an error, never port 80."""
    path = tmp_path / "svc.yaml"
    path.write_text(
        "apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: default}\n"
        "spec:\n  clusterIP: 10.96.0.10\n  ports:\n  - port: 1:20\n    protocol: TCP\n"
    )
    result = load(path)
    assert not result.state.services
    assert [e.field for e in result.errors] == ["spec.ports[0].port"]
    assert result.errors[0].message == "expected an integer, got string 1:20"

"""Conntrack cleanup: which entries go stale (pure), deleting them, and why it matters (traffic).

The traffic tests are the reason the feature exists: a UDP client that keeps one source port
stays pinned to a removed endpoint, or black-holed after a service gains its first endpoint,
until the entry is deleted.
"""

from __future__ import annotations

import dataclasses
import os
import random
import socket
from collections.abc import Iterator

import pytest
from hypothesis import given
from pyroute2.conntrack import Conntrack, NFCTAttrTuple
from pyroute2 import netns as pyroute2_netns

from nfproxy.daemon.conntrack import stale_flows
from nfproxy.kernel.conntrack import FlowFilter
from nfproxy.kernel import conntrack as kct
from nfproxy.kernel import netns as netns_mod
from nfproxy.core.model import (
    ClusterState,
    Endpoint,
    IPFamily,
    NodeConfig,
    Protocol,
    ServicePort,
    ServicePortName,
    ServiceType,
    sort_endpoints,
)
from nfproxy.verify.sandbox import Sandbox, SandboxSpec
from nfproxy.verify.validate import apply_nft
from nfproxy.testing import clusters, random_cluster

V4, V6 = IPFamily.V4, IPFamily.V6
NODE = NodeConfig(name="node-a", ips=("192.168.0.2",), cluster_cidrs=("10.244.0.0/16",))
A, B = "10.244.0.5", "10.244.0.6"
DNS = ServicePortName("kube-system", "dns", "dns", Protocol.UDP)


def udp_service(**kw: object) -> ServicePort:
    fields: dict = dict(
        name=DNS, family=V4, type=ServiceType.CLUSTER_IP, cluster_ip="10.96.0.10", port=53
    )
    fields.update(kw)
    return ServicePort(**fields)


def state(svc: ServicePort | None, *eps: Endpoint) -> ClusterState:
    if svc is None:
        return ClusterState(NODE)
    return ClusterState(NODE, {svc.key: svc}, {svc.key: sort_endpoints(list(eps))} if eps else {})


def ep(ip: str, port: int = 5353, **kw: object) -> Endpoint:
    return Endpoint(ip, port, node_name="node-a", **kw)  # type: ignore[arg-type]


def plain(flows: list[FlowFilter]) -> set[tuple]:
    return {(f.family, f.orig_dst, f.orig_dport, f.reply_src, f.reply_sport) for f in flows}


# ---- which entries are stale


def test_removed_endpoint_through_every_address_and_the_node_port() -> None:
    svc = udp_service(
        type=ServiceType.LOAD_BALANCER, node_port=30053, external_ips=("203.0.113.7",),
        load_balancer_ips=("198.51.100.7",),
    )
    flows = stale_flows(state(svc, ep(A), ep(B)), state(svc, ep(B)))
    assert plain(flows) == {
        (V4, "10.96.0.10", 53, A, 5353),
        (V4, "203.0.113.7", 53, A, 5353),
        (V4, "198.51.100.7", 53, A, 5353),
        (V4, None, 30053, A, 5353),
    }
    assert all(f.protocol is Protocol.UDP for f in flows)
    assert "endpoint 10.244.0.5:5353 removed" in flows[0].reason


def test_endpoint_no_longer_serving_is_removed_but_terminating_serving_is_not() -> None:
    svc = udp_service()
    old = state(svc, ep(A), ep(B))
    # B terminates but still serves: kube-proxy keeps its flows (policy changes never cut flows).
    assert stale_flows(old, state(svc, ep(A), ep(B, ready=False, terminating=True))) == []
    gone = stale_flows(old, state(svc, ep(A), ep(B, ready=False, serving=False, terminating=True)))
    assert plain(gone) == {(V4, "10.96.0.10", 53, B, 5353)}
    # Same IP, other port: a different endpoint.
    moved = stale_flows(old, state(svc, ep(A), ep(B, 5354)))
    assert plain(moved) == {(V4, "10.96.0.10", 53, B, 5353)}


def test_first_endpoint_clears_everything_sent_to_the_service() -> None:
    svc = udp_service(type=ServiceType.NODE_PORT, node_port=30053, external_ips=("203.0.113.7",))
    want = {(V4, "10.96.0.10", 53, None, None), (V4, "203.0.113.7", 53, None, None),
            (V4, None, 30053, None, None)}
    assert plain(stale_flows(state(svc), state(svc, ep(A)))) == want
    # A service that did not exist before counts as having had none.
    assert plain(stale_flows(state(None), state(svc, ep(A)))) == want
    # Endpoints that were not serving do not count as "some".
    dead = state(svc, ep(A, ready=False, serving=False))
    assert plain(stale_flows(dead, state(svc, ep(A)))) == want
    # From some to more: nothing.
    assert stale_flows(state(svc, ep(A)), state(svc, ep(A), ep(B))) == []


def test_removed_service_and_removed_addresses_are_cleared_whole() -> None:
    svc = udp_service(type=ServiceType.NODE_PORT, node_port=30053, external_ips=("203.0.113.7",))
    flows = stale_flows(state(svc, ep(A)), state(None))
    assert plain(flows) == {
        (V4, "10.96.0.10", 53, None, None),
        (V4, "203.0.113.7", 53, None, None),
        (V4, None, 30053, None, None),
    }
    # One external IP dropped, an endpoint gone at the same time: the dropped address whole,
    # the endpoint through what remains.
    smaller = dataclasses.replace(svc, external_ips=())
    flows = stale_flows(state(svc, ep(A), ep(B)), state(smaller, ep(B)))
    assert plain(flows) == {
        (V4, "203.0.113.7", 53, None, None),
        (V4, "10.96.0.10", 53, A, 5353),
        (V4, None, 30053, A, 5353),
    }


def test_only_udp_and_ipv6_in_canonical_form() -> None:
    tcp = udp_service(name=dataclasses.replace(DNS, protocol=Protocol.TCP))
    assert stale_flows(state(tcp, ep(A)), state(tcp)) == []
    v6 = udp_service(family=V6, cluster_ip="fd00:96::a")
    flows = stale_flows(state(v6, ep("fd01::5"), ep("fd01::6")), state(v6, ep("fd01::6")))
    assert plain(flows) == {(V6, "fd00:96::a", 53, "fd01::5", 5353)}
    assert str(flows[0]) == (
        "-f ipv6 -p udp --orig-dst fd00:96::a --orig-port-dst 53 "
        "--reply-src fd01::5 --reply-port-src 5353"
    )


def test_filter_matching() -> None:
    f = FlowFilter(V4, orig_dst="10.96.0.10", orig_dport=53, reply_src=A, reply_sport=5353)
    assert f.matches(Protocol.UDP, "10.96.0.10", 53, A, 5353)
    assert not f.matches(Protocol.TCP, "10.96.0.10", 53, A, 5353)
    assert not f.matches(Protocol.UDP, "10.96.0.11", 53, A, 5353)
    assert not f.matches(Protocol.UDP, "10.96.0.10", 54, A, 5353)
    assert not f.matches(Protocol.UDP, "10.96.0.10", 53, B, 5353)
    assert not f.matches(Protocol.UDP, "10.96.0.10", 53, A, 5354)
    node_port = FlowFilter(V4, orig_dport=30053)
    assert node_port.matches(Protocol.UDP, "192.168.0.2", 30053, "10.96.0.10", 53)
    assert not node_port.matches(Protocol.UDP, "192.168.0.2", 30054, "10.96.0.10", 53)


@given(clusters(max_services=15, max_endpoints=6))
def test_properties_on_random_clusters(old: ClusterState) -> None:
    assert stale_flows(old, old) == []
    # Drop every other endpoint everywhere: each dropped serving UDP endpoint gets a filter that
    # matches a flow DNATed to it through the cluster IP, and nothing else is UDP-unrelated.
    new_eps = {k: eps[::2] for k, eps in old.endpoints.items()}
    new = dataclasses.replace(old, endpoints=new_eps)
    flows = stale_flows(old, new)
    assert flows == sorted(set(flows), key=lambda f: f.sort_key)
    assert all(f.protocol is Protocol.UDP for f in flows)
    for key, eps in old.endpoints.items():
        svc = old.services[key]
        for gone in eps[1::2]:
            hit = any(
                f.matches(Protocol.UDP, svc.cluster_ip, svc.port, gone.ip, gone.port) for f in flows
            )
            assert hit == (svc.protocol is Protocol.UDP and gone.serving and gone not in eps[::2])


def test_reversed_change_is_the_first_endpoint_case() -> None:
    old = random_cluster(random.Random(7), 30)
    empty = dataclasses.replace(old, endpoints={})
    flows = stale_flows(empty, old)
    udp_with_serving = {
        k for k, eps in old.endpoints.items()
        if old.services[k].protocol is Protocol.UDP and any(e.serving for e in eps)
    }
    assert udp_with_serving, "the seed should give UDP services"
    for key in udp_with_serving:
        svc = old.services[key]
        assert FlowFilter(svc.family, orig_dst=svc.cluster_ip, orig_dport=svc.port) in flows


# ---- deleting: pyroute2 against the kernel, in a throwaway namespace


def add_entry(ns: str, family: IPFamily, orig: tuple, reply: tuple, proto: int = 17) -> None:
    af = socket.AF_INET if family is V4 else socket.AF_INET6
    # pyroute2 opens its netlink socket lazily, at the first request: everything must happen
    # inside the namespace, or the entry lands in the root namespace.
    with netns_mod.entered(ns):
        ct = Conntrack(nfgen_family=af)
        try:
            ct.entry(
                "add", timeout=120,
                tuple_orig=NFCTAttrTuple(family=af, saddr=orig[0], sport=orig[1], daddr=orig[2], dport=orig[3], proto=proto),
                tuple_reply=NFCTAttrTuple(family=af, saddr=reply[0], sport=reply[1], daddr=reply[2], dport=reply[3], proto=proto),
            )
        finally:
            ct.close()


@pytest.mark.kernel
def test_delete_removes_exactly_the_matching_entries(netns: str) -> None:
    client = "10.244.1.9"
    # DNATed to A and to B through the cluster IP; to A through a node port; TCP to A.
    add_entry(netns, V4, (client, 40001, "10.96.0.10", 53), (A, 5353, client, 40001))
    add_entry(netns, V4, (client, 40002, "10.96.0.10", 53), (B, 5353, client, 40002))
    add_entry(netns, V4, (client, 40003, "192.168.0.2", 30053), (A, 5353, "192.168.0.2", 40003))
    add_entry(netns, V4, (client, 40004, "10.96.0.10", 53), (A, 5353, client, 40004), proto=6)
    add_entry(netns, V6, ("fd01::9", 40005, "fd00:96::a", 53), ("fd01::5", 5353, "fd01::9", 40005))
    assert len(kct.list_flows(netns, V4)) == 3  # in the namespace, not the root one
    flows = [
        FlowFilter(V4, orig_dst="10.96.0.10", orig_dport=53, reply_src=A, reply_sport=5353),
        FlowFilter(V4, orig_dport=30053, reply_src=A, reply_sport=5353),
        FlowFilter(V6, orig_dst="fd00:96::a", orig_dport=53, reply_src="fd01::5", reply_sport=5353),
    ]
    assert kct.delete_per_family(flows, netns) == {V4: 2, V6: 1}
    left = kct.list_flows(netns, V4)
    assert [(f.orig_sport, f.reply_src) for f in left] == [(40002, B)]
    assert left[0].nat
    assert [f.orig_sport for f in kct.list_flows(netns, V4, Protocol.TCP)] == [40004]
    assert kct.list_flows(netns, V6) == []
    assert kct.delete(flows, netns) == 0  # nothing left to match: not an error


@pytest.mark.kernel
def test_delete_in_a_missing_namespace_fails_loudly() -> None:
    with pytest.raises(Exception, match="does not exist"):
        kct.delete([FlowFilter(V4, orig_dport=1)], "nfp-test-no-such-namespace")


# ---- traffic: the reason the cleanup exists


SPEC = SandboxSpec.of(
    node_ips=["192.168.0.2"],
    clients={"outside": "203.0.113.10"},
    endpoints={A: [(5353, "udp")], B: [(5353, "udp")]},
)


@pytest.fixture
def sandbox() -> Iterator[Sandbox]:
    if os.geteuid() != 0:
        pytest.fail("conntrack traffic tests need root: they build a sandbox of namespaces")
    with Sandbox(SPEC) as sb:
        yield sb
    mine = [n for n in pyroute2_netns.listnetns() if n.startswith(f"{sb.base}-")]
    assert mine == [], f"namespaces left behind: {mine}"


@pytest.mark.kernel
def test_removed_endpoint_keeps_its_flow_until_the_entry_is_deleted(sandbox: Sandbox) -> None:
    sb = sandbox
    svc = udp_service()
    old, new = state(svc, ep(A)), state(svc, ep(B))
    apply_nft(old, sb.node_ns)
    with sb.open("outside", "10.96.0.10", 53, "udp", timeout=0.5) as conn:
        assert conn.exchange().endpoint == f"{A}:5353"
        apply_nft(new, sb.node_ns)  # A is gone from the rules...
        pinned = conn.exchange()
        assert pinned.endpoint == f"{A}:5353", "the conntrack entry should still pin A"
        # ...and a fresh flow already goes to B: only the old flow is stuck.
        assert sb.connect("outside", "10.96.0.10", 53, "udp")[0].endpoint == f"{B}:5353"
        stuck = [f for f in kct.list_flows(sb.node_ns, V4) if f.orig_sport == conn.local_port]
        assert [(f.orig_dst, f.reply_src, f.reply_sport) for f in stuck] == [("10.96.0.10", A, 5353)]

        flows = stale_flows(old, new)
        assert kct.delete(flows, sb.node_ns) == 1  # only A's entry; B's fresh flow stays
        assert all(f.reply_src == B for f in kct.list_flows(sb.node_ns, V4))
        assert conn.exchange().endpoint == f"{B}:5353"  # same socket, same source port


@pytest.mark.kernel
def test_first_endpoint_ends_the_black_hole(sandbox: Sandbox) -> None:
    sb = sandbox
    svc = udp_service()
    # Before any rule for the service exists, datagrams to its IP are routed on (here into the
    # node's sink) and conntrack records them without NAT.
    apply_nft(state(None), sb.node_ns)
    with sb.open("outside", "10.96.0.10", 53, "udp", timeout=0.3) as conn:
        assert conn.exchange().kind == "timeout"
        new = state(svc, ep(A))
        apply_nft(new, sb.node_ns)
        # The un-NATed entry keeps the flow away from the endpoint. Its packets still address
        # the cluster IP, now allocated, and an unreplied UDP flow stays `ct state new`: the
        # cluster-ips check rejects them (kube-proxy's nftables mode does the same).
        assert conn.exchange().kind == "refused", "the un-NATed entry should keep the flow off the endpoint"
        assert sb.connect("outside", "10.96.0.10", 53, "udp")[0].endpoint == f"{A}:5353"
        flows = stale_flows(state(None), new)
        # The black hole, and (as kube-proxy's filter is by destination only) the fresh flow.
        assert kct.delete(flows, sb.node_ns) == 2
        assert conn.exchange().endpoint == f"{A}:5353"


@pytest.mark.kernel
def test_rejected_period_leaves_no_entry(sandbox: Sandbox) -> None:
    # With no endpoints the rules reject before conntrack confirms the flow, so unlike the
    # unprogrammed period above there is no entry to clean: the same socket works at once.
    sb = sandbox
    svc = udp_service()
    apply_nft(state(svc), sb.node_ns)
    with sb.open("outside", "10.96.0.10", 53, "udp", timeout=0.5) as conn:
        assert conn.exchange().kind == "refused"
        assert [f for f in kct.list_flows(sb.node_ns, V4) if f.orig_sport == conn.local_port] == []
        apply_nft(state(svc, ep(A)), sb.node_ns)
        assert conn.exchange().endpoint == f"{A}:5353"

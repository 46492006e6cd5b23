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

from nfproxy.core.changes import diff
from nfproxy.daemon.conntrack import stale_flows, sweeps
from nfproxy.daemon.node import Daemon, DaemonConfig
from nfproxy.daemon.proxier import Proxier
from nfproxy.kernel.conntrack import Flow, FlowFilter
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


CLIENT = "10.244.1.9"


def entry(dst: str, dport: int, reply: str, rport: int = 5353, family: IPFamily = V4,
          protocol: Protocol = Protocol.UDP, sport: int = 40000) -> Flow:
    """An entry as the kernel reads back: sent to dst:dport, answered from reply:rport."""
    src = CLIENT if family is V4 else "fd01::9"
    return Flow(family, protocol, src, sport, dst, dport, reply, rport, src, sport)


def deleted(old: ClusterState | None, new: ClusterState, *flows: Flow) -> set[Flow]:
    """Which of `flows` the sync old -> new deletes: its sweeps' judgement of each."""
    judges = {s.family: s for s in sweeps(old, new, diff(old, new).keys)}
    return {f for f in flows if f.family in judges and judges[f.family].stale(f)}


# ---- which entries are stale


def test_removed_endpoint_through_every_address_and_the_node_port() -> None:
    svc = udp_service(
        type=ServiceType.LOAD_BALANCER, node_port=30053, external_ips=("203.0.113.7",),
        load_balancer_ips=("198.51.100.7",),
    )
    to_a = [entry(ip, 53, A) for ip in ("10.96.0.10", "203.0.113.7", "198.51.100.7")]
    to_a.append(entry("192.168.0.2", 30053, A))
    to_b = [dataclasses.replace(f, reply_src=B) for f in to_a]
    assert deleted(state(svc, ep(A), ep(B)), state(svc, ep(B)), *to_a, *to_b) == set(to_a)
    why = {s.family: s for s in sweeps(state(svc, ep(A), ep(B)), state(svc, ep(B)), [svc.key])}[V4]
    assert why.stale(to_a[0]) == "10.96.0.10:53: reply from 10.244.0.5:5353, not a serving endpoint"


def test_endpoint_no_longer_serving_is_removed_but_terminating_serving_is_not() -> None:
    svc = udp_service()
    old = state(svc, ep(A), ep(B))
    flows = (entry("10.96.0.10", 53, A), entry("10.96.0.10", 53, B))
    # B terminates but still serves: kube-proxy keeps its flows (policy changes never cut flows).
    assert deleted(old, state(svc, ep(A), ep(B, ready=False, terminating=True)), *flows) == set()
    gone = state(svc, ep(A), ep(B, ready=False, serving=False, terminating=True))
    assert deleted(old, gone, *flows) == {flows[1]}
    # Same IP, other port: a different endpoint (kube-proxy's #130542 matches the port too).
    moved = entry("10.96.0.10", 53, B, 5354)
    assert deleted(old, state(svc, ep(A), ep(B, 5354)), *flows, moved) == {flows[1]}


def test_first_endpoint_ends_the_black_hole_and_keeps_fresh_flows() -> None:
    """Entries made before the service had rules carry no NAT (the reply comes from the address
    itself): stale once endpoints serve. A flow already DNATed to the new endpoint stays."""
    svc = udp_service(type=ServiceType.NODE_PORT, node_port=30053, external_ips=("203.0.113.7",))
    holes = {entry("10.96.0.10", 53, "10.96.0.10", 53), entry("203.0.113.7", 53, "203.0.113.7", 53),
             entry("192.168.0.2", 30053, "192.168.0.2", 30053)}
    fresh = {entry("10.96.0.10", 53, A), entry("192.168.0.2", 30053, A)}
    assert deleted(state(svc), state(svc, ep(A)), *holes, *fresh) == holes
    assert deleted(state(None), state(svc, ep(A)), *holes, *fresh) == holes
    dead = state(svc, ep(A, ready=False, serving=False))
    assert deleted(dead, state(svc, ep(A)), *holes, *fresh) == holes
    assert deleted(state(svc, ep(A)), state(svc, ep(A), ep(B)), *fresh) == set()


def test_scaled_to_zero_every_entry_to_its_addresses_goes() -> None:
    """kubernetes#139629: the reject rule of a service without endpoints matches its address,
    which conntrack has already rewritten for an existing flow; so every entry sent to the
    service's addresses is stale. Through the node port, the entries DNATed to the endpoints
    that went away (upstream leaves a node port of such a service alone: matched on the port
    alone, it could be anyone's flow; nfproxy knows which endpoints went)."""
    svc = udp_service(type=ServiceType.NODE_PORT, node_port=30053, external_ips=("203.0.113.7",))
    ours = {entry("10.96.0.10", 53, A), entry("10.96.0.10", 53, B, sport=40001),
            entry("203.0.113.7", 53, A), entry("10.96.0.10", 53, "10.96.0.10", 53, sport=40002),
            entry("192.168.0.2", 30053, A), entry("192.168.0.2", 30053, B)}
    theirs = {entry("192.168.0.9", 30053, "192.168.0.9", 30053), entry("10.96.0.10", 54, A)}
    assert deleted(state(svc, ep(A), ep(B)), state(svc), *ours, *theirs) == ours
    # The same with no sync between (a restart, or a cleanup that failed): the addresses only.
    by_address = {f for f in ours if f.orig_dport == 53}
    assert deleted(None, state(svc), *ours, *theirs) == by_address


def test_removed_service_and_removed_addresses_are_cleared_whole() -> None:
    svc = udp_service(type=ServiceType.NODE_PORT, node_port=30053, external_ips=("203.0.113.7",))
    ours = {entry("10.96.0.10", 53, A), entry("203.0.113.7", 53, "203.0.113.7", 53),
            entry("192.168.0.2", 30053, A)}
    theirs = {entry("192.168.0.9", 30053, "192.168.0.9", 30053)}
    assert deleted(state(svc, ep(A)), state(None), *ours, *theirs) == ours
    # One external IP dropped, an endpoint gone at the same time: the dropped address whole,
    # the endpoint through what remains.
    smaller = dataclasses.replace(svc, external_ips=())
    flows = {entry("203.0.113.7", 53, B), entry("10.96.0.10", 53, A), entry("192.168.0.2", 30053, A)}
    kept = {entry("10.96.0.10", 53, B)}
    assert deleted(state(svc, ep(A), ep(B)), state(smaller, ep(B)), *flows, *kept) == flows
    filters = stale_flows(state(svc, ep(A), ep(B)), state(smaller, ep(B)))
    assert [str(f) for f in filters] == [
        "-f ipv4 -p udp --orig-port-dst 30053 --reply-src 10.244.0.5 --reply-port-src 5353",
        "-f ipv4 -p udp --orig-dst 203.0.113.7 --orig-port-dst 53",
    ]


def test_only_udp_and_ipv6_in_canonical_form() -> None:
    tcp = udp_service(name=dataclasses.replace(DNS, protocol=Protocol.TCP))
    assert sweeps(state(tcp, ep(A)), state(tcp), [tcp.key]) == []
    assert deleted(state(tcp, ep(A)), state(tcp), entry("10.96.0.10", 53, A, protocol=Protocol.TCP)) == set()
    v6 = udp_service(family=V6, cluster_ip="fd00:96::a")
    to_5, to_6 = entry("fd00:96::a", 53, "fd01::5", family=V6), entry("fd00:96::a", 53, "fd01::6", family=V6)
    assert deleted(state(v6, ep("fd01::5"), ep("fd01::6")), state(v6, ep("fd01::6")), to_5, to_6) == {to_5}
    sweep = sweeps(None, state(v6, ep("fd01::6")), ())[0]
    assert sweep.stale(to_5) == "fd00:96::a:53: reply from [fd01::5]:5353, not a serving endpoint"


def test_only_a_sync_that_changed_a_udp_service_port_walks_its_family() -> None:
    """kube-proxy walks the table when EndpointsMap.Update says ConntrackCleanupRequired (a UDP
    service port's endpoints changed); nfproxy also when its service changed. The first sync
    and one owed after a failure walk every family with UDP services."""
    udp4 = udp_service()
    udp6 = udp_service(family=V6, cluster_ip="fd00:96::a")
    tcp4 = udp_service(name=dataclasses.replace(DNS, name="web", protocol=Protocol.TCP), cluster_ip="10.96.0.80")
    both = ClusterState(NODE, {s.key: s for s in (udp4, udp6, tcp4)},
                        {udp4.key: (ep(A),), udp6.key: (ep("fd01::5"),), tcp4.key: (ep(A),)})
    assert [s.family for s in sweeps(None, both, ())] == [V4, V6]
    assert [s.family for s in sweeps(both, both, (), owed=True)] == [V4, V6]
    assert sweeps(both, both, ()) == []
    tcp_only = dataclasses.replace(both, endpoints={**both.endpoints, tcp4.key: (ep(B),)})
    assert sweeps(both, tcp_only, diff(both, tcp_only).keys) == []
    v6_only = dataclasses.replace(both, endpoints={**both.endpoints, udp6.key: (ep("fd01::6"),)})
    assert [s.family for s in sweeps(both, v6_only, diff(both, v6_only).keys)] == [V6]


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
    judge = kct.matcher([f, dataclasses.replace(node_port, reason="np")])
    assert judge(entry("192.168.0.2", 30053, B)) == "np"
    assert judge(entry("10.96.0.10", 53, A)) == ""  # matched (a filter without a reason)
    assert judge(entry("10.96.0.10", 53, B)) is None


@given(clusters(max_services=15, max_endpoints=6))
def test_properties_on_random_clusters(old: ClusterState) -> None:
    assert sweeps(old, old, diff(old, old).keys) == []
    # Drop every other endpoint everywhere: a flow DNATed through the cluster IP to a dropped
    # serving UDP endpoint is stale, one to a kept serving endpoint is not, TCP never is.
    new_eps = {k: eps[::2] for k, eps in old.endpoints.items()}
    new = dataclasses.replace(old, endpoints=new_eps)
    judges = {s.family: s for s in sweeps(old, new, diff(old, new).keys)}
    for key, eps in old.endpoints.items():
        svc = old.services[key]
        if not svc.cluster_ip:
            continue
        for i, e in enumerate(eps):
            if not e.serving:
                continue
            f = entry(svc.cluster_ip, svc.port, e.ip, e.port, family=key[1], protocol=svc.protocol)
            stale = key[1] in judges and judges[key[1]].stale(f) is not None
            dropped = i % 2 == 1 and not any(k.ip == e.ip and k.port == e.port and k.serving for k in new_eps[key])
            assert stale == (svc.protocol is Protocol.UDP and dropped), (f, eps)


def test_reversed_change_is_the_first_endpoint_case() -> None:
    old = random_cluster(random.Random(7), 30)
    empty = dataclasses.replace(old, endpoints={})
    judges = {s.family: s for s in sweeps(empty, old, diff(empty, old).keys)}
    udp_with_serving = {
        k for k, eps in old.endpoints.items()
        if old.services[k].protocol is Protocol.UDP and any(e.serving for e in eps)
    }
    assert udp_with_serving, "the seed should give UDP services"
    for key in udp_with_serving:
        svc = old.services[key]
        hole = entry(svc.cluster_ip, svc.port, svc.cluster_ip, svc.port, family=key[1])
        assert judges[key[1]].stale(hole)


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


def clean(old: ClusterState | None, new: ClusterState, ns: str) -> int:
    """What the daemon does after a sync from old to new: each sweep's walk of the table."""
    return sum(kct.delete_judged(ns, s.family, Protocol.UDP, s.stale) for s in sweeps(old, new, diff(old, new).keys))


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

        assert clean(old, new, sb.node_ns) == 1  # only A's entry; B's fresh flow stays
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
        # The black hole only: the fresh flow's reply comes from a serving endpoint.
        assert clean(state(None), new, sb.node_ns) == 1
        assert conn.exchange().endpoint == f"{A}:5353"
        assert [f.reply_src for f in kct.list_flows(sb.node_ns, V4)] == [A, A]


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


@pytest.mark.kernel
def test_scaled_to_zero_the_flow_is_rejected_once_its_entry_is_deleted(sandbox: Sandbox) -> None:
    """kubernetes#139629 with real traffic: with no endpoint left the rules reject the service,
    but only for new flows; a sender that keeps its source port stays DNATed to the gone
    endpoint until its entry is deleted, then is told at once (ICMP port unreachable)."""
    sb = sandbox
    svc = udp_service()
    old, new = state(svc, ep(A)), state(svc)
    apply_nft(old, sb.node_ns)
    with sb.open("outside", "10.96.0.10", 53, "udp", timeout=0.5) as conn:
        assert conn.exchange().endpoint == f"{A}:5353"
        apply_nft(new, sb.node_ns)
        assert conn.exchange().endpoint == f"{A}:5353", "the entry should still pin A"
        assert sb.connect("outside", "10.96.0.10", 53, "udp")[0].kind == "refused"  # new flows
        assert clean(old, new, sb.node_ns) == 1
        assert conn.exchange().kind == "refused"


@pytest.mark.kernel
def test_scaled_to_zero_while_the_daemon_was_down_the_restart_cuts_the_flow(sandbox: Sandbox) -> None:
    """kubernetes#139629 across a restart: the daemon's first sync knows no previous state, so
    only its walk of the table against the current one can find the entry to the gone endpoint.
    Until 2026-12-07 that walk skipped services without serving endpoints: the sender stayed
    pinned to A. The daemon writes the rules here (nft, the real kernel, in the sandbox's node)."""
    sb = sandbox
    svc = udp_service()

    def daemon() -> Daemon:
        proxier = Proxier("nft", netns=sb.node_ns, families=(V4,))
        config = DaemonConfig("nft", netns=sb.node_ns, health_check_node_ports=False,
                              healthz_bind_address="", metrics_bind_address="")
        return Daemon(None, config, proxier)  # type: ignore[arg-type]  # driven through its proxier

    before = daemon()
    assert before.proxier.sync(state(svc, ep(A))).kind == "full"
    before.proxier.close()
    with sb.open("outside", "10.96.0.10", 53, "udp", timeout=0.5) as conn:
        assert conn.exchange().endpoint == f"{A}:5353"
        after = daemon()  # A went away while no daemon ran
        assert after.proxier.sync(state(svc)).kind == "full"
        assert [f for f in kct.list_flows(sb.node_ns, V4) if f.reply_src == A] == []
        assert after.metrics.conntrack_deleted.labels("IPv4")._value.get() == 1
        assert conn.exchange().kind == "refused"
        after.proxier.close()


@pytest.mark.kernel
def test_entries_in_other_zones_are_read_and_deleted_in_their_zone(netns: str) -> None:
    """The delete carries the zone the entry was read with (one tuple can live in two zones)."""
    with netns_mod.entered(netns):
        ct = Conntrack(nfgen_family=socket.AF_INET)
        try:
            for zone, sport in ((0, 40001), (7, 40001), (7, 40002)):
                ct.entry(
                    "add", timeout=120, zone=zone,
                    tuple_orig=NFCTAttrTuple(family=socket.AF_INET, saddr=CLIENT, sport=sport,
                                             daddr="10.96.0.10", dport=53, proto=17),
                    tuple_reply=NFCTAttrTuple(family=socket.AF_INET, saddr=A, sport=5353,
                                              daddr=CLIENT, dport=sport, proto=17),
                )
        finally:
            ct.close()
    assert sorted(f.orig_sport for f in kct.list_flows(netns, V4)) == [40001, 40001, 40002]
    assert kct.delete_judged(netns, V4, Protocol.UDP, lambda f: "stale" if f.orig_sport == 40001 else None) == 2
    assert [f.orig_sport for f in kct.list_flows(netns, V4)] == [40002]


def test_an_entry_laid_out_otherwise_is_read_by_the_general_walk() -> None:
    """The fast pattern knows the kernel's usual layout; another order of the same attributes
    (or one more, a zone inside a tuple) is read attribute by attribute, to the same flow."""
    def attr(kind: int, value: bytes) -> bytes:
        return kct._attr(kind, value)

    def tuple_(kind: int, src: str, dst: str, sport: int, dport: int) -> bytes:
        ip = kct._nested(1, attr(1, socket.inet_aton(src)), attr(2, socket.inet_aton(dst)))
        proto = kct._nested(2, attr(3, dport.to_bytes(2, "big")), attr(2, sport.to_bytes(2, "big")), attr(1, b"\x11"))
        return kct._nested(kind, proto, ip, attr(3, b"\x00\x07"))  # proto first; a CTA_TUPLE_ZONE

    msg = tuple_(1, CLIENT, "10.96.0.10", 40001, 53) + tuple_(2, A, CLIENT, 5353, 40001) + attr(3, b"\0\0\0\x08")
    assert kct._TUPLES[socket.AF_INET].match(msg, 0) is None
    flow = kct._decode(msg, 0, len(msg), V4, 17, kct._Addresses(socket.AF_INET))
    assert flow == entry("10.96.0.10", 53, A, sport=40001)
    assert kct._decode(msg, 0, len(msg), V4, 6, kct._Addresses(socket.AF_INET)) is None  # not TCP


@pytest.mark.kernel
def test_a_kernel_that_refuses_the_dump_filter_is_read_whole(netns: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A filter flag this kernel does not know is refused (EOPNOTSUPP), as a kernel before 5.8
    would refuse or ignore the filter: the family's whole table is read, and its UDP kept."""
    add_entry(netns, V4, (CLIENT, 40001, "10.96.0.10", 53), (A, 5353, CLIENT, 40001))
    add_entry(netns, V4, (CLIENT, 40002, "10.96.0.10", 53), (A, 5353, CLIENT, 40002), proto=6)
    add_entry(netns, V6, ("fd01::9", 40003, "fd00:96::a", 53), ("fd01::5", 5353, "fd01::9", 40003))
    monkeypatch.setattr(kct, "_CTA_FILTER_FLAG_PROTO_NUM", 1 << 30)
    asked: list[bool] = []
    request = kct._dump_request

    def recorded(af: int, proto: int, *, filtered: bool = True) -> bytes:
        asked.append(filtered)
        return request(af, proto, filtered=filtered)

    monkeypatch.setattr(kct, "_dump_request", recorded)
    assert [f.orig_sport for f in kct.list_flows(netns, V4)] == [40001]
    assert asked == [True, False]
    assert [f.orig_sport for f in kct.list_flows(netns, V4, Protocol.TCP)] == [40002]
    assert kct.delete_judged(netns, V4, Protocol.UDP, lambda f: "stale") == 1

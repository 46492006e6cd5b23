"""kube-proxy's rule behaviours on real traffic in throwaway namespaces: the INVALID drop and
its counter, localhost node ports (iptables, with route_localnet set only in the namespace
programmed), the eTP=Local pod short-circuit by the first pod CIDR only, and the nft backend's
cluster-ips check (reject on an unused port, drop on an unallocated address)."""

from __future__ import annotations

import re

import socket
import struct
import time

import pytest
from prometheus_client import CollectorRegistry

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
from nfproxy.daemon.invalid_drops import METRIC, InvalidDropCollector, reader
from nfproxy.daemon.localhost import ROUTE_LOCALNET, prepare
from nfproxy.daemon.proxier import Proxier
from nfproxy.kernel import netns as netns_mod
from nfproxy.kernel import sysctl
from nfproxy.kernel.iptables import IptablesRunner
from nfproxy.kernel.nft import NftSession
from nfproxy.verify.sandbox import Sandbox, SandboxSpec

pytestmark = pytest.mark.kernel

V4 = IPFamily.V4
NODE_IP = "192.168.0.2"
EP_LOCAL, EP_REMOTE = "10.244.1.1", "10.244.2.1"


def _state(node: NodeConfig, *ports: ServicePort) -> ClusterState:
    eps = sort_endpoints([Endpoint(EP_LOCAL, 8080, node_name="node-a"), Endpoint(EP_REMOTE, 8080, node_name="node-b")])
    return ClusterState(node, {p.key: p for p in ports}, {p.key: eps for p in ports})


def _spec(**clients: str) -> SandboxSpec:
    return SandboxSpec.of(node_ips=[NODE_IP], clients=clients,
                          endpoints={EP_LOCAL: [(8080, "tcp")], EP_REMOTE: [(8080, "tcp")]})


def _nodeport(name: str = "web") -> ServicePort:
    return ServicePort(ServicePortName("ns1", name, "http", Protocol.TCP), V4, ServiceType.NODE_PORT,
                       "10.96.0.10", 80, node_port=30080)


# --------------------------------------------------------------------------------------------
# The INVALID drop


def _tcp_without_flags(src: str, dst: str, port: int) -> bytes:
    """A TCP segment with no flag at all: conntrack calls that combination INVALID."""
    header = struct.pack("!HHIIBBHHH", 40000, port, 1, 0, 5 << 4, 0, 1024, 0, 0)
    pseudo = socket.inet_aton(src) + socket.inet_aton(dst) + struct.pack("!BBH", 0, socket.IPPROTO_TCP, len(header))
    data = pseudo + header
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return header[:16] + struct.pack("!H", ~total & 0xFFFF) + header[18:]


def _send_invalid(ns: str, src: str, dst: str, port: int) -> None:
    with netns_mod.entered(ns), socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_TCP) as s:
        s.sendto(_tcp_without_flags(src, dst, port), (dst, 0))


def _scrape(read) -> float | None:  # noqa: ANN001
    registry = CollectorRegistry()
    registry.register(InvalidDropCollector(read))
    return registry.get_sample_value(METRIC)


def _wait_for(predicate, timeout: float = 5.0) -> bool:  # noqa: ANN001
    """Forwarding runs in softirq, not in the sender's call: wait for the event, not a time."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


@pytest.mark.parametrize("backend", ["iptables", "nft"])
def test_invalid_packet_is_dropped_and_counted(backend: str) -> None:
    node = NodeConfig(name="node-a", ips=(NODE_IP,), cluster_cidrs=("10.244.0.0/16",))
    with Sandbox(_spec(pod="10.244.5.5")) as sb:
        assert sysctl.read("net.netfilter.nf_conntrack_tcp_be_liberal", sb.node_ns) == "0"
        Proxier(backend, netns=sb.node_ns).sync(_state(node, _nodeport()))
        read = reader(backend, sb.node_ns)
        assert _scrape(read) == 0.0
        # An ordinary connection through the node is not counted.
        assert sb.connect("pod", EP_REMOTE, 8080, "tcp", 3)[0].ok
        assert _scrape(read) == 0.0
        for _ in range(3):
            _send_invalid(sb.client_ns("pod"), "10.244.5.5", EP_REMOTE, 8080)
        assert _wait_for(lambda: _scrape(read) == 3.0), _scrape(read)


@pytest.mark.parametrize("backend", ["iptables", "nft"])
def test_no_invalid_drop_when_tcp_be_liberal(backend: str) -> None:
    with Sandbox(_spec(pod="10.244.5.5")) as sb:
        sysctl.ensure("net.netfilter.nf_conntrack_tcp_be_liberal", 1, sb.node_ns)
        liberal = sysctl.read("net.netfilter.nf_conntrack_tcp_be_liberal", sb.node_ns) != "0"
        node = NodeConfig(name="node-a", ips=(NODE_IP,), drop_invalid=not liberal)
        Proxier(backend, netns=sb.node_ns).sync(_state(node, _nodeport()))
        if backend == "iptables":
            dump = IptablesRunner(V4, sb.node_ns).save("filter")
            assert "-A KUBE-FORWARD" in dump and "INVALID" not in dump
        else:
            dump = NftSession(sb.node_ns).list_text()
            # The endpoint maps' per-element connection counters are not the INVALID drop's.
            own = re.sub(r"\tmap endpoints-counted-\S+ \{.*?\n\t\}", "", dump, flags=re.S)
            assert "\tmap endpoints-counted-" in dump and "\tmap endpoints-counted-" not in own
            assert "filter-forward" in dump and "ct state invalid" not in dump and "counter" not in own
        assert _scrape(reader(backend, sb.node_ns)) is None


# --------------------------------------------------------------------------------------------
# Localhost node ports


def test_iptables_accepts_node_ports_on_localhost_by_default() -> None:
    root_before = sysctl.read(ROUTE_LOCALNET)
    node = NodeConfig(name="node-a", ips=(NODE_IP,), cluster_cidrs=("10.244.0.0/16",))
    with Sandbox(_spec()) as sb:
        prepare("iptables", node, sb.node_ns)
        assert sysctl.read(ROUTE_LOCALNET, sb.node_ns) == "1"
        Proxier("iptables", netns=sb.node_ns).sync(_state(node, _nodeport()))
        outcomes = sb.connect("node", "127.0.0.1", 30080, "tcp", 40)
        assert {o.endpoint for o in outcomes} == {f"{EP_LOCAL}:8080", f"{EP_REMOTE}:8080"}, outcomes[:3]
        # Masqueraded: the endpoint never sees a loopback source.
        assert all(o.source and not o.source.startswith("127.") for o in outcomes)
    assert sysctl.read(ROUTE_LOCALNET) == root_before


@pytest.mark.parametrize(("backend", "localhost"), [("iptables", False), ("nft", True)])
def test_localhost_node_ports_off_or_unsupported(backend: str, localhost: bool) -> None:
    node = NodeConfig(name="node-a", ips=(NODE_IP,), cluster_cidrs=("10.244.0.0/16",), localhost_nodeports=localhost)
    with Sandbox(_spec()) as sb:
        sysctl.ensure(ROUTE_LOCALNET, 0, sb.node_ns)  # a new namespace may inherit the host's
        prepare(backend, node, sb.node_ns)
        assert sysctl.read(ROUTE_LOCALNET, sb.node_ns) == "0"
        Proxier(backend, netns=sb.node_ns).sync(_state(node, _nodeport()))
        outcomes = sb.connect("node", "127.0.0.1", 30080, "tcp", 3)
        assert [o.kind for o in outcomes] == ["refused"] * 3, outcomes
        # The node port itself works on the node IP.
        assert sb.connect("node", NODE_IP, 30080, "tcp", 1)[0].ok


# --------------------------------------------------------------------------------------------
# eTP=Local short-circuit: the first pod CIDR only, in both backends


@pytest.mark.parametrize("backend", ["iptables", "nft"])
def test_pod_short_circuit_uses_the_first_pod_cidr(backend: str) -> None:
    node = NodeConfig(name="node-a", ips=(NODE_IP,), cluster_cidrs=("10.244.0.0/16", "10.250.0.0/16"))
    svc = ServicePort(ServicePortName("ns1", "lb", "http", Protocol.TCP), V4, ServiceType.LOAD_BALANCER,
                      "10.96.0.20", 80, node_port=30081, external_ips=("192.168.99.11",),
                      external_policy_local=True, health_check_node_port=30000)
    with Sandbox(_spec(pod="10.244.5.5", other="10.250.5.5")) as sb:
        Proxier(backend, netns=sb.node_ns).sync(_state(node, svc))
        pod = sb.connect("pod", "192.168.99.11", 80, "tcp", 40)
        other = sb.connect("other", "192.168.99.11", 80, "tcp", 20)
    # 40 connections miss one of two endpoints with probability 2 * 2^-40.
    assert {o.endpoint for o in pod} == {f"{EP_LOCAL}:8080", f"{EP_REMOTE}:8080"}, pod[:3]
    assert {o.endpoint for o in other} == {f"{EP_LOCAL}:8080"}, other[:3]
    assert {o.source for o in other} == {"10.250.5.5"}


# --------------------------------------------------------------------------------------------
# nft cluster-ips check (upstream's TestClusterIPGeneral flows)


def test_nft_rejects_unused_ports_and_drops_unallocated_cluster_ips() -> None:
    node = NodeConfig(name="node-a", ips=(NODE_IP,), cluster_cidrs=("10.244.0.0/16",),
                      service_cidrs=("10.96.0.0/16",))
    with Sandbox(_spec(pod="10.244.5.5")) as sb:
        proxier = Proxier("nft", netns=sb.node_ns)
        proxier.sync(_state(node, _nodeport()))
        assert sb.connect("pod", "10.96.0.10", 80, "tcp", 1)[0].ok
        assert [o.kind for o in sb.connect("pod", "10.96.0.10", 443, "tcp", 2)] == ["refused"] * 2
        assert [o.kind for o in sb.connect("pod", "10.96.0.10", 80, "udp", 2)] == ["refused"] * 2
        assert [o.kind for o in sb.connect("pod", "10.96.0.50", 80, "tcp", 2, timeout=0.5)] == ["timeout"] * 2
        # From the node itself too (checked after its own DNAT).
        assert [o.kind for o in sb.connect("node", "10.96.0.10", 443, "tcp", 1)] == ["refused"]
        assert sb.connect("node", "10.96.0.10", 80, "tcp", 1)[0].ok
        # A partial sync that adds a service allocates its address: no longer dropped.
        second = ServicePort(ServicePortName("ns1", "new", "http", Protocol.TCP), V4, ServiceType.CLUSTER_IP,
                             "10.96.0.50", 80)
        assert proxier.sync(_state(node, _nodeport(), second)).kind == "partial"
        assert sb.connect("pod", "10.96.0.50", 80, "tcp", 1)[0].ok
        assert [o.kind for o in sb.connect("pod", "10.96.0.50", 81, "tcp", 1)] == ["refused"]


def test_nft_leaves_localhost_node_ports_alone_exactly() -> None:
    """The same flow on the nft backend (read back from the kernel): untouched, as upstream's
    nftables mode, whatever --iptables-localhost-nodeports says."""
    from nfproxy.analysis import nft_json
    from nfproxy.analysis.interpret import Packet, interpret
    from nfproxy.backends.nft import render as nft_render

    node = NodeConfig(name="node-a", ips=(NODE_IP,), cluster_cidrs=("10.0.0.0/8",))
    state = _state(node, _nodeport())
    with netns_mod.throwaway("nfp-h2") as ns:
        session = NftSession(ns)
        session.apply(nft_render.render(state, V4).script())
        rs = nft_json.parse(session.list_table("ip", "nfproxy"))
    dist = interpret(rs, Packet("127.0.0.1", "127.0.0.1", 30080, "tcp", "node"), node_ips=node.ips, mode="ideal")
    assert {o.verdict for o in dist} == {"accept"}
    dist = interpret(rs, Packet(NODE_IP, NODE_IP, 30080, "tcp", "node"), node_ips=node.ips, mode="ideal")
    assert {o.endpoint for o in dist} == {f"{EP_LOCAL}:8080", f"{EP_REMOTE}:8080"}

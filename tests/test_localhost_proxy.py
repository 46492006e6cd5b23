"""The localhost node-port proxy's decisions, without root (its traffic is in
test_localhost_nodeports_kernel.py): which node ports it serves with which endpoints (upstream's
NodePortSpec from the nftables proxier), how it picks one (pickEndpoint, affinity included), the
rules' reject sets per gate and addresses, and the metrics it feeds."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, generate_latest

from nfproxy.backends.nft import render as nft
from nfproxy.core.model import (
    ClusterState,
    Endpoint,
    IPFamily,
    NodeConfig,
    Protocol,
    ServicePort,
    ServicePortName,
    ServiceType,
)
from nfproxy.daemon.localhost_proxy import NodePortSpec, _Listener, localhost_node_ports
from nfproxy.daemon.metrics import LocalhostRejectedCollector, ProxyMetrics

V4, V6 = IPFamily.V4, IPFamily.V6
LOCAL, REMOTE = Endpoint("10.180.0.1", 80, node_name="node-a"), Endpoint("10.180.2.1", 80, node_name="node-b")
ON = NodeConfig(name="node-a", ips=("192.168.0.2",), nodeport_addresses=("localhost",), nft_localhost_nodeports=True)


def _port(name: str, proto: Protocol = Protocol.TCP, family: IPFamily = V4, **kw: object) -> ServicePort:
    cip = "fd00::41" if family is V6 else "172.30.0.41"
    return ServicePort(ServicePortName("ns1", name, "p", proto), family, ServiceType.NODE_PORT, cip, 80,  # type: ignore[arg-type]
                       **{"node_port": 30000 + len(name), **kw})


def _state(node: NodeConfig, *ports: ServicePort, eps: tuple[Endpoint, ...] = (LOCAL, REMOTE)) -> ClusterState:
    return ClusterState(node, {p.key: p for p in ports}, {p.key: eps for p in ports})


def test_tcp_node_ports_with_endpoints_are_served_with_their_external_endpoints() -> None:
    ports = (_port("a"), _port("bb", external_policy_local=True), _port("ccc", Protocol.UDP),
             _port("dddd", affinity_timeout=60))
    specs = {s.node_port: s for s in localhost_node_ports(_state(ON, *ports))}
    assert set(specs) == {30001, 30002, 30004}  # UDP is the rules' to reject
    assert specs[30001].endpoints == (LOCAL, REMOTE) and specs[30001].family is V4
    assert specs[30002].endpoints == (LOCAL,)  # eTP=Local: the local endpoints
    assert specs[30004].affinity_timeout == 60
    # eTP=Local without a local endpoint: nothing to serve, no listener (upstream skips it).
    assert localhost_node_ports(_state(ON, _port("bb", external_policy_local=True), eps=(REMOTE,))) == ()


def test_nothing_is_served_with_the_gate_off_or_without_loopback_addresses() -> None:
    off = NodeConfig(name="node-a", nodeport_addresses=("localhost",))
    no_loopback = NodeConfig(name="node-a", nodeport_addresses=("primary",), nft_localhost_nodeports=True)
    everything = NodeConfig(name="node-a", nodeport_addresses=("all",), nft_localhost_nodeports=True)
    for node in (off, no_loopback, everything):
        assert localhost_node_ports(_state(node, _port("a"))) == ()
    # Per family: `127.0.0.0/8` names IPv4 loopback only.
    v4_only = NodeConfig(name="node-a", nodeport_addresses=("127.0.0.0/8",), nft_localhost_nodeports=True)
    v6 = Endpoint("fd00:180::1", 80, node_name="node-a")
    state = ClusterState(v4_only, {p.key: p for p in (_port("a"), _port("a", family=V6))},
                         {_port("a").key: (LOCAL,), _port("a", family=V6).key: (v6,)})
    assert [s.family for s in localhost_node_ports(state)] == [V4]


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _listener(spec: NodePortSpec, clock: _Clock, seed: int = 1) -> _Listener:
    return _Listener(spec, None, random.Random(seed), clock)  # type: ignore[arg-type]


def test_endpoints_are_picked_at_random_and_affinity_pins_a_sliding_window() -> None:
    clock = _Clock()
    plain = _listener(NodePortSpec(V4, 30001, "ns1/a:p", (LOCAL, REMOTE)), clock)
    assert {plain.pick() for _ in range(64)} == {LOCAL, REMOTE}
    sticky = _listener(NodePortSpec(V4, 30001, "ns1/a:p", (LOCAL, REMOTE), 10.0), clock)
    first = sticky.pick()
    for step in range(5):  # each use renews the window (upstream: pinnedLastUsed = now)
        clock.now += 9.0
        assert sticky.pick() == first
    # A pinned endpoint that is gone is replaced; an affinity change drops the pin.
    other = REMOTE if first == LOCAL else LOCAL
    sticky.update(NodePortSpec(V4, 30001, "ns1/a:p", (other,), 10.0))
    assert sticky.pick() == other
    sticky.update(NodePortSpec(V4, 30001, "ns1/a:p", (LOCAL, REMOTE), 0.0))
    assert {sticky.pick() for _ in range(64)} == {LOCAL, REMOTE}


def test_weights_are_honoured_as_the_rules_do() -> None:
    drained = Endpoint("10.180.0.9", 80, node_name="node-a", weight=0)
    listener = _listener(NodePortSpec(V4, 30001, "ns1/a:p", (LOCAL, drained)), _Clock())
    assert {listener.pick() for _ in range(64)} == {LOCAL}


def test_the_rules_reject_what_the_proxy_does_not_serve() -> None:
    tcp, udp = _port("a"), _port("bb", Protocol.UDP)
    served = nft.render(_state(ON, tcp, udp), V4).script()
    assert "ip daddr 127.0.0.0/8 meta l4proto udp th dport @localhost-nodeport-reject-udp" \
           " counter name localhost-nodeport-rejected-udp reject" in served
    assert "localhost-nodeport-reject-tcp" not in served  # the proxy serves TCP
    assert "add element ip nfproxy localhost-nodeport-reject-udp {\n\t30002\n}" in served
    no_proxy = NodeConfig(name="node-a", ips=("192.168.0.2",), nft_localhost_nodeports=True)
    rejected = nft.render(_state(no_proxy, tcp, udp), V4).script()
    assert "@localhost-nodeport-reject-tcp counter name localhost-nodeport-rejected-tcp reject" in rejected
    v6 = nft.render(_state(no_proxy, _port("a", family=V6)), V6).script()
    assert "ip6 daddr ::1 meta l4proto tcp th dport @localhost-nodeport-reject-tcp" in v6
    off = NodeConfig(name="node-a", ips=("192.168.0.2",), nodeport_addresses=("localhost",))
    assert "localhost" not in nft.render(_state(off, tcp, udp), V4).script()


def test_metrics_follow_upstream_names_and_labels() -> None:
    registry = CollectorRegistry()
    metrics = ProxyMetrics(registry, process_metrics=False, backend="nft", localhost_nodeports=True)
    metrics.localhost_listening(2, family=V4)
    metrics.localhost_listener_failed(family=V6)
    registry.register(LocalhostRejectedCollector(lambda: {(V4, "udp"): 5, (V6, "tcp"): 1}))
    text = generate_latest(registry).decode()
    assert 'kubeproxy_nftables_localhost_nodeport_listeners{ip_family="IPv4"} 2.0' in text
    assert 'kubeproxy_nftables_localhost_nodeport_listener_creation_failures_total{ip_family="IPv6"} 1.0' in text
    assert 'kubeproxy_nftables_localhost_nodeport_rejected_packets_total{ip_family="IPv4",protocol="UDP"} 5.0' in text
    assert 'kubeproxy_nftables_localhost_nodeport_rejected_packets_total{ip_family="IPv6",protocol="TCP"} 1.0' in text
    # Gate off, or iptables mode: none of them (upstream registers them only then).
    for kw in ({"backend": "nft"}, {"backend": "iptables", "localhost_nodeports": True}):
        plain = CollectorRegistry()
        ProxyMetrics(plain, process_metrics=False, **kw).localhost_listening(1, family=V4)  # type: ignore[arg-type]
        assert "localhost_nodeport" not in generate_latest(plain).decode()

"""kube-proxy's rule behaviours decided once in core and spelled by both backends (issue G
point 4, issue H point 3): local-traffic detection, node-port addresses, source-range VIPs,
masquerade bit, the INVALID drop, localhost node ports and the nft cluster-ips check; the
flags that set them; ServiceCIDR objects from manifests."""

from __future__ import annotations

import argparse

import pytest

from nfproxy.nftables.text import commands as nft_commands
from nfproxy.backends.iptables import render as ipt
from nfproxy.backends.nft import render as nft
from nfproxy.cli.config import FlagError, add_node_flags, node_config_from_args
from nfproxy.core.categorize import PodMatch, PodMatchKind, firewall_sources, nodeport_cidrs, pod_match
from nfproxy.core.model import (
    ClusterState,
    Endpoint,
    IPFamily,
    LocalMode,
    NodeConfig,
    Protocol,
    ServicePort,
    ServicePortName,
    ServiceType,
)
from nfproxy.sources.manifests import load_objects

V4, V6 = IPFamily.V4, IPFamily.V6
NODE = NodeConfig(name="node-a", ips=("192.168.0.2",), cluster_cidrs=("10.0.0.0/16", "10.2.0.0/16"))


def _spn(name: str = "svc1", port: str = "p80") -> ServicePortName:
    return ServicePortName("ns1", name, port, Protocol.TCP)


def _etp_local_lb(**kw: object) -> ServicePort:
    fields: dict[str, object] = dict(
        node_port=3001,
        load_balancer_ips=("1.2.3.4",),
        external_policy_local=True,
    )
    fields.update(kw)
    return ServicePort(_spn(), V4, ServiceType.LOAD_BALANCER, "172.30.0.41", 80, **fields)  # type: ignore[arg-type]


def _state(node: NodeConfig, *ports: ServicePort) -> ClusterState:
    eps = (Endpoint("10.180.0.1", 80, node_name="node-a"), Endpoint("10.180.2.1", 80, node_name="node-b"))
    return ClusterState(node, {p.key: p for p in ports}, {p.key: eps for p in ports})


def _ipt(state: ClusterState, family: IPFamily = V4) -> str:
    return ipt.render(state, family).restore_text()


def _nft(state: ClusterState, family: IPFamily = V4) -> str:
    return nft.render(state, family).script()


# --------------------------------------------------------------------------------------------
# Local-traffic detection: one decision, two spellings


def test_both_backends_use_the_first_pod_cidr_of_the_family() -> None:
    """kube-proxy's ClusterCIDR detector takes one CIDR per family (cidrs[0]); nft used to
    match every CIDR and iptables only the first."""
    assert pod_match(NODE, V4) == PodMatch(PodMatchKind.CIDR, "10.0.0.0/16")
    state = _state(NODE, _etp_local_lb())
    i, n = _ipt(state), _nft(state)
    assert "-s 10.0.0.0/16 -j KUBE-SVC-" in i and "! -s 10.0.0.0/16 -j KUBE-MARK-MASQ" in i
    assert "10.2.0.0/16" not in i
    assert 'ip saddr 10.0.0.0/16 goto service-' in n and "ip saddr != 10.0.0.0/16 jump mark-for-masquerade" in n
    assert "10.2.0.0/16" not in n and "cluster-cidrs" not in n


@pytest.mark.parametrize(
    ("mode", "extra", "ipt_local", "nft_local"),
    [
        (LocalMode.BRIDGE_INTERFACE, {"pod_bridge_interface": "cbr0"}, "-i cbr0", 'iifname "cbr0"'),
        (LocalMode.INTERFACE_NAME_PREFIX, {"pod_interface_name_prefix": "veth"}, "-i veth+", 'iifname "veth*"'),
    ],
)
def test_interface_detectors_are_spelled_by_both_backends(
    mode: LocalMode, extra: dict[str, str], ipt_local: str, nft_local: str
) -> None:
    node = NodeConfig(name="node-a", ips=("192.168.0.2",), detect_local_mode=mode, **extra)  # type: ignore[arg-type]
    state = _state(node, _etp_local_lb())
    i, n = _ipt(state), _nft(state)
    assert f"{ipt_local} -j KUBE-SVC-" in i and f"! {ipt_local} -j KUBE-MARK-MASQ" in i
    neg = nft_local.replace("iifname ", "iifname != ")
    assert f"{nft_local} goto service-" in n and f"{neg} jump mark-for-masquerade" in n
    # The same detector serves IPv6.
    assert pod_match(node, V6) == pod_match(node, V4)


def test_node_cidr_mode_takes_the_node_objects_pod_cidrs_over_the_flag() -> None:
    node_obj = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-a"},
                "spec": {"podCIDRs": ["10.244.3.0/24"]}}
    flags = NodeConfig(name="node-a", cluster_cidrs=("10.0.0.0/8",))
    assert load_objects([node_obj], flags).state.node.cluster_cidrs == ("10.0.0.0/8",)
    node_mode = NodeConfig(name="node-a", cluster_cidrs=("10.0.0.0/8",), detect_local_mode=LocalMode.NODE_CIDR)
    got = load_objects([node_obj], node_mode).state.node
    assert pod_match(got, V4) == PodMatch(PodMatchKind.CIDR, "10.244.3.0/24")
    # No Node object (yet): the flag's CIDR, rather than no detector at all.
    assert load_objects([], node_mode).state.node.cluster_cidrs == ("10.0.0.0/8",)


# --------------------------------------------------------------------------------------------
# Source ranges: the VIP as source, decided once


def test_vips_are_allowed_as_source_only_when_a_range_covers_a_node_ip() -> None:
    covered = _etp_local_lb(load_balancer_source_ranges=("192.168.0.0/24", "203.0.113.0/25"))
    apart = _etp_local_lb(load_balancer_source_ranges=("203.0.113.0/25",))
    assert firewall_sources(covered, NODE) == ("192.168.0.0/24", "203.0.113.0/25", "1.2.3.4")
    assert firewall_sources(apart, NODE) == ("203.0.113.0/25",)
    i, n = _ipt(_state(NODE, covered)), _nft(_state(NODE, covered))
    assert "-s 1.2.3.4 -j KUBE-EXT-" in i
    assert "ip saddr != { 192.168.0.0/24, 203.0.113.0/25, 1.2.3.4 } drop" in n
    assert "-s 1.2.3.4 " not in _ipt(_state(NODE, apart))
    assert "1.2.3.4 } drop" not in _nft(_state(NODE, apart))


# --------------------------------------------------------------------------------------------
# Node-port addresses


def test_nodeport_defaults_differ_per_backend_as_upstream() -> None:
    assert nodeport_cidrs(NODE, V4, primary_by_default=False) == ()
    assert nodeport_cidrs(NODE, V4, primary_by_default=True) == ("192.168.0.2/32",)
    state = _state(NODE, _etp_local_lb())
    assert "nodeport-ips {\n\t192.168.0.2/32\n}" in _nft(state)
    assert "-m addrtype --dst-type LOCAL -j KUBE-NODEPORTS" in _ipt(state)


def test_primary_mixes_with_cidrs_and_all_addresses_when_no_node_ip() -> None:
    node = NodeConfig(ips=("192.168.0.2", "fd00::2"), nodeport_addresses=("primary", "10.1.0.0/16"))
    # In the order given, as kube-proxy 1.37's expandNodePortAddressKeywords.
    assert nodeport_cidrs(node, V4, primary_by_default=False) == ("192.168.0.2/32", "10.1.0.0/16")
    assert nodeport_cidrs(node, V6, primary_by_default=False) == ("fd00::2/128",)
    assert nodeport_cidrs(NodeConfig(), V4, primary_by_default=True) == ()


def test_localhost_nodeports_are_on_by_default_in_iptables_only_for_ipv4() -> None:
    state = _state(NODE, _etp_local_lb())
    assert "--dst-type LOCAL -j KUBE-NODEPORTS" in _ipt(state)
    off = _state(NodeConfig(name="node-a", ips=("192.168.0.2",), localhost_nodeports=False), _etp_local_lb())
    assert "--dst-type LOCAL ! -d 127.0.0.0/8 -j KUBE-NODEPORTS" in _ipt(off)
    v6 = ServicePort(_spn(), V6, ServiceType.NODE_PORT, "fd00::41", 80, node_port=3001)
    assert "--dst-type LOCAL ! -d ::1/128 -j KUBE-NODEPORTS" in _ipt(_state(NODE, v6), V6)
    # The nft backend cannot DNAT loopback traffic at all (as upstream's nftables mode).
    assert "ip daddr != 127.0.0.0/8" in _nft(state)


def test_loopback_cidr_in_nodeport_addresses_needs_localhost_nodeports_off_to_return() -> None:
    on = NodeConfig(nodeport_addresses=("127.0.0.0/8",))
    off = NodeConfig(nodeport_addresses=("127.0.0.0/8",), localhost_nodeports=False)
    svc = ServicePort(_spn(), V4, ServiceType.NODE_PORT, "172.30.0.41", 80, node_port=3001)
    assert "-d 127.0.0.0/8 -j RETURN" not in _ipt(_state(on, svc))
    assert "-d 127.0.0.0/8 -j RETURN" in _ipt(_state(off, svc))


# --------------------------------------------------------------------------------------------
# Masquerade bit, INVALID drop


def test_masquerade_bit_sets_the_mark_in_both_backends() -> None:
    node = NodeConfig(name="node-a", masquerade_bit=15)
    state = _state(node, _etp_local_lb())
    i, n = _ipt(state), _nft(state)
    assert "--or-mark 0x8000" in i and "--mark 0x8000/0x8000" in i and "0x4000" not in i
    assert "meta mark or 0x8000" in n and "meta mark and 0x8000 == 0 return" in n and "0x4000" not in n


def test_invalid_drop_is_counted_and_left_out_when_liberal() -> None:
    state = _state(NODE, _etp_local_lb())
    assert "--ctstate INVALID -m nfacct --nfacct-name ct_state_invalid_dropped_pkts -j DROP" in _ipt(state)
    n = _nft(state)
    assert "add counter ip nfproxy ct_state_invalid_dropped_pkts" in n
    assert "ct state invalid counter name ct_state_invalid_dropped_pkts drop" in n
    liberal = _state(NodeConfig(name="node-a", drop_invalid=False), _etp_local_lb())
    assert "INVALID" not in _ipt(liberal)
    assert "ct state invalid" not in _nft(liberal) and "add counter" not in _nft(liberal)


# --------------------------------------------------------------------------------------------
# nft cluster-ips check


def _multi_port_state(node: NodeConfig) -> ClusterState:
    ports = [
        ServicePort(ServicePortName("ns2", "svc2", "http", Protocol.TCP), V4, ServiceType.CLUSTER_IP, "172.30.0.42", 80),
        ServicePort(ServicePortName("ns2", "svc2", "dns-udp", Protocol.UDP), V4, ServiceType.CLUSTER_IP, "172.30.0.42", 53),
        ServicePort(_spn(), V4, ServiceType.CLUSTER_IP, "172.30.0.41", 80),
    ]
    eps = (Endpoint("10.180.0.1", 80),)
    return ClusterState(node, {p.key: p for p in ports}, {p.key: eps for p in ports})


def test_cluster_ips_set_holds_each_cluster_ip_once_and_cidrs_drop() -> None:
    node = NodeConfig(name="node-a", service_cidrs=("172.30.0.0/16", "fd00:30::/112"))
    rs = nft.render(_multi_port_state(node), V4)
    assert dict(rs.cluster_ip_refs) == {"172.30.0.41": 1, "172.30.0.42": 2}
    script = rs.script()
    assert "cluster-ips-check ip daddr @cluster-ips reject" in script
    assert "cluster-ips-check ip daddr { 172.30.0.0/16 } drop" in script
    assert "fd00:30::" not in script
    assert "filter-output-post-dnat ct state new jump cluster-ips-check" in script
    # Without service CIDRs only the reject (as upstream: it needs no CIDR).
    bare = nft.render(_multi_port_state(NodeConfig(name="node-a")), V4).script()
    assert "@cluster-ips reject" in bare and "drop comment \"Drop traffic to unallocated" not in bare


def test_partial_sync_keeps_a_shared_cluster_ip_until_its_last_port_goes() -> None:
    state = _multi_port_state(NodeConfig(name="node-a"))
    before = nft.render(state, V4)
    http = (ServicePortName("ns2", "svc2", "http", Protocol.TCP), V4)
    dns = (ServicePortName("ns2", "svc2", "dns-udp", Protocol.UDP), V4)

    def without(*keys: object) -> ClusterState:
        services = {k: v for k, v in state.services.items() if k not in keys}
        return ClusterState(state.node, services, {k: v for k, v in state.endpoints.items() if k in services})

    one_gone = without(http)
    after = nft.render_update(before, one_gone, [http])
    d = nft.delta(before, after, [http])
    assert not any("cluster-ips" in c for c in nft_commands(d.transaction))
    assert dict(after.cluster_ip_refs) == dict(nft.render(one_gone, V4).cluster_ip_refs)
    both_gone = without(http, dns)
    last = nft.render_update(after, both_gone, [dns])
    d = nft.delta(after, last, [dns])
    assert "delete element ip nfproxy cluster-ips { 172.30.0.42 }" in nft_commands(d.transaction)
    assert dict(last.cluster_ip_refs) == {"172.30.0.41": 1}
    back = nft.render_update(last, state, [http, dns])
    d = nft.delta(last, back, [http, dns])
    assert nft_commands(d.transaction).count("add element ip nfproxy cluster-ips { 172.30.0.42 }") == 1


# --------------------------------------------------------------------------------------------
# Flags


def _parse(*argv: str) -> NodeConfig:
    parser = argparse.ArgumentParser()
    add_node_flags(parser)
    return node_config_from_args(parser.parse_args(list(argv)))


def test_kube_proxy_flags_reach_the_node_config() -> None:
    node = _parse(
        "--node-ip", "192.168.0.2",
        "--nodeport-addresses", "primary,10.1.0.0/16",
        "--iptables-localhost-nodeports=false",
        "--iptables-masquerade-bit", "15",
        "--detect-local-mode", "InterfaceNamePrefix",
        "--pod-interface-name-prefix", "veth",
        "--service-cluster-ip-range", "10.96.0.0/12,fd00:96::/112",
    )
    assert node.nodeport_addresses == ("primary", "10.1.0.0/16")
    assert node.localhost_nodeports is False and node.masquerade_mark == 0x8000
    assert node.detect_local_mode is LocalMode.INTERFACE_NAME_PREFIX and node.pod_interface_name_prefix == "veth"
    assert node.service_cidrs == ("10.96.0.0/12", "fd00:96::/112")
    defaults = _parse()
    assert defaults.localhost_nodeports is True and defaults.masquerade_bit == 14
    assert defaults.detect_local_mode is LocalMode.CLUSTER_CIDR and defaults.drop_invalid is True


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nodeport-addresses", "primaryy"], "--nodeport-addresses"),
        (["--iptables-masquerade-bit", "32"], "--iptables-masquerade-bit: must be within 0-31"),
        (["--detect-local-mode", "BridgeInterface"], "--pod-bridge-interface: required"),
        (["--detect-local-mode", "InterfaceNamePrefix"], "--pod-interface-name-prefix: required"),
        (["--detect-local-mode", "BridgeInterface", "--pod-bridge-interface", "br 0"], "not an interface name"),
        (["--service-cluster-ip-range", "10.96.0.0/12,10.97.0.0/16"], "more than one IPv4"),
    ],
)
def test_bad_flag_values_name_the_flag(argv: list[str], message: str) -> None:
    with pytest.raises(FlagError, match=message):
        _parse(*argv)


def test_bad_boolean_is_a_usage_error() -> None:
    parser = argparse.ArgumentParser()
    add_node_flags(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--iptables-localhost-nodeports=maybe"])


# --------------------------------------------------------------------------------------------
# ServiceCIDR objects


def _service_cidr(name: str, *cidrs: str) -> dict[str, object]:
    return {"apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR",
            "metadata": {"name": name}, "spec": {"cidrs": list(cidrs)}}


def test_service_cidr_objects_win_over_the_flag() -> None:
    flag = NodeConfig(service_cidrs=("10.0.0.0/24",))
    result = load_objects([_service_cidr("kubernetes", "10.96.0.0/28", "fd00:96::/112"),
                           _service_cidr("extra", "10.97.0.0/24")], flag)
    assert result.errors == ()
    assert result.state.node.service_cidrs == ("10.97.0.0/24", "10.96.0.0/28", "fd00:96::/112")
    assert load_objects([], flag).state.node.service_cidrs == ("10.0.0.0/24",)


def test_bad_service_cidr_names_object_and_field() -> None:
    result = load_objects([_service_cidr("bad", "10.96.0.0/28", "10.97.0.0/28"),
                           _service_cidr("worse", "not-a-cidr")])
    messages = [str(e) for e in result.errors]
    assert any("ServiceCIDR bad" in m and "spec.cidrs" in m and "more than one IPv4" in m for m in messages)
    assert any("ServiceCIDR worse" in m and "spec.cidrs[0]" in m for m in messages)
    assert result.state.node.service_cidrs == ()
    wrong = dict(_service_cidr("v", "10.96.0.0/28"), apiVersion="networking.k8s.io/v2")
    assert "not supported" in str(load_objects([wrong]).errors[0])


# --------------------------------------------------------------------------------------------
# Upstream's localhost node-port flow (iptables TestNodePorts), exactly, through the interpreter


def test_localhost_to_node_port_is_masqueraded_to_every_endpoint_exactly() -> None:
    from fractions import Fraction

    from nfproxy.analysis.interpret import Packet, interpret
    from nfproxy.verify.compare import iptables_ruleset

    node = NodeConfig(name="node-a", ips=("192.168.0.2",), cluster_cidrs=("10.0.0.0/8",))
    svc = ServicePort(_spn(), V4, ServiceType.NODE_PORT, "172.30.0.41", 80, node_port=3001)
    state = _state(node, svc)
    packet = Packet("127.0.0.1", "127.0.0.1", 3001, "tcp", "node")
    dist = interpret(iptables_ruleset(state, V4), packet, node_ips=node.ips, mode="ideal")
    assert {(o.verdict, o.endpoint, o.masquerade): p for o, p in dist.items()} == {
        ("dnat", "10.180.0.1:80", True): Fraction(1, 2),
        ("dnat", "10.180.2.1:80", True): Fraction(1, 2),
    }
    off = _state(NodeConfig(name="node-a", ips=("192.168.0.2",), localhost_nodeports=False), svc)
    dist = interpret(iptables_ruleset(off, V4), packet, node_ips=node.ips, mode="ideal")
    assert {o.verdict for o in dist} == {"accept"}


def test_route_localnet_is_needed_only_for_iptables_localhost_node_ports(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from nfproxy.daemon.localhost import needs_route_localnet, prepare

    assert needs_route_localnet("iptables", NodeConfig())
    assert needs_route_localnet("iptables", NodeConfig(nodeport_addresses=("127.0.0.0/16",)))
    assert not needs_route_localnet("iptables", NodeConfig(nodeport_addresses=("192.168.0.0/24",)))
    assert not needs_route_localnet("iptables", NodeConfig(nodeport_addresses=("primary",), ips=("192.168.0.2",)))
    assert not needs_route_localnet("iptables", NodeConfig(localhost_nodeports=False))
    assert not needs_route_localnet("nft", NodeConfig())
    with caplog.at_level(logging.INFO, logger="nfproxy.daemon"):
        prepare("nft", NodeConfig(), None)  # logs only: the nft backend sets no sysctl
        prepare("nft", NodeConfig(localhost_nodeports=False), None)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "localhost NodePorts are not supported" in said[0]

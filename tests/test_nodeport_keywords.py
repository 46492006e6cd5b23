"""`--nodeport-addresses` / `nodePortAddresses` as kube-proxy 1.36-1.37 takes them (KEP-6032):
the keywords `primary`, `localhost` and `all` mixed with CIDRs, checked as upstream's
validateKubeProxyNodePortAddress (its validation_test.go cases, translated), expanded as its
expandNodePortAddressKeywords (server_test.go), and honoured by both backends (walked through
each backend's rules by the exact interpreter, no root). Also the feature gates kube-proxy 1.37
answers differently: the locked GA PreferSameTrafficDistribution and the alpha
KubeProxyNFTablesLocalhostNodePorts."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest

from nfproxy.analysis.interpret import Outcome, Packet, interpret
from nfproxy.cli.config import FlagError, add_node_flags, node_config_from_args
from nfproxy.cli.feature_gates import parse_feature_gates
from nfproxy.cli.main import main
from nfproxy.core import categorize
from nfproxy.core.categorize import nodeport_cidrs
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
from nfproxy.verify.compare import iptables_ruleset, nft_ruleset

V4, V6 = IPFamily.V4, IPFamily.V6
WORDS = "(nor one of the keywords 'primary', 'localhost', 'all')"
HEADER = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n"

# kube-proxy's TestValidateKubeProxyNodePortAddress: (name, addresses, bad index, kind) where
# kind is "invalid" or "duplicate"; upstream reports every bad item, nfproxy the first.
UPSTREAM_CASES = [
    ("no addresses", [], None, None),
    ("valid 1", ["127.0.0.0/8"], None, None),
    ("valid 2", ["0.0.0.0/0"], None, None),
    ("valid 3", ["::/0"], None, None),
    ("valid 4", ["127.0.0.1/32", "1.2.3.0/24"], None, None),
    ("valid 5", ["127.0.0.1/32"], None, None),
    ("valid 6", ["::1/128"], None, None),
    ("valid 7", ["1.2.3.4/32"], None, None),
    ("valid 8", ["10.20.30.0/24"], None, None),
    ("valid 9", ["10.20.0.0/16", "100.200.0.0/16"], None, None),
    ("valid 10", ["10.0.0.0/8"], None, None),
    ("valid 11", ["2001:db8::/32"], None, None),
    ("primary", ["primary"], None, None),
    ("localhost", ["localhost"], None, None),
    ("all", ["all"], None, None),
    ("primary combined with localhost", ["primary", "localhost"], None, None),
    ("all keywords combined", ["primary", "localhost", "all"], None, None),
    ("duplicate keyword", ["localhost", "localhost"], 1, "duplicate"),
    ("duplicate keyword separated by other values", ["primary", "10.0.0.0/8", "primary"], 2, "duplicate"),
    ("duplicate CIDRs are allowed", ["10.0.0.0/8", "10.0.0.0/8", "localhost"], None, None),
    ("keywords combined with CIDRs", ["all", "primary", "192.168.0.0/16", "localhost"], None, None),
    ("keyword combined with CIDR", ["primary", "127.0.0.1/32"], None, None),
    ("typo'd keyword", ["Localhost"], 0, "invalid"),
    ("typo'd keyword combined with valid keyword", ["primary", "locahost"], 1, "invalid"),
    ("invalid foo address", ["foo"], 0, "invalid"),
    ("invalid octet address", ["10.0.0.0/0", "1.2.3"], 1, "invalid"),
    ("address cannot be 0", ["127.0.0.1/32", "0", "1.2.3.0/24"], 1, "invalid"),
    ("address missing subnet range", ["127.0.0.1/32", "10.20.30.40", "1.2.3.0/24"], 1, "invalid"),
    ("missing ipv6 subnet ranges", ["::0", "::1", "2001:db8::/32"], 0, "invalid"),
    ("invalid ipv6 ip format", ["::1/128", "2001:db8::/32", "2001:db8:xyz/64"], 2, "invalid"),
]


def _expected(addresses: list[str], index: int | None, kind: str | None) -> str:
    if index is None:
        return ""
    item = addresses[index]
    if kind == "duplicate":
        return f"[{index}] '{item}': duplicate value"
    return f"[{index}] {item} is not a valid CIDR {WORDS}"


def _node(*argv: str) -> NodeConfig:
    parser = argparse.ArgumentParser()
    add_node_flags(parser)
    parser.add_argument("--feature-gates", default="")
    return node_config_from_args(parser.parse_args(list(argv)))


@pytest.mark.parametrize("name, addresses, index, kind", UPSTREAM_CASES, ids=[c[0] for c in UPSTREAM_CASES])
def test_the_flag_checks_as_upstream(name: str, addresses: list[str], index: int | None, kind: str | None) -> None:
    argv = [a for item in addresses for a in ("--nodeport-addresses", item)]
    expected = _expected(addresses, index, kind)
    if not expected:
        assert set(_node(*argv).nodeport_addresses) == set(addresses)
        return
    with pytest.raises(FlagError) as err:
        _node(*argv)
    assert str(err.value).startswith(f"--nodeport-addresses: {expected}")


@pytest.mark.parametrize("name, addresses, index, kind", UPSTREAM_CASES, ids=[c[0] for c in UPSTREAM_CASES])
def test_the_file_checks_as_upstream(tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str,
                                     addresses: list[str], index: int | None, kind: str | None) -> None:
    config = tmp_path / "config.conf"
    items = ", ".join(f'"{a}"' for a in addresses)
    config.write_text(HEADER + f"nodePortAddresses: [{items}]\n")
    status = main(["--config", str(config), "--write-config-to", str(tmp_path / "out")])
    err = capsys.readouterr().err
    expected = _expected(addresses, index, kind)
    if not expected:
        assert status == 0, err
        written = (tmp_path / "out").read_text()
        assert all(a in written for a in addresses)
        return
    assert status == 2 and "Traceback" not in err
    assert f"{config}:3: KubeProxyConfiguration: nodePortAddresses: {expected}" in err


def test_comma_separated_flag_values_are_items_too() -> None:
    assert _node("--nodeport-addresses", "localhost,10.0.0.0/8", "--nodeport-addresses", "all").nodeport_addresses == (
        "localhost", "10.0.0.0/8", "all")
    with pytest.raises(FlagError, match=r"\[2\] 'localhost': duplicate value"):
        _node("--nodeport-addresses", "localhost,10.0.0.0/8", "--nodeport-addresses", "localhost")


# kube-proxy's Test_expandNodePortAddressKeywords, as each family's proxier sees the result
# (NewNodePortAddresses: a zero CIDR, or nothing of the family, is every local address: ()).
DUAL = ("192.168.1.1", "fd00::1")
V4_ONLY = ("192.168.1.1", "::1")  # upstream's ipv4Only: the IPv6 node IP is loopback
V6_ONLY = ("127.0.0.1", "fd00::1")


@pytest.mark.parametrize("addresses, ips, v4, v6", [
    (("10.0.0.0/8", "fd01::/64"), DUAL, ("10.0.0.0/8",), ("fd01::/64",)),
    (("primary",), DUAL, ("192.168.1.1/32",), ("fd00::1/128",)),
    (("primary",), V4_ONLY, ("192.168.1.1/32",), ()),
    (("localhost",), DUAL, ("127.0.0.0/8",), ("::1/128",)),
    (("localhost",), V6_ONLY, ("127.0.0.0/8",), ("::1/128",)),
    (("all",), DUAL, (), ()),
    (("primary", "localhost"), DUAL, ("192.168.1.1/32", "127.0.0.0/8"), ("fd00::1/128", "::1/128")),
    (("localhost", "10.0.0.0/8"), V4_ONLY, ("127.0.0.0/8", "10.0.0.0/8"), ("::1/128",)),
    (("all", "primary", "192.168.0.0/16", "localhost"), DUAL, (), ()),
], ids=["literal CIDRs", "primary dual-stack", "primary IPv4-only", "localhost dual-stack",
        "localhost IPv6-only", "all", "primary with localhost", "keyword with CIDR", "all wins"])
def test_keywords_expand_as_upstream(addresses: tuple[str, ...], ips: tuple[str, ...],
                                     v4: tuple[str, ...], v6: tuple[str, ...]) -> None:
    node = NodeConfig(ips=ips, nodeport_addresses=addresses)
    for primary_default in (False, True):
        assert nodeport_cidrs(node, V4, primary_by_default=primary_default) == v4
        assert nodeport_cidrs(node, V6, primary_by_default=primary_default) == v6


def test_explicit_loopback_is_named_loopback_not_a_cidr_around_it() -> None:
    """ContainsExplicitLoopback: `localhost`, 127.0.0.0/8 or ::1/128 name loopback; `all` (and
    0.0.0.0/0) contain it without naming it, and does not start the localhost proxy."""
    assert categorize.nodeport_loopback(NodeConfig(nodeport_addresses=("localhost",)), V6, primary_by_default=True)
    assert categorize.nodeport_loopback(NodeConfig(nodeport_addresses=("127.0.0.1/32",)), V4, primary_by_default=True)
    assert categorize.nodeport_loopback(NodeConfig(nodeport_addresses=("all", "localhost")), V4, primary_by_default=True)
    assert not categorize.nodeport_loopback(NodeConfig(nodeport_addresses=("all",)), V4, primary_by_default=True)
    assert not categorize.nodeport_loopback(NodeConfig(ips=("192.168.1.1",)), V4, primary_by_default=True)


# --------------------------------------------------------------------------------------------
# Both backends, walked by the exact interpreter

NODE_IPS = ("192.168.0.2", "10.1.2.3", "172.16.0.9")  # the local addresses of the node
ENDPOINT = "10.180.0.1:80"


def _state(node: NodeConfig, family: IPFamily = V4) -> ClusterState:
    v6 = family is V6
    svc = ServicePort(ServicePortName("ns1", "svc1", "p80", Protocol.TCP), family, ServiceType.NODE_PORT,
                      "fd00::41" if v6 else "172.30.0.41", 80, node_port=30080)
    eps = (Endpoint("fd00:180::1" if v6 else "10.180.0.1", 80, node_name="node-a"),)
    return ClusterState(node, {svc.key: svc}, {svc.key: eps})


def _dnat(backend: str, state: ClusterState, dst: str, family: IPFamily = V4) -> bool:
    ruleset = (nft_ruleset if backend == "nft" else iptables_ruleset)(state, family)
    local = NODE_IPS if family is V4 else ("fd00::2",)
    src = "203.0.113.7" if family is V4 else "2001:db8::7"
    src = dst if dst in ("127.0.0.1", "::1") else src
    origin = "node" if src == dst else "outside"
    got = interpret(ruleset, Packet(src, dst, 30080, "tcp", origin), node_ips=local)  # type: ignore[arg-type]
    return any(o.verdict == "dnat" for o in got) and set(got) <= {Outcome("dnat", o.endpoint, o.masquerade) for o in got}


def _from_flags(*argv: str) -> NodeConfig:
    return _node("--node-name", "node-a", "--node-ip", "192.168.0.2", *argv)


@pytest.mark.parametrize("backend", ["nft", "iptables"])
def test_all_takes_node_ports_on_every_local_address(backend: str) -> None:
    state = _state(_from_flags("--nodeport-addresses", "all"))
    assert all(_dnat(backend, state, ip) for ip in NODE_IPS)
    # Loopback: kube-proxy's iptables mode with localhost node ports on (its default), never nft.
    assert _dnat(backend, state, "127.0.0.1") is (backend == "iptables")


@pytest.mark.parametrize("backend", ["nft", "iptables"])
def test_localhost_takes_node_ports_on_loopback_only(backend: str) -> None:
    state = _state(_from_flags("--nodeport-addresses", "localhost"))
    assert not any(_dnat(backend, state, ip) for ip in NODE_IPS)
    # nft never DNATs loopback (its localhost proxy serves it, behind the gate); iptables does.
    assert _dnat(backend, state, "127.0.0.1") is (backend == "iptables")
    v6 = _state(_from_flags("--nodeport-addresses", "localhost"), V6)
    assert not _dnat(backend, v6, "::1", V6) and not _dnat(backend, v6, "fd00::2", V6)


@pytest.mark.parametrize("backend", ["nft", "iptables"])
def test_primary_mixes_with_a_cidr_from_the_file(backend: str, tmp_path: Path) -> None:
    from nfproxy.cli.main import parse  # the daemon's own parsing, --config and all

    config = tmp_path / "config.conf"
    config.write_text(HEADER + "nodePortAddresses: [primary, 10.1.0.0/16]\n")
    _, args = parse(["run", "--config", str(config), "--node-name", "node-a", "--node-ip", "192.168.0.2"])
    state = _state(node_config_from_args(args))
    assert _dnat(backend, state, "192.168.0.2") and _dnat(backend, state, "10.1.2.3")
    assert not _dnat(backend, state, "172.16.0.9")


def test_iptables_loads_every_keyword_mix_with_one_destination_per_rule() -> None:
    """docs/compat.md once listed a two-`-d` tail rule (`-d CIDR ... ! -d 127.0.0.0/8`), which
    iptables-restore refuses; every KUBE-SERVICES rule here has at most one -d."""
    from nfproxy.backends.iptables import render as ipt

    for addresses in (("localhost",), ("all",), ("primary", "127.0.0.0/8"), ("0.0.0.0/0", "localhost"),
                      ("10.0.0.0/8", "127.0.0.1/32")):
        for localhost in (True, False):
            node = NodeConfig(ips=("192.168.0.2",), nodeport_addresses=addresses, localhost_nodeports=localhost)
            for family in (V4, V6):
                text = ipt.render(_state(node, family), family).restore_text()
                tail = [line for line in text.splitlines() if "KUBE-SERVICES" in line and "-d" in line]
                assert all(line.count(" -d ") <= 1 for line in tail), tail


# --------------------------------------------------------------------------------------------
# Feature gates


def test_prefer_same_traffic_distribution_is_ga_and_locked_as_upstream(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("test.gates.ga")
    with caplog.at_level(logging.INFO, logger="test.gates.ga"):
        assert parse_feature_gates("PreferSameTrafficDistribution=true", log) == {"PreferSameTrafficDistribution": True}
    (record,) = caplog.records
    # kube-proxy's line, word for word (component-base's featuregate, at info).
    assert record.levelno == logging.INFO and record.getMessage() == (
        'Warning: setting GA feature gate. It will be removed in a future release. '
        'featureGate="PreferSameTrafficDistribution" value=true')  # klog quotes the message
    with pytest.raises(FlagError, match="cannot set feature gate PreferSameTrafficDistribution to false, "
                                        "feature is locked to true"):
        parse_feature_gates("PreferSameTrafficDistribution=false", log)


def test_a_locked_gate_in_the_file_is_named_by_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "config.conf"
    config.write_text(HEADER + "featureGates:\n  PreferSameTrafficDistribution: false\n")
    assert main(["--config", str(config), "--write-config-to", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert (f"{config}:4: KubeProxyConfiguration: featureGates.PreferSameTrafficDistribution: cannot set "
            "feature gate PreferSameTrafficDistribution to false, feature is locked to true") in err


def test_the_localhost_nodeports_gate_is_off_by_default_and_reaches_the_node_config(
        caplog: pytest.LogCaptureFixture) -> None:
    assert not _node().nft_localhost_nodeports
    on = _node("--feature-gates", "KubeProxyNFTablesLocalhostNodePorts=true")
    assert on.nft_localhost_nodeports
    log = logging.getLogger("test.gates.alpha")
    with caplog.at_level(logging.WARNING, logger="test.gates.alpha"):
        parse_feature_gates("KubeProxyNFTablesLocalhostNodePorts=true", log, "nftables")
        assert not caplog.records  # it does something: nothing to warn about
        parse_feature_gates("KubeProxyNFTablesLocalhostNodePorts=true", log, "iptables")
    assert "no effect in iptables mode" in caplog.records[0].getMessage()


def test_localhost_rejects_follow_upstream() -> None:
    """localhostNodePortRejectProtocols: none with the gate off; UDP and SCTP when the proxy
    serves TCP (the addresses name loopback); every protocol otherwise."""
    assert categorize.localhost_rejects(NodeConfig(nodeport_addresses=("localhost",)), V4) == frozenset()
    on = NodeConfig(nodeport_addresses=("localhost",), **{"nft_localhost_nodeports": True})
    assert categorize.localhost_rejects(on, V4) == categorize.localhost_rejects(on, V6) == {"udp", "sctp"}
    assert categorize.localhost_rejects(NodeConfig(**{"nft_localhost_nodeports": True}), V4) == {"tcp", "udp", "sctp"}

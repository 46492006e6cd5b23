"""The compat corpus as data: it loads, it covers every feature, and bad files are named clearly."""

from __future__ import annotations

import dataclasses
import functools
import textwrap
from pathlib import Path

import pytest
import yaml

from nfproxy.core.model import IPFamily, NodeConfig, Protocol, ServiceType
from nfproxy.verify.probe import Probe, origin_of
from tests.scenarios import COMPAT_DIR, ScenarioError, load, load_all

SCENARIOS = load_all()


def test_the_corpus_loads_with_unique_names_and_reasons() -> None:
    assert len(SCENARIOS) >= 30
    names = [s.name for s in SCENARIOS]
    assert len(set(names)) == len(names)
    for s in SCENARIOS:
        assert s.path.parent == COMPAT_DIR and s.path.stem == s.name
        assert len(s.description) > 40, s.name
        assert s.probes and s.state.services, s.name


def test_probe_fields_map_onto_the_interpreters_packet() -> None:
    fields = [f.name for f in dataclasses.fields(Probe)]
    assert fields[:5] == ["src", "dst", "port", "proto", "origin"]


def _raw(name: str) -> dict:
    return yaml.safe_load((COMPAT_DIR / f"{name}.yaml").read_text())


@functools.cache
def _features() -> dict[str, set[str]]:
    """Which scenarios exercise which feature, read from the loaded states and the probes."""
    found: dict[str, set[str]] = {}

    def mark(feature: str, scenario: str) -> None:
        found.setdefault(feature, set()).add(scenario)

    for s in SCENARIOS:
        node = s.state.node
        endpoint_ips = {e.ip for eps in s.state.endpoints.values() for e in eps}
        if node.masquerade_all:
            mark("masquerade-all", s.name)
        if node.nodeport_addresses:
            mark("nodeport-addresses", s.name)
        for (spn, family), sp in s.state.services.items():
            eps = s.state.endpoints.get((spn, family), ())
            mark(f"type:{sp.type.value}", s.name)
            if sp.external_ips:
                mark("type:externalIPs", s.name)
            if sp.external_policy_local and sp.externally_accessible:
                mark("eTP:Local", s.name)
            elif sp.externally_accessible:
                mark("eTP:Cluster", s.name)
            mark("iTP:Local" if sp.internal_policy_local else "iTP:Cluster", s.name)
            if sp.affinity_timeout:
                mark("affinity", s.name)
            if sp.load_balancer_source_ranges:
                mark("source-ranges", s.name)
            if any(e.zone_hints for e in eps):
                mark("topology-hints", s.name)
            if any(e.terminating and e.serving for e in eps):
                mark("terminating", s.name)
            if family is IPFamily.V6:
                mark("ipv6", s.name)
            mark(f"proto:{spn.protocol.value}", s.name)
            mark("port:named" if spn.port else "port:unnamed", s.name)
        slices: dict[tuple[str, str], int] = {}
        for obj in _raw(s.name)["objects"]:
            if obj["kind"] == "EndpointSlice":
                key = (obj["metadata"]["namespace"], obj["metadata"]["labels"]["kubernetes.io/service-name"])
                slices[key] = slices.get(key, 0) + 1
        if any(n > 1 for n in slices.values()):
            mark("several-slices", s.name)
        for p in s.probes:
            mark(f"origin:{p.origin}", s.name)
            mark(f"verdict:{p.expect.verdict}", s.name)
            if p.expect.masquerade is not None:
                mark(f"masquerade:{p.expect.masquerade}", s.name)
            if p.expect.uniform is not None:
                mark(f"n={len(p.expect.uniform)}", s.name)
            chosen = {u.rsplit(":", 1)[0] for u in p.expect.uniform or ()}
            if p.src in endpoint_ips and chosen == {p.src} and p.expect.masquerade:
                mark("hairpin", s.name)
            if p.proto == "sctp":
                mark("probe:sctp", s.name)
            if p.proto == "udp":
                mark("probe:udp", s.name)
            if ":" in p.dst:
                mark("probe:ipv6", s.name)
            if p.exact_only:
                mark("exact-only", s.name)
    return found


@pytest.mark.parametrize(
    "feature",
    [
        "type:ClusterIP", "type:NodePort", "type:LoadBalancer", "type:externalIPs",
        "eTP:Local", "eTP:Cluster", "iTP:Local", "iTP:Cluster", "affinity", "topology-hints",
        "terminating", "verdict:reject", "verdict:drop", "verdict:dnat", "verdict:accept",
        "source-ranges", "hairpin", "masquerade:True", "masquerade:False", "masquerade-all",
        "proto:UDP", "proto:SCTP", "probe:udp", "probe:sctp", "ipv6", "probe:ipv6",
        "port:named", "port:unnamed", "several-slices", "n=1", "n=2", "n=3", "n=7", "n=64",
        "origin:pod", "origin:outside", "origin:node", "nodeport-addresses",
    ],
)
def test_the_corpus_covers(feature: str) -> None:
    assert _features().get(feature), f"no scenario exercises {feature}"


def test_blocked_and_allowed_source_ranges_are_both_probed() -> None:
    for s in SCENARIOS:
        lb = {ip for sp in s.state.services.values() if sp.load_balancer_source_ranges
              for ip in sp.load_balancer_ips}
        verdicts = {p.expect.verdict for p in s.probes if p.dst in lb}
        if lb:
            assert {"dnat", "drop"} <= verdicts, s.name


def test_sctp_probes_are_exact_only_and_say_why() -> None:
    sctp = [(s.name, p) for s in SCENARIOS for p in s.probes if p.proto == "sctp"]
    assert sctp
    for name, p in sctp:
        assert "SCTP" in p.exact_only, (name, p)
    # Nothing else may hide from the kernel runner.
    others = [(s.name, str(p)) for s in SCENARIOS for p in s.probes if p.exact_only and p.proto != "sctp"]
    assert others == []


def test_origin_is_derived_from_the_cluster_cidr() -> None:
    node = NodeConfig(name="n", ips=("192.168.0.2", "fd00::2"), cluster_cidrs=("10.0.0.0/8", "fd01::/48"))
    assert origin_of("node", node) == "node"
    assert origin_of("10.3.4.5", node) == "pod"
    assert origin_of("fd01::9", node) == "pod"
    assert origin_of("11.0.0.1", node) == "outside"
    assert origin_of("2001:db8::1", node) == "outside"
    assert origin_of("10.3.4.5", NodeConfig(masquerade_all=True)) == "outside"


def test_a_scenario_becomes_model_state() -> None:
    s = load(COMPAT_DIR / "dual-stack.yaml")
    assert s.state.node == NodeConfig(
        name="node-a", ips=("192.168.0.2", "fd00:1::2"),
        cluster_cidrs=("10.0.0.0/8", "fd01::/48"), zone="zone-a",
    )
    families = {family for (_, family) in s.state.services}
    assert families == {IPFamily.V4, IPFamily.V6}
    sp = next(iter(s.state.services.values()))
    assert sp.type is ServiceType.NODE_PORT and sp.node_port == 30086
    assert sp.protocol is Protocol.TCP
    p = s.probes[1]
    assert (p.src, p.dst, p.port, p.proto, p.origin) == ("fd01::5:5", "fd00:30::6:10", 80, "tcp", "pod")
    assert p.expect.uniform == ("[fd01::6:1]:8080", "[fd01::6:2]:8080")
    assert (p.expect.verdict, p.expect.masquerade) == ("dnat", False)


GOOD = """
name: {name}
description: a scenario used to test the loader's error messages
node: {{name: node-a, ips: [192.168.0.2], clusterCIDR: 10.0.0.0/8}}
objects:
  - apiVersion: v1
    kind: Service
    metadata: {{name: web, namespace: ns1}}
    spec:
      clusterIP: 172.30.0.10
      ports: [{{name: http, port: 80, protocol: TCP}}]
  - apiVersion: discovery.k8s.io/v1
    kind: EndpointSlice
    metadata: {{name: web-1, namespace: ns1, labels: {{kubernetes.io/service-name: web}}}}
    addressType: IPv4
    ports: [{{name: http, port: 80, protocol: TCP}}]
    endpoints: [{{addresses: [10.180.0.1]}}]
probes:
  - {{src: 10.0.5.5, dst: 172.30.0.10, port: 80, proto: tcp,
     expect: {{uniform: [10.180.0.1:80], masquerade: false}}}}
"""


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def test_a_good_file_loads(tmp_path: Path) -> None:
    s = load(_write(tmp_path, "good", GOOD.format(name="good")))
    assert s.probes[0].origin == "pod" and s.probes[0].expect.uniform == ("10.180.0.1:80",)


@pytest.mark.parametrize(
    ("old", "new", "where", "message"),
    [
        ("name: bad", "name: other", "name", "does not match the file name"),
        ("src: 10.0.5.5", "src: 10.0.5", "probes[0].src", "not a valid IP address"),
        ("src: 10.0.5.5", "src: 192.168.0.2", "probes[0].src", "write src: node"),
        ("src: 10.0.5.5", "src: 2001:db8::1", "probes[0].src", "different IP families"),
        ("port: 80, proto: tcp", "port: 0, proto: tcp", "probes[0].port", "not a valid port"),
        ("proto: tcp", "proto: icmp", "probes[0].proto", "not one of tcp, udp, sctp"),
        ("uniform: [10.180.0.1:80]", "uniform: [10.180.0.9:80]", "probes[0].expect.uniform[0]",
         "no endpoint of any service"),
        ("uniform: [10.180.0.1:80]", "uniform: [10.180.0.1]", "probes[0].expect.uniform[0]",
         "is not ip:port"),
        ("uniform: [10.180.0.1:80]", "uniform: [10.180.0.1:80, 10.180.0.1:80]",
         "probes[0].expect.uniform[1]", "listed twice"),
        ("uniform: [10.180.0.1:80], masquerade: false", "verdict: drop, masquerade: false",
         "probes[0].expect.masquerade", "nothing is delivered"),
        ("uniform: [10.180.0.1:80], masquerade: false", "verdict: dnat, masquerade: false",
         "probes[0].expect.uniform", "needs the endpoints"),
        ("uniform: [10.180.0.1:80], masquerade: false", "uniform: [10.180.0.1:80]",
         "probes[0].expect.masquerade", "required with uniform"),
        ("uniform: [10.180.0.1:80], masquerade: false", "verdict: bounce",
         "probes[0].expect.verdict", "not one of"),
        ("proto: tcp,", "proto: tcp, color: red,", "probes[0].color", "unknown field"),
        ("clusterIP: 172.30.0.10", "clusterIP: 172.30.0.999", "objects",
         "spec.clusterIP"),
        ("clusterCIDR: 10.0.0.0/8", "clusterCIDR: 10.0.0.0/99", "node.clusterCIDR[0]",
         "not a valid CIDR"),
        ("ips: [192.168.0.2]", "ips: []", "node.ips", "at least one node IP"),
    ],
)
def test_errors_name_the_file_probe_and_field(
    tmp_path: Path, old: str, new: str, where: str, message: str
) -> None:
    text = GOOD.format(name="bad")
    assert old in text
    path = _write(tmp_path, "bad", text.replace(old, new, 1))
    with pytest.raises(ScenarioError) as err:
        load(path)
    text = str(err.value)
    assert f"{path}: {where}: " in text and message in text, text


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    text = GOOD.format(name="bad").replace("src: 10.0.5.5", "src: x").replace("port: 80, proto: tcp", "port: -1, proto: tcp")
    with pytest.raises(ScenarioError) as err:
        load(_write(tmp_path, "bad", text))
    assert "probes[0].src" in str(err.value) and "probes[0].port" in str(err.value)


def test_structural_errors(tmp_path: Path) -> None:
    for text, message in (
        ("[1, 2]", "expected a mapping"),
        ("name: bad\n", "description: required field is missing"),
        ("name: bad\n: [", "not valid YAML"),
    ):
        with pytest.raises(ScenarioError, match=message):
            load(_write(tmp_path, "bad", text))
    with pytest.raises(ScenarioError, match="no \\*.yaml scenario files"):
        load_all(tmp_path / "empty")
    _write(tmp_path, "good", GOOD.format(name="good"))
    _write(tmp_path, "worse", "name: worse\n")
    with pytest.raises(ScenarioError, match="worse.yaml"):
        load_all(tmp_path)

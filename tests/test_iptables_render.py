"""The iptables renderer: golden files per feature, structural properties, names and comments.

Goldens are the complete `restore_text()` of a small ClusterState. Regenerate them with
`NFPROXY_UPDATE_GOLDEN=1 pytest tests/test_iptables_render.py`, then read every changed one
against kube-proxy's proxier_test.go expectations before committing it. The scenarios reuse
kube-proxy's test names and addresses (ns1/svc1:p80 at 172.30.0.41, endpoints 10.180.0.x) so
that the chain names in the goldens can be compared with upstream's expected dumps directly.
"""

from __future__ import annotations

import dataclasses

import os
import random
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings

from nfproxy.backends.iptables.render import (
    JUMPS,
    LARGE_CLUSTER_ENDPOINTS,
    SERVICE_CHAIN_PREFIXES,
    IptablesRules,
    endpoint_chain_name,
    quote_comment,
    render,
    service_chain_name,
    service_hash,
)
from nfproxy.core.categorize import categorize
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
from nfproxy.testing import clusters, random_cluster, uniform_cluster

GOLDEN_DIR = Path(__file__).parent / "golden" / "iptables"
UPDATE = os.environ.get("NFPROXY_UPDATE_GOLDEN") == "1"

NODE = NodeConfig(
    name="test-node",
    ips=("192.168.0.2", "fd00:1::2"),
    cluster_cidrs=("10.0.0.0/8", "fd00:10::/64"),
    zone="zone-a",
)
V4, V6 = IPFamily.V4, IPFamily.V6
TCP, UDP, SCTP = Protocol.TCP, Protocol.UDP, Protocol.SCTP

BUILTIN_TARGETS = {"ACCEPT", "DROP", "REJECT", "RETURN", "MARK", "MASQUERADE", "DNAT"}
BUILTIN_CHAINS = {
    "filter": {"INPUT", "FORWARD", "OUTPUT"},
    "nat": {"PREROUTING", "INPUT", "OUTPUT", "POSTROUTING"},
}


# ------------------------------------------------------------------------------------------
# Building states


def spn(ns: str, name: str, port: str = "p80", proto: Protocol = TCP) -> ServicePortName:
    return ServicePortName(ns, name, port, proto)


def ep(ip: str, port: int = 80, node: str = "other-node", **kw: Any) -> Endpoint:
    return Endpoint(ip=ip, port=port, node_name=node, **kw)


def state(*pairs: tuple[ServicePort, list[Endpoint]], node: NodeConfig = NODE) -> ClusterState:
    services = {svc.key: svc for svc, _ in pairs}
    endpoints = {svc.key: sort_endpoints(eps) for svc, eps in pairs if eps}
    return ClusterState(node=node, services=services, endpoints=endpoints)


def _service(kind: ServiceType, name: ServicePortName, ip: str, **kw: Any) -> ServicePort:
    family = V6 if ":" in ip else V4
    kw.setdefault("port", 80)
    return ServicePort(name=name, family=family, type=kind, cluster_ip=ip, **kw)


def cluster_ip(name: ServicePortName, ip: str, **kw: Any) -> ServicePort:
    return _service(ServiceType.CLUSTER_IP, name, ip, **kw)


def node_port(name: ServicePortName, ip: str, np: int, **kw: Any) -> ServicePort:
    return _service(ServiceType.NODE_PORT, name, ip, node_port=np, **kw)


def load_balancer(name: ServicePortName, ip: str, np: int, lb: str, **kw: Any) -> ServicePort:
    kind = ServiceType.LOAD_BALANCER
    return _service(kind, name, ip, node_port=np, load_balancer_ips=(lb,), **kw)


# ------------------------------------------------------------------------------------------
# Golden scenarios: one feature each, named after the golden file.


def _clusterip_three_endpoints() -> tuple[ClusterState, IPFamily]:
    # 10.180.0.11 sorts before 10.180.0.2 (string order, as kube-proxy sorts).
    svc = cluster_ip(spn("ns1", "svc1"), "172.30.0.41")
    return state((svc, [ep("10.180.0.1"), ep("10.180.0.2"), ep("10.180.0.11")])), V4


def _nodeport() -> tuple[ClusterState, IPFamily]:
    svc = node_port(spn("ns3", "svc3"), "172.30.0.43", 3003)
    return state((svc, [ep("10.180.0.3")])), V4


def _loadbalancer_source_ranges_etp_local() -> tuple[ClusterState, IPFamily]:
    # The second range contains the node IP 192.168.0.2: the LB IP is allowed as a source too.
    svc = load_balancer(
        spn("ns2", "svc2"),
        "172.30.0.42",
        3001,
        "1.2.3.4",
        load_balancer_source_ranges=("203.0.113.0/25", "192.168.0.0/24"),
        external_policy_local=True,
        health_check_node_port=30000,
    )
    return state((svc, [ep("10.180.0.2", node="test-node"), ep("10.180.0.3")])), V4


def _loadbalancer_etp_local_no_local_endpoints() -> tuple[ClusterState, IPFamily]:
    # kube-proxy's ns2/svc2 in TestOverallIPTablesRules: external traffic not short-circuited is
    # dropped in KUBE-EXTERNAL-SERVICES; the health check port is still accepted.
    svc = load_balancer(
        spn("ns2", "svc2"),
        "172.30.0.42",
        3001,
        "1.2.3.4",
        external_ips=("192.168.99.22",),
        external_policy_local=True,
        health_check_node_port=30000,
    )
    return state((svc, [ep("10.180.0.2")])), V4


def _external_ips() -> tuple[ClusterState, IPFamily]:
    svc = cluster_ip(spn("ns4", "svc4"), "172.30.0.44", external_ips=("192.168.99.33",))
    return state((svc, [ep("10.180.0.4"), ep("10.180.0.5")])), V4


def _affinity() -> tuple[ClusterState, IPFamily]:
    # kube-proxy's TestSessionAffinity-style service: unnamed port, 3 endpoints, default timeout.
    svc = cluster_ip(spn("ns1", "svc1", ""), "172.30.1.1", affinity_timeout=10800)
    return state((svc, [ep("10.0.1.1"), ep("10.0.1.2"), ep("10.0.1.5")])), V4


def _no_endpoints() -> tuple[ClusterState, IPFamily]:
    plain = cluster_ip(spn("ns6", "svc6"), "172.30.0.46")
    lb = load_balancer(spn("ns7", "svc7"), "172.30.0.47", 3007, "5.6.7.9", external_ips=("192.168.99.77",))
    not_ready = cluster_ip(spn("ns8", "svc8"), "172.30.0.48")
    return state((plain, []), (lb, []), (not_ready, [ep("10.180.0.8", ready=False, serving=False)])), V4


def _itp_local_no_local_endpoints() -> tuple[ClusterState, IPFamily]:
    svc = cluster_ip(spn("ns1", "svc1"), "172.30.0.41", internal_policy_local=True)
    local_ok = cluster_ip(spn("ns2", "svc2"), "172.30.0.42", internal_policy_local=True)
    return state(
        (svc, [ep("10.180.0.1")]),
        (local_ok, [ep("10.180.0.2", node="test-node"), ep("10.180.0.3")]),
    ), V4


def _masquerade_all() -> tuple[ClusterState, IPFamily]:
    node = NodeConfig(name="test-node", ips=("192.168.0.2",), cluster_cidrs=("10.0.0.0/8",), masquerade_all=True)
    svc = cluster_ip(spn("ns1", "svc1"), "172.30.0.41")
    return state((svc, [ep("10.180.0.1")]), node=node), V4


def _no_cluster_cidr() -> tuple[ClusterState, IPFamily]:
    # No local-traffic detector: no cluster-IP masquerade rule and no pod short-circuit.
    node = NodeConfig(name="test-node", ips=("192.168.0.2",))
    svc = node_port(spn("ns1", "svc1"), "172.30.0.41", 3001, external_policy_local=True)
    return state((svc, [ep("10.180.0.1", node="test-node")]), node=node), V4


def _udp() -> tuple[ClusterState, IPFamily]:
    svc = node_port(spn("kube-system", "kube-dns", "dns", UDP), "172.30.0.10", 30053, port=53)
    return state((svc, [ep("10.180.0.7", 53), ep("10.180.0.8", 53)])), V4


def _sctp() -> tuple[ClusterState, IPFamily]:
    svc = cluster_ip(spn("ns1", "svc1", "sctp", SCTP), "172.30.0.41", port=3868)
    return state((svc, [ep("10.180.0.1", 3868)])), V4


def _ipv6() -> tuple[ClusterState, IPFamily]:
    svc = node_port(spn("ns1", "svc1"), "fd00:172:30::41", 3001, external_ips=("2001:db8::99",))
    return state((svc, [ep("fd00:10::1"), ep("fd00:10::2")])), V6


def _terminating_fallback() -> tuple[ClusterState, IPFamily]:
    # No endpoint is ready: the serving+terminating ones are used, the non-serving one is not.
    svc = cluster_ip(spn("ns1", "svc1"), "172.30.0.41")
    eps = [
        ep("10.180.0.1", ready=False, serving=True, terminating=True),
        ep("10.180.0.2", ready=False, serving=False, terminating=True),
        ep("10.180.0.3", ready=False, serving=True, terminating=True),
    ]
    return state((svc, eps)), V4


def _topology_hints() -> tuple[ClusterState, IPFamily]:
    # Every ready endpoint has a hint and one matches zone-a: only zone-a endpoints are used.
    svc = cluster_ip(spn("ns1", "svc1"), "172.30.0.41")
    eps = [
        ep("10.180.0.1", zone_hints=frozenset({"zone-a"})),
        ep("10.180.0.2", zone_hints=frozenset({"zone-b"})),
        ep("10.180.0.3", zone_hints=frozenset({"zone-a"})),
    ]
    return state((svc, eps)), V4


def _nodeport_addresses() -> tuple[ClusterState, IPFamily]:
    node = NodeConfig(
        name="test-node",
        ips=("192.168.0.2",),
        cluster_cidrs=("10.0.0.0/8",),
        nodeport_addresses=("192.168.0.0/24", "fd00:1::/64", "10.1.0.0/16"),
    )
    svc = node_port(spn("ns3", "svc3"), "172.30.0.43", 3003)
    return state((svc, [ep("10.180.0.3")]), node=node), V4


GOLDENS = {
    "clusterip_three_endpoints": _clusterip_three_endpoints,
    "nodeport": _nodeport,
    "loadbalancer_source_ranges_etp_local": _loadbalancer_source_ranges_etp_local,
    "loadbalancer_etp_local_no_local_endpoints": _loadbalancer_etp_local_no_local_endpoints,
    "external_ips": _external_ips,
    "affinity": _affinity,
    "no_endpoints": _no_endpoints,
    "itp_local_no_local_endpoints": _itp_local_no_local_endpoints,
    "masquerade_all": _masquerade_all,
    "no_cluster_cidr": _no_cluster_cidr,
    "udp": _udp,
    "sctp": _sctp,
    "ipv6": _ipv6,
    "terminating_fallback": _terminating_fallback,
    "topology_hints": _topology_hints,
    "nodeport_addresses": _nodeport_addresses,
}


@pytest.mark.parametrize("name", sorted(GOLDENS))
def test_golden(name: str) -> None:
    st, family = GOLDENS[name]()
    text = render(st, family).restore_text()
    path = GOLDEN_DIR / f"{name}.txt"
    if UPDATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"missing golden {path}; run with NFPROXY_UPDATE_GOLDEN=1 and review it"
    assert text == path.read_text(), f"{name}: output differs from {path}"


# ------------------------------------------------------------------------------------------
# Names, probabilities and comments


def test_hash_worked_examples() -> None:
    assert service_chain_name(spn("ns1", "svc1")) == "KUBE-SVC-XPGD46QRK7WJZT7O"
    assert endpoint_chain_name(spn("ns1", "svc1"), "10.180.0.1:80") == "KUBE-SEP-SXIVWICOYRO3J4NJ"
    assert service_chain_name(spn("ns1", "svc1", "")) == "KUBE-SVC-AQI2S6QIMU7PVVRP"


def test_hash_matches_kube_proxy_test_names() -> None:
    # More pairs from kube-proxy's proxier_test.go expected dumps.
    assert service_hash(spn("ns2", "svc2")) == "GNZBNJ2PO5MGZ6GT"
    assert service_hash(spn("ns5", "svc5")) == "NUKIZ6OKUXPJNT4C"
    assert endpoint_chain_name(spn("ns4", "svc4"), "10.180.0.4:80") == "KUBE-SEP-UKSFD7AGPMPPLUHC"
    assert endpoint_chain_name(spn("ns1", "svc1", ""), "10.0.1.1:80") == "KUBE-SEP-3JOIVZTXZZRGORX4"


def test_hash_batch_equals_reference_base32() -> None:
    import base64
    import hashlib

    from nfproxy.backends.iptables.render import _hash16_many

    rng = random.Random(7)
    alphabet = "abc/:-.[]0123456789"
    texts = ["".join(rng.choices(alphabet, k=rng.randint(0, 60))) for _ in range(500)]
    expected = [base64.b32encode(hashlib.sha256(t.encode()).digest()).decode()[:16] for t in texts]
    assert _hash16_many(texts) == expected
    assert _hash16_many([]) == []


def test_service_chains_share_the_suffix() -> None:
    st, _ = _loadbalancer_source_ranges_etp_local()
    rules = render(st, V4)
    (group,) = rules.service_chains.values()
    suffix = service_hash(spn("ns2", "svc2"))
    assert group.chains[:4] == [f"KUBE-{p}-{suffix}" for p in ("EXT", "FW", "SVC", "SVL")]


@pytest.mark.parametrize(
    "text",
    [
        "ns1/svc1:p80 cluster IP",
        "kubernetes service nodeports; NOTE: this must be the last rule in this chain",
        "-leading-dash",
        "x" * 254 + "'",
        "semi;colon",
    ],
)
def test_quote_comment_accepts_printable_ascii(text: str) -> None:
    assert quote_comment(text) == f'"{text}"'


@pytest.mark.parametrize("text", ["a", "ns1/svc1:p80", "ns-1/svc.x:8080", "x" * 255])
def test_quote_comment_leaves_one_name_bare_as_kube_proxy_does(text: str) -> None:
    assert quote_comment(text) == text


@pytest.mark.parametrize(
    "text",
    [
        'ns1/svc"1',
        "ns1\\svc1",
        "ns1/svc1\n-A INPUT -j ACCEPT",
        "tab\there",
        "nul\x00",
        "del\x7f",
        "caf\u00e9",
        "",
        "x" * 256,
    ],
)
def test_quote_comment_rejects_unsafe_text(text: str) -> None:
    with pytest.raises(ValueError) as info:
        quote_comment(text)
    assert repr(text)[:40] in str(info.value)


def test_unsafe_service_name_cannot_reach_the_payload() -> None:
    svc = cluster_ip(spn("ns1", 'svc1" -j ACCEPT'), "172.30.0.41")
    with pytest.raises(ValueError):
        render(state((svc, [ep("10.180.0.1")])), V4)


# ------------------------------------------------------------------------------------------
# Parsing the payload back, for the structural checks


def parse(text: str) -> dict[str, tuple[list[str], list[str]]]:
    """table -> (declared chains in order, rule lines), checking the restore framing."""
    tables: dict[str, tuple[list[str], list[str]]] = {}
    current: str | None = None
    for line in text.splitlines():
        if line.startswith("*"):
            assert current is None, "table opened before COMMIT"
            current = line[1:]
            tables[current] = ([], [])
        elif line == "COMMIT":
            assert current is not None
            current = None
        else:
            assert current is not None, f"line outside a table: {line!r}"
            if line.startswith(":"):
                tables[current][0].append(line[1:].split()[0])
            else:
                assert line.startswith(("-A ", "-X ")), line
                tables[current][1].append(line)
    assert current is None, "missing final COMMIT"
    return tables


def targets(rule: str) -> list[str]:
    return re.findall(r" -[jg] (\S+)", rule)


def check_structure(rules: IptablesRules) -> None:
    tables = parse(rules.restore_text())
    assert set(tables) == {"filter", "nat"}
    for table, (declared, lines) in tables.items():
        counts = Counter(declared)
        assert not [c for c, n in counts.items() if n > 1], f"{table}: chain declared twice"
        known = set(declared) | BUILTIN_CHAINS[table]
        used: set[str] = set()
        for line in lines:
            chain = line.split()[1]
            assert chain in known, f"{table}: rule in undeclared chain: {line}"
            for target in targets(line):
                if target not in BUILTIN_TARGETS:
                    assert target in declared, f"{table}: jump to undeclared {target}: {line}"
                    used.add(target)
        # Like kube-proxy's checkIPTablesRuleJumps: no per-service chain is left orphaned.
        orphans = [c for c in declared if c.startswith(SERVICE_CHAIN_PREFIXES) and c not in used]
        assert not orphans, f"{table}: chains declared but never jumped to: {orphans}"


def cascade_targets(lines: list[str], chain: str) -> list[tuple[str, str | None]]:
    """(target SEP, probability or None) of a SVC/SVL chain's load-balancing rules, in order."""
    out = []
    for line in lines:
        if not line.startswith(f"-A {chain} ") or " -m recent " in line:
            continue
        (target,) = targets(line)
        if not target.startswith("KUBE-SEP-"):
            continue
        m = re.search(r"--probability (\S+)", line)
        out.append((target, m.group(1) if m else None))
    return out


# ------------------------------------------------------------------------------------------
# Properties over random clusters


@given(clusters())
@settings(deadline=None, max_examples=60)
def test_render_is_deterministic(st: ClusterState) -> None:
    for family in IPFamily:
        first = render(st, family).restore_text()
        assert render(st, family).restore_text() == first
        # Insertion order of the mappings must not matter either.
        shuffled = ClusterState(
            node=st.node,
            services=dict(reversed(list(st.services.items()))),
            endpoints=dict(reversed(list(st.endpoints.items()))),
        )
        assert render(shuffled, family).restore_text() == first


@given(clusters())
@settings(deadline=None, max_examples=60)
def test_structure(st: ClusterState) -> None:
    for family in IPFamily:
        check_structure(render(st, family))


@given(clusters())
@settings(deadline=None, max_examples=60)
def test_cascades_hold_each_endpoint_once_with_exact_probabilities(st: ClusterState) -> None:
    for family in IPFamily:
        rules = render(st, family)
        for svc, eps in st.service_ports(family):
            routing = categorize(svc, eps, st.node)
            group = rules.service_chains.get(svc.key)
            if not routing.has_endpoints:
                assert group is None
                continue
            assert group is not None
            suffix = service_hash(svc.name)
            for prefix, members in (("KUBE-SVC-", routing.cluster), ("KUBE-SVL-", routing.local)):
                chain = prefix + suffix
                if not members:
                    assert chain not in group.chains
                    continue
                got = cascade_targets(group.rules, chain)
                want = [endpoint_chain_name(svc.name, e.address) for e in members]
                assert [t for t, _ in got] == want
                n = len(want)
                for i, (_, prob) in enumerate(got):
                    assert prob == (None if i == n - 1 else "%0.10f" % (1 / (n - i)))
                if svc.affinity_timeout:
                    recent = [r for r in group.rules_of(chain) if " --rcheck " in r]
                    assert [targets(r)[0] for r in recent] == want
            # Every reachable endpoint has exactly one endpoint chain, hairpin first.
            seps = [c for c in group.chains if c.startswith("KUBE-SEP-")]
            assert seps == [endpoint_chain_name(svc.name, e.address) for e in routing.reachable]
            for sep, e in zip(seps, routing.reachable):
                first, dnat = group.rules_of(sep)
                assert first.endswith(f" -s {e.ip} -j KUBE-MARK-MASQ")
                assert dnat.endswith(f" -j DNAT --to-destination {e.address}")


@given(clusters())
@settings(deadline=None, max_examples=30)
def test_every_service_has_a_verdict_for_its_cluster_ip(st: ClusterState) -> None:
    """The cluster IP is either captured in nat or rejected/dropped in filter, never both."""
    for family in IPFamily:
        rules = render(st, family)
        nat = rules.nat["KUBE-SERVICES"]
        flt = rules.filter["KUBE-SERVICES"]
        for svc, _ in st.service_ports(family):
            needle = f" -d {svc.cluster_ip} --dport {svc.port} "
            proto = f"-p {svc.protocol.lower} "
            captured = f'"{svc.name} cluster IP"'
            refused = f'"{svc.name} has'
            in_nat = [r for r in nat if needle in r and proto in r and captured in r]
            in_filter = [r for r in flt if needle in r and proto in r and refused in r]
            assert len(in_nat) + len(in_filter) == 1, (svc, in_nat, in_filter)


# ------------------------------------------------------------------------------------------
# Specific behaviour


def test_nodeports_rule_is_last_in_nat_services() -> None:
    st = random_cluster(random.Random(3), 20)
    for family in IPFamily:
        last = render(st, family).nat["KUBE-SERVICES"][-1]
        assert "NOTE: this must be the last rule in this chain" in last
        assert last.endswith("-j KUBE-NODEPORTS")
        assert (" ! -d ::1/128 " in last) == (family is V6)


def test_large_cluster_mode_drops_per_endpoint_comments() -> None:
    small = render(uniform_cluster(LARGE_CLUSTER_ENDPOINTS // 10, 10), V4)
    large = render(uniform_cluster(LARGE_CLUSTER_ENDPOINTS // 10 + 1, 10), V4)
    for rules, commented in ((small, True), (large, False)):
        group = next(iter(rules.service_chains.values()))
        svc_rules = [r for r in group.rules if r.startswith("-A KUBE-SVC-") and "KUBE-SEP-" in r]
        sep_rules = [r for r in group.rules if r.startswith("-A KUBE-SEP-")]
        assert svc_rules and sep_rules
        for r in svc_rules + sep_rules:
            assert ("--comment" in r) == commented, r
        # Service-level comments stay in both modes.
        assert all("--comment" in r for r in rules.nat["KUBE-SERVICES"])


# What `iptables-save` shows on a kube-proxy node (kube-proxy prepends its jump rules one by one).
EXPECTED_JUMPS = """\
-A INPUT -j KUBE-FIREWALL
-A OUTPUT -j KUBE-FIREWALL
-A INPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes load balancer firewall" -j KUBE-PROXY-FIREWALL
-A INPUT -m comment --comment "kubernetes health check service ports" -j KUBE-NODEPORTS
-A INPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes externally-visible service portals" -j KUBE-EXTERNAL-SERVICES
-A FORWARD -m conntrack --ctstate NEW -m comment --comment "kubernetes load balancer firewall" -j KUBE-PROXY-FIREWALL
-A FORWARD -m comment --comment "kubernetes forwarding rules" -j KUBE-FORWARD
-A FORWARD -m conntrack --ctstate NEW -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A FORWARD -m conntrack --ctstate NEW -m comment --comment "kubernetes externally-visible service portals" -j KUBE-EXTERNAL-SERVICES
-A OUTPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes load balancer firewall" -j KUBE-PROXY-FIREWALL
-A OUTPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A OUTPUT -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A POSTROUTING -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING
"""


def test_jumps_are_kube_proxys_with_ct_state_gates() -> None:
    assert "".join(j.line + "\n" for j in JUMPS) == EXPECTED_JUMPS
    assert [j.table for j in JUMPS] == ["filter"] * 11 + ["nat"] * 3


def test_the_localnet_guard_goes_with_localhost_node_ports() -> None:
    """route_localnet=1 (localhost node ports) lets outside packets reach 127.0.0.0/8
    (CVE-2020-8558): kube-proxy 1.37 drops them in KUBE-FIREWALL, IPv4 only, and so must we."""
    st, family = _nodeport()
    guard = render(st, family).filter["KUBE-FIREWALL"]
    assert guard == ['-A KUBE-FIREWALL -m comment --comment "block incoming localnet connections"'
                     ' -d 127.0.0.0/8 ! -s 127.0.0.0/8 -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP']
    off = dataclasses.replace(st, node=dataclasses.replace(st.node, localhost_nodeports=False))
    assert render(off, family).filter["KUBE-FIREWALL"] == []
    assert render(st, V6).filter["KUBE-FIREWALL"] == []


def test_restore_text_without_jumps_has_no_builtin_chain_rules() -> None:
    st, family = _nodeport()
    text = render(st, family).restore_text(with_jumps=False)
    for builtin in ("INPUT", "FORWARD", "OUTPUT", "PREROUTING", "POSTROUTING"):
        assert f"-A {builtin} " not in text


def test_partial_restore_writes_only_the_named_services() -> None:
    st, _ = _itp_local_no_local_endpoints()
    rules = render(st, V4)
    keep = spn("ns2", "svc2")
    text = rules.restore_text(with_jumps=False, services=[(keep, V4)])
    tables = parse(text)
    nat_declared = tables["nat"][0]
    assert nat_declared[:4] == ["KUBE-SERVICES", "KUBE-NODEPORTS", "KUBE-POSTROUTING", "KUBE-MARK-MASQ"]
    assert nat_declared[4:] == rules.service_chains[(keep, V4)].chains
    # Top-level chains are always complete: declaring them flushes them.
    assert set(rules.nat["KUBE-SERVICES"]) <= set(tables["nat"][1])


def test_delete_chains_only_accepts_service_chains() -> None:
    rules = render(_nodeport()[0], V4)
    text = rules.restore_text(with_jumps=False, services=[], delete_chains=["KUBE-SEP-AAAAAAAAAAAAAAAA"])
    assert ":KUBE-SEP-AAAAAAAAAAAAAAAA - [0:0]" in text
    assert text.rstrip().endswith("-X KUBE-SEP-AAAAAAAAAAAAAAAA\nCOMMIT")
    for bad in ("KUBE-SERVICES", "INPUT", "DOCKER"):
        with pytest.raises(ValueError):
            rules.restore_text(delete_chains=[bad])


def test_both_local_policies_still_reference_only_declared_chains() -> None:
    """iTP=Local + eTP=Local: kube-proxy short-circuits via the SVC chain; see the module note."""
    svc = node_port(
        spn("ns1", "svc1"), "172.30.0.41", 3001, internal_policy_local=True, external_policy_local=True
    )
    rules = render(state((svc, [ep("10.180.0.1", node="test-node"), ep("10.180.0.2")])), V4)
    check_structure(rules)


def test_render_at_scale() -> None:
    """10 000 x 10 renders whole. Its time is bench/render.py's (timing is no test's business:
    a loaded machine would make it a flake)."""
    st = uniform_cluster(10000, 10)
    text = render(st, V4).restore_text()
    assert text.count("\n") > 400_000

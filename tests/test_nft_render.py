"""The nftables renderer: golden dumps per feature, structural properties, and the real kernel.

Goldens are the `nft -f` script itself (what the kernel gets), read against kube-proxy's
pkg/proxy/nftables/proxier_test.go expectations. Regenerate with NFPROXY_UPDATE_GOLDEN=1 and
read the diff before accepting it.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings

from nfproxy.backends.nft import render as nft
from nfproxy.backends.nft.render import (
    Element,
    NftRuleset,
    endpoint_chain_base,
    hash_and_truncate,
    nft_comment,
    nft_name,
    render,
    service_chain_base,
)
from nfproxy.nftables import Chain, Map, Rule, Verb
from nfproxy.nftables.expr import Body
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

GOLDEN = Path(__file__).parent / "golden" / "nft"
UPDATE = os.environ.get("NFPROXY_UPDATE_GOLDEN") == "1"

NODE = NodeConfig(
    name="node-a",
    ips=("192.168.0.2", "fd00:1::2"),
    cluster_cidrs=("10.0.0.0/8", "fd01::/48"),
    zone="zone-a",
)


# ------------------------------------------------------------------------------------------
# Quoting and names


def test_nft_name_accepts_kube_proxy_style_names() -> None:
    assert nft_name("service-ULMVA6XW-ns1/svc1/tcp/p80") == "service-ULMVA6XW-ns1/svc1/tcp/p80"
    assert nft_name("endpoint-X-ns/svc/tcp/__fd00.1..2/80") == "endpoint-X-ns/svc/tcp/__fd00.1..2/80"


@pytest.mark.parametrize(
    "text",
    ["", "1abc", "a b", "a;b", 'a"b', "a\nb", "a{b}", "a:b", "a@b", "a#b", "x" * 257, "ä"],
)
def test_nft_name_rejects_unsafe_text(text: str) -> None:
    with pytest.raises(ValueError, match=re.escape(repr(text))):
        nft_name(text)


def test_nft_comment_quotes_safe_text() -> None:
    assert nft_comment("ns1/svc1:p80") == '"ns1/svc1:p80"'
    assert nft_comment("short-circuit pod traffic") == '"short-circuit pod traffic"'


@pytest.mark.parametrize("text", ['a"b', "a\\b", "a\nb", "a;b", "a#b", "a{b", "a$b", "a\tb"])
def test_nft_comment_rejects_unsafe_text(text: str) -> None:
    with pytest.raises(ValueError, match=re.escape(repr(text))):
        nft_comment(text)


def test_nft_comment_cuts_to_nft_limit() -> None:
    long = "n" * 63 + "/" + "s" * 63 + ":" + "p" * 15
    quoted = nft_comment(long)
    assert len(quoted) == 128 + 2 and quoted.endswith('..."')


def test_names_match_kube_proxy() -> None:
    """Hashes from kube-proxy's proxier_test.go expectations."""
    p80 = ServicePortName("ns1", "svc1", "p80", Protocol.TCP)
    assert service_chain_base(p80) == "ULMVA6XW-ns1/svc1/tcp/p80"
    assert endpoint_chain_base(p80, Endpoint("10.180.0.1", 80)) == "5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80"
    assert service_chain_base(ServicePortName("ns2", "svc2", "p80", Protocol.TCP)).startswith("42NFTM6N-")
    assert service_chain_base(ServicePortName("ns5", "svc5", "p80", Protocol.TCP)).startswith("HVFWP5L3-")
    ns5 = ServicePortName("ns5", "svc5", "p80", Protocol.TCP)
    assert endpoint_chain_base(ns5, Endpoint("10.180.0.3", 80)).startswith("GTK6MW7G-")


def test_ipv6_endpoint_names_use_dots() -> None:
    spn = ServicePortName("ns1", "svc1", "p80", Protocol.TCP)
    assert endpoint_chain_base(spn, Endpoint("fd00:10::1", 80)).endswith("__fd00.10..1/80")


def test_long_names_are_hashed_and_truncated() -> None:
    # Real names stay under the limit (kube-proxy's worst case is about 205 characters)...
    longest = "n" * 63 + "/" + "s" * 63 + "/sctp/" + "p" * 15 + "__" + "ffff." * 7 + "ffff/65535"
    assert hash_and_truncate(longest).endswith(longest)
    # ...but anything longer is cut to 240, and still unique through the hash of the whole.
    a, b = hash_and_truncate("x" * 300 + "a"), hash_and_truncate("x" * 300 + "b")
    assert len(a) == len(b) == 240 and a.endswith("...") and a != b
    assert len(nft.ENDPOINT_PREFIX + a) <= 256


def test_unsafe_service_name_is_refused() -> None:
    spn = ServicePortName("ns1", "svc;flush ruleset", "p80", Protocol.TCP)
    svc = ServicePort(spn, IPFamily.V4, ServiceType.CLUSTER_IP, "172.30.0.1", 80)
    with pytest.raises(ValueError, match="flush ruleset"):
        render(ClusterState(NODE, {svc.key: svc}, {}), IPFamily.V4)


def test_unsafe_address_is_refused() -> None:
    spn = ServicePortName("ns1", "svc1", "p80", Protocol.TCP)
    svc = ServicePort(spn, IPFamily.V4, ServiceType.CLUSTER_IP, "172.30.0.1 } ; flush ruleset", 80)
    with pytest.raises(ValueError, match="flush ruleset"):
        render(ClusterState(NODE, {svc.key: svc}, {}), IPFamily.V4)


# ------------------------------------------------------------------------------------------
# Golden dumps


def _spn(ns: str, name: str, port: str = "p80", proto: Protocol = Protocol.TCP) -> ServicePortName:
    return ServicePortName(ns, name, port, proto)


def _state(
    *pairs: tuple[ServicePort, list[Endpoint]], node: NodeConfig = NODE
) -> ClusterState:
    services = {svc.key: svc for svc, _ in pairs}
    endpoints = {svc.key: sort_endpoints(eps) for svc, eps in pairs if eps}
    return ClusterState(node=node, services=services, endpoints=endpoints)


def _ep(ip: str, port: int = 80, node: str = "node-b", **kw: object) -> Endpoint:
    return Endpoint(ip=ip, port=port, node_name=node, **kw)  # type: ignore[arg-type]


V4 = IPFamily.V4
V6 = IPFamily.V6


def _clusterip(name: str, ip: str, **kw: object) -> ServicePort:
    spn = kw.pop("spn", None) or _spn("ns1", name)
    return ServicePort(spn, V4, ServiceType.CLUSTER_IP, ip, 80, **kw)  # type: ignore[arg-type]


GOLDEN_CASES: dict[str, tuple[Callable[[], ClusterState], IPFamily]] = {
    "clusterip_3_endpoints": (
        lambda: _state(
            (
                _clusterip("svc1", "172.30.0.41"),
                [_ep("10.180.0.1"), _ep("10.180.0.2"), _ep("10.180.1.1", node="node-a")],
            )
        ),
        V4,
    ),
    "nodeport": (
        lambda: _state(
            (
                ServicePort(_spn("ns3", "svc3"), V4, ServiceType.NODE_PORT, "172.30.0.43", 80, node_port=3003),
                [_ep("10.180.0.3")],
            )
        ),
        V4,
    ),
    "nodeport_addresses": (
        lambda: _state(
            (
                ServicePort(_spn("ns3", "svc3"), V4, ServiceType.NODE_PORT, "172.30.0.43", 80, node_port=3003),
                [_ep("10.180.0.3")],
            ),
            node=NodeConfig(
                name="node-a",
                ips=("192.168.0.2",),
                cluster_cidrs=("10.0.0.0/8",),
                nodeport_addresses=("192.168.0.0/24", "192.168.0.2/32", "10.1.2.3/16", "fd00::/64"),
            ),
        ),
        V4,
    ),
    "loadbalancer_source_ranges_etp_local": (
        lambda: _state(
            (
                ServicePort(
                    _spn("ns2", "svc2"),
                    V4,
                    ServiceType.LOAD_BALANCER,
                    "172.30.0.42",
                    80,
                    node_port=3001,
                    external_ips=("192.168.99.22",),
                    load_balancer_ips=("1.2.3.4",),
                    load_balancer_source_ranges=("203.0.113.0/25", "192.168.0.0/24"),
                    external_policy_local=True,
                    health_check_node_port=30000,
                ),
                [_ep("10.180.0.2", node="node-a"), _ep("10.180.0.3")],
            )
        ),
        V4,
    ),
    "loadbalancer_etp_local_no_local_endpoints": (
        lambda: _state(
            (
                ServicePort(
                    _spn("ns2", "svc2"),
                    V4,
                    ServiceType.LOAD_BALANCER,
                    "172.30.0.42",
                    80,
                    node_port=3001,
                    load_balancer_ips=("1.2.3.4",),
                    load_balancer_source_ranges=("203.0.113.0/25",),
                    external_policy_local=True,
                    health_check_node_port=30000,
                ),
                [_ep("10.180.0.2")],
            )
        ),
        V4,
    ),
    "external_ips": (
        lambda: _state(
            (
                _clusterip("svc4", "172.30.0.44", spn=_spn("ns4", "svc4"), external_ips=("192.168.99.33",)),
                [_ep("10.180.0.4"), _ep("10.180.0.5", node="node-a")],
            )
        ),
        V4,
    ),
    "affinity": (
        lambda: _state(
            (
                ServicePort(
                    _spn("ns5", "svc5"),
                    V4,
                    ServiceType.LOAD_BALANCER,
                    "172.30.0.45",
                    80,
                    node_port=3002,
                    load_balancer_ips=("5.6.7.8",),
                    load_balancer_source_ranges=("203.0.113.0/25",),
                    affinity_timeout=10800,
                ),
                [_ep("10.180.0.3"), _ep("10.180.0.4")],
            )
        ),
        V4,
    ),
    "no_endpoints": (
        lambda: _state(
            (
                ServicePort(
                    _spn("ns6", "svc6"),
                    V4,
                    ServiceType.LOAD_BALANCER,
                    "172.30.0.46",
                    80,
                    node_port=3006,
                    external_ips=("192.168.99.11",),
                    load_balancer_ips=("1.2.3.4",),
                ),
                [],
            )
        ),
        V4,
    ),
    "itp_local_no_local_endpoints": (
        lambda: _state(
            (
                _clusterip("svc7", "172.30.0.47", internal_policy_local=True),
                [_ep("10.180.0.7")],
            ),
            (
                _clusterip("svc8", "172.30.0.48", internal_policy_local=True),
                [_ep("10.180.0.8", node="node-a"), _ep("10.180.0.9")],
            ),
        ),
        V4,
    ),
    "itp_and_etp_local": (
        lambda: _state(
            (
                ServicePort(
                    _spn("ns9", "svc9"),
                    V4,
                    ServiceType.NODE_PORT,
                    "172.30.0.49",
                    80,
                    node_port=3009,
                    internal_policy_local=True,
                    external_policy_local=True,
                ),
                [_ep("10.180.0.8", node="node-a"), _ep("10.180.0.9")],
            ),
        ),
        V4,
    ),
    "masquerade_all": (
        lambda: _state(
            (_clusterip("svc1", "172.30.0.41"), [_ep("10.180.0.1")]),
            node=NodeConfig(name="node-a", ips=("192.168.0.2",), masquerade_all=True),
        ),
        V4,
    ),
    "no_cluster_cidr": (
        lambda: _state(
            (
                ServicePort(
                    _spn("ns2", "svc2"), V4, ServiceType.NODE_PORT, "172.30.0.42", 80,
                    node_port=3001, external_policy_local=True,
                ),
                [_ep("10.180.0.1", node="node-a")],
            ),
            node=NodeConfig(name="node-a", ips=("192.168.0.2",)),
        ),
        V4,
    ),
    "two_cluster_cidrs": (
        lambda: _state(
            (_clusterip("svc1", "172.30.0.41"), [_ep("10.180.0.1")]),
            node=NodeConfig(name="node-a", ips=("192.168.0.2",), cluster_cidrs=("10.0.0.0/16", "10.2.0.0/16")),
        ),
        V4,
    ),
    "udp": (
        lambda: _state(
            (
                _clusterip("dns", "172.30.0.10", spn=_spn("kube-system", "dns", "dns", Protocol.UDP)),
                [_ep("10.180.0.53", 53), _ep("10.180.1.53", 53)],
            )
        ),
        V4,
    ),
    "sctp": (
        lambda: _state(
            (
                _clusterip("sig", "172.30.0.12", spn=_spn("ns1", "sig", "", Protocol.SCTP)),
                [_ep("10.180.0.12", 3868)],
            )
        ),
        V4,
    ),
    "ipv6": (
        lambda: _state(
            (
                ServicePort(
                    _spn("ns1", "svc1"),
                    V6,
                    ServiceType.LOAD_BALANCER,
                    "fd00:172:30::41",
                    80,
                    node_port=3001,
                    load_balancer_ips=("2001:db8:1::4",),
                    load_balancer_source_ranges=("2001:db8::/32",),
                    affinity_timeout=60,
                ),
                [_ep("fd00:10::1"), _ep("fd00:10::2", node="node-a")],
            )
        ),
        V6,
    ),
    "terminating_fallback": (
        lambda: _state(
            (
                _clusterip("svc1", "172.30.0.41"),
                [
                    _ep("10.180.0.1", ready=False, serving=True, terminating=True),
                    _ep("10.180.0.2", ready=False, serving=False, terminating=True),
                    _ep("10.180.0.3", ready=False, serving=True, terminating=True, node="node-a"),
                ],
            )
        ),
        V4,
    ),
    "topology_hints": (
        lambda: _state(
            (
                _clusterip("svc1", "172.30.0.41"),
                [
                    _ep("10.180.0.1", zone_hints=frozenset({"zone-a"})),
                    _ep("10.180.0.2", zone_hints=frozenset({"zone-b"})),
                    _ep("10.180.0.3", zone_hints=frozenset({"zone-a"}), node="node-a"),
                ],
            )
        ),
        V4,
    ),
}


@pytest.mark.parametrize("case", sorted(GOLDEN_CASES))
def test_golden(case: str) -> None:
    build, family = GOLDEN_CASES[case]
    got = render(build(), family).script()
    path = GOLDEN / f"{case}.nft"
    if UPDATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(got)
    assert path.exists(), f"no golden {path}; run with NFPROXY_UPDATE_GOLDEN=1 and read it"
    assert got == path.read_text()


def test_structure_is_split_per_service() -> None:
    build, family = GOLDEN_CASES["loadbalancer_source_ranges_etp_local"]
    rs = render(build(), family)
    (key,) = rs.services
    owned = rs.services[key]
    assert list(owned.chains) == [
        "service-42NFTM6N-ns2/svc2/tcp/p80",
        "local-42NFTM6N-ns2/svc2/tcp/p80",
        "external-42NFTM6N-ns2/svc2/tcp/p80",
        "firewall-42NFTM6N-ns2/svc2/tcp/p80",
    ]
    # No endpoint chains: keys in a shared hash data map, one lane per selecting chain.
    assert dict(owned.blocks) == {
        "service-42NFTM6N-ns2/svc2/tcp/p80": (0, 1),
        "local-42NFTM6N-ns2/svc2/tcp/p80": (1, 1),
    }
    assert owned.shards == ("endpoints-counted-tcp-hash-0", "endpoints-counted-tcp-hash-0")
    # Only the endpoint on this node: kube-proxy 1.37 nftables hairpins local endpoints only.
    assert set(owned.hairpin) == {"10.180.0.2"}
    assert rs.elements["service-nodeports"] == {
        "tcp . 3001": Element("service-nodeports", "tcp . 3001", "goto external-42NFTM6N-ns2/svc2/tcp/p80")
    }
    assert rs.elements["firewall-ips"]["1.2.3.4 . tcp . 80"] == Element(
        "firewall-ips", "1.2.3.4 . tcp . 80", "goto firewall-42NFTM6N-ns2/svc2/tcp/p80", "ns2/svc2:p80"
    )


@pytest.mark.parametrize("drop_invalid", [True, False])
def test_forward_and_input_test_new_connections_once(drop_invalid: bool) -> None:
    """Every packet of a connection walks filter-forward and filter-input; only the first needs
    the checks, so each base chain tests `ct state new` once and jumps to a chain holding them,
    in kube-proxy's order (issue S: two rules a packet fewer in forward)."""
    node = NodeConfig(name="node-a", ips=("192.168.0.2",), cluster_cidrs=("10.0.0.0/8",),
                      service_cidrs=("172.16.0.0/12",), drop_invalid=drop_invalid)
    rs = render(ClusterState(node=node, services={}, endpoints={}), IPFamily.V4)
    invalid = ("ct state invalid counter name ct_state_invalid_dropped_pkts drop",) if drop_invalid else ()
    assert _texts(rs.chains["filter-forward"]) == (*invalid, "ct state new jump forward-new")
    # kube-proxy's two forward checks: one no-endpoint map for cluster, external and LB IPs.
    assert _texts(rs.chains["forward-new"]) == ("jump service-endpoints-check", "jump cluster-ips-check")
    assert _texts(rs.chains["filter-input"]) == ("ct state new jump input-new",)
    assert _texts(rs.chains["input-new"]) == ("jump nodeport-endpoints-check", "jump service-endpoints-check")
    # Output's checks sit on either side of the node's own DNAT: they stay inline, the
    # no-endpoint check after it (as kube-proxy's filter-output, priority filter).
    assert _texts(rs.chains["filter-output"]) == ("ct state new jump firewall-check",)
    assert _texts(rs.chains["filter-output-post-dnat"]) == (
        "ct state new jump service-endpoints-check", "ct state new jump cluster-ips-check",
    )

def test_duplicate_element_key_first_service_wins() -> None:
    a = _clusterip("a", "172.30.0.1", external_ips=("192.168.99.1",))
    b = _clusterip("b", "172.30.0.2", external_ips=("192.168.99.1",))
    rs = render(_state((a, [_ep("10.1.0.1")]), (b, [_ep("10.1.0.2")])), V4)
    value = rs.elements["service-ips"]["192.168.99.1 . tcp . 80"].value
    assert value.startswith("goto external-") and value.endswith("ns1/a/tcp/p80")


# ------------------------------------------------------------------------------------------
# Properties

_REF = re.compile(r"(?:goto|jump) (\S+)")
_SETREF = re.compile(r"@([A-Za-z0-9_./-]+)")
def _texts(bodies: tuple[Body, ...]) -> tuple[str, ...]:
    """Rule bodies as nft text."""
    return tuple(map(str, bodies))


_NUMGEN = re.compile(r"numgen random mod (\d+) vmap \{ (.*) \}$")
_DNAT_MAP = re.compile(r"dnat ip6? to numgen random mod (\d+) offset (\d+) map @(\S+)$")
PROPS = settings(deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow])


def _all_chains(rs: NftRuleset) -> list[str]:
    names = list(rs.chains)
    for owned in rs.services.values():
        names += list(owned.chains)
    return names


def _all_sets(rs: NftRuleset) -> list[str]:
    names = list(rs.sets) + list(rs.shard_users)
    for owned in rs.services.values():
        names += list(owned.affinity_sets)
    return names


@PROPS
@given(clusters())
def test_render_is_deterministic(state: ClusterState) -> None:
    for family in IPFamily:
        a, b = render(state, family), render(state, family)
        assert a == b
        assert a.script() == b.script()


@PROPS
@given(clusters())
def test_every_reference_is_declared_and_names_are_unique(state: ClusterState) -> None:
    for family in IPFamily:
        rs = render(state, family)
        chains, sets = _all_chains(rs), _all_sets(rs)
        assert len(chains) == len(set(chains))
        assert len(sets) == len(set(sets))
        declared_chains, declared_sets = set(chains), set(sets)
        rules = [str(r) for rules in rs.chains.values() for r in rules]
        for owned in rs.services.values():
            rules += [str(r) for rules in owned.chains.values() for r in rules]
        values = [el.value for els in rs.all_elements().values() for el in els.values()]
        for text in rules + values:
            for target in _REF.findall(text):
                assert target in declared_chains, text
            for ref in _SETREF.findall(text):
                assert ref in declared_sets, text
        for name in rs.all_elements():
            assert name in rs.sets or name in rs.shard_users
        for name in chains + sets:
            nft_name(name)


@PROPS
@given(clusters())
def test_numgen_covers_each_endpoint_once(state: ClusterState) -> None:
    for family in IPFamily:
        rs = render(state, family)
        for key, owned in rs.services.items():
            svc = state.services[key]
            r = categorize(svc, state.endpoints.get(key, ()), state.node)
            base = service_chain_base(svc.name)
            for prefix, eps in (("service-", r.cluster), ("local-", r.local)):
                chain = prefix + base
                if not eps:
                    assert chain not in owned.chains
                    continue
                if not svc.affinity_timeout:
                    # Lanes: the values offset..offset+mod-1 of one interval map, one range per
                    # endpoint in endpoint order, each 1/n of the lane, nothing else in it.
                    (m,) = [m for rule in owned.chains[chain] if (m := _DNAT_MAP.search(str(rule)))]
                    mod, first, shard = int(m.group(1)), int(m.group(2)), m.group(3)
                    spans = sorted(
                        (lo, hi, el.value) for k, el in rs.all_elements()[shard].items()
                        for lo, hi in [_span(k)] if first <= hi and lo < first + mod
                    )
                    assert [v for _, _, v in spans] == [f"{ep.ip} . {ep.port}" for ep in eps]
                    assert spans[0][0] == first and spans[-1][1] == first + mod - 1
                    assert all(a[1] + 1 == b[0] for a, b in zip(spans, spans[1:]))
                    assert {hi - lo + 1 for lo, hi, _ in spans} == {mod // len(eps)}
                    assert mod % len(eps) == 0 and (mod == nft.LANE or mod == len(eps))
                    assert first % nft.LANE == 0 and first + mod <= nft.LANES_PER_MAP * nft.LANE
                    continue
                (m,) = [m for rule in owned.chains[chain] if (m := _NUMGEN.search(str(rule)))]
                n = int(m.group(1))
                slots = m.group(2).split(" , ")
                assert n == len(eps) == len(slots)
                assert [s.split(" : ")[0] for s in slots] == [str(i) for i in range(n)]
                targets = [s.split(" : goto ")[1] for s in slots]
                assert targets == ["endpoint-" + endpoint_chain_base(svc.name, ep) for ep in eps]
                assert len(set(targets)) == n
                for target in targets:
                    assert target in owned.chains


# ------------------------------------------------------------------------------------------
# The real kernel


def _have_kernel_tools() -> bool:
    return os.geteuid() == 0 and shutil.which("nft") is not None and shutil.which("ip") is not None


def _apply_in_netns(script: str) -> dict:
    ns = f"nfproxy-nfttest-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        for _ in range(2):  # the second apply proves the script is safe over an existing table
            done = subprocess.run(
                ["ip", "netns", "exec", ns, "nft", "-f", "-"],
                input=script, text=True, capture_output=True,
            )
            assert done.returncode == 0, done.stderr[-3000:]
        listed = subprocess.run(
            ["ip", "netns", "exec", ns, "nft", "-j", "list", "ruleset"],
            check=True, text=True, capture_output=True,
        )
        return json.loads(listed.stdout)
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=True)


def _kernel_states() -> list[tuple[str, ClusterState]]:
    states = [(name, build()) for name, (build, _f) in sorted(GOLDEN_CASES.items())]
    states.append(("uniform-200x10", uniform_cluster(200, 10)))
    states += [(f"random-{seed}", random_cluster(random.Random(seed), 200)) for seed in (1, 2, 3, 4)]
    return states


@pytest.mark.kernel
def test_kernel_accepts_scripts() -> None:
    assert _have_kernel_tools(), "needs root, nft and ip"
    for label, state in _kernel_states():
        rulesets = [render(state, family) for family in IPFamily]
        listing = _apply_in_netns("".join(rs.script() for rs in rulesets))
        objects = listing["nftables"]
        for rs in rulesets:
            fam = rs.nft_family
            chains = {o["chain"]["name"] for o in objects if "chain" in o and o["chain"]["family"] == fam}
            sets = {o["set"]["name"] for o in objects if "set" in o and o["set"]["family"] == fam}
            maps = {o["map"]["name"] for o in objects if "map" in o and o["map"]["family"] == fam}
            assert chains == set(_all_chains(rs)), label
            assert sets | maps == set(_all_sets(rs)), label
            (hp,) = [o["set"] for o in objects if "set" in o and o["set"]["name"] == "hairpin" and o["set"]["family"] == fam]
            assert len(hp.get("elem", [])) == len(rs.hairpin_refs), label
            for name, elements in rs.all_elements().items():
                kind = "map" if name in rs.shard_users or isinstance(rs.sets[name], Map) else "set"
                (obj,) = [o[kind] for o in objects if kind in o and o[kind]["name"] == name and o[kind]["family"] == fam]
                assert len(obj.get("elem", [])) == len(elements), (label, name)


def _slot_ops(d: nft.NftDelta) -> list:
    return [(v, o) for v, o in d.transaction.operations() if isinstance(o, Element) and o.set.startswith("endpoints-")]


def _span(key: str) -> tuple[int, int]:
    low, _, high = key.partition("-")
    return int(low), int(high or low)


def _slots_of(rs: NftRuleset, key) -> list[str]:  # noqa: ANN001
    """The endpoint of each range of the port's one selecting chain, in range order."""
    owned = rs.services[key]
    ((chain, _lane),) = owned.blocks.items()
    (shard,) = owned.shards
    m = re.search(r"numgen random mod (\d+) offset (\d+)", str(owned.chains[chain][-1]))
    mod, first = int(m.group(1)), int(m.group(2))
    spans = sorted((*_span(k), el.value) for k, el in rs.all_elements()[shard].items())
    return [v for lo, hi, v in spans if first <= lo and hi < first + mod]


def test_partial_update_keeps_endpoints_on_their_ranges() -> None:
    """An interval lane (here 21 endpoints, more than a hash map's chain holds): a replaced
    endpoint changes one range; an endpoint more or fewer rewrites the lane's ranges and nothing
    else: no rule, no chain (the kernel validates no table for that)."""
    import dataclasses

    state = uniform_cluster(5, 21)
    rs = render(state, V4)
    key = sorted(state.services, key=str)[2]
    assert rs.services[key].shards == ("endpoints-counted-tcp-ranges-0",)
    eps = list(state.endpoints[key])
    eps.pop(3)
    shrunk = dataclasses.replace(state, endpoints={**state.endpoints, key: tuple(eps)})
    new = nft.render_update(rs, shrunk, [key])
    d = nft.delta(rs, new, [key])
    ops = list(d.transaction.operations())
    assert ops and all(isinstance(o, Element) for _, o in ops), ops
    assert len(_slot_ops(d)) == 21 + 20
    assert _slots_of(new, key) == [f"{e.ip} . {e.port}" for e in eps]
    assert new.services[key].chains == rs.services[key].chains  # mod LANE: the rule stays

    replaced = Endpoint(ip="10.0.0.0", port=8080)  # sorts before every other endpoint
    swapped = sorted([*eps[:4], replaced, *eps[5:]], key=lambda e: e.ip)
    other = dataclasses.replace(shrunk, endpoints={**shrunk.endpoints, key: tuple(swapped)})
    newer = nft.render_update(new, other, [key])
    d = nft.delta(new, newer, [key])
    slot_ops = _slot_ops(d)
    assert [v for v, _ in slot_ops] == [Verb.DELETE, Verb.ADD], slot_ops
    deleted, added = slot_ops[0][1], slot_ops[1][1]
    assert added.key == deleted.key and added.value == "10.0.0.0 . 8080"
    assert _slots_of(newer, key)[4] == "10.0.0.0 . 8080"  # it took the place of the one that went


def test_partial_update_of_a_hash_chain() -> None:
    """A hash-map chain (unweighted, at most 16 endpoints): a replaced endpoint is one key
    deleted and added again, the rule kept; an endpoint fewer is the rule's modulus rewritten,
    and the endpoints that stay keep their keys (the last one takes the key that went)."""
    import dataclasses

    state = uniform_cluster(5, 10)
    rs = render(state, V4)
    key = sorted(state.services, key=str)[2]
    (chain,) = rs.services[key].blocks
    assert rs.services[key].shards == ("endpoints-counted-tcp-hash-0",)
    assert "numgen random mod 10 offset " in str(rs.services[key].chains[chain][-1])
    eps = list(state.endpoints[key])
    before = _slots_of(rs, key)
    gone = eps.pop(3)
    shrunk = dataclasses.replace(state, endpoints={**state.endpoints, key: tuple(eps)})
    new = nft.render_update(rs, shrunk, [key])
    d = nft.delta(rs, new, [key])
    assert "numgen random mod 9 offset " in str(new.services[key].chains[chain][-1])
    others = [(v, o) for v, o in d.transaction.operations() if not isinstance(o, Element)]
    assert others[0] == (Verb.FLUSH, Chain(chain))
    assert [o for _, o in others[1:]] == [Rule(chain, body) for body in new.services[key].chains[chain]]
    after = _slots_of(new, key)
    moved = before.index(f"{gone.ip} . {gone.port}")
    assert after == [before[-1] if i == moved else v for i, v in enumerate(before[:-1])]
    assert [v for v, _ in _slot_ops(d)] == [Verb.DELETE, Verb.DELETE, Verb.ADD]

    replaced = Endpoint(ip="10.0.0.0", port=8080)
    swapped = [*eps[:4], replaced, *eps[5:]]
    other = dataclasses.replace(shrunk, endpoints={**shrunk.endpoints, key: tuple(swapped)})
    newer = nft.render_update(new, other, [key])
    d = nft.delta(new, newer, [key])
    assert newer.services[key].chains == new.services[key].chains
    slot_ops = _slot_ops(d)
    assert [v for v, _ in slot_ops] == [Verb.DELETE, Verb.ADD], slot_ops
    assert slot_ops[0][1].key == slot_ops[1][1].key and slot_ops[1][1].value == "10.0.0.0 . 8080"

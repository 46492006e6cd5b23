"""The traffic sandbox against the real kernel: every test builds (and tears down) its own."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest
from pyroute2 import netns as pyroute2_netns

from nfproxy.verify import sandbox as sandbox_mod
from nfproxy.kernel.nft import NftSession
from nfproxy.verify.sandbox import (
    ConnectFailed,
    Outcome,
    Sandbox,
    SandboxError,
    SandboxSpec,
    summarize,
)

pytestmark = pytest.mark.kernel

EPS4 = ("10.244.0.5", "10.244.0.6", "10.244.0.7")
EP6 = "fd01::5"
SPEC = SandboxSpec.of(
    node_ips=["192.168.0.2", "fd00:1::2"],
    service_cidrs=["10.96.0.0/16", "fd00:96::/108"],
    clients={"outside": ["203.0.113.10", "2001:db8::10"], "pod": "10.244.1.9"},
    endpoints={
        **{ip: [(8080, "tcp"), (8080, "udp")] for ip in EPS4},
        EP6: [(8080, "tcp"), (53, "udp")],
    },
)

_PICK = (
    "ip daddr 10.96.0.10 meta l4proto { tcp, udp } th dport 80 dnat to numgen random mod 3"
    " map { 0 : 10.244.0.5, 1 : 10.244.0.6, 2 : 10.244.0.7 } : 8080"
)
# "priority dstnat" is only valid on prerouting in nft 1.0.6: output spells out -100.
NUMGEN = f"""
table ip t {{
    chain pre {{
        type nat hook prerouting priority dstnat; policy accept;
        {_PICK}
    }}
    chain out {{
        type nat hook output priority -100; policy accept;
        {_PICK}
    }}
}}
"""


@pytest.fixture(autouse=True)
def _root_and_no_leftovers() -> Iterator[None]:
    if os.geteuid() != 0:
        pytest.fail("sandbox tests need root: they create network namespaces (run scripts/test)")
    yield
    mine = [n for n in pyroute2_netns.listnetns() if n.startswith(f"nfsb-{os.getpid()}-")]
    assert mine == [], f"namespaces left behind: {mine}"


def _only(outcomes: list[Outcome]) -> Outcome:
    assert len({(o.kind, o.endpoint, o.source) for o in outcomes}) == 1, outcomes
    return outcomes[0]


def test_direct_connections_see_endpoint_and_client_source() -> None:
    with Sandbox(SPEC) as sb:
        sources = {"outside": "203.0.113.10", "pod": "10.244.1.9", "node": "192.168.0.2"}
        for client, src in sources.items():
            for ip in EPS4:
                for proto in ("tcp", "udp"):
                    o = _only(sb.connect(client, ip, 8080, proto, count=3))
                    want = ("ok", f"{ip}:8080", src)
                    assert (o.kind, o.endpoint, o.source) == want, (client, proto)
        for client, src in (("outside", "2001:db8::10"), ("node", "fd00:1::2")):
            o = _only(sb.connect(client, EP6, 8080, "tcp", count=3))
            assert (o.kind, o.endpoint, o.source) == ("ok", f"[{EP6}]:8080", src)
            o = _only(sb.connect(client, EP6, 53, "udp", count=3))
            assert (o.kind, o.endpoint, o.source) == ("ok", f"[{EP6}]:53", src)


def test_host_network_endpoint_lives_in_the_node() -> None:
    spec = SandboxSpec.of(
        node_ips=["192.168.0.2"], clients={"outside": "203.0.113.10"},
        endpoints={"192.168.0.2": [(10250, "tcp")]},
    )
    with Sandbox(spec) as sb:
        assert sb.endpoint_ns("192.168.0.2") == sb.node_ns
        o = _only(sb.connect("outside", "192.168.0.2", 10250, count=2))
        assert (o.endpoint, o.source) == ("192.168.0.2:10250", "203.0.113.10")


def test_nothing_listening_is_refused_fast_for_tcp_and_udp() -> None:
    with Sandbox(SPEC) as sb:
        for proto in ("tcp", "udp"):
            o = _only(sb.connect("outside", EPS4[0], 9999, proto, count=2))
            assert o.kind == "refused"  # an answer, not a timeout: how fast is bench's business


def test_numgen_dnat_spreads_connections_and_held_ones_stick() -> None:
    with Sandbox(SPEC) as sb:
        NftSession(sb.node_ns).apply(NUMGEN)
        for client, proto in (("outside", "tcp"), ("pod", "udp"), ("node", "tcp")):
            outcomes = sb.connect(client, "10.96.0.10", 80, proto, count=900)
            counts = summarize(outcomes)
            assert set(counts) == {f"{ip}:8080" for ip in EPS4}, (client, proto, counts)
            assert min(counts.values()) > 200, (client, proto, counts)
            assert {o.source for o in outcomes} == {sb.address(client, 4)}
        for proto in ("tcp", "udp"):
            with sb.open("outside", "10.96.0.10", 80, proto) as conn:
                seen = {conn.exchange().label for _ in range(20)}
                if conn.greeting is not None:
                    seen.add(conn.greeting.label)
                assert len(seen) == 1 and seen <= {f"{ip}:8080" for ip in EPS4}, seen


def test_held_connection_survives_a_ruleset_replacement() -> None:
    with Sandbox(SPEC) as sb:
        nft = NftSession(sb.node_ns)
        nft.apply(NUMGEN)
        with sb.open("pod", "10.96.0.10", 80) as conn:
            first = conn.greeting
            assert first is not None and first.ok
            nft.apply("delete table ip t\n" + NUMGEN)
            again = conn.exchange()
            assert (again.kind, again.endpoint) == ("ok", first.endpoint)


def test_masquerade_shows_as_the_node_ip() -> None:
    with Sandbox(SPEC) as sb:
        NftSession(sb.node_ns).apply(
            NUMGEN
            + 'table ip m {\n chain post {\n type nat hook postrouting priority srcnat;\n'
            + ' oifname "ep*" masquerade\n }\n}\n'
        )
        outcomes = sb.connect("outside", "10.96.0.10", 80, "tcp", count=30)
        assert summarize(outcomes, by="source") == {"192.168.0.2": 30}


def test_ipv6_dnat_and_masquerade() -> None:
    with Sandbox(SPEC) as sb:
        NftSession(sb.node_ns).apply(
            """
            table ip6 t {
                chain pre {
                    type nat hook prerouting priority dstnat; policy accept;
                    ip6 daddr fd00:96::10 tcp dport 80 dnat to [fd01::5]:8080
                    ip6 daddr fd00:96::10 udp dport 53 dnat to [fd01::5]:53
                }
                chain out {
                    type nat hook output priority -100; policy accept;
                    ip6 daddr fd00:96::10 tcp dport 80 dnat to [fd01::5]:8080
                }
                chain post {
                    type nat hook postrouting priority srcnat; policy accept;
                    ip6 daddr fd01::5 udp dport 53 masquerade
                }
            }
            """
        )
        o = _only(sb.connect("outside", "fd00:96::10", 80, "tcp", count=20))
        assert (o.endpoint, o.source) == ("[fd01::5]:8080", "2001:db8::10")
        o = _only(sb.connect("node", "fd00:96::10", 80, "tcp", count=20))
        assert (o.endpoint, o.source) == ("[fd01::5]:8080", "fd00:1::2")
        o = _only(sb.connect("outside", "fd00:96::10", 53, "udp", count=20))
        assert (o.endpoint, o.source) == ("[fd01::5]:53", "fd00:1::2")


def test_hairpin_needs_masquerade() -> None:
    """An endpoint reaching its own service: without SNAT its reply never returns via the node."""
    hairpin = """
    table ip h {
        chain pre {
            type nat hook prerouting priority dstnat; policy accept;
            ip daddr 10.96.0.30 tcp dport 80 dnat to 10.244.0.5:8080
        }
        chain post {
            type nat hook postrouting priority srcnat; policy accept;
            ip saddr 10.244.0.5 ip daddr 10.244.0.5 masquerade
        }
    }
    """
    with Sandbox(SPEC) as sb:
        nft = NftSession(sb.node_ns)
        nft.apply(hairpin.replace("masquerade", "accept"))
        o = _only(sb.connect("10.244.0.5", "10.96.0.30", 80, count=3, timeout=0.3))
        assert o.kind == "timeout"
        nft.apply("delete table ip h\n" + hairpin)
        o = _only(sb.connect(EPS4[0], "10.96.0.30", 80, count=3))
        assert (o.endpoint, o.source) == ("10.244.0.5:8080", "192.168.0.2")


def test_reject_is_refused_within_a_second_and_drop_times_out() -> None:
    with Sandbox(SPEC) as sb:
        NftSession(sb.node_ns).apply(
            """
            table inet f {
                chain forward_filter {
                    type filter hook forward priority filter; policy accept;
                    ip daddr 10.96.0.20 tcp dport 80 reject with tcp reset
                    ip daddr 10.96.0.21 drop
                    ip daddr 10.96.0.22 reject with icmp type host-unreachable
                }
                chain input_filter {
                    type filter hook input priority filter; policy accept;
                    ip daddr 192.168.0.2 tcp dport 30000 reject with tcp reset
                    ip daddr 192.168.0.2 udp dport 30000 reject
                }
            }
            """
        )
        for dst, port, proto in (
            ("10.96.0.20", 80, "tcp"), ("192.168.0.2", 30000, "tcp"), ("192.168.0.2", 30000, "udp")
        ):
            o = _only(sb.connect("outside", dst, port, proto, count=50))
            assert o.kind == "refused", (dst, proto, o)
        o = _only(sb.connect("outside", "10.96.0.22", 80, "tcp", count=2))
        assert o.kind == "unreachable"
        for proto in ("tcp", "udp"):
            started = time.monotonic()
            outcomes = sb.connect("outside", "10.96.0.21", 80, proto, count=10, timeout=0.3)
            assert {o.kind for o in outcomes} == {"timeout"}
            assert time.monotonic() - started >= 0.3  # they waited for the timeout
        with pytest.raises(ConnectFailed) as failed:
            sb.open("outside", "10.96.0.20", 80)
        assert failed.value.outcome.kind == "refused"


def test_unrewritten_service_traffic_is_dropped_not_answered() -> None:
    with Sandbox(SPEC) as sb:
        for client in ("outside", "node"):
            o = _only(sb.connect(client, "10.96.0.99", 80, "tcp", count=3, timeout=0.2))
            assert o.kind == "timeout"


def test_udp_probes_each_use_a_fresh_source_port() -> None:
    with Sandbox(SPEC) as sb:
        outcomes = sb.connect("outside", EPS4[0], 8080, "udp", count=500)
        assert len({o.source_port for o in outcomes}) == 500


def test_cleanup_when_the_body_raises_or_is_interrupted() -> None:
    for exc in (RuntimeError("boom"), KeyboardInterrupt()):
        with pytest.raises(type(exc)):
            with Sandbox(SPEC) as sb:
                names = sb.namespaces
                conn = sb.open("outside", EPS4[0], 8080)
                assert set(names) <= set(pyroute2_netns.listnetns())
                raise exc
        assert not set(names) & set(pyroute2_netns.listnetns())
        assert not conn.exchange().ok  # closed with the sandbox
    with pytest.raises(SandboxError):
        sb.connect("outside", EPS4[0], 8080)


def test_failed_build_leaves_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(self: object) -> None:
        raise KeyboardInterrupt  # after every namespace, link and server socket exists

    monkeypatch.setattr(sandbox_mod._Servers, "start", interrupted)
    sb = Sandbox(SPEC)
    with pytest.raises(KeyboardInterrupt):
        sb.start()
    assert sb.namespaces == ()
    assert [n for n in pyroute2_netns.listnetns() if n.startswith(sb.base)] == []


@pytest.mark.parametrize(
    "kwargs",
    [
        {"node_ips": ["192.168.0.2"], "clients": {"a": "192.168.0.2"}},
        {"clients": {"node": "203.0.113.1"}},
        {"clients": {"a": "169.254.1.1"}},
        {"endpoints": {"10.0.0.1": [(80, "sctp")]}},
        {"endpoints": {"10.0.0.1": [(0, "tcp")]}},
        {"clients": {"a": "not-an-ip"}},
        {"service_cidrs": ["10.96.0.0/33"]},
    ],
)
def test_bad_specs_are_rejected(kwargs: dict) -> None:
    with pytest.raises(SandboxError):
        SandboxSpec.of(**kwargs)


def test_two_thousand_tcp_connections_in_a_few_seconds() -> None:
    spec = SandboxSpec.of(
        node_ips=["192.168.0.2"], clients={"outside": "203.0.113.10"},
        endpoints={ip: [(8080, "tcp")] for ip in EPS4},
    )
    with Sandbox(spec) as sb:
        NftSession(sb.node_ns).apply(NUMGEN)
        started = time.monotonic()
        outcomes = sb.connect("outside", "10.96.0.10", 80, "tcp", count=2000)
        elapsed = time.monotonic() - started
    assert sum(summarize(outcomes).values()) == 2000 and all(o.ok for o in outcomes)
    print(f"\n2000 TCP connections through DNAT in {elapsed:.2f}s: {2000 / elapsed:.0f}/s")


def test_outcomes_carry_the_client_port_masquerade_would_change() -> None:
    with Sandbox(SPEC) as sb:
        for client in ("outside", "node"):
            for proto in ("tcp", "udp"):
                outcomes = sb.connect(client, EPS4[0], 8080, proto, count=20)
                assert all(o.ok and o.client_port for o in outcomes)
                assert all(o.client_port == o.source_port for o in outcomes), (client, proto)
        NftSession(sb.node_ns).apply(
            NUMGEN
            + 'table ip m {\n chain post {\n type nat hook postrouting priority srcnat;\n'
            + ' oifname "ep*" masquerade fully-random\n }\n}\n'
        )
        # The node masqueraded to its own address: only the port shows it.
        outcomes = sb.connect("node", "10.96.0.10", 80, "tcp", count=30)
        assert {o.source for o in outcomes} == {"192.168.0.2"}
        assert sum(o.client_port != o.source_port for o in outcomes) >= 28


def test_node_udp_rejected_is_refused_and_dropped_is_denied() -> None:
    """The node's own datagrams stopped in its output path fail the send (EPERM) either way;
    a reject also queues its ICMP error on the socket, which tells the two apart."""
    with Sandbox(SPEC) as sb:
        NftSession(sb.node_ns).apply(
            """
            table ip o {
                chain out {
                    type filter hook output priority filter; policy accept;
                    ip daddr 10.96.0.40 udp dport 53 reject
                    ip daddr 10.96.0.41 udp dport 53 drop
                }
            }
            """
        )
        o = _only(sb.connect("node", "10.96.0.40", 53, "udp", count=3))
        assert o.kind == "refused"
        o = _only(sb.connect("node", "10.96.0.41", 53, "udp", count=3))
        assert o.kind == "denied"
        with sb.open("node", "10.96.0.40", 53, "udp") as conn:
            assert conn.exchange().kind == "refused"

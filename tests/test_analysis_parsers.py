"""The parsers read every spelling of the same rules into one IR, and the interpreter walks it."""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import pytest

from nfproxy.analysis import inventory, iptables_save, nft_json
from nfproxy.analysis.interpret import InterpretError, Outcome, Packet, interpret, trace
from nfproxy.analysis.ir import Dnat, Match, Statistic
from nfproxy.backends.iptables import render as iptables_backend
from nfproxy.kernel.iptables import Flavour, IptablesRunner
from nfproxy.core.model import IPFamily, NodeConfig
from nfproxy.sources import manifests
from nfproxy.verify.validate import apply_iptables

ROOT = Path(__file__).resolve().parent.parent
DUMPS = Path(__file__).resolve().parent / "dumps"
STATE = manifests.load(str(ROOT / "examples"), NodeConfig()).state
NODE_IPS = ["192.168.0.2"]

PACKETS = [
    Packet("10.244.0.5", "10.96.10.10", 80, "tcp", "pod"),  # 3 endpoints
    Packet("10.244.0.11", "10.96.10.10", 80, "tcp", "pod"),  # hairpin
    Packet("192.168.0.2", "10.96.10.10", 80, "tcp", "node"),  # masqueraded
    Packet("1.2.3.4", "10.96.10.50", 80, "tcp", "outside"),  # no endpoints: reject
    Packet("198.51.100.7", "203.0.113.10", 443, "tcp", "outside"),  # allowed source range
    Packet("8.8.8.8", "203.0.113.10", 443, "tcp", "outside"),  # blocked source
    Packet("8.8.8.8", "192.168.0.2", 30443, "tcp", "outside"),  # eTP=Local node port
    Packet("192.168.0.2", "192.168.0.2", 30443, "tcp", "node"),  # ... from the node: cluster
    Packet("10.244.0.5", "10.96.0.10", 53, "udp", "pod"),
    Packet("10.244.0.5", "10.96.0.10", 53, "tcp", "pod"),
    Packet("10.244.0.5", "10.96.99.99", 80, "tcp", "pod"),  # not a service: untouched
]


@pytest.mark.kernel
def test_save_and_restore_formats_mean_the_same(netns: str) -> None:
    restore = iptables_save.parse(iptables_backend.render(STATE, IPFamily.V4).restore_text(with_jumps=True), 4)
    apply_iptables(STATE, netns, Flavour.LEGACY)
    saved_legacy = IptablesRunner(IPFamily.V4, netns, Flavour.LEGACY).save()
    assert "0.33333333349" in saved_legacy and "/32" in saved_legacy  # what a node prints
    legacy = iptables_save.parse(saved_legacy, IPFamily.V4)
    for p in PACKETS:
        expected = interpret(restore, p, node_ips=NODE_IPS)
        assert sum(expected.values()) == 1
        assert interpret(legacy, p, node_ips=NODE_IPS) == expected, p
    assert interpret(restore, PACKETS[3], node_ips=NODE_IPS) == {Outcome("reject"): 1}
    assert interpret(restore, PACKETS[5], node_ips=NODE_IPS) == {Outcome("drop"): 1}
    assert interpret(restore, PACKETS[10], node_ips=NODE_IPS) == {Outcome("accept"): 1}
    hairpin = interpret(restore, PACKETS[1], node_ips=NODE_IPS)
    assert hairpin[Outcome("dnat", "10.244.0.11:8080", True)] == Fraction(715827883, 2**31)


def test_save_text_details() -> None:
    text = (DUMPS / "kube-proxy-iptables-save.txt").read_text()
    rs = iptables_save.parse(text, IPFamily.V4)
    nat = rs.table("ip", "nat")
    svc = nat.chains["KUBE-SVC-XPGD46QRK7WJZT7O"]
    assert [s.probability for r in svc.rules for s in r.statements if isinstance(s, Statistic)] == ["0.33333333349", "0.50000000000"]
    assert svc.rules[1].comment == "ns1/svc1:p80 -> 10.180.0.1:80"
    sep = nat.chains["KUBE-SEP-SXIVWICOYRO3J4NJ"]
    assert any(isinstance(s, Dnat) for s in sep.rules[1].statements)
    assert nat.chains["PREROUTING"].hook == "prerouting" and nat.chains["PREROUTING"].priority == -100
    d = interpret(rs, Packet("10.0.1.1", "172.30.0.41", 80, "tcp", "pod"))
    assert d == {
        Outcome("dnat", "10.180.0.1:80"): Fraction(715827883, 2**31),
        Outcome("dnat", "10.180.0.2:80"): Fraction(1431655765, 2**32),
        Outcome("dnat", "10.180.0.3:80"): Fraction(1431655765, 2**32),
    }
    assert set(interpret(rs, Packet("10.0.1.1", "172.30.0.41", 80, "tcp", "pod"), mode="ideal").values()) == {Fraction(1, 3)}
    # Node port: masqueraded (eTP=Cluster); no endpoints: rejected from outside.
    np = interpret(rs, Packet("8.8.8.8", "192.168.0.2", 3001, "tcp", "outside"), node_ips=NODE_IPS)
    assert all(o.masquerade for o in np) and len(np) == 3
    assert interpret(rs, Packet("8.8.8.8", "172.30.0.42", 80, "tcp", "outside")) == {Outcome("reject"): 1}


def test_upstream_nft_dump() -> None:
    rs = nft_json.parse(json.loads((DUMPS / "kube-proxy-nft.json").read_text()))
    assert [t.name for t in rs.tables] == ["kube-proxy"]
    d = interpret(rs, Packet("10.0.1.1", "172.30.0.41", 80, "tcp", "pod"), node_ips=NODE_IPS)
    assert d == {Outcome("dnat", "10.180.0.1:80"): Fraction(1, 2), Outcome("dnat", "10.180.0.2:80"): Fraction(1, 2)}
    assert interpret(rs, Packet("10.0.1.1", "172.30.0.42", 80, "tcp", "pod"), node_ips=NODE_IPS) == {Outcome("reject"): 1}
    # cluster-ips-check (upstream only): a wrong port on a cluster IP is rejected.
    assert interpret(rs, Packet("10.0.1.1", "172.30.0.41", 81, "tcp", "pod"), node_ips=NODE_IPS) == {Outcome("reject"): 1}
    np = interpret(rs, Packet("8.8.8.8", "192.168.0.2", 3001, "tcp", "outside"), node_ips=NODE_IPS)
    assert set(np) == {Outcome("dnat", "10.180.0.1:80", True), Outcome("dnat", "10.180.0.2:80", True)}
    paths = trace(rs, Packet("10.180.0.1", "172.30.0.41", 80, "tcp", "pod"), node_ips=NODE_IPS)
    hairpin = next(p for p in paths if p.outcome.endpoint == "10.180.0.1:80")
    assert hairpin.outcome.masquerade and any(s.chain == "mark-for-masquerade" for s in hairpin.steps)


def test_unknown_matches_are_refused_by_name() -> None:
    text = "*nat\n:KUBE-SERVICES - [0:0]\n-A PREROUTING -j KUBE-SERVICES\n-A KUBE-SERVICES -m connlimit --connlimit-above 3 -j DROP\nCOMMIT\n"
    rs = iptables_save.parse(text, 4)
    with pytest.raises(InterpretError, match="KUBE-SERVICES rule 1.*connlimit"):
        interpret(rs, Packet("10.0.0.1", "10.0.0.2", 80, "tcp", "pod"))
    doc = {"nftables": [
        {"table": {"family": "ip", "name": "t"}},
        {"chain": {"family": "ip", "table": "t", "name": "c", "type": "filter", "hook": "input", "prio": 0, "policy": "accept"}},
        {"rule": {"family": "ip", "table": "t", "chain": "c", "expr": [{"limit": {"rate": 1, "per": "second"}}, {"drop": None}]}},
    ]}
    with pytest.raises(InterpretError, match="chain c rule 1"):
        interpret(nft_json.parse(doc), Packet("10.0.0.1", "192.168.0.2", 80, "tcp", "outside"), node_ips=NODE_IPS)


def test_parse_errors_name_the_line() -> None:
    with pytest.raises(iptables_save.ParseError, match="line 2"):
        iptables_save.parse("*nat\n-A X -s not-an-ip -j ACCEPT\nCOMMIT\n", 4)
    with pytest.raises(iptables_save.ParseError, match="outside"):
        iptables_save.parse("-A X -j ACCEPT\n", 4)
    with pytest.raises(nft_json.ParseError):
        nft_json.parse({"not": "nft"})


def test_ipv6_and_mark_targets() -> None:
    text = (
        "*nat\n:KUBE-SVC-X - [0:0]\n:KUBE-SEP-A - [0:0]\n:KUBE-MARK-MASQ - [0:0]\n:KUBE-POSTROUTING - [0:0]\n"
        "-A OUTPUT -j KUBE-SVC-X\n-A POSTROUTING -j KUBE-POSTROUTING\n"
        "-A KUBE-SVC-X -d fd00::10/128 -p udp -m udp --dport 53 -j KUBE-SEP-A\n"
        "-A KUBE-SEP-A -s fd00:1::5/128 -j KUBE-MARK-MASQ\n"
        "-A KUBE-SEP-A -p udp -m udp -j DNAT --to-destination [fd00:1::5]:5353\n"
        "-A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000\n"
        "-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN\n"
        "-A KUBE-POSTROUTING -j MASQUERADE\nCOMMIT\n"
    )
    rs = iptables_save.parse(text, IPFamily.V6)
    assert interpret(rs, Packet("fd00:1::5", "fd00::10", 53, "udp", "node")) == {Outcome("dnat", "[fd00:1::5]:5353", True): 1}
    assert interpret(rs, Packet("fd00:1::6", "fd00::10", 53, "udp", "node")) == {Outcome("dnat", "[fd00:1::5]:5353", False): 1}
    assert interpret(rs, Packet("fd00:1::6", "fd00::10", 53, "tcp", "node")) == {Outcome("accept"): 1}


def test_inventory_api_still_works() -> None:
    text = (DUMPS / "kube-proxy-iptables-save.txt").read_text()
    inv = inventory.from_iptables_save(text)
    assert inv.chain_kinds["KUBE-SEP-"] == 3 and inv.rules > 0
    inv = inventory.from_nft_json(json.loads((DUMPS / "kube-proxy-nft.json").read_text()), table="kube-proxy")
    assert inv.chain_kinds["endpoint-"] == 2 and inv.maps == 5
    assert [m for m in (Match,)]  # the IR is importable alongside


@pytest.mark.parametrize("text", [
    "10.1.2.3/32", "10.1.2.3", "0.0.0.0/0", "10.0.0.0/8", "10.1.2.3/24", "255.255.255.255/32",
    "fd00::1/128", "fd00::/64", "::ffff:10.1.2.3/128",
])
def test_addresses_read_as_ipaddress_reads_them(text: str) -> None:
    """The short way for IPv4 host addresses gives what ipaddress gives."""
    import ipaddress

    assert iptables_save._network(text) == ipaddress.ip_network(text, strict=False)


@pytest.mark.parametrize("text", ["010.1.2.3/32", "1.2.3/32", "1.2.3.256", "1.2.3.4/33", "1.2.3.4/", "x", "1.2.3.4 "])
def test_odd_address_spellings_are_refused_as_ipaddress_refuses_them(text: str) -> None:
    with pytest.raises(ValueError):
        iptables_save._network(text)


# ---- a save read while it is written (kernel/process.lines)


def test_a_tools_lines_arrive_before_it_ends(tmp_path: Path) -> None:
    """The first line is read while the tool still runs: it waits for a file the reader makes
    after that line has arrived."""
    from nfproxy.kernel.process import lines

    go = tmp_path / "go"
    out = lines(["sh", "-c", f'echo "*nat"; while [ ! -e {go} ]; do sleep 0.01; done; echo COMMIT'])
    assert next(out) == "*nat\n"
    go.touch()
    assert list(out) == ["COMMIT\n"]


def test_a_tool_that_fails_after_writing_raises_with_its_stderr() -> None:
    from nfproxy.kernel.process import KernelError, lines

    out = lines(["sh", "-c", "echo '*nat'; echo 'no such table' >&2; exit 3"])
    with pytest.raises(KernelError, match=r"exit 3\): no such table"):
        iptables_save.parse(out, 4)


def test_a_tool_that_hangs_is_killed() -> None:
    from nfproxy.kernel.process import KernelError, lines

    with pytest.raises(KernelError, match="timed out after 1s"):
        list(lines(["sh", "-c", "echo start; exec sleep 60"], timeout=1))


def test_streamed_lines_parse_as_the_text_does() -> None:
    text = (DUMPS / "kube-proxy-iptables-save.txt").read_text()
    assert iptables_save.parse(iter(text.splitlines(keepends=True)), 4) == iptables_save.parse(text, 4)


_EDGE_LINES = """*nat
:KUBE-SEP-A - [0:0]
:KUBE-SVC-A - [0:0]
:C - [0:0]
-A KUBE-SEP-A -s 10.0.0.1/32 -j KUBE-MARK-MASQ
-A KUBE-SEP-A -p tcp -m tcp -j DNAT --to-destination 10.0.0.1:8080
-A KUBE-SEP-A -p udp -m udp -j DNAT --to-destination 10.0.0.2:53
-A KUBE-SEP-A -p sctp -m sctp -j DNAT --to-destination 10.0.0.3:9
-A KUBE-SEP-A -p tcp -m udp -j DNAT --to-destination 10.0.0.1:8080
-A KUBE-SVC-A -m statistic --mode random --probability 0.33333333349 -j KUBE-SEP-A
-A KUBE-SVC-A -m statistic --mode random --probability 0.50000000000 -j RETURN
-A KUBE-SVC-A -j KUBE-SEP-A
-A C -s 10.0.0.1/32 -j ACCEPT
-A C -s 10.0.0.1/32 -j DROP
-A C -s 10.0.0.1/32 -j MASQUERADE
-A C -s 10.0.0.1/32 -j MARK
-A C -s 10.0.0.1/32 -j LOG
-A C -s 10.0.0.1/32 -j SNAT
-A C -j REJECT
-A C -j RETURN
-A C -j C
-A C -p tcp -m tcp -j ACCEPT
-A KUBE-SEP-A -s 10.0.0.1/32 -m comment --comment ns/svc:http -j KUBE-MARK-MASQ
-A KUBE-SEP-A -p tcp -m comment --comment "ns/svc:http -j C" -m tcp -j DNAT --to-destination 10.0.0.1:8080
-A KUBE-SVC-A -m comment --comment "ns/svc:http -> 10.0.0.1:8080" -m statistic --mode random --probability 0.33333333349 -j KUBE-SEP-A
-A KUBE-SVC-A -m comment --comment "ns/svc:http -> 10.0.0.1:8080" -j KUBE-SEP-A
-A KUBE-SVC-A -m comment --comment "a \\"quoted\\" one" -j KUBE-SEP-A
-A KUBE-SVC-A -m comment --comment one -m comment --comment two -j KUBE-SEP-A
-A KUBE-SVC-A -m comment --comment -j -j KUBE-SEP-A
COMMIT
"""

_BAD_LINES = [
    "-A C -s 10.0.0.1/32 -j ACCEPT --to-destination 10.0.0.1:80",
    "-A C -j DNAT",
    "-A C -s 300.0.0.1/32 -j C",
    "-A C -s 010.0.0.1/32 -j C",
    "-A C -m statistic --mode random --probability 1.5 -j C",
    "-A C -m statistic --mode random --probability 0.5.5 -j C",
    "-A C -p tcp -m tcp -j DNAT --to-destination 10.0.0.1:99999",
    "-A C -p tcp -m tcp -j DNAT --to-destination 10.0.0.999:80",
]


def _both_ways(text: str, monkeypatch: pytest.MonkeyPatch) -> tuple[object, object, int]:
    """(the ruleset or error with the common shapes read directly, the same read the general
    way, how many lines took the direct way)."""
    import re

    taken: list[bool] = []
    real = iptables_save._common

    def counted(*args: object) -> bool:
        taken.append(real(*args))  # type: ignore[arg-type]
        return taken[-1]

    def read() -> object:
        try:
            return iptables_save.parse(text, IPFamily.V4)
        except iptables_save.ParseError as exc:
            return ("ParseError", str(exc))

    with monkeypatch.context() as m:
        m.setattr(iptables_save, "_common", counted)
        direct = read()
        m.setattr(iptables_save, "_COMMON", re.compile("(?!)"))
        general = read()
    return direct, general, sum(taken)


def test_common_lines_read_as_the_general_reader_reads_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """The shortcut for the four commonest rule lines of a save makes the same statements as the
    general reader, for kube-proxy's own save, for every kind of target, and for bad lines (the
    same error, naming the same line)."""
    for text in ((DUMPS / "kube-proxy-iptables-save.txt").read_text(), _EDGE_LINES):
        direct, general, taken = _both_ways(text, monkeypatch)
        assert not isinstance(direct, tuple), direct
        assert direct == general
        assert taken >= 8
    for bad in _BAD_LINES:
        direct, general, _ = _both_ways(f"*nat\n:C - [0:0]\n{bad}\nCOMMIT\n", monkeypatch)
        assert direct == general, bad


@pytest.mark.kernel
def test_a_large_save_reads_the_same_through_the_shortcut(netns: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A node's save (200 services over kube-proxy's layout as iptables-save prints it): the same
    ruleset either way, most of its rules read by the shortcut."""
    import random

    from nfproxy.testing import random_cluster, uniform_cluster

    state = random_cluster(random.Random(11), 120)
    apply_iptables(state, netns, Flavour.LEGACY)
    texts = [IptablesRunner(IPFamily.V4, netns, Flavour.LEGACY).save()]
    apply_iptables(uniform_cluster(80, 6), netns, Flavour.LEGACY)
    texts.append(IptablesRunner(IPFamily.V4, netns, Flavour.LEGACY).save())
    for text in texts:
        direct, general, taken = _both_ways(text, monkeypatch)
        assert not isinstance(direct, tuple), direct
        assert direct == general
        rules = sum(line.startswith("-A ") for line in text.splitlines())
        assert taken > rules // 2

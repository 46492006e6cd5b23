"""Set elements read over netlink (kernel/nft_elements.py, analysis/nft_elements.py) make the
same rule IR as libnftables' full listing, on the real kernel: nfproxy's own tables, and sets
of every shape the reader knows (prefixes, ranges, ranges to the last value, adjacent ranges,
single values, comments, host-order keys, verdicts). What it does not know, and a ruleset that
changes while it is read, send the reading to libnftables."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

import pytest

from nfproxy.analysis import dump, nft_json
from nfproxy.analysis.check import check
from nfproxy.analysis.ir import Ruleset
from nfproxy.analysis.nft_elements import ATTEMPTS
from nfproxy.core.model import ClusterState, sort_endpoints
from nfproxy.kernel.nft import NftSession
from nfproxy.kernel.nft_elements import ElementReader
from nfproxy.testing import random_cluster, uniform_cluster
from nfproxy.verify.validate import apply_nft

pytestmark = pytest.mark.kernel


def _by_set(rs: Ruleset) -> dict:
    """Each table's chains, and each set with its elements as a multiset (the reader keeps the
    kernel's order for hash sets, libnftables sorts them)."""
    out: dict = {}
    for t in rs.tables:
        out[(t.family, t.name)] = (t.dialect, t.chains)
        for name, s in t.sets.items():
            out[(t.family, t.name, name)] = (s.kind, s.key_kinds, s.data_kinds, s.flags, s.timeout, Counter(s.elements))
    return out


def _libnftables(ns: str) -> Ruleset:
    return nft_json.parse(NftSession(ns).list_ruleset())


def _weighted(state: ClusterState, rng: random.Random) -> ClusterState:
    endpoints = {
        key: sort_endpoints([dataclasses.replace(e, weight=rng.choice([0, 1, 2, 7, 1000])) for e in eps])
        for key, eps in state.endpoints.items()
    }
    return dataclasses.replace(state, endpoints=endpoints)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_nfproxy_tables_read_the_same_both_ways(netns: str, seed: int, caplog: pytest.LogCaptureFixture) -> None:
    rng = random.Random(seed)
    state = random_cluster(rng, 40)
    if seed == 3:
        state = _weighted(state, rng)
    apply_nft(state, netns)
    caplog.set_level("INFO", logger="nfproxy.analysis")
    fast, full = dump.read_nft(netns), _libnftables(netns)
    assert "through libnftables" not in caplog.text
    assert sum(len(s.elements) for t in fast.tables for s in t.sets.values()) > 100
    assert _by_set(fast) == _by_set(full)
    assert check(fast) == check(full)


SHAPES = """
table ip shapes {
    set prefixes { type ipv4_addr; flags interval;
        elements = { 10.0.0.0/8, 192.168.1.7, 172.16.0.0-172.16.0.9, 172.16.0.10-172.16.0.20,
                     203.0.113.0/25, 255.255.255.0/24 } }
    set ports { type inet_service; flags interval; elements = { 0-1023, 8080, 30000-32767, 65535 } }
    set everything { type ipv4_addr; flags interval; elements = { 0.0.0.0/0 } }
    map slots { typeof numgen random mod 10 : ip daddr . tcp dport; flags interval;
        elements = { 0-2 : 10.0.0.1 . 80, 3 : 10.0.0.2 . 81, 4-4294967295 : 10.0.0.3 . 82 } }
    map pick { typeof numgen random mod 4 : verdict;
        elements = { 0 : jump a, 1 : goto b, 2 : drop, 3 : accept } }
    set said { type ipv4_addr . inet_proto . inet_service;
        elements = { 10.1.1.1 . tcp . 80 comment "web", 10.1.1.2 . udp . 53, 10.1.1.3 . sctp . 0 } }
    set marks { type mark; elements = { 0x1, 0x4000 } }
    set empty { type ipv4_addr; }
    chain a { }
    chain b { }
}
table ip6 shapes6 {
    set nets { type ipv6_addr; flags interval;
        elements = { 2001:db8::/32, fd00::1, fd00::10-fd00::20, ffff::/16 } }
    map services { type ipv6_addr . inet_proto . inet_service : verdict;
        elements = { 2001:db8::1 . tcp . 443 : goto c } }
    chain c { }
}
table inet mixed {
    set v4 { type ipv4_addr; elements = { 192.0.2.1 } }
}
"""


def test_every_shape_reads_the_same_both_ways(netns: str, caplog: pytest.LogCaptureFixture) -> None:
    NftSession(netns).apply(SHAPES)
    caplog.set_level("INFO", logger="nfproxy.analysis")
    fast, full = dump.read_nft(netns), _libnftables(netns)
    assert "through libnftables" not in caplog.text
    assert _by_set(fast) == _by_set(full)
    prefixes = next(t for t in fast.tables if t.name == "shapes").sets["prefixes"]
    assert len(prefixes.elements) == 6


OUTSIDE = {
    "ifname": 'set names { type ifname; elements = { "eth0" } }',
    "a protocol only /etc/protocols names": "set gre { type inet_proto; elements = { 47 } }",
}


@pytest.mark.parametrize("what", sorted(OUTSIDE))
def test_a_set_outside_the_vocabulary_is_listed_by_libnftables(netns: str, what: str, caplog: pytest.LogCaptureFixture) -> None:
    NftSession(netns).apply(SHAPES + f"table ip other {{\n{OUTSIDE[what]}\n}}\n")
    caplog.set_level("INFO", logger="nfproxy.analysis")
    fast = dump.read_nft(netns)
    assert "through libnftables" in caplog.text
    assert _by_set(fast) == _by_set(_libnftables(netns))
    other = next(t for t in fast.tables if t.name == "other")
    assert [len(s.elements) for s in other.sets.values()] == [1]


def test_a_ruleset_that_changes_while_read_is_read_again(netns: str, monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """The generation moves under every attempt: the reader gives up and lists through
    libnftables, which retries on its own; once it stands still, the first read after is kept."""
    apply_nft(uniform_cluster(20, 3), netns)
    real = ElementReader.generation
    calls = []

    def moving(self: ElementReader) -> int:
        calls.append(1)
        return real(self) + len(calls)

    monkeypatch.setattr(ElementReader, "generation", moving)
    caplog.set_level("INFO", logger="nfproxy.analysis.nft_elements")
    fast = dump.read_nft(netns)
    assert len(calls) == 2 * ATTEMPTS
    assert "it changed 3 times" in caplog.text
    assert _by_set(fast) == _by_set(_libnftables(netns))


def test_the_generation_moves_with_every_commit(netns: str) -> None:
    with ElementReader(netns) as reader:
        before = reader.generation()
        NftSession(netns).apply("table ip t { }")
        assert reader.generation() > before


@pytest.mark.parametrize("with_set", [False, True])
def test_tables_of_other_families(netns: str, with_set: bool, caplog: pytest.LogCaptureFixture) -> None:
    """A bridge table's chains need no element dump; a set of its would look empty in the terse
    listing, so it sends the reading to libnftables."""
    body = "chain c { type filter hook forward priority 0; }"
    if with_set:
        body += "\nset macs { type ether_addr; elements = { 02:00:00:00:00:01 } }"
    NftSession(netns).apply(SHAPES + f"table bridge br {{\n{body}\n}}\n")
    caplog.set_level("INFO", logger="nfproxy.analysis")
    fast = dump.read_nft(netns)
    assert ("through libnftables" in caplog.text) is with_set
    assert _by_set(fast) == _by_set(_libnftables(netns))
    bridge = next(t for t in fast.tables if t.family == "bridge")
    assert [len(s.elements) for s in bridge.sets.values()] == ([1] if with_set else [])


def test_iptables_nft_tables_are_left_to_the_iptables_backend(netns: str, caplog: pytest.LogCaptureFixture) -> None:
    """Tables named as iptables-nft names its own are not read, not even their sets (one here
    that the reader would have no words for)."""
    NftSession(netns).apply(SHAPES + 'table ip nat {\nset names { type ifname; elements = { "eth0" } }\n'
                                     "chain KUBE-SERVICES { }\n}\n")
    caplog.set_level("INFO", logger="nfproxy.analysis")
    fast = dump.read_nft(netns)
    assert "through libnftables" not in caplog.text
    assert "nat" not in {t.name for t in fast.tables}
    full = _libnftables(netns)
    assert _by_set(fast) == _by_set(Ruleset(tuple(t for t in full.tables if t.name != "nat")))


def test_the_endpoint_counters_read_the_same_both_ways(netns: str, caplog: pytest.LogCaptureFixture) -> None:
    """The endpoint metric's reading (`counters.read_live_counts`) and audit's: the counted
    maps' elements over netlink give the counts libnftables' full listing gives (exact counts
    under real traffic: tests/test_counters_kernel.py, tests/test_audit_kernel.py)."""
    from nfproxy.analysis.counters import endpoint_counts_nft
    from nfproxy.analysis.nft_elements import counted_table

    apply_nft(random_cluster(random.Random(4), 40), netns)
    caplog.set_level("INFO", logger="nfproxy.analysis")
    for family in ("ip", "ip6"):
        fast = counted_table(netns, family, "nfproxy")
        full = NftSession(netns).list_table(family, "nfproxy")
        assert fast is not None and full is not None
        doc, counted = fast
        assert counted and not any("elem" in i.get("map", {}) for i in doc["nftables"])
        counts = endpoint_counts_nft(doc, counted)
        assert counts and counts == endpoint_counts_nft(full)
    # audit's reading: the whole ruleset and the counted maps from one generation
    reading = dump.read_nft_counted(netns)
    assert reading.counted and _by_set(reading.ruleset) == _by_set(_libnftables(netns))
    assert endpoint_counts_nft(reading.doc, reading.counted) == endpoint_counts_nft(NftSession(netns).list_ruleset())
    assert "through libnftables" not in caplog.text
    assert counted_table(netns, "ip", "no-such-table") is None

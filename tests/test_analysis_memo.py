"""The interpreter's memo is shared by every walk on one ruleset (compare's probes): a walk
memoised for one packet must answer for another only when it would decide the same."""

from __future__ import annotations

from fractions import Fraction

from nfproxy.analysis import nft_json
from nfproxy.analysis.interpret import Outcome, Packet, interpret, interpret_both


def _ruleset():
    """Mark what comes from 192.0.2.9, DNAT 10.96.0.1:80 to two endpoints; postrouting
    masquerades (saddr . daddr) pairs found in a set (hairpin), and anything marked 0x4000."""
    fam, t = "ip", "t"
    saddr = {"payload": {"protocol": "ip", "field": "saddr"}}
    daddr = {"payload": {"protocol": "ip", "field": "daddr"}}
    return nft_json.parse({"nftables": [
        {"table": {"family": fam, "name": t}},
        {"set": {"family": fam, "table": t, "name": "pairs", "type": ["ipv4_addr", "ipv4_addr"],
                 "elem": [{"concat": ["10.0.0.5", "10.0.0.5"]}, {"concat": ["10.0.0.6", "10.0.0.6"]}]}},
        {"map": {"family": fam, "table": t, "name": "eps", "type": "integer", "map": "ipv4_addr",
                 "elem": [[0, "10.0.0.5"], [1, "10.0.0.6"]]}},
        {"chain": {"family": fam, "table": t, "name": "pre", "type": "nat", "hook": "prerouting", "prio": -100, "policy": "accept"}},
        {"chain": {"family": fam, "table": t, "name": "post", "type": "nat", "hook": "postrouting", "prio": 100, "policy": "accept"}},
        {"chain": {"family": fam, "table": t, "name": "hairpin"}},
        {"chain": {"family": fam, "table": t, "name": "marked"}},
        {"rule": {"family": fam, "table": t, "chain": "pre", "expr": [
            {"match": {"op": "==", "left": saddr, "right": "192.0.2.9"}},
            {"mangle": {"key": {"meta": {"key": "mark"}}, "value": {"|": [{"meta": {"key": "mark"}}, 16384]}}}]}},
        {"rule": {"family": fam, "table": t, "chain": "pre", "expr": [
            {"match": {"op": "==", "left": daddr, "right": "10.96.0.1"}},
            {"dnat": {"family": fam, "addr": {"map": {"key": {"numgen": {"mode": "random", "mod": 2, "offset": 0}}, "data": "@eps"}}}}]}},
        {"rule": {"family": fam, "table": t, "chain": "post", "expr": [{"jump": {"target": "hairpin"}}]}},
        {"rule": {"family": fam, "table": t, "chain": "post", "expr": [{"jump": {"target": "marked"}}]}},
        {"rule": {"family": fam, "table": t, "chain": "hairpin", "expr": [
            {"match": {"op": "==", "left": {"concat": [saddr, daddr]}, "right": "@pairs"}}, {"masquerade": None}]}},
        {"rule": {"family": fam, "table": t, "chain": "marked", "expr": [
            {"match": {"op": "==", "left": {"&": [{"meta": {"key": "mark"}}, 16384]}, "right": 16384}}, {"masquerade": None}]}},
    ]})


HALF = Fraction(1, 2)


def _expected(src: str) -> dict[Outcome, Fraction]:
    return {Outcome("dnat", f"10.0.0.{i}:80", src == f"10.0.0.{i}"): HALF for i in (5, 6)}


def test_walks_shared_across_packets_answer_each_packet() -> None:
    rs = _ruleset()
    sources = ["10.1.0.1", "10.0.0.5", "10.0.0.6", "10.1.0.2", "10.0.0.5", "10.1.0.1"]
    for src in sources:  # one interpreter for all of them: the memo is shared
        got = interpret(rs, Packet(src, "10.96.0.1", 80, "tcp", "outside"), mode="ideal")
        assert got == _expected(src), src
    # A fresh ruleset (a fresh memo) answers the same, in any order.
    for src in reversed(sources):
        assert interpret(_ruleset(), Packet(src, "10.96.0.1", 80, "tcp", "outside"), mode="ideal") == _expected(src)


def test_a_mark_written_before_the_walk_is_part_of_its_key() -> None:
    rs = _ruleset()
    plain = interpret(rs, Packet("10.1.0.1", "10.96.0.1", 80, "tcp", "outside"), mode="ideal")
    marked = interpret(rs, Packet("192.0.2.9", "10.96.0.1", 80, "tcp", "outside"), mode="ideal")
    assert plain == _expected("10.1.0.1")
    assert marked == {Outcome("dnat", f"10.0.0.{i}:80", True): HALF for i in (5, 6)}
    again = interpret(rs, Packet("10.1.0.1", "10.96.0.1", 80, "tcp", "outside"), mode="ideal")
    assert again == plain


def test_interpret_both_matches_each_mode_with_a_shared_memo() -> None:
    rs = _ruleset()
    for src in ("10.0.0.6", "10.1.0.3", "10.0.0.5", "192.0.2.9"):
        packet = Packet(src, "10.96.0.1", 80, "tcp", "outside")
        kernel, ideal = interpret_both(rs, packet)
        assert kernel == interpret(_ruleset(), packet, mode="kernel")
        assert ideal == interpret(_ruleset(), packet, mode="ideal")


def test_disjoint_spans_are_kept_and_overlaps_go_to_the_earliest_element() -> None:
    """Interval maps the kernel holds never overlap: those spans come back sorted as they are
    (at once: the clipping compared each span with every earlier one, 20 000 ranges took
    minutes); overlapping ones are clipped so the earliest element keeps each value."""
    from nfproxy.analysis.index import _first_wins
    from nfproxy.analysis.ir import Const, Element

    els = [Element((Const(i),)) for i in range(4)]
    disjoint = [(20, 29, 0, els[0]), (0, 9, 1, els[1]), (10, 19, 2, els[2])]
    assert _first_wins(disjoint) == sorted(disjoint)
    overlapping = [(5, 14, 1, els[1]), (0, 9, 0, els[0]), (12, 20, 2, els[2])]
    assert _first_wins(overlapping) == [(0, 9, 0, els[0]), (10, 14, 1, els[1]), (15, 20, 2, els[2])]
    many = [(i * 10, i * 10 + 9, i, Element((Const(i),))) for i in range(20_000)]
    assert _first_wins(list(reversed(many))) == many

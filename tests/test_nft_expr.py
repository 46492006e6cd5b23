"""Rule bodies as typed statements (nftables/expr.py): one vocabulary for every body the
renderers write, printed as exactly the nft text they write today, read back from that text."""

from __future__ import annotations

import random

import pytest

from nfproxy.backends.nft import render as nft
from nfproxy.core.model import IPFamily
from nfproxy.nftables import Rule, Transaction, Verb
from nfproxy.nftables import expr as x
from nfproxy.nftables import script
from nfproxy.testing import random_cluster
from tests.scenarios import load_all

STATES = [sc.state for sc in load_all()] + [random_cluster(random.Random(seed), 30, 8) for seed in range(4)]


def _rules(txs: list[Transaction] | tuple[Transaction, ...]) -> list[Rule]:
    return [obj for tx in txs for verb, obj in tx.ops if verb is Verb.ADD and type(obj) is Rule]


@pytest.mark.parametrize("family", list(IPFamily))
def test_every_rendered_body_is_said_by_the_vocabulary(family: IPFamily) -> None:
    """Every rule body the renderers write reads into statements that print it back unchanged."""
    seen = 0
    for state in STATES:
        for rule in _rules(nft.render(state, family).transactions()):
            typed = script.rule_body(rule.body)
            assert not x.is_raw(typed)
            assert str(typed) == x.text(typed) == rule.body
            seen += 1
    assert seen > 1000


def test_text_is_nfts_syntax() -> None:
    ip = x.payload("ip", "daddr")
    cases = {
        x.body(x.Match(ip, "10.0.0.1"), x.Match(x.payload("ip", "saddr"), "10.0.0.0/8", "!="), x.jump("m")):
            "ip daddr 10.0.0.1 ip saddr != 10.0.0.0/8 jump m",
        x.body(x.Match(x.Bitwise(x.MARK, "and", 0x4000), 0), x.RETURN): "meta mark and 0x4000 == 0 return",
        x.body(x.MetaSet(x.MARK, x.Bitwise(x.MARK, "xor", 0x4000))): "meta mark set meta mark xor 0x4000",
        x.body(x.Match(x.Meta("iifname"), "veth*", "!="), x.goto("c"), x.Comment("pods")):
            'iifname != "veth*" goto c comment "pods"',
        x.body(x.VerdictMap(x.numgen(5), x.AnonMap(((0, x.goto("a")), (x.Range(1, 4), x.goto("b")))))):
            "numgen random mod 5 vmap { 0 : goto a , 1-4 : goto b }",
        x.body(x.Match(x.L4PROTO, "tcp"), x.Dnat(x.MapLookup(x.numgen(10, 0), "m"), family="ip")):
            "meta l4proto tcp dnat ip to numgen random mod 10 offset 0 map @m",
        x.body(x.Match(x.L4PROTO, "udp"), x.COUNTER, x.Dnat("fd00::1", 53)): "meta l4proto udp counter dnat to [fd00::1]:53",
        x.body(x.Match(x.CT_STATUS, "dnat"), x.Lookup(x.Concat((x.payload("ip", "saddr"), ip)), "hairpin"), x.jump("m")):
            "ct status dnat ip saddr . ip daddr @hairpin jump m",
        x.body(x.Match(x.Fib("daddr"), "local"), x.VerdictMap(x.Concat((x.L4PROTO, x.TH_DPORT)), "ports")):
            "fib daddr type local meta l4proto . th dport vmap @ports",
        x.body(x.Match(ip, x.AnonSet(("10.0.0.0/8", "192.168.0.1"))), x.DROP):
            "ip daddr { 10.0.0.0/8, 192.168.0.1 } drop",
        x.body(x.SetUpdate("aff", x.payload("ip6", "saddr"))): "update @aff { ip6 saddr }",
        x.body(x.Masquerade(fully_random=True)): "masquerade fully-random",
        x.body(x.Match(x.CT_STATE, "invalid"), x.Counter("dropped"), x.DROP): "ct state invalid counter name dropped drop",
        x.body(x.Match(x.CT_STATE, "established,related"), x.ACCEPT): "ct state established,related accept",
        x.body(x.Dnat("fd00::2")): "dnat to fd00::2",
        x.body(x.Dnat("10.0.0.2", family="ip")): "dnat ip to 10.0.0.2",
        x.raw("tcp dport 80 log"): "tcp dport 80 log",
    }
    for b, text in cases.items():
        assert str(b) == text
        if not x.is_raw(b):
            assert script.rule_body(text) == b


def test_common_words_are_shared() -> None:
    """Rules repeat a few selectors, verdicts and draws: each is one object, not a copy per rule."""
    assert x.payload("ip", "daddr") is x.payload("ip", "daddr") and x.payload("th", "dport") is x.TH_DPORT
    assert x.numgen(10, 446846400) is x.numgen(10, 446846400) is not x.numgen(10)
    assert x.Verdict("drop") == x.DROP and hash(x.Verdict("drop")) == hash(x.DROP)
    read = script.rule_body("ip daddr 10.0.0.1 counter drop")
    assert read[0].left is x.payload("ip", "daddr") and read[1] is x.COUNTER


def test_names_are_read_from_the_objects() -> None:
    b = x.body(x.Lookup(x.payload("ip", "saddr"), "aff"), x.Counter("k"), x.Dnat(x.MapLookup(x.numgen(2), "m")),
               x.VerdictMap(x.numgen(2), x.AnonMap(((0, x.goto("c0")), (1, x.DROP)))), x.jump("c1"))
    assert x.names(b) == x.Names(chains=("c0", "c1"), sets=("aff", "m"), counters=("k",))
    assert x.names(x.body(x.ACCEPT)) is x.NO_NAMES


def test_a_body_outside_the_vocabulary_is_refused_by_the_reader() -> None:
    with pytest.raises(ValueError, match="outside the JSON vocabulary"):
        script.rule_body("tcp dport 80 log")
    with pytest.raises(ValueError, match="not supported"):
        script.rule_body("ip daddr { { 1.2.3.4 } } accept")

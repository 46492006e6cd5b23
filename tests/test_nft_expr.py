"""Rule bodies as typed statements (nftables/expr.py): one vocabulary for every body the
renderers write, printed as exactly the nft text they wrote as strings and as nft's JSON, read
back from text into the very objects the renderer built, shared where rules repeat."""

from __future__ import annotations

import random

import pytest

from nfproxy.backends.nft import render as nft
from nfproxy.core.model import IPFamily
from nfproxy.kernel.memory.nft import MemoryNft
from nfproxy.kernel.process import KernelError
from nfproxy.nftables import Chain, Rule, Table, Transaction, Verb
from nfproxy.nftables import expr as x
from nfproxy.nftables import json as nft_json
from nfproxy.nftables import script
from nfproxy.testing import random_cluster, uniform_cluster
from tests.scenarios import load_all

STATES = [sc.state for sc in load_all()] + [random_cluster(random.Random(seed), 30, 8) for seed in range(4)]


def _rules(txs: list[Transaction] | tuple[Transaction, ...]) -> list[Rule]:
    return [obj for tx in txs for verb, obj in tx.ops if verb is Verb.ADD and type(obj) is Rule]


@pytest.mark.parametrize("family", list(IPFamily))
def test_every_rendered_body_is_said_by_the_vocabulary(family: IPFamily) -> None:
    """Every rule body the renderers write is statements (no raw text) whose text reads back
    into the same statements."""
    seen = 0
    for state in STATES:
        for rule in _rules(nft.render(state, family).transactions()):
            assert type(rule.body) is x.Body and not x.is_raw(rule.body)
            text = str(rule.body)
            assert x.text(rule.body) == text and script.rule_body(text) == rule.body
            seen += 1
    assert seen > 1000


@pytest.mark.parametrize("family", list(IPFamily))
def test_a_script_read_back_is_the_transaction_that_wrote_it(family: IPFamily) -> None:
    """`check --from-file` reads `nfproxy render` output into the objects the renderer built."""
    for state in STATES[:8]:
        rs = nft.render(state, family)
        assert _rules(script.parse(rs.script())) == _rules(rs.transactions())


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


def test_renders_share_their_words() -> None:
    """Two renders hold the same selectors, verdicts and draws, not copies: at 10 000 services
    the rule bodies are 20 000 tuples of mostly shared objects."""
    state = uniform_cluster(40, 3)
    a, b = nft.render(state, IPFamily.V4), nft.render(state, IPFamily.V4)
    key = next(iter(state.services))
    ((masq_a, pick_a),), ((masq_b, pick_b),) = a.services[key].chains.values(), b.services[key].chains.values()
    assert masq_a == masq_b and masq_a is not masq_b
    assert masq_a[0].left is masq_b[0].left is x.payload("ip", "daddr")
    assert masq_a[-1] is masq_b[-1]  # jump mark-for-masquerade
    assert pick_a[0] is pick_b[0]  # meta l4proto tcp
    assert pick_a[1].to.key is pick_b[1].to.key is x.numgen(3, pick_a[1].to.key.offset)


def test_json_follows_nft_1_0_6() -> None:
    """What `nft -j` prints for these bodies (tests/test_memory_kernel.py holds whole rulesets
    to the kernel's own listing)."""
    rule = x.body(x.Match(x.CT_STATE, "new"), x.Match(x.payload("ip6", "saddr"), x.AnonSet(("fd00::/8", "10::1"))),
                  x.REJECT, x.Comment("why"))
    assert nft_json.rule("ip6", "t", "c", rule, 7) == {"rule": {
        "family": "ip6", "table": "t", "chain": "c", "handle": 7, "comment": "why", "expr": [
            {"match": {"op": "in", "left": {"ct": {"key": "state"}}, "right": "new"}},
            {"match": {"op": "==", "left": {"payload": {"protocol": "ip6", "field": "saddr"}},
                       "right": {"set": ["10::1", {"prefix": {"addr": "fd00::", "len": 8}}]}}},
            {"reject": {"type": "icmpv6", "expr": "port-unreachable"}},
        ]}}
    dnat = x.body(x.Dnat(x.MapLookup(x.numgen(3, 3 << 30), "m"), family="ip"))
    assert nft_json.rule("ip", "t", "c", dnat, 1)["rule"]["expr"] == [{"dnat": {"family": "ip", "addr": {"map": {
        "key": {"numgen": {"mode": "random", "mod": 3, "offset": (3 << 30) - (1 << 32)}}, "data": "@m"}}}}]
    mark = x.body(x.Match(x.Bitwise(x.MARK, "and", 0x4000), 0), x.RETURN)
    assert nft_json.rule("ip", "t", "c", mark, 1)["rule"]["expr"] == [
        {"match": {"op": "==", "left": {"&": [{"meta": {"key": "mark"}}, 16384]}, "right": 0}}, {"return": None}]


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


def test_text_is_for_libnftables_and_the_rule_compiler_only() -> None:
    """Raw is the named escape hatch (text the script carries to libnftables); a body given as
    text (tests, benches) is read by the rule compiler alone. The transaction still refuses text
    that would be more than one rule; the memory kernel and the JSON printer take statements."""
    raw = Rule("c", x.raw("tcp dport 80 log"))
    assert x.is_raw(raw.body) and str(raw.body) == "tcp dport 80 log"
    text = Rule("c", "ip daddr 10.0.0.1 drop")
    assert text.body == "ip daddr 10.0.0.1 drop"
    assert Rule("c", (x.DROP,)).body == x.body(x.DROP) and type(Rule("c", (x.DROP,)).body) is x.Body
    for rule in (raw, text):
        tx = Transaction("ip", "t")
        tx.add(Table("ip", "t"))
        tx.add(Chain("c"))
        tx.add(rule)
        tx.check()
        with pytest.raises(KernelError, match="a rule body of text"):
            MemoryNft(IPFamily.V4, table="t").apply(tx)
        with pytest.raises(ValueError, match="outside the JSON vocabulary"):
            nft_json.rule("ip", "t", "c", rule.body, 1)
    for body in ("accept; flush ruleset", x.raw("accept\nflush ruleset"), x.body()):
        bad = Transaction("ip", "t")
        bad.add(Rule("c", body))
        assert bad.error is not None and "one statement list" in bad.error

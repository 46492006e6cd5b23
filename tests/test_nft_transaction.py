"""The Transaction's bulk verbs (Elements batches, refill, add_rules) say exactly what the same
objects queued one at a time say: same checks, same operations, same text."""

from __future__ import annotations

import gc

import pytest

from nfproxy.core.gc_pause import gc_paused
from nfproxy.nftables import Chain, Element, Elements, Map, Rule, Transaction, Verb
from nfproxy.nftables import text as nft_text


def _one_at_a_time(elements: list[Element]) -> Transaction:
    tx = Transaction("ip", "nfproxy")
    for el in elements:
        tx.add(el)
    return tx


def _batched(elements: list[Element]) -> Transaction:
    tx = Transaction("ip", "nfproxy")
    tx.add_elements(elements)
    return tx


MIXED = [
    Element("service-ips", "10.0.0.1 . tcp . 80", "goto service-A"),
    Element("service-ips", "10.0.0.2 . tcp . 80", "goto service-B"),
    Element("no-endpoint-services", "10.0.0.3 . tcp . 80", "goto reject-chain", "ns/svc:http"),
    Element("no-endpoint-services", "10.0.0.4 . tcp . 80", "drop"),
    Element("cluster-ips", "10.0.0.1"),
    Element("cluster-ips", "10.0.0.2"),
]


def test_a_batch_writes_the_text_and_operations_of_its_elements_one_at_a_time() -> None:
    single, batched = _one_at_a_time(MIXED), _batched(MIXED)
    single.check()
    batched.check()
    assert nft_text.script(batched) == nft_text.script(single)
    assert list(batched.operations()) == list(single.operations()) == [(Verb.ADD, el) for el in MIXED]
    assert len(batched) == len(single) == len(MIXED)
    assert nft_text.commands(batched) == nft_text.commands(single)
    assert len(batched.ops) == 3  # one operation per run of one set


def test_batch_columns_and_of_agree() -> None:
    els = MIXED[:2]
    assert Elements.of("service-ips", els) == Elements(
        "service-ips", ("10.0.0.1 . tcp . 80", "10.0.0.2 . tcp . 80"), ("goto service-A", "goto service-B")
    )
    assert Elements.of("cluster-ips", MIXED[4:]) == Elements("cluster-ips", ("10.0.0.1", "10.0.0.2"))
    assert list(Elements("cluster-ips", ("10.0.0.1",)).each()) == [Element("cluster-ips", "10.0.0.1")]


def test_of_refuses_elements_of_another_set_and_non_elements() -> None:
    with pytest.raises(ValueError, match="cluster-ips"):
        Elements.of("service-ips", MIXED[:1] + MIXED[4:5])
    with pytest.raises(TypeError, match="not all elements"):
        Elements.of("service-ips", [MIXED[0], ("service-ips", "k")])  # type: ignore[list-item]


@pytest.mark.parametrize(
    "batch, why",
    [
        (Elements("cluster-ips", ("10.0.0.1", "10.0.0.2\nadd table ip x")), "bad element key '10.0.0.2\\nadd table ip x'"),
        (Elements("cluster-ips", ("10.0.0.1", "")), "bad element key ''"),
        (Elements("service-ips", ("k1", "k2"), ("goto a", "goto b\nflush ruleset")), "bad element key 'k2'"),
        (Elements("service-ips", ("k1",), ("goto a",), ('say "hi"',)), "not safe in an nftables comment"),
        (Elements("bad set;", ("k1",)), "not a safe nftables name"),
        (Elements("service-ips", ("k1", "k2"), ("goto a",)), "2 keys, 1 values"),
        (Elements("service-ips", ("k1", 7)), "must be text"),  # type: ignore[arg-type]
    ],
)
def test_a_bad_batch_latches_the_error_a_single_element_would(batch: Elements, why: str) -> None:
    tx = Transaction("ip", "nfproxy")
    tx.add(batch)
    tx.add(Chain("after"))  # nothing is queued after the first error
    with pytest.raises(ValueError):
        tx.check()
    assert tx.error is not None and why in tx.error
    assert not tx.ops


def test_a_batch_only_adds() -> None:
    tx = Transaction("ip", "nfproxy")
    tx.delete(Elements("cluster-ips", ("10.0.0.1",)))
    assert tx.error == "delete elements is not an nft command"


def test_an_empty_batch_writes_nothing() -> None:
    tx = Transaction("ip", "nfproxy")
    tx.add(Map("m", type="ipv4_addr : verdict"))
    tx.add(Elements("m", ()))
    tx.check()
    assert len(tx) == 1
    assert "element" not in nft_text.script(tx)


CHAINS = {"service-A-ns/a/tcp/http": ("ip daddr 10.0.0.1 jump mark-for-masquerade", "goto endpoints-A"),
          "external-A-ns/a/tcp/http": ("jump mark-for-masquerade",), "empty-chain": ()}


def test_refill_is_add_flush_then_rules_one_at_a_time() -> None:
    bulk, single = Transaction("ip", "nfproxy"), Transaction("ip", "nfproxy")
    bulk.refill(CHAINS)
    for name in CHAINS:
        single.add(Chain(name))
        single.flush(Chain(name))
    for name, bodies in CHAINS.items():
        for body in bodies:
            single.add(Rule(name, body))
    bulk.check()
    single.check()
    assert bulk.ops == single.ops
    assert len(bulk) == len(single) == 9
    assert nft_text.script(bulk) == nft_text.script(single)


@pytest.mark.parametrize(
    "chains, why",
    [
        ({"bad name;": ("accept",)}, "not a safe nftables name"),
        ({"ok": ("accept", "accept; flush ruleset")}, "rule body must be one statement list"),
        ({"ok": ("accept\nflush ruleset",)}, "rule body must be one statement list"),
        ({"ok": ("",)}, "rule body must be one statement list"),
    ],
)
def test_refill_and_add_rules_latch_what_add_would(chains: dict, why: str) -> None:
    for queue in ("refill", "add_rules"):
        tx = Transaction("ip", "nfproxy")
        if queue == "refill":
            tx.refill(chains)
        else:
            for name, bodies in chains.items():
                tx.add_rules(name, bodies)
        assert tx.error is not None and why in tx.error, (queue, tx.error)
        with pytest.raises(ValueError):
            tx.check()


def test_add_rules_queues_rules() -> None:
    tx = Transaction("ip", "nfproxy")
    tx.add_rules("c", ("accept", "drop"))
    tx.add_rules("c", ())
    assert tx.ops == [(Verb.ADD, Rule("c", "accept")), (Verb.ADD, Rule("c", "drop"))]
    assert len(tx) == 2


def test_plain_chain_fast_path_still_checks_every_kind_of_chain() -> None:
    tx = Transaction("ip", "nfproxy")
    tx.add(Chain("c"))
    tx.add(Chain("c", type="nat"))  # known name, but a half base chain
    assert tx.error == "base chain c needs type, hook and priority"


def test_gc_paused_leaves_no_collection_pending() -> None:
    """What a render allocated is moved to the oldest generation on the way out, not walked by
    the next allocation's young collection."""
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        held = [[i] for i in range(50_000)]
    assert gc.isenabled()
    assert gc.get_count()[0] < 1_000
    assert len(held) == 50_000


@pytest.mark.kernel
def test_object_names_tells_a_missing_table_from_an_empty_one() -> None:
    """The full sync's listing of our chains and sets asks no `list table` (it lists every rule)
    unless it found nothing, and still says None only when the table is missing."""
    from nfproxy.kernel import netns
    from nfproxy.kernel.nft import NftSession

    with netns.throwaway("nfp-gperf") as ns:
        session = NftSession(ns)
        assert session.object_names("ip", "nfproxy") is None
        session.apply("add table ip other\nadd chain ip other c\nadd set ip other s { type ipv4_addr ; }\n")
        assert session.object_names("ip", "nfproxy") is None
        session.apply("add table ip nfproxy\n")
        assert session.object_names("ip", "nfproxy") == (set(), set(), set())
        session.apply("add chain ip nfproxy x\nadd rule ip nfproxy x accept\n"
                      "add set ip nfproxy m { type ipv4_addr ; }\n"
                      "add map ip nfproxy d { type ipv4_addr : ipv4_addr ; }\nadd counter ip nfproxy k\n")
        assert session.object_names("ip", "nfproxy") == ({"x"}, {"m", "d"}, {"k"})

"""nft_wire writes the bytes pyroute2 writes, for every message nft_netlink makes.

The corpus: the messages nft_netlink compiles from rulesets the nft backend renders (whole
rulesets taken apart into what the compiler accepts, and partial-sync deltas of mutated
clusters), hand-written transactions for every verb and statement the compiler knows, and
hand-made messages of every class pyroute2 describes for nf_tables (tables, base chains, set
declarations, objects, every expression kind). Each must encode to pyroute2's bytes exactly;
what pyroute2 would drop, mangle or fail on must raise Unsupported. Pure logic: no kernel, no root.
"""

from __future__ import annotations

import dataclasses
import random
import struct
import types
from collections.abc import Iterator
from typing import Any

import pytest
from pyroute2.netlink import NLA_F_NESTED, NLM_F_ACK, NLM_F_CREATE, NLM_F_REQUEST
from pyroute2.netlink.nfnetlink import NFNL_SUBSYS_NFTABLES, nfgen_msg
from pyroute2.netlink.nfnetlink.nftsocket import (
    NFPROTO_IPV4,
    NFPROTO_IPV6,
    NFT_MSG_DELRULE,
    NFT_MSG_GETOBJ,
    NFT_MSG_NEWCHAIN,
    NFT_MSG_NEWRULE,
    NFT_MSG_NEWSET,
    NFT_MSG_NEWSETELEM,
    NFT_MSG_NEWTABLE,
    nft_chain_msg,
    nft_rule_msg,
    nft_set_elem_list_msg,
    nft_set_msg,
    nft_table_msg,
)
from pyroute2.netlink.nlsocket import NetlinkRequest

from nfproxy.backends.nft import render as nft_backend
from nfproxy.core.changes import diff
from nfproxy.core.model import ClusterState, Endpoint, IPFamily, sort_endpoints
from nfproxy.kernel.nfnetlink import messages as nn
from nfproxy.kernel.nfnetlink.values import (
    TYPE_INET_PROTO,
    TYPE_INET_SERVICE,
    TYPE_INTEGER,
    TYPE_IPV4,
    TYPE_IPV6,
    TYPE_MARK,
    Field,
    Message,
    SetType,
    Unsupported,
)
from nfproxy.kernel.nfnetlink.values import NFNL_MSG_BATCH_BEGIN, NFNL_MSG_BATCH_END
from nfproxy.kernel.nft_wire import batch_begin, batch_end, encode_message
from nfproxy.nftables import Chain, Element, Map, Rule, Set, Transaction, Verb
from nfproxy.nftables import expr as x
from nfproxy.testing import random_cluster, uniform_cluster
from tests import nft_oracle
from tests.nft_oracle import MAX_MESSAGES, compile_transaction

TABLE = nft_backend.TABLE
FAMILIES = {IPFamily.V4: "ip", IPFamily.V6: "ip6"}
NFPROTO = {"ip": NFPROTO_IPV4, "ip6": NFPROTO_IPV6}


def pyroute2_bytes(message: Message, family: int, seq: int) -> bytes:
    msg = nn.build(message, family, seq)
    msg.encode()
    return bytes(msg.data)


def assert_same(messages: list[Message], family: int) -> None:
    for seq, m in enumerate(messages, 1):
        assert encode_message(m, family, seq) == pyroute2_bytes(m, family, seq), m.command


# --------------------------------------------------------------------------------------------
# Set declarations as the kernel would report them (set_type_from_kernel's output).

_TYPES = {
    "ipv4_addr": Field(TYPE_IPV4, 4),
    "ipv6_addr": Field(TYPE_IPV6, 16),
    "inet_proto": Field(TYPE_INET_PROTO, 1),
    "inet_service": Field(TYPE_INET_SERVICE, 2),
    "mark": Field(TYPE_MARK, 4),
    "ip daddr": Field(TYPE_IPV4, 4),
    "ip6 daddr": Field(TYPE_IPV6, 16),
    **{f"{p} dport": Field(TYPE_INET_SERVICE, 2) for p in ("tcp", "udp", "sctp")},
}


def _fields(text: str) -> tuple[Field, ...]:
    if text.startswith("numgen "):
        return (Field(TYPE_INTEGER, 4, True),)
    return tuple(_TYPES[part] for part in text.split(" . "))


def declared(obj: Set | Map) -> SetType:
    key, _, data = (obj.type or obj.typeof or "").partition(" : ")
    verdict = data == "verdict"
    values = None if not data else () if verdict else _fields(data)
    return SetType(obj.name, _fields(key), values, verdict, "interval" in obj.flags)


def declarations(tx: Transaction) -> dict[str, SetType]:
    return {obj.name: declared(obj) for verb, obj in tx.operations() if type(obj) in (Set, Map) and verb is Verb.ADD}


# --------------------------------------------------------------------------------------------
# The corpus from rendered rulesets.


def _compiled(family: str, ops: list[tuple[Verb, Any]], types_: dict[str, SetType]) -> list[Message]:
    tx = Transaction(family, TABLE)
    for verb, obj in ops:
        getattr(tx, verb.value)(obj)
    return compile_transaction(tx, types_.__getitem__)


def ruleset_messages(state: ClusterState, family: IPFamily) -> Iterator[tuple[str, list[Message]]]:
    """A full sync taken apart into what the compiler accepts: each plain chain verb, each rule
    it can compile, the elements of each set (added, then deleted), each set deleted."""
    fam = FAMILIES[family]
    full = nft_backend.render(state, family).transaction()
    types_ = declarations(full)
    chains: list[tuple[Verb, Any]] = []
    elements: list[tuple[Verb, Any]] = []
    for verb, obj in full.operations():
        kind = type(obj)
        if kind is Chain and obj.hook is None and not obj.comment:
            chains.append((verb, obj))
        elif kind is Rule:
            try:
                yield fam, _compiled(fam, [(verb, obj)], types_)
            except Unsupported:
                pass  # ct state, masquerade, reject ...: libnftables' business
        elif kind is Element:
            elements.append((verb, obj))
        elif kind in (Set, Map) and verb is Verb.ADD:
            yield fam, _compiled(fam, [(Verb.DELETE, type(obj)(obj.name))], types_)
    yield fam, _compiled(fam, chains, types_)
    for i in range(0, len(elements), MAX_MESSAGES):
        batch = elements[i : i + MAX_MESSAGES]
        yield fam, _compiled(fam, batch, types_)
        yield fam, _compiled(fam, [(Verb.DELETE, Element(el.set, el.key)) for _, el in batch], types_)


def _mutated(rng: random.Random, state: ClusterState, pool: ClusterState) -> ClusterState:
    """One service changed: removed, added, endpoints added or removed, or its port moved."""
    key = rng.choice(sorted(state.services, key=str))
    svc = state.services[key]
    services, endpoints = dict(state.services), dict(state.endpoints)
    eps = list(endpoints.get(key, ()))
    choice = rng.randrange(5)
    if choice == 0:
        del services[key]
        endpoints.pop(key, None)
    elif choice == 1:
        new = sorted((k for k in pool.services if k not in services), key=str)
        if new:
            k = rng.choice(new)
            services[k] = pool.services[k]
            if k in pool.endpoints:
                endpoints[k] = pool.endpoints[k]
    elif choice == 2 and eps:
        eps.pop(rng.randrange(len(eps)))
        endpoints[key] = sort_endpoints(eps) if eps else ()
    elif choice in (2, 3):
        prefix = "10.250.0." if svc.family is IPFamily.V4 else "fd09::"
        added = [Endpoint(ip=f"{prefix}{rng.randrange(1, 250)}", port=9000, node_name="node-a") for _ in range(rng.randint(1, 12))]
        endpoints[key] = sort_endpoints(list({e.address: e for e in [*eps, *added]}.values()))
    else:
        services[key] = dataclasses.replace(svc, port=svc.port + 1000)
    endpoints = {k: v for k, v in endpoints.items() if v}
    return dataclasses.replace(state, services=services, endpoints=endpoints)


def _declarations_apart(tx: Transaction) -> tuple[Transaction, Transaction]:
    """(the sets and maps `tx` adds, the rest of it)."""
    declared, rest = Transaction(tx.family, tx.table), Transaction(tx.family, tx.table)
    for verb, obj in tx.operations():
        if type(obj) in (Set, Map) and verb is Verb.ADD:
            declared.add(obj)
        else:
            getattr(rest, verb.value)(obj)
    return declared, rest


def delta_messages(seed: int, steps: int) -> Iterator[tuple[str, list[Message]]]:
    """Partial syncs of a mutating cluster, as the proxier sends them over netlink (set and map
    declarations split off first: the bulk compiler says those, kernel/nft_bulk.py)."""
    rng = random.Random(seed)
    state = random_cluster(rng, 14)
    pool = random_cluster(random.Random(seed + 100), 28)
    applied = {family: nft_backend.render(state, family) for family in FAMILIES}
    types_ = {family: declarations(applied[family].transaction()) for family in FAMILIES}
    stale: dict[IPFamily, tuple[tuple[str, ...], tuple[str, ...]]] = {}
    for _ in range(steps):
        new_state = _mutated(rng, state, pool)
        changes = diff(state, new_state)
        for family, fam in FAMILIES.items():
            keys = changes.of(family)
            chains, sets = stale.get(family, ((), ()))
            new = nft_backend.render_update(applied[family], new_state, keys)
            if isinstance(new, nft_backend.Cannot):
                applied[family] = nft_backend.render(new_state, family)
                types_[family] = declarations(applied[family].transaction())
                stale.pop(family, None)
                continue
            d = nft_backend.delta(applied[family], new, keys, delete_chains=chains, delete_sets=sets)
            tx = d.transaction
            if tx and nft_oracle.unencodable(tx) is not None:
                declared, tx = _declarations_apart(tx)
                assert nft_oracle.unencodable(tx) is None, nft_oracle.unencodable(tx)
                types_[family].update(declarations(declared))
            if tx:
                yield fam, compile_transaction(tx, types_[family].__getitem__)
            applied[family] = new
            stale[family] = (d.stale_chains, d.stale_sets)
        state = new_state


def test_every_message_of_rendered_rulesets_is_pyroute2s_bytes() -> None:
    clusters = [
        (random_cluster(random.Random(1), 10), IPFamily.V4),
        (random_cluster(random.Random(2), 10), IPFamily.V6),
        (random_cluster(random.Random(3), 8), IPFamily.V4),
        (uniform_cluster(3, 4), IPFamily.V4),
    ]
    kinds: set[tuple[int, str]] = set()
    count = 0
    for state, family in clusters:
        for fam, messages in ruleset_messages(state, family):
            assert_same(messages, NFPROTO[fam])
            kinds |= {(m.msg_type, m.command.split(" ")[0]) for m in messages}
            count += len(messages)
    assert count > 300, count
    assert {t for t, _ in kinds} >= {3, 5, 6, 8, 9, 11, 12, 14}, kinds  # every message type


def test_partial_sync_deltas_are_pyroute2s_bytes() -> None:
    count = 0
    for seed in (5, 6):
        for fam, messages in delta_messages(seed, 8):
            assert_same(messages, NFPROTO[fam])
            count += len(messages)
    assert count > 50, count


def test_typed_bodies_are_the_messages_of_their_text() -> None:
    """The compiler reads a body's typed statements (nftables/expr.py); a body still held as
    text is read into them first, so both are one rule's messages. Raw text is refused."""
    count = 0
    for family, fam in FAMILIES.items():
        full = nft_backend.render(random_cluster(random.Random(4), 10), family).transaction()
        types_ = declarations(full)
        for verb, obj in full.operations():
            if type(obj) is Rule:
                text = Rule(obj.chain, str(obj.body))  # the renderer's statements, held as their text
                assert _compiled(fam, [(verb, text)], types_) == _compiled(fam, [(verb, obj)], types_), obj
                count += 1
    assert count > 100, count
    with pytest.raises(Unsupported):
        nn.rule_messages(Rule("c", x.raw("tcp dport 80 drop")), "ip", TABLE, V4_TYPES.__getitem__, "raw", iter(range(9)))


# --------------------------------------------------------------------------------------------
# Hand-written transactions: every verb and statement the compiler takes.

V4_TYPES = {
    "svc": SetType("svc", (Field(TYPE_IPV4, 4), Field(TYPE_INET_PROTO, 1), Field(TYPE_INET_SERVICE, 2)), (), verdict=True),
    "ports": SetType("ports", (Field(TYPE_INET_PROTO, 1), Field(TYPE_INET_SERVICE, 2)), (), verdict=True),
    "ips": SetType("ips", (Field(TYPE_IPV4, 4),), None),
    "pairs": SetType("pairs", (Field(TYPE_IPV4, 4), Field(TYPE_IPV4, 4)), None),
    "marks": SetType("marks", (Field(TYPE_MARK, 4),), None, interval=True),
    "ep": SetType("ep", (Field(TYPE_INTEGER, 4, True),), (Field(TYPE_IPV4, 4), Field(TYPE_INET_SERVICE, 2)), interval=True),
    "ep-hash": SetType("ep-hash", (Field(TYPE_INTEGER, 4, True),), (Field(TYPE_IPV4, 4), Field(TYPE_INET_SERVICE, 2))),
    "ep-addr": SetType("ep-addr", (Field(TYPE_INTEGER, 4, True),), (Field(TYPE_IPV4, 4),)),
    "affinity": SetType("affinity", (Field(TYPE_IPV4, 4),), None),
}
V6_TYPES = {
    "svc6": SetType("svc6", (Field(TYPE_IPV6, 16), Field(TYPE_INET_PROTO, 1), Field(TYPE_INET_SERVICE, 2)), (), verdict=True),
    "ep6": SetType("ep6", (Field(TYPE_INTEGER, 4, True),), (Field(TYPE_IPV6, 16), Field(TYPE_INET_SERVICE, 2)), interval=True),
    "pairs6": SetType("pairs6", (Field(TYPE_IPV6, 16), Field(TYPE_IPV6, 16)), None),
}

V4_RULES = [
    "ip saddr 10.0.0.1 drop",
    "ip daddr != 10.0.0.1 accept",
    "ip saddr 10.0.0.0/8 return",
    "ip saddr != 10.1.0.0/16 continue",
    "ip daddr 10.16.0.0/12 jump a",
    "ip daddr != 192.168.3.128/25 goto a",
    "ip daddr 10.0.0.9/32 drop",
    "ip saddr { 10.0.0.0/8, 192.168.0.0/16, 172.16.0.1 } drop",
    "ip saddr != { 10.0.0.0/8, 10.0.0.0/9 } drop",
    "ip daddr { 0.0.0.0/8, 240.0.0.0/4 } drop",
    "ip daddr { 1.2.3.0/24, 255.255.255.255 } jump a",
    "ip saddr { 10.0.0.1 } drop",
    "meta l4proto tcp th dport 80 drop",
    "meta l4proto 47 accept",
    "th dport != 443 jump a",
    "ip daddr . meta l4proto . th dport vmap @svc",
    "meta l4proto . th dport vmap @ports",
    "ip saddr . ip daddr @pairs jump a",
    "ip saddr . ip daddr != @pairs return",
    "ip daddr @ips fib daddr type local meta l4proto . th dport vmap @ports",
    "fib saddr type != local jump a",
    "fib daddr type broadcast drop",
    "numgen random mod 3 vmap { 0 : goto a , 1 : goto b , 2 : jump c }",
    "numgen random mod 2 offset 4 vmap { 4 : goto a , 5 : drop }",
    "meta l4proto tcp dnat ip to numgen random mod 7 offset 12 map @ep",
    "meta l4proto udp dnat ip to numgen random mod 2 map @ep-hash",
    "dnat ip to numgen random mod 2 map @ep-addr",
    "meta l4proto tcp counter dnat to 10.0.0.1:8081",
    "dnat ip to 10.0.0.2",
    "dnat to 10.0.0.3:53",
    "ip saddr 10.0.0.1 update @affinity { ip saddr } goto a",
    "update @affinity { ip saddr }",
    "counter",
    "counter accept",
    "ip saddr @affinity goto a",
    "ip daddr != @ips drop",
    'jump a comment "a short comment"',
    'ip saddr 10.0.0.1 drop comment "ns/svc:port with a, comma and é"',
]
V6_RULES = [
    "ip6 saddr fd00::1 drop",
    "ip6 daddr != fd00::/8 accept",
    "ip6 daddr fd00:1::/32 jump a",
    "ip6 saddr fd00::/61 return",
    "ip6 daddr fd00::1/128 drop",
    "ip6 saddr { fd00::/8, ::1, fe80::/10 } drop",
    "ip6 daddr { ::/8, ffff::/16 } drop",
    "ip6 daddr . meta l4proto . th dport vmap @svc6",
    "ip6 saddr . ip6 daddr @pairs6 jump a",
    "meta l4proto tcp dnat ip6 to numgen random mod 5 offset 3 map @ep6",
    "meta l4proto tcp counter dnat to [fd00::1]:8080",
    "dnat to fd00::2",
    "meta l4proto icmpv6 accept",
    'fib daddr type local jump a comment "ipv6"',
]


def _tx(family: str, *ops: tuple[str, Any]) -> Transaction:
    tx = Transaction(family, TABLE)
    for verb, obj in ops:
        getattr(tx, verb)(obj)
    tx.check()
    return tx


def hand_written() -> Iterator[tuple[str, Transaction, dict[str, SetType]]]:
    for body in V4_RULES:
        yield "ip", _tx("ip", ("add", Rule("a-chain", body))), V4_TYPES
    for body in V6_RULES:
        yield "ip6", _tx("ip6", ("add", Rule("a-chain", body))), V6_TYPES
    yield "ip", _tx(
        "ip",
        ("add", Chain("fresh")), ("flush", Chain("fresh")), ("delete", Chain("old")),
        ("delete", Set("affinity")), ("delete", Map("svc")),
        ("add", Rule("fresh", "ip saddr 10.0.0.1 drop")),
        ("add", Element("svc", "172.30.0.1 . tcp . 80", "goto fresh")),
        ("add", Element("svc", "172.30.0.2 . udp . 53", "jump fresh")),
        ("add", Element("svc", "172.30.0.3 . sctp . 9", "drop")),
        ("add", Element("svc", "172.30.0.4 . 6 . 65535", "accept", comment="ns/svc:http")),
        ("delete", Element("svc", "172.30.0.9 . tcp . 80")),
        ("add", Element("ports", "tcp . 30080", "goto fresh")),
        ("add", Element("ips", "10.0.0.1")),
        ("add", Element("ips", "10.0.0.2", comment="a comment, with punctuation: ns/svc")),
        ("add", Element("pairs", "10.0.0.1 . 10.0.0.1")),
        ("delete", Element("pairs", "10.0.0.2 . 10.0.0.2")),
        ("add", Element("marks", "16-31")),
        ("add", Element("marks", "7", comment="one")),
        ("delete", Element("marks", "32-47")),
        ("add", Element("ep", "0-3", "10.0.0.1 . 8080", comment="x")),
        ("add", Element("ep", "4", "10.0.0.2 . 8081")),
        ("delete", Element("ep", "5-9")),
        ("add", Element("ep-hash", "16", "10.1.0.1 . 80")),
        ("add", Element("ep-addr", "0x10", "10.1.0.2")),
        ("delete", Chain("fresh")),
    ), V4_TYPES
    yield "ip6", _tx(
        "ip6",
        ("add", Chain("fresh6")),
        ("add", Element("svc6", "fd00::1 . tcp . 80", "goto fresh6")),
        ("add", Element("ep6", "0-1", "fd00::1 . 8080", comment="ns/svc:port")),
        ("add", Element("pairs6", "fd00::1 . fd00::1")),
        ("delete", Element("svc6", "fd00::2 . udp . 53")),
    ), V6_TYPES
    many = Transaction("ip", TABLE)
    many.add_elements(Element("svc", f"10.{i // 256}.{i % 256}.1 . tcp . 80", "goto fresh") for i in range(600))
    many.add_elements(Element("ep", f"{2 * i}-{2 * i + 1}", f"10.0.{i % 256}.1 . 80") for i in range(300))
    yield "ip", many, V4_TYPES  # 256 elements a message, and interval pairs across messages


def test_every_verb_and_statement_of_the_compiler_is_pyroute2s_bytes() -> None:
    expressions: set[str] = set()
    for fam, tx, types_ in hand_written():
        messages = compile_transaction(tx, types_.__getitem__)
        assert_same(messages, NFPROTO[fam])
        for m in messages:
            for name, value, *_ in m.attrs:
                if name == "NFTA_RULE_EXPRESSIONS":
                    expressions |= {e["attrs"][0][1] for e in value}
    assert expressions >= {"payload", "meta", "cmp", "bitwise", "lookup", "immediate", "numgen", "fib",
                           "nat", "counter", "dynset", "byteorder"}, expressions


# --------------------------------------------------------------------------------------------
# Hand-made messages of every class and expression pyroute2 knows for nf_tables: what a full
# sync over netlink would add (tables, base chains, declarations) and every expression kind.


def _expr(name: str, *attrs: tuple[Any, ...]) -> dict[str, Any]:
    return {"attrs": [("NFTA_EXPR_NAME", name), ("NFTA_EXPR_DATA", {"attrs": list(attrs)}, NLA_F_NESTED)]}


def _data(value: bytes) -> dict[str, Any]:
    return {"attrs": [("NFTA_DATA_VALUE", value)]}


EXPRESSIONS = [
    _expr("payload", ("NFTA_PAYLOAD_DREG", 1), ("NFTA_PAYLOAD_BASE", 1), ("NFTA_PAYLOAD_OFFSET", 12), ("NFTA_PAYLOAD_LEN", 4)),
    _expr("payload", ("NFTA_PAYLOAD_SREG", 1), ("NFTA_PAYLOAD_BASE", 2), ("NFTA_PAYLOAD_OFFSET", 0), ("NFTA_PAYLOAD_LEN", 2),
          ("NFTA_PAYLOAD_CSUM_TYPE", 1), ("NFTA_PAYLOAD_CSUM_OFFSET", 16), ("NFTA_PAYLOAD_CSUM_FLAGS", frozenset({"NFT_PAYLOAD_L4CSUM_PSEUDOHDR"}))),
    _expr("meta", ("NFTA_META_KEY", 3), ("NFTA_META_DREG", 1)),
    _expr("meta", ("NFTA_META_KEY", 3), ("NFTA_META_SREG", 1)),
    _expr("cmp", ("NFTA_CMP_SREG", 1), ("NFTA_CMP_OP", 5), ("NFTA_CMP_DATA", _data(b"\x00\x00\x40\x00"))),
    _expr("bitwise", ("NFTA_BITWISE_SREG", 1), ("NFTA_BITWISE_DREG", 1), ("NFTA_BITWISE_LEN", 4),
          ("NFTA_BITWISE_MASK", _data(b"\xff\xff\xbf\xff")), ("NFTA_BITWISE_XOR", _data(b"\x00\x00\x40\x00"))),
    _expr("bitwise", ("NFTA_BITWISE_SREG", 1), ("NFTA_BITWISE_DREG", 1), ("NFTA_BITWISE_LEN", 4),
          ("NFTA_BITWISE_OP", 1), ("NFTA_BITWISE_DATA", _data(b"\x00\x00\x00\x08"))),
    _expr("byteorder", ("NFTA_BYTEORDER_SREG", 1), ("NFTA_BYTEORDER_DREG", 1), ("NFTA_BYTEORDER_OP", 0),
          ("NFTA_BYTEORDER_LEN", 4), ("NFTA_BYTEORDER_SIZE", 4)),
    _expr("lookup", ("NFTA_LOOKUP_SREG", 9), ("NFTA_LOOKUP_DREG", 0), ("NFTA_LOOKUP_SET", "__map%d"),
          ("NFTA_LOOKUP_SET_ID", 7), ("NFTA_LOOKUP_FLAGS", 1)),
    _expr("immediate", ("NFTA_IMMEDIATE_DREG", 0), ("NFTA_IMMEDIATE_DATA", {"attrs": [
        ("NFTA_DATA_VERDICT", {"attrs": [("NFTA_VERDICT_CODE", -4), ("NFTA_VERDICT_CHAIN", "a-chain")]}, NLA_F_NESTED)]})),
    _expr("immediate", ("NFTA_IMMEDIATE_DREG", 0), ("NFTA_IMMEDIATE_DATA", {"attrs": [
        ("NFTA_DATA_VERDICT", {"attrs": [("NFTA_VERDICT_CODE", -5)]})]})),
    _expr("immediate", ("NFTA_IMMEDIATE_DREG", 2), ("NFTA_IMMEDIATE_DATA", _data(b"\x1f\x90"))),
    _expr("numgen", ("NFTA_NG_DREG", 1), ("NFTA_NG_MODULUS", 10), ("NFTA_NG_TYPE", 0), ("NFTA_NG_OFFSET", 3)),
    _expr("fib", ("NFTA_FIB_FLAGS", 2), ("NFTA_FIB_RESULT", 3), ("NFTA_FIB_DREG", 1)),
    _expr("ct", ("NFTA_CT_DREG", 1), ("NFTA_CT_KEY", 0)),
    _expr("ct", ("NFTA_CT_DREG", 1), ("NFTA_CT_KEY", 8), ("NFTA_CT_DIRECTION", 1)),
    _expr("ct", ("NFTA_CT_SREG", 1), ("NFTA_CT_KEY", 3)),
    _expr("nat", ("NFTA_NAT_TYPE", 0), ("NFTA_NAT_FAMILY", 10), ("NFTA_NAT_REG_ADDR_MIN", 1), ("NFTA_NAT_REG_ADDR_MAX", 2),
          ("NFTA_NAT_REG_PROTO_MIN", 3), ("NFTA_NAT_REG_PROTO_MAX", 4), ("NFTA_NAT_FLAGS", 0x12)),
    _expr("masq", ("NFTA_MASQ_FLAGS", frozenset({"NF_NAT_RANGE_PROTO_RANDOM_FULLY"}))),
    _expr("masq", ("NFTA_MASQ_FLAGS", frozenset()), ("NFTA_MASQ_REG_PROTO_MIN", 1), ("NFTA_MASQ_REG_PROTO_MAX", 1)),
    _expr("redir", ("NFTA_REDIR_REG_PROTO_MIN", 1), ("NFTA_REDIR_FLAGS", frozenset({"NF_NAT_RANGE_PROTO_SPECIFIED"}))),
    _expr("counter", ("NFTA_COUNTER_BYTES", 0), ("NFTA_COUNTER_PACKETS", 0)),
    _expr("counter", ("NFTA_COUNTER_BYTES", 1 << 40), ("NFTA_COUNTER_PACKETS", 12345)),
    _expr("dynset", ("NFTA_DYNSET_SREG_KEY", 1), ("NFTA_DYNSET_OP", 1), ("NFTA_DYNSET_SET_NAME", "affinity-x")),
    _expr("dynset", ("NFTA_DYNSET_SET_NAME", "s"), ("NFTA_DYNSET_SET_ID", 3), ("NFTA_DYNSET_OP", 0), ("NFTA_DYNSET_SREG_KEY", 1),
          ("NFTA_DYNSET_SREG_DATA", 2), ("NFTA_DYNSET_TIMEOUT", 10800000), ("NFTA_DYNSET_FLAGS", frozenset({"NFT_DYNSET_F_INV"}))),
    _expr("objref", ("NFTA_OBJREF_IMM_TYPE", 1), ("NFTA_OBJREF_IMM_NAME", "ct_state_invalid_dropped_pkts")),
    _expr("objref", ("NFTA_OBJREF_SET_SREG", 1), ("NFTA_OBJREF_SET_NAME", "__objmap%d"), ("NFTA_OBJREF_SET_ID", 2)),
    _expr("reject", ("NFTA_REJECT_TYPE", 0), ("NFTA_REJECT_ICMP_CODE", 3)),
    _expr("reject", ("NFTA_REJECT_TYPE", 2), ("NFTA_REJECT_ICMP_CODE", 1)),
    _expr("reject", ("NFTA_REJECT_TYPE", 1)),
    _expr("range", ("NFTA_RANGE_SREG", 1), ("NFTA_RANGE_OP", 1), ("NFTA_RANGE_FROM_DATA", _data(b"\x75\x30")),
          ("NFTA_RANGE_TO_DATA", _data(b"\x7f\xff"))),
    _expr("limit", ("NFTA_LIMIT_RATE", 10), ("NFTA_LIMIT_UNIT", 60), ("NFTA_LIMIT_BURST", 5), ("NFTA_LIMIT_TYPE", 0), ("NFTA_LIMIT_FLAGS", 1)),
    _expr("log", ("NFTA_LOG_PREFIX", "nfproxy: "), ("NFTA_LOG_GROUP", 2), ("NFTA_LOG_SNAPLEN", 64), ("NFTA_LOG_QTHRESHOLD", 1),
          ("NFTA_LOG_LEVEL", 4), ("NFTA_LOG_FLAGS", frozenset({"NF_LOG_TCPSEQ", "NF_LOG_UID"}))),
    _expr("hash", ("NFTA_HASH_SREG", 1), ("NFTA_HASH_DREG", 1), ("NFTA_HASH_LEN", 4), ("NFTA_HASH_MODULUS", 4),
          ("NFTA_HASH_SEED", 0xDEADBEEF), ("NFTA_HASH_OFFSET", 0), ("NFTA_HASH_TYPE", 0)),
    _expr("queue", ("NFTA_QUEUE_NUM", 3), ("NFTA_QUEUE_TOTAL", 2), ("NFTA_QUEUE_FLAGS", 1)),
    _expr("quota", ("NFTA_QUOTA_BYTES", 1000), ("NFTA_QUOTA_FLAGS", frozenset({"NFT_QUOTA_F_INV"}))),
    _expr("exthdr", ("NFTA_EXTHDR_DREG", 1), ("NFTA_EXTHDR_TYPE", 2), ("NFTA_EXTHDR_OFFSET", 2), ("NFTA_EXTHDR_LEN", 2),
          ("NFTA_EXTHDR_FLAGS", frozenset({"NFT_EXTHDR_F_PRESENT"})), ("NFTA_EXTHDR_OP", 1)),
    _expr("rt", ("NFTA_RT_DREG", 1), ("NFTA_RT_KEY", 3)),
    _expr("socket", ("NFTA_SOCKET_KEY", 0), ("NFTA_SOCKET_DREG", 1)),
    _expr("connlimit", ("NFTA_CONNLIMIT_COUNT", 10), ("NFTA_CONNLIMIT_FLAGS", frozenset({"NFT_LIMIT_F_INV"}))),
    _expr("dup", ("NFTA_DUP_SREG_ADDR", 1), ("NFTA_DUP_SREG_DEV", 2)),
    _expr("match", ("NFTA_MATCH_NAME", "comment"), ("NFTA_MATCH_REV", 0), ("NFTA_MATCH_INFO", b"\x00" * 256)),
    _expr("xfrm", ("NFTA_XFRM_DREG", 1), ("NFTA_XFRM_KEY", 5), ("NFTA_XFRM_DIR", 0), ("NFTA_XFRM_SPNUM", 0)),
    {"attrs": [("NFTA_EXPR_DATA", {"attrs": [("NFTA_COUNTER_PACKETS", 1)]}), ("NFTA_EXPR_NAME", "counter")]},  # name last
]


def hand_made() -> list[Message]:
    rule = nn._RuleMsg
    elems = nn._ElemListMsg
    out = [
        Message(nft_table_msg, NFT_MSG_NEWTABLE, NLM_F_CREATE, (("NFTA_TABLE_NAME", TABLE), ("NFTA_TABLE_FLAGS", 0),
                ("NFTA_TABLE_USERDATA", "rules for nfproxy")), "table"),
        Message(nft_table_msg, NFT_MSG_NEWTABLE, 0, (("NFTA_TABLE_NAME", "t"), ("NFTA_TABLE_FLAGS", 1, NLA_F_NESTED),
                ["NFTA_TABLE_HANDLE", 7, NLA_F_NESTED]), "top-level flags: a tuple's are ORed in, a list's are not"),
        Message(nft_chain_msg, NFT_MSG_NEWCHAIN, NLM_F_CREATE, (
            ("NFTA_CHAIN_TABLE", TABLE), ("NFTA_CHAIN_NAME", "nat-prerouting"),
            ("NFTA_CHAIN_HOOK", {"attrs": [("NFTA_HOOK_HOOKNUM", 0), ("NFTA_HOOK_PRIORITY", -100)]}, NLA_F_NESTED),
            ("NFTA_CHAIN_POLICY", 1), ("NFTA_CHAIN_TYPE", "nat"),
            ("NFTA_CHAIN_USERDATA", "helper for @no-endpoint-services / @no-endpoint-nodeports")), "base chain"),
        Message(nft_chain_msg, NFT_MSG_NEWCHAIN, NLM_F_CREATE, (
            ("NFTA_CHAIN_TABLE", TABLE), ("NFTA_CHAIN_NAME", "ingress"), ("NFTA_CHAIN_ID", 4),
            ("NFTA_CHAIN_HOOK", {"attrs": [("NFTA_HOOK_HOOKNUM", 0), ("NFTA_HOOK_PRIORITY", 10), ("NFTA_HOOK_DEV", "eth0"),
                                           ("NFTA_HOOK_DEVS", {"attrs": [("NFTA_DEVICE_NAME", "eth1")]})]}),
            ("NFTA_CHAIN_FLAGS", frozenset({"NFT_CHAIN_BINDING"})),
            ("NFTA_CHAIN_COUNTERS", {"attrs": [("NFTA_COUNTER_BYTES", 1), ("NFTA_COUNTER_PACKETS", 2)]})), "netdev chain"),
        Message(nft_rule_msg, NFT_MSG_DELRULE, 0, (("NFTA_RULE_TABLE", TABLE), ("NFTA_RULE_CHAIN", "c"),
                                                   ("NFTA_RULE_HANDLE", 42)), "delete rule by handle"),
        Message(rule, NFT_MSG_NEWRULE, NLM_F_CREATE, (
            ("NFTA_RULE_TABLE", TABLE), ("NFTA_RULE_CHAIN", "c"), ("NFTA_RULE_POSITION", 9), ("NFTA_RULE_ID", 3),
            ("NFTA_RULE_EXPRESSIONS", EXPRESSIONS, NLA_F_NESTED), ("NFTA_RULE_USERDATA", "x" * 250)), "every expression"),
        Message(rule, NFT_MSG_NEWRULE, NLM_F_CREATE, (("NFTA_RULE_TABLE", TABLE), ("NFTA_RULE_CHAIN", "c"),
                ("NFTA_RULE_EXPRESSIONS", EXPRESSIONS[:3])), "expressions without the nested flag"),
        Message(nft_set_msg, NFT_MSG_NEWSET, NLM_F_CREATE, (
            ("NFTA_SET_TABLE", TABLE), ("NFTA_SET_NAME", "endpoints-tcp-ranges-0"),
            ("NFTA_SET_FLAGS", frozenset({"NFT_SET_INTERVAL", "NFT_SET_MAP", "NFT_SET_CONCAT"})),
            ("NFTA_SET_KEY_TYPE", TYPE_INTEGER), ("NFTA_SET_KEY_LEN", 4), ("NFTA_SET_DATA_TYPE", (TYPE_IPV4 << 6) | TYPE_INET_SERVICE),
            ("NFTA_SET_DATA_LEN", 8), ("NFTA_SET_POLICY", 1), ("NFTA_SET_ID", 11), ("NFTA_SET_TIMEOUT", 60000),
            ("NFTA_SET_GC_INTERVAL", 3000),
            ("NFTA_SET_DESC", {"attrs": [("NFTA_SET_DESC_SIZE", 64), ("NFTA_SET_DESC_CONCAT", [
                {"attrs": [("NFTA_LIST_ELEM", [{"attrs": [("NFTA_SET_FIELD_LEN", 4)]}])]},
                {"attrs": [("NFTA_LIST_ELEM", [{"attrs": [("NFTA_SET_FIELD_LEN", 2)]}])]}])]}, NLA_F_NESTED),
            ("NFTA_SET_USERDATA", [("NFTNL_UDATA_SET_KEYBYTEORDER", b"\x01\x00\x00\x00"), ("NFTNL_UDATA_SET_COMMENT", "a map")]),
            ("NFTA_SET_EXPR", _expr("counter", ("NFTA_COUNTER_BYTES", 0), ("NFTA_COUNTER_PACKETS", 0))),
            ("NFTA_SET_EXPRESSIONS", [_expr("counter"), _expr("limit", ("NFTA_LIMIT_RATE", 1))], NLA_F_NESTED),
        ), "set declaration"),
        Message(nft_set_msg, NFT_MSG_NEWSET, NLM_F_CREATE, (
            ("NFTA_SET_TABLE", TABLE), ("NFTA_SET_NAME", "s"), ("NFTA_SET_USERDATA", "plain text as bytes"),
            ("NFTA_SET_EXPRESSIONS", [_expr("lookup", ("NFTA_LOOKUP_SET", "x"), ("NFTA_LOOKUP_FLAGS", frozenset({"NFT_LOOKUP_F_INV"}))),
                                      _expr("fib", ("NFTA_FIB_RESULT", frozenset({"NFT_FIB_RESULT_OIF"})), ("NFTA_FIB_FLAGS", 1)),
                                      _expr("nat", ("NFTA_NAT_TYPE", 1), ("NFTA_NAT_FLAGS", frozenset({"NF_NAT_RANGE_MAP_IPS"})))]),
        ), "pyroute2's own expression classes: flag sets where nft_netlink's take integers"),
        Message(elems, NFT_MSG_NEWSETELEM, NLM_F_CREATE, (
            ("NFTA_SET_ELEM_LIST_TABLE", TABLE), ("NFTA_SET_ELEM_LIST_SET", "s"), ("NFTA_SET_ELEM_LIST_SET_ID", 5),
            ("NFTA_SET_ELEM_LIST_ELEMENTS", [
                {"attrs": [("NFTA_SET_ELEM_KEY", _data(b"\x0a\x00\x00\x01")), ("NFTA_SET_ELEM_TIMEOUT", 5000),
                           ("NFTA_SET_ELEM_EXPIRATION", 100), ("NFTA_SET_ELEM_OBJREF", "c"),
                           ("NFTA_SET_ELEM_KEY_END", _data(b"\x0a\x00\x00\xff")),
                           ("NFTA_SET_ELEM_USERDATA", [("NFTNL_UDATA_SET_ELEM_COMMENT", "hi"), ("NFTNL_UDATA_SET_ELEM_FLAGS", b"\x01\x00\x00\x00")])]},
                {"attrs": [("NFTA_SET_ELEM_KEY", _data(b"")), ("NFTA_SET_ELEM_FLAGS", 1),
                           ("NFTA_SET_ELEM_DATA", {"attrs": [("NFTA_DATA_VERDICT", {"attrs": [
                               ("NFTA_VERDICT_CODE", -3), ("NFTA_VERDICT_CHAIN_ID", 8)]})]}),
                           ("NFTA_SET_ELEM_EXPR", _expr("counter", ("NFTA_COUNTER_PACKETS", 3))),
                           ("NFTA_SET_ELEM_EXPRESSIONS", [_expr("counter")])]},
                {"attrs": [("NFTA_SET_ELEM_KEY", _data(bytearray(b"\x01\x02\x03")))]},
            ], NLA_F_NESTED)), "every element attribute"),
        Message(nn._ObjMsg, NFT_MSG_GETOBJ, 0, (("NFTA_OBJ_TABLE", TABLE), ("NFTA_OBJ_TYPE", nn.NFT_OBJECT_COUNTER),
                ("NFTA_OBJ_NAME", "c"), ("NFTA_OBJ_DATA", {"attrs": [("NFTA_COUNTER_BYTES", 2), ("NFTA_COUNTER_PACKETS", 1)]}),
                ("NFTA_OBJ_USERDATA", b"\x00\x03ab\x00")), "counter object"),
        Message(nft_set_elem_list_msg, 13, 0, (("NFTA_SET_ELEM_LIST_TABLE", TABLE), ("NFTA_SET_ELEM_LIST_SET", "ñame"),
                ("NFTA_SET_ELEM_LIST_ELEMENTS", [{"attrs": [("NFTA_SET_ELEM_FLAGS", frozenset())]}])), "pyroute2's own element class"),
    ]
    return out


def test_hand_made_messages_of_every_class_are_pyroute2s_bytes() -> None:
    for family in (NFPROTO_IPV4, NFPROTO_IPV6, 1, 0):
        assert_same(hand_made(), family)


def test_ack_is_the_only_difference_without_ack() -> None:
    for m in hand_made():
        msg = nn.build(m, NFPROTO_IPV4, 77)
        msg["header"]["flags"] &= ~NLM_F_ACK
        msg.encode()
        assert encode_message(m, NFPROTO_IPV4, 77, ack=False) == bytes(msg.data), m.command


def _sent(msg: Any, seq: int, pid: int, **kwargs: Any) -> bytes:
    """What NetlinkNft._send writes: NetlinkRequest.prepare() sets the request's seq and pid
    (the socket's, or the process id for 0) and encodes; build() alone leaves pid 0."""
    if pid == 0:
        msg["header"]["sequence_number"] = seq
        msg.encode()
        return bytes(msg.data)
    sock = types.SimpleNamespace(addr_pool=None, status={}, epid=pid, marshal=None)
    request = NetlinkRequest(sock, msg, msg_seq=seq, **kwargs)
    request.msg.encode()
    return bytes(request.msg.data)


def test_batch_framing_is_what_send_writes() -> None:
    for seq, pid in ((0, 0), (9, 0), (1, 4242), (0xFFFFFFFF, 0x7FFFFFFF)):
        frames = {}
        for name, msg_type in (("begin", NFNL_MSG_BATCH_BEGIN), ("end", NFNL_MSG_BATCH_END)):
            msg = nfgen_msg()  # pyroute2's own batch frame
            msg["res_id"] = NFNL_SUBSYS_NFTABLES
            msg["header"]["type"] = msg_type
            msg["header"]["flags"] = NLM_F_REQUEST
            msg["header"]["sequence_number"] = 0
            frames[name] = _sent(msg, seq, pid, msg_flags=NLM_F_REQUEST, msg_type=msg_type)
        assert batch_begin(seq, pid=pid) == frames["begin"]
        assert batch_end(seq, pid=pid) == frames["end"]
        m = hand_made()[0]
        assert encode_message(m, NFPROTO_IPV4, seq, pid=pid) == _sent(nn.build(m, NFPROTO_IPV4, 0), seq, pid)
    assert batch_begin(3)[4:6] == (0x10).to_bytes(2, "little") and batch_end(3)[-2:] == b"\x00\x0a"


# --------------------------------------------------------------------------------------------
# What pyroute2 would drop, mangle or fail on is refused.


def _rule_with(*exprs: dict[str, Any]) -> Message:
    return Message(nn._RuleMsg, NFT_MSG_NEWRULE, 0, (("NFTA_RULE_TABLE", TABLE), ("NFTA_RULE_EXPRESSIONS", list(exprs))), "the rule")


@pytest.mark.parametrize(
    "message",
    [
        Message(nft_table_msg, NFT_MSG_NEWTABLE, 0, (("NFTA_TABLE_NAME", "t"), ("NFTA_TABLE_BOGUS", 1)), "unknown attribute"),
        _rule_with(_expr("payload", ("NFTA_PAYLOAD_DREG", 1), ("NFTA_PAYLOAD_BOGUS", 1))),
        _rule_with(_expr("no-such-expression", ("NFTA_COUNTER_BYTES", 1))),
        _rule_with({"attrs": [("NFTA_EXPR_DATA", {"attrs": []})]}),  # no name
        _rule_with(_expr("synproxy", ("NFTA_SYNPROXY_MSS", 1460))),  # pyroute2's class names a missing 'u16'
        _rule_with(_expr("dynset", ("NFTA_DYNSET_EXPR", _expr("counter")))),  # class set by pyroute2's history
        _rule_with(_expr("meta", ("NFTA_META_KEY", "NFT_META_MARK"))),  # a name, not the number
        _rule_with(_expr("meta", ("NFTA_META_KEY", None))),  # pyroute2 writes an empty attribute
        _rule_with(_expr("meta", ("NFTA_META_KEY", 1.0))),
        _rule_with(_expr("meta", ("NFTA_META_KEY", -1))),
        _rule_with(_expr("cmp", ("NFTA_CMP_DATA", {"attrs": [("NFTA_DATA_VALUE", 5)]}))),
        _rule_with(_expr("cmp", ("NFTA_CMP_DATA", {"attrs": [("NFTA_DATA_VALUE", "é")]}))),  # pyroute2 truncates
        _rule_with(_expr("cmp", ("NFTA_CMP_DATA", {"attrs": [("NFTA_DATA_VALUE", b"x")], "extra": 1}))),
        _rule_with(_expr("cmp", ("NFTA_CMP_DATA", [("NFTA_DATA_VALUE", b"x")]))),
        _rule_with(_expr("cmp", ("NFTA_CMP_DATA", {"attrs": [("NFTA_DATA_VALUE",)]}))),
        _rule_with(_expr("lookup", ("NFTA_LOOKUP_SET", 5))),
        _rule_with(_expr("masq", ("NFTA_MASQ_FLAGS", frozenset({"NF_NAT_RANGE_NO_SUCH_FLAG"})))),  # pyroute2 drops it
        _rule_with(_expr("masq", ("NFTA_MASQ_FLAGS", 4))),
        Message(nn._RuleMsg, NFT_MSG_NEWRULE, 0, (("NFTA_RULE_USERDATA", b"bytes"),), "a comment must be text"),
        Message(nn._RuleMsg, NFT_MSG_NEWRULE, 0, (("NFTA_RULE_EXPRESSIONS", {"attrs": []}),), "not a list"),
        Message(nn._RuleMsg, NFT_MSG_NEWRULE, 0, (("NFTA_RULE_TABLE", "t", "nested"),), "flags not a number"),
        Message(nft_set_msg, NFT_MSG_NEWSET, 0, (("NFTA_SET_USERDATA", [("NFTNL_UDATA_NO_SUCH", b"")]),), "user data"),
        Message(nft_set_msg, NFT_MSG_NEWSET, 0, (("NFTA_SET_USERDATA", [("NFTNL_UDATA_SET_COMMENT", "x" * 300)]),), "long"),
        Message(nft_set_msg, 0x10000, 0, (("NFTA_SET_NAME", "s"),), "message type out of range"),
        Message(nft_set_msg, NFT_MSG_NEWSET, 0, (("NFTA_SET_NAME", "s" * 70000),), "attribute over 64 KiB"),
        Message(nft_set_msg, NFT_MSG_NEWSET, 0, ("NFTA_SET_NAME",), "not a pair"),
    ],
    ids=lambda m: m.command,
)
def test_what_pyroute2_would_not_encode_faithfully_is_unsupported(message: Message) -> None:
    with pytest.raises(Unsupported):
        encode_message(message, NFPROTO_IPV4, 1)
    with pytest.raises(Unsupported):  # as a batch's message (no ack asked): refused before sending
        encode_message(message, NFPROTO_IPV4, 1, ack=False)


def test_every_message_is_written_as_pyroute2_would_send_it() -> None:
    """What the sender writes for a message is, for any sequence number and port id, the bytes
    pyroute2's encoder and NetlinkRequest write for the same message."""
    for seq, pid in ((0, 0), (9, 0), (1, 4242), (0xFFFFFFFF, 0x7FFFFFFF)):
        for family in (NFPROTO_IPV4, NFPROTO_IPV6):
            for m in hand_made():
                wire = encode_message(m, family, seq, pid=pid)
                _, msg_type, flags, _, _ = struct.unpack_from("=IHHII", wire)
                assert (msg_type, flags) == ((NFNL_SUBSYS_NFTABLES << 8) | m.msg_type, NLM_F_REQUEST | NLM_F_ACK | m.flags)
                assert wire == _sent(nn.build(m, family, 0), seq, pid), m.command
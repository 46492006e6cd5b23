"""The partial-sync message compiler that nfproxy used until 2026-12-07, kept as the tests'
oracle: it builds pyroute2-shaped messages (pyroute2's own classes, through the rule compiler in
nfproxy/kernel/nfnetlink/messages.py), so pyroute2's generic encoder can say what bytes the
batch compiler's (kernel/nft_bulk.py) and nft_wire's must be. `build` makes the pyroute2 object
of one message; `compile_transaction` a whole transaction's, as nfnetlink messages."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from pyroute2.netlink import NLA_F_NESTED, NLM_F_ACK, NLM_F_CREATE, NLM_F_REQUEST
from pyroute2.netlink.nfnetlink import NFNL_SUBSYS_NFTABLES
from pyroute2.netlink.nfnetlink.nftsocket import (
    NFT_MSG_DELCHAIN,
    NFT_MSG_DELRULE,
    NFT_MSG_DELSET,
    NFT_MSG_DELSETELEM,
    NFT_MSG_DELTABLE,
    NFT_MSG_NEWCHAIN,
    NFT_MSG_NEWSETELEM,
    nft_chain_msg,
    nft_rule_msg,
    nft_set_msg,
    nft_table_msg,
)

from nfproxy.kernel.nfnetlink.messages import _FAMILIES, _INTERVAL_END, _data, _ElemListMsg, _verdict_data, rule_messages
from nfproxy.kernel.nfnetlink.values import (
    TYPE_INTEGER,
    TYPE_IPV4,
    TYPE_IPV6,
    TYPE_MARK,
    Message,
    SetType,
    Unsupported,
    encode_concat,
    interval_bounds,
    verdict_of,
)
from nfproxy.nftables import Chain, Counter, Element, Map, Rule, Set, Table, Transaction, Verb
from nfproxy.nftables import text as nft_text
from nfproxy.nftables.objects import quote_comment

# The oracle refuses what the old partial-sync path refused: large transactions.
MAX_MESSAGES = 4000
# Elements per netlink message: one attribute nest is limited to 64 KiB.
_ELEMENTS_PER_MESSAGE = 256





def _element(el: Element, st: SetType, command: str, *, with_values: bool) -> list[dict[str, Any]]:
    """One element's attributes, from its fields: the key and value are ` . `-joined values
    typed by the set's declaration, the comment is libnftnl user data. An element of an
    interval set is two kernel elements, as libnftables sends them: the start key (carrying
    value and comment) and the key after the range's end, flagged as an interval end."""
    if st.interval:
        return _interval_element(el, st, command, with_values=with_values)
    key = encode_concat(el.key.split(" . "), st.key, command)
    return [_start_element(key, el, st, command, with_values)]


def _start_element(key: bytes, el: Element, st: SetType, command: str, with_values: bool) -> dict[str, Any]:
    attrs: list[Any] = [("NFTA_SET_ELEM_KEY", _data(key), NLA_F_NESTED)]
    if not with_values:
        return {"attrs": attrs}
    if bool(el.value) != (st.data is not None):
        raise Unsupported(f"element value does not fit set {st.name}: {command}")
    if el.value:
        if st.verdict:
            code, chain = verdict_of(el.value.split(" "), command)
            attrs.append(("NFTA_SET_ELEM_DATA", _verdict_data(code, chain), NLA_F_NESTED))
        else:
            assert st.data is not None
            data = encode_concat(el.value.split(" . "), st.data, command)
            attrs.append(("NFTA_SET_ELEM_DATA", _data(data), NLA_F_NESTED))
    if el.comment:
        # Cut as the text writer cuts it: both paths must leave the same element.
        text = quote_comment(el.comment)[1:-1].encode() + b"\0"
        attrs.append(("NFTA_SET_ELEM_USERDATA", bytes((0, len(text))) + text))
    return {"attrs": attrs}


def _interval_element(el: Element, st: SetType, command: str, *, with_values: bool) -> list[dict[str, Any]]:
    """`LOW-HIGH` (or one value) of an interval set of integers, or an address, prefix or
    address range of an interval set of addresses; keys big-endian: nft stores interval keys in
    network order and byte-swaps a host-order key (numgen) in the rule. A range that runs to
    the key's last value has no end element, as nft sends it."""
    if len(st.key) != 1 or st.key[0].type not in (TYPE_INTEGER, TYPE_MARK, TYPE_IPV4, TYPE_IPV6):
        raise Unsupported(f"interval set {st.name} of concatenated or other keys: {command}")
    size = st.key[0].size
    low, high = interval_bounds(el.key, st.key[0], command)
    if not 0 <= low <= high < 1 << (8 * size):
        raise Unsupported(f"interval {el.key!r} outside what {size} bytes hold: {command}")
    start = _start_element(low.to_bytes(size, "big"), el, st, command, with_values)
    if high + 1 == 1 << (8 * size):
        return [start]
    end = {"attrs": [_INTERVAL_END, ("NFTA_SET_ELEM_KEY", _data((high + 1).to_bytes(size, "big")), NLA_F_NESTED)]}
    return [start, end]


def unencodable(tx: Transaction) -> str | None:
    """Why `tx` cannot go as a netlink batch, known from its objects alone; None if it can.

    The vocabulary is what partial syncs say: plain chains added, flushed and deleted, rules
    added, elements added and deleted, sets and maps deleted (the stale ones a partial sync
    left), the transaction's table deleted (the off table, with its last port). Tables
    declared, set and map declarations, base chains and chain comments are said by the bulk
    compiler (kernel/nft_bulk.py, kernel/nfnetlink/declarations.py). Judged from the
    queue (an element batch is one entry), so a full sync (a table declaration first, 250 000
    operations) is turned away at once.
    """
    if tx.family not in _FAMILIES:
        return f"family {tx.family!r}"
    for verb, obj in tx.ops:
        kind = type(obj)
        if kind in (Set, Map) and verb is Verb.DELETE:
            continue
        if kind is Table and verb is Verb.DELETE and obj.name == tx.table:  # type: ignore[union-attr]
            continue  # the off table going with its last port
        if kind in (Table, Set, Map, Counter):
            return f"{verb.value} {kind.__name__.lower()} {getattr(obj, 'name', '')}: declarations go to the bulk compiler"
        if kind is Chain and (obj.hook is not None or obj.comment):  # type: ignore[union-attr]
            return f"{verb.value} chain {obj.name}: base chains and chain comments go to the bulk compiler"  # type: ignore[union-attr]
        if verb is Verb.CREATE:
            return f"create {kind.__name__.lower()}: not in the netlink vocabulary"
    if len(tx) > MAX_MESSAGES:
        return f"{len(tx)} operations: large transactions go to the bulk compiler"
    return None


def compile_transaction(tx: Transaction, set_type: Callable[[str], SetType], first_set_id: int = 1) -> list[Message]:
    """A Transaction -> the messages of one batch (without BEGIN/END). Pure except `set_type`.

    Verbs and fields are encoded directly; only rule bodies are compiled from nft syntax.
    Raises Unsupported (see `unencodable`, and rule bodies outside the vocabulary) before any
    message is built.
    """
    why = unencodable(tx)
    if why is not None:
        raise Unsupported(why)
    family, table = tx.family, tx.table
    out: list[Message] = []
    set_ids = iter(range(first_set_id, 1 << 30))
    where = f"{family} {table}"
    for verb, obj in tx.operations():
        command = nft_text.command(verb, obj, where)
        kind = type(obj)
        if kind is Chain:
            if verb is Verb.ADD:
                out.append(Message(nft_chain_msg, NFT_MSG_NEWCHAIN, NLM_F_CREATE,
                                   (("NFTA_CHAIN_TABLE", table), ("NFTA_CHAIN_NAME", obj.name)), command))
            elif verb is Verb.FLUSH:
                out.append(Message(nft_rule_msg, NFT_MSG_DELRULE, 0,
                                   (("NFTA_RULE_TABLE", table), ("NFTA_RULE_CHAIN", obj.name)), command))
            else:
                out.append(Message(nft_chain_msg, NFT_MSG_DELCHAIN, 0,
                                   (("NFTA_CHAIN_TABLE", table), ("NFTA_CHAIN_NAME", obj.name)), command))
        elif kind is Rule:
            out.extend(rule_messages(obj, family, table, set_type, command, set_ids))
        elif kind is Table:  # a delete of the transaction's own table: unencodable() lets no other through
            out.append(Message(nft_table_msg, NFT_MSG_DELTABLE, 0, (("NFTA_TABLE_NAME", obj.name),), command))
        elif kind in (Set, Map):  # a delete: unencodable() lets no other verb through
            out.append(Message(nft_set_msg, NFT_MSG_DELSET, 0,
                               (("NFTA_SET_TABLE", table), ("NFTA_SET_NAME", obj.name)), command))
        else:
            _queue_element(out, verb, obj, table, set_type(obj.set), command)
    if len(out) > MAX_MESSAGES:
        raise Unsupported(f"{len(out)} messages: large transactions go to libnftables")
    return out


def _queue_element(out: list[Message], verb: Verb, el: Element, table: str, st: SetType, command: str) -> None:
    """Consecutive elements of one set and verb share a message (up to 256 elements)."""
    adding = verb is Verb.ADD
    items = _element(el, st, command, with_values=adding)
    msg_type = NFT_MSG_NEWSETELEM if adding else NFT_MSG_DELSETELEM
    prev = out[-1] if out else None
    if prev is not None and prev.msg_type == msg_type and prev.attrs[1] == ("NFTA_SET_ELEM_LIST_SET", el.set):
        held = prev.attrs[2][1]
        if len(held) < _ELEMENTS_PER_MESSAGE:
            out[-1] = dataclasses.replace(
                prev,
                attrs=(*prev.attrs[:2], ("NFTA_SET_ELEM_LIST_ELEMENTS", [*held, *items], NLA_F_NESTED)),
                command=f"{prev.command}\n{command}",
            )
            return
    out.append(Message(
        _ElemListMsg,
        msg_type,
        NLM_F_CREATE if adding else 0,
        (
            ("NFTA_SET_ELEM_LIST_TABLE", table),
            ("NFTA_SET_ELEM_LIST_SET", el.set),
            ("NFTA_SET_ELEM_LIST_ELEMENTS", items, NLA_F_NESTED),
        ),
        command,
    ))

"""Every nft transaction, full or partial, as one nfnetlink batch, without libnftables.

libnftables holds a whole transaction in memory several times over before it sends a byte: the
script, its parse tree, its evaluated commands, its cache of the table, the batch. For a full
sync at 10 000 services x 10 that is ~600 MiB on top of the daemon (docs/benchmarks.md), and
the IPv6 table's few lines cost another 160 MiB and 0.4 s because libnftables first fetches
the IPv4 table's 200 000 elements into its cache. This module sends the same transaction as
one nfnetlink batch built straight from the objects: declarations as libnftables writes them
(kernel/nfnetlink/declarations.py), rules through the rule compiler, elements from their
fields, each message encoded to bytes at once (kernel/nft_wire.py), so the batch is the only
copy.

One batch, so one transaction: the kernel commits all of it or none. A transaction this module
cannot say raises `Unsupported` before anything is sent, and the caller uses libnftables.
"""

from __future__ import annotations

import dataclasses
import functools
import socket
import struct
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from nfproxy.core import forked
from nfproxy.kernel import nft_wire
from nfproxy.kernel.nft_rule_templates import RuleTemplates
from nfproxy.kernel.nfnetlink.declarations import declared
from nfproxy.kernel.nfnetlink.framing import attr, frame, strz
from nfproxy.kernel.nfnetlink.values import (
    TYPE_INTEGER,
    TYPE_IPV4,
    TYPE_IPV6,
    TYPE_MARK,
    Field,
    SetType,
    Unsupported,
    encode_value,
    interval_bounds,
    verdict_of,
)
from nfproxy.kernel.nfnetlink import sender
from nfproxy.kernel.nfnetlink.messages import rule_messages
from nfproxy.kernel.process import KernelError
from nfproxy.nftables import Chain, Counter, Element, Map, Rule, Set, Table, Transaction, Verb
from nfproxy.nftables import expr as x
from nfproxy.nftables import text as nft_text
from nfproxy.nftables.objects import Elements, quote_comment

_NFPROTO = {"ip": 2, "ip6": 10}

# Message types and attribute numbers: include/uapi/linux/netfilter/nf_tables.h.
_DELTABLE, _NEWCHAIN, _DELCHAIN, _NEWRULE, _DELRULE = 2, 3, 5, 6, 8
_DELSET, _NEWSETELEM, _DELSETELEM, _DELOBJ = 11, 12, 14, 20
_CHAIN_NAME, _RULE_CHAIN, _SET_NAME = 3, 2, 2
_OBJ_NAME, _OBJ_TYPE, _OBJ_COUNTER = 2, 3, 1
_LIST_SET, _LIST_ELEMENTS = 2, 3  # after NFTA_SET_ELEM_LIST_TABLE, 1
_NLA_F_NESTED = 0x8000
_NLM_F_CREATE, _NLM_F_APPEND = 0x400, 0x800
_ATTR = struct.Struct("=HH")
_ELEMENTS_PER_MESSAGE = 256  # one attribute nest holds at most 64 KiB
_SEQ = struct.Struct("=I")
# From this many elements a forked helper encodes them while the rules are compiled here
# (core/forked.py): 200 000 at 10 000 x 10 take ~0.5 s; a fork of the daemon ~10 ms.
_ELEMENTS_BESIDE = 20000


# --------------------------------------------------------------------------------------------
# The batch.


@dataclass(slots=True)
class Batch:
    """A transaction's messages, encoded, and what each came from (for an error's command)."""

    data: bytearray
    origins: list[tuple[int, int, int]]  # per message: (index in tx.ops, first element, last element)
    last: int = 0  # where the last message starts in `data`
    # The element types of every set the batch declares, as the kernel will report them: once
    # it is committed, nft_netlink need not ask.
    declared: dict[str, SetType] = field(default_factory=dict)


class _Compiler:
    """Turns one Transaction into one Batch. Messages are numbered from 1 (seq)."""

    def __init__(self, tx: Transaction, set_type: Callable[[str], SetType], first_set_id: int = 1) -> None:
        self.tx = tx
        self.family = _NFPROTO[tx.family]
        self.outer_set_type = set_type
        self.parts: list[bytes] = []
        self.origins: list[tuple[int, int, int]] = []
        self.set_ids = iter(range(first_set_id, 1 << 30))  # sets declared or anonymous: ids apart per transaction of a batch
        self.table_attr = strz(1, tx.table)  # NFTA_{CHAIN,SET,OBJ,RULE,SET_ELEM_LIST}_TABLE are all 1
        self.new_sets: dict[str, SetType] = {}
        self.templates = RuleTemplates(self.rule_body, self.map_kind)
        self._kinds: dict[str, SetType | None] = {}

    def set_type(self, name: str) -> SetType:
        st = self.new_sets.get(name)
        return st if st is not None else self.outer_set_type(name)

    def map_kind(self, name: str) -> SetType | None:
        """What a rule naming a set this batch declares depends on: its type, whatever its name."""
        kind = self._kinds.get(name, False)
        if kind is False:
            st = self.new_sets.get(name)
            kind = self._kinds[name] = None if st is None else dataclasses.replace(st, name="")
        return kind  # type: ignore[return-value]

    def emit(self, msg: bytes, origin: tuple[int, int, int]) -> None:
        self.parts.append(msg)
        self.origins.append(origin)

    def seq(self) -> int:
        return len(self.origins) + 1

    def compile(self) -> Batch:
        tx = self.tx
        many = sum(_count(o) for _, o in tx.ops if type(o) in (Elements, Element)) >= _ELEMENTS_BESIDE  # type: ignore[arg-type]
        jobs = self.element_jobs() if many else []  # typed ahead only for a helper to take them
        helper = forked.beside(lambda: self.encode(jobs)) if jobs else None
        started = time.monotonic()
        pending: list[int] = []  # where the helper's messages go in self.parts
        for i, (verb, obj) in enumerate(tx.ops):
            kind = type(obj)
            if verb is Verb.NOTE:
                continue
            if verb is Verb.CREATE:
                raise Unsupported(f"create {kind.__name__.lower()}: not in the bulk vocabulary")
            if kind is Elements or kind is Element:
                if helper is None:
                    self.elements(i, verb, obj.set, _element_rows(obj), _count(obj), self.set_type(obj.set))  # type: ignore[arg-type, union-attr]
                else:
                    pending.append(len(self.parts))
                    self.emit(b"", (i, 0, 0))
            elif kind is Rule:
                self.rule(i, obj)  # type: ignore[arg-type]
            else:
                self.other(i, verb, obj)
        if helper is not None:
            encoded = helper.result(max(5.0, 4 * (time.monotonic() - started)))
            self.splice(pending, encoded if encoded is not None and len(encoded) == len(jobs) else self.encode(jobs))
        data = bytearray().join(self.parts) if self.parts else bytearray()
        if helper is not None:
            _renumber(data)
        batch = Batch(data, self.origins, len(data) - len(self.parts[-1]) if self.parts else 0, dict(self.new_sets))
        self.parts = []
        return batch

    def element_jobs(self) -> list[tuple[int, Verb, Elements | Element, SetType]]:
        """Every element operation with the set type it is encoded with, known before the
        loop (a set declared earlier in the transaction, else the kernel's), so that a forked
        helper can encode them all; [] when a type is not known yet (the loop then says why)."""
        new_sets: dict[str, SetType] = {}
        jobs: list[tuple[int, Verb, Elements | Element, SetType]] = []
        try:
            for i, (verb, obj) in enumerate(self.tx.ops):
                kind = type(obj)
                if verb is Verb.ADD and (kind is Set or kind is Map):
                    new_sets[obj.name] = declared(obj).set_type  # type: ignore[arg-type, assignment, union-attr]
                elif kind is Elements or kind is Element:
                    name = obj.set  # type: ignore[union-attr]
                    jobs.append((i, verb, obj, new_sets.get(name) or self.outer_set_type(name)))  # type: ignore[arg-type]
        except (KeyError, Unsupported, KernelError):
            return []
        return jobs

    def encode(self, jobs: list[tuple[int, Verb, Elements | Element, SetType]]) -> list[tuple[list[bytes], list[tuple[int, int, int]]]]:
        """The messages and origins of each element operation in `jobs` (in a forked helper, or
        here when it failed)."""
        out = []
        for i, verb, obj, st in jobs:
            self.parts, self.origins, kept = [], [], (self.parts, self.origins)
            try:
                self.elements(i, verb, obj.set, _element_rows(obj), _count(obj), st)
                out.append((self.parts, self.origins))
            finally:
                self.parts, self.origins = kept
        return out

    def splice(self, pending: list[int], encoded: list[tuple[list[bytes], list[tuple[int, int, int]]]]) -> None:
        parts: list[bytes] = []
        origins: list[tuple[int, int, int]] = []
        last = 0
        for at, (msgs, where) in zip(pending, encoded):
            parts += self.parts[last:at]
            origins += self.origins[last:at]
            parts += msgs
            origins += where
            last = at + 1
        self.parts = parts + self.parts[last:]
        self.origins = origins + self.origins[last:]

    def other(self, i: int, verb: Verb, obj: object) -> None:
        kind, t, origin = type(obj), self.table_attr, (i, 0, 0)
        if kind is Table and verb is Verb.DELETE:
            self.emit(frame(_DELTABLE, 0, self.family, self.seq(), t), origin)
        elif verb is Verb.ADD and _declared_whole(obj):
            made = declared(obj, next(self.set_ids) if kind is Set or kind is Map else 0)  # type: ignore[arg-type]
            if made.set_type is not None:
                self.new_sets[obj.name] = made.set_type  # type: ignore[union-attr]
            self.emit(frame(made.msg_type, _NLM_F_CREATE, self.family, self.seq(), t + made.attrs), origin)
        elif kind is Chain:
            name = strz(_CHAIN_NAME, obj.name)  # type: ignore[union-attr]
            if verb is Verb.ADD:
                self.emit(frame(_NEWCHAIN, _NLM_F_CREATE, self.family, self.seq(), t + name), origin)
            elif verb is Verb.FLUSH:
                self.emit(frame(_DELRULE, 0, self.family, self.seq(), t + strz(_RULE_CHAIN, obj.name)), origin)  # type: ignore[union-attr]
            else:
                self.emit(frame(_DELCHAIN, 0, self.family, self.seq(), t + name), origin)
        elif kind in (Set, Map):
            name = strz(_SET_NAME, obj.name)  # type: ignore[union-attr]
            if verb is Verb.FLUSH:  # every element: DELSETELEM without a list
                self.emit(frame(_DELSETELEM, 0, self.family, self.seq(), t + strz(_LIST_SET, obj.name)), origin)  # type: ignore[union-attr]
            else:
                self.emit(frame(_DELSET, 0, self.family, self.seq(), t + name), origin)
        elif kind is Counter and verb is Verb.DELETE:
            payload = t + strz(_OBJ_NAME, obj.name) + attr(_OBJ_TYPE, struct.pack(">I", _OBJ_COUNTER))  # type: ignore[union-attr]
            self.emit(frame(_DELOBJ, 0, self.family, self.seq(), payload), origin)
        else:
            raise Unsupported(f"{verb.value} {kind.__name__.lower()}: not in the bulk vocabulary")

    def rule(self, i: int, rule: Rule) -> None:
        body = self.templates.body(rule.body)
        if body is not None:
            payload = self.table_attr + strz(_RULE_CHAIN, rule.chain) + body
            self.emit(frame(_NEWRULE, _NLM_F_CREATE | _NLM_F_APPEND, self.family, self.seq(), payload), (i, 0, 0))
            return
        command = f"add rule {self.tx.family} {self.tx.table} {rule.chain} {_text(rule.body)}"
        for message in rule_messages(rule, self.tx.family, self.tx.table, self.set_type, command, self.set_ids):
            self.emit(nft_wire.encode_message(message, self.family, self.seq(), ack=False), (i, 0, 0))

    def rule_body(self, body: str | tuple[x.Statement, ...], aliases: Mapping[str, str] | None = None) -> bytes:
        """A rule of one message, its attributes after table and chain (for RuleTemplates; an
        alias names a map by another name)."""
        command = f"add rule {self.tx.family} {self.tx.table} - {_text(body)}"
        set_type = self.set_type
        if aliases:
            def set_type(name: str) -> SetType:
                alias = aliases.get(name)
                return self.set_type(name) if alias is None else dataclasses.replace(self.set_type(alias), name=name)
        messages = rule_messages(Rule("-", body), self.tx.family, self.tx.table, set_type, command, iter(range(1, 2)))
        if len(messages) != 1:
            raise Unsupported("a rule of more than one message")
        encoded = nft_wire.encode_message(messages[0], self.family, 0, ack=False)
        return encoded[20 + len(self.table_attr) + len(strz(_RULE_CHAIN, "-")) :]

    def elements(self, i: int, verb: Verb, name: str, els: Iterator[Row], count: int, st: SetType) -> None:
        """Up to 256 elements per message, as libnftables groups them (and under the 64 KiB
        an attribute nest holds)."""
        if verb not in (Verb.ADD, Verb.DELETE):
            raise Unsupported(f"{verb.value} element: not in the bulk vocabulary")
        adding = verb is Verb.ADD
        write = element_writer(st, adding)
        msg_type, flags = (_NEWSETELEM, _NLM_F_CREATE) if adding else (_DELSETELEM, 0)
        head = self.table_attr + strz(_LIST_SET, name)
        pack_head = _ATTR.pack
        done = 0
        while done < count:
            items: list[bytes] = []
            size, first = 0, done
            for el in els:
                try:
                    parts = write(el)
                except Unsupported as exc:
                    where = f"{self.tx.family} {self.tx.table}"
                    raise Unsupported(f"{exc}: {nft_text.command(verb, Element(name, *el), where)}") from None
                for part in parts:  # list entries numbered 1, 2, 3 ... as libnftnl numbers them
                    n = len(part)  # a multiple of 4 (every attribute in it is padded), or made one
                    if n & 3:
                        part += b"\0" * (4 - (n & 3))
                        n = len(part)
                    items.append(pack_head(n + 4, (len(items) + 1) | _NLA_F_NESTED) + part)
                    size += n + 4
                done += 1
                if done - first == _ELEMENTS_PER_MESSAGE or size > _NEST_BUDGET:
                    break
            payload = head + attr(_LIST_ELEMENTS | _NLA_F_NESTED, b"".join(items))
            self.emit(frame(msg_type, flags, self.family, self.seq(), payload), (i, first, done))


_NEST_BUDGET = 60000  # bytes of elements per message: a nest's length is 16 bits
_ELEM_KEY, _ELEM_DATA, _ELEM_FLAGS, _ELEM_USERDATA = 1, 2, 3, 6
_DATA_VALUE, _DATA_VERDICT, _VERDICT_CODE, _VERDICT_CHAIN = 1, 2, 1, 2
_INTERVAL_END = attr(_ELEM_FLAGS, struct.pack(">I", 1))


Row = tuple[str, str, str]  # an element's key, value and comment, as Elements holds them


def element_writer(st: SetType, adding: bool) -> Callable[[Row], tuple[bytes, ...]]:
    """One element of set `st` -> the bodies of its entries in an element list (an interval's
    start and end are two), the bytes pyroute2 makes of nft_netlink's `_element`
    (tests/test_nft_bulk.py holds them equal), made directly: a full sync writes 200 000, so
    each set's field encoders and attribute headers are made once."""
    keys = _interval_keys(st) if st.interval else _plain_keys(st)
    value = _value_writer(st) if adding else None

    def write(row: Row) -> tuple[bytes, ...]:
        try:
            start, end = keys(row[0])
            if value is not None:
                start += value(row[1])
                if row[2]:
                    start += _comment(row[2])
        except (ValueError, KeyError, OverflowError, OSError) as exc:
            raise Unsupported(f"element of set {st.name}: {exc}") from None
        return (start,) if end is None else (start, end)

    return write


def _plain_keys(st: SetType) -> Callable[[str], tuple[bytes, None]]:
    encode = _concat_writer(st.key, st.name)
    size = sum(-(-f.size // 4) * 4 for f in st.key) if len(st.key) > 1 else st.key[0].size
    head = _nested_head(_ELEM_KEY, _DATA_VALUE, size)
    pad = b"\0" * (-size % 4)

    def keys(text: str) -> tuple[bytes, None]:
        return head + encode(text) + pad, None

    return keys


def _interval_keys(st: SetType) -> Callable[[str], tuple[bytes, bytes | None]]:
    if len(st.key) != 1 or st.key[0].type not in (TYPE_INTEGER, TYPE_MARK, TYPE_IPV4, TYPE_IPV6):
        raise Unsupported(f"interval set {st.name} of concatenated or other keys")
    field = st.key[0]
    size, top = field.size, 1 << (8 * field.size)
    head = _nested_head(_ELEM_KEY, _DATA_VALUE, size)
    pad = b"\0" * (-size % 4)

    integer = field.type in (TYPE_INTEGER, TYPE_MARK)

    def keys(text: str) -> tuple[bytes, bytes | None]:
        if integer:  # the slot ranges of the endpoint maps, 100 000 at 10 000 x 10
            low_text, _, high_text = text.partition("-")
            low, high = int(low_text, 10), int(high_text or low_text, 10)
        else:
            low, high = interval_bounds(text, field, "")
        if not 0 <= low <= high < top:
            raise ValueError(f"interval {text!r} outside what {size} bytes hold")
        start = head + low.to_bytes(size, "big") + pad
        return start, None if high + 1 == top else _INTERVAL_END + head + (high + 1).to_bytes(size, "big") + pad

    return keys


def _value_writer(st: SetType) -> Callable[[str], bytes]:
    if st.data is None:
        def none(text: str) -> bytes:
            if text:
                raise ValueError(f"a value {text!r} in a set without values")
            return b""
        return none
    if st.verdict:
        def verdict(text: str) -> bytes:
            code, chain = verdict_of(text.split(" "), "")
            body = attr(_VERDICT_CODE, struct.pack(">i", code)) + (strz(_VERDICT_CHAIN, chain) if chain is not None else b"")
            return attr(_ELEM_DATA, attr(_DATA_VERDICT, body))
        return _required(verdict)
    encode = _concat_writer(st.data, st.name)
    size = sum(-(-f.size // 4) * 4 for f in st.data) if len(st.data) > 1 else st.data[0].size
    head, pad = _nested_head(_ELEM_DATA, _DATA_VALUE, size), b"\0" * (-size % 4)
    return _required(lambda text: head + encode(text) + pad)


def _required(write: Callable[[str], bytes]) -> Callable[[str], bytes]:
    def value(text: str) -> bytes:
        if not text:
            raise ValueError("an element without the value its map needs")
        return write(text)
    return value


def _nested_head(outer: int, inner: int, size: int) -> bytes:
    """The two attribute headers of `outer { inner: <size bytes> }`."""
    padded = size + (-size % 4)
    return _ATTR.pack(8 + padded, outer) + _ATTR.pack(4 + size, inner)


def _concat_writer(fields: tuple[Field, ...], name: str) -> Callable[[str], bytes]:
    """` . `-joined values -> their bytes, each field padded to 4 when concatenated (as
    nfnetlink.values.encode_concat); repeated values (protocols, ports) are encoded once."""
    writers = [_field_writer(f, padded=len(fields) > 1, name=name) for f in fields]
    if len(writers) == 1:
        return writers[0]
    count = len(writers)
    if count == 2:  # address . port, the endpoint maps' values
        first, second = writers

        def pair(text: str) -> bytes:
            a, b = text.split(" . ")  # ValueError for another count, as below
            return first(a) + second(b)

        return pair

    def concat(text: str) -> bytes:
        parts = text.split(" . ")
        if len(parts) != count:
            raise ValueError(f"{len(parts)} fields where the set has {count}")
        return b"".join([w(x) for w, x in zip(writers, parts)])

    return concat


def _field_writer(f: Field, *, padded: bool, name: str) -> Callable[[str], bytes]:
    if f.type == TYPE_IPV4:
        return functools.partial(socket.inet_pton, socket.AF_INET)
    if f.type == TYPE_IPV6:
        def v6(text: str) -> bytes:
            if "%" in text:
                raise ValueError(f"{text!r}: a scope")
            return socket.inet_pton(socket.AF_INET6, text)
        return v6
    known: dict[str, bytes] = {}

    def other(text: str) -> bytes:
        got = known.get(text)
        if got is None:
            got = encode_value(text, f, f"set {name}")
            if padded:
                got += b"\0" * (-len(got) % 4)
            if len(known) < 1 << 16:
                known[text] = got
        return got

    return other


def _comment(text: str) -> bytes:
    text_bytes = quote_comment(text)[1:-1].encode() + b"\0"  # cut as the text writer cuts it
    return attr(_ELEM_USERDATA, bytes((0, len(text_bytes))) + text_bytes)  # NFTNL_UDATA_SET_ELEM_COMMENT


def _element_rows(obj: Elements | Element) -> Iterator[Row]:
    if type(obj) is Element:
        return iter(((obj.key, obj.value, obj.comment),))
    n = len(obj.keys)  # type: ignore[union-attr]
    return zip(obj.keys, obj.values or ("",) * n, obj.comments or ("",) * n)  # type: ignore[union-attr]


def _text(body: str | Iterable[x.Statement]) -> str:
    """A body as nft text, for an error's command."""
    return body if isinstance(body, str) else x.text(body)


def _count(obj: Elements | Element) -> int:
    return 1 if type(obj) is Element else len(obj)  # type: ignore[arg-type]


def _declared_whole(obj: object) -> bool:
    """Declarations with more to say than a name (kernel/nfnetlink/declarations.py); a plain
    chain, 20 000 of them at 10 000 x 10, is said directly."""
    kind = type(obj)
    return kind in (Table, Set, Map, Counter) or (kind is Chain and (obj.hook is not None or obj.comment is not None))  # type: ignore[union-attr]


def compile_batch(tx: Transaction, set_type: Callable[[str], SetType], first_set_id: int = 1) -> Batch:
    """The whole of `tx` as one batch's messages (BEGIN and END not included)."""
    if tx.family not in _NFPROTO:
        raise Unsupported(f"family {tx.family!r}")
    compiler = _Compiler(tx, set_type, first_set_id)
    try:
        return compiler.compile()
    finally:
        # The templates hold the compiler's bound method: a cycle that kept the compiler, and
        # through it the whole transaction (~35 MiB at 10 000 x 10), until a cyclic collection,
        # which an idle daemon may never run (the proxier frees a sync by refcounts alone).
        del compiler.templates


# --------------------------------------------------------------------------------------------
# Sending it.


def send(batch: Batch, tx: Transaction, netns: str | None, sock: socket.socket | None = None) -> None:
    """Send the batch (kernel/nfnetlink/sender.py); a refusal names the command of `tx` its
    message came from. `sock`: the caller's raw socket (NetlinkNft.raw_socket), left open."""
    send_joined([(batch, tx)], netns, sock)


def send_joined(batches: list[tuple[Batch, Transaction]], netns: str | None, sock: socket.socket | None = None) -> None:
    """Several transactions' batches (of one family: nfproxy's table and the off table) as one
    kernel batch, one commit; messages renumbered in order."""
    batches = [(b, tx) for b, tx in batches if b.origins]
    if not batches:
        return
    if len(batches) == 1:
        (batch, tx), = batches
        owners = [(tx, origin) for origin in batch.origins]
        data, last = batch.data, batch.last
    else:
        data, owners, last = bytearray(), [], 0
        for batch, tx in batches:
            last = len(data) + batch.last
            data += batch.data
            owners += [(tx, origin) for origin in batch.origins]
        _renumber(data)
    sender.send(data, last, len(owners), lambda seq: _command(*owners[seq - 1]), netns, sock)


def _renumber(data: bytearray) -> None:
    """Number the messages of `data` 1, 2, 3 ... by walking their headers: an error names a
    message by its place in the batch (after a helper's messages were spliced in, or batches
    of several transactions were joined)."""
    at, seq = 0, 1
    while at < len(data):
        (length,) = struct.unpack_from("=I", data, at)
        _SEQ.pack_into(data, at + 8, seq)
        at += (length + 3) & ~3
        seq += 1


def _command(tx: Transaction, origin: tuple[int, int, int]) -> str:
    """The command a refused message came from (an element message: its first element)."""
    i, first, _ = origin
    verb, obj = tx.ops[i]
    where = f"{tx.family} {tx.table}"
    if type(obj) is Elements:
        obj = next(e for n, e in enumerate(obj.each()) if n == first)
    return nft_text.command(verb, obj, where)  # type: ignore[arg-type]

"""The rule compiler's messages (kernel/nfnetlink/messages.py) as netlink bytes, without pyroute2's generic encoder.

pyroute2 encodes a message by building an object per attribute and introspecting its class at
every level: ~400 µs per message. A full sync is a quarter million operations (rules, chains,
elements), so encoding alone would take well over a minute. This module writes the same bytes
with precompiled per-attribute encoders, struct and bytes joins: 5 to 15 µs for a rule (by its
number of expressions), about 2 µs for an element of an element list.

The truth is still pyroute2's: attribute numbers, nesting, array cell numbering and every value's
wire format are read from the very classes the rule compiler hands to pyroute2 (`Message.msg_class`
and the classes its `nla_map` names, recursively), compiled lazily once per class the way
pyroute2's `compile_nla_table` compiles them. Nothing is typed here by hand but the small set of
value formats pyroute2 has (integers, strings, binary, flag sets, libnftnl user data, the be16
comment); tests/test_nft_wire.py proves byte equality with pyroute2 over every message the
compiler makes from rendered rulesets, and over hand-made messages of every class.

pyroute2's quirks are kept, because the bytes must be its bytes:
- a `(NAME, value, flags)` triple ORs its flags into the type only at the message's top level;
  below it pyroute2 rebuilds attributes as pairs, so the NLA_F_NESTED the rule compiler puts on nested
  attributes never reaches the wire (the kernel does not require it);
- array cells are numbered 1, 2, 3 ... with the array's flags, unless the cell class has a fixed
  `header_type` (an expression: 1 | NLA_F_NESTED in the rule compiler's `_Expr`);
- NFTA_EXPR_DATA takes its class from the sibling NFTA_EXPR_NAME (`nft_<name>`);
- the `comment` user data of rules, chains and tables is a big-endian u16 length, the text and a
  NUL (the same bytes as libnftnl's one-byte type 0, one-byte length below 256).

Where pyroute2 would write something that is not what was asked (an unknown attribute name it
silently drops, None it writes as an empty attribute, a flag name it ignores, non-ASCII text it
truncates) or would fail, this raises `Unsupported` instead: never wrong bytes.
"""

from __future__ import annotations

import struct
import threading
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pyroute2.netlink import (
    NLA_F_FLAGS,
    NLA_F_NESTED,
    NLM_F_ACK,
    NLM_F_REQUEST,
    nla_base_string,
    nla_header,
    nlmsg_atoms,
    nlmsg_base,
    nlmsg_encoder_generic,
)
from pyroute2.netlink.nfnetlink import NFNL_SUBSYS_NFTABLES
from pyroute2.netlink.nfnetlink.nftsocket import CData, nft_contains_expr, nft_flags_be32, nftnl_udata

from nfproxy.kernel.nfnetlink.sender import batch_frame
from nfproxy.kernel.nfnetlink.values import NFNL_MSG_BATCH_BEGIN, NFNL_MSG_BATCH_END, Message, Unsupported

Encoder = Callable[[Any], bytes]  # an attribute's value -> the whole attribute, padded

_NLMSGHDR = struct.Struct("=IHHII").pack  # length, type, flags, seq, pid (host order)
_NFGENMSG = struct.Struct("=BB").pack  # family, version (res_id follows, big-endian)
_NLA = struct.Struct("=HH").pack  # length, type
_BE16 = struct.Struct(">H").pack
_PAD = (b"", b"\0\0\0", b"\0\0", b"\0")  # indexed by length & 3
_NLA_HEADER = nla_header.header
_EXPR_BY_NAME = nft_contains_expr.nft_expr.expr  # pyroute2's NFTA_EXPR_DATA class chooser
_KEY_OF_CHOOSER = "NFTA_EXPR_NAME"  # the sibling it chooses by
# Class attributes pyroute2 assigns while it encodes (nft_dynset.rule_expr is whichever
# expression class it met first): their encoding depends on history, so they are refused.
_STATEFUL = frozenset({"rule_expr"})
_STRUCT_INTS = frozenset("bBhHiIlLqQ")
_CACHED = 1024  # whole attributes remembered per encoder, by int or str value


# --------------------------------------------------------------------------------------------
# One class's attributes, compiled as pyroute2's compile_nla_table compiles them.


@dataclass(frozen=True, slots=True)
class _Spec:
    """One nla_map entry: type number, class (or pyroute2's chooser function), flags, array."""

    type: int
    cls: Any
    flags: int
    array: bool


@dataclass(slots=True)
class _Table:
    """A class's attributes by name: encoders, choosers (NFTA_EXPR_DATA) and flagged variants."""

    cls: type
    specs: dict[str, _Spec]
    encoders: dict[str, Encoder] = field(default_factory=dict)
    choosers: dict[str, Callable[[Sequence[Any]], Encoder]] = field(default_factory=dict)
    flagged: dict[tuple[str, Any], Encoder] = field(default_factory=dict)


# A table is built (with the tables of the classes it reaches) under the lock and published when
# the outermost build is done: a published table's encoders are complete and never change.
_TABLES: dict[type, _Table] = {}
_BUILDING: dict[type, _Table] = {}
_LOCK = threading.RLock()


def _nla_map(cls: type) -> list[tuple[int, str, str, int]]:
    """(type, name, format, flags) for each entry, numbered as pyroute2 numbers them."""
    nla_map = cls.nla_map
    if not isinstance(nla_map, (tuple, list)) or not nla_map:
        raise Unsupported(f"{cls.__qualname__}: an nla_map adapter is outside the wire encoder")
    items = [list(i) if isinstance(i[-1], int) else [*i, 0] for i in nla_map]
    if isinstance(items[0][0], int):
        return [(int(k), n, f, fl) for k, n, f, fl in items]
    return [(k, n, f, fl) for k, (n, f, fl) in enumerate(items)]


def _spec(cls: type, fmt: str, key: int, flags: int) -> _Spec:
    array = fmt.startswith("*")
    name = fmt[1:] if array else fmt
    lb, rb = name.find("("), name.find(")")
    if 0 < lb < rb:
        name = name[:lb]  # an init argument: only array(...) and target(...) take one
    parts = [x.strip() for x in name.split("|")]
    if len(parts) == 2:
        flags |= NLA_F_FLAGS[parts.pop(1)]
    name = parts[0]
    if name == "recursive":
        return _Spec(key, cls, flags, array)
    if name == "nested":
        return _Spec(key, cls, flags | NLA_F_NESTED, array)
    if name in _STATEFUL:
        return _Spec(key, None, flags, array)
    if not hasattr(cls, name):  # pyroute2 cannot compile the class at all
        raise Unsupported(f"{cls.__qualname__}: its nla_map names a class {name!r} it does not have")
    return _Spec(key, getattr(cls, name), flags, array)


def _table(cls: type) -> _Table:
    table = _TABLES.get(cls)
    if table is not None:
        return table
    with _LOCK:
        table = _TABLES.get(cls) or _BUILDING.get(cls)
        if table is not None:
            return table
        outermost = not _BUILDING
        try:
            return _build(cls)
        finally:
            if outermost:
                _TABLES.update(_BUILDING)
                _BUILDING.clear()


def _build(cls: type) -> _Table:
    specs: dict[str, _Spec] = {}
    for key, name, fmt, flags in _nla_map(cls):
        specs[name] = _spec(cls, fmt, key, flags)
    table = _BUILDING[cls] = _Table(cls, specs)
    for name, spec in specs.items():  # after registering: classes may nest themselves
        if isinstance(spec.cls, types.FunctionType):
            table.choosers[name] = _chooser(cls, name, spec)
        else:
            table.encoders[name] = _encoder(cls, name, spec, 0)
    return table


def _attr_flags(spec: _Spec, cls: type, extra: int) -> int:
    """pyroute2's `_nla_flags` of an attribute: the class's, the map's and the caller's."""
    return cls.nla_flags | spec.flags | extra


def _encoder(owner: type, name: str, spec: _Spec, extra: int) -> Encoder:
    """The encoder of attribute `name` of `owner`, with `extra` flags from a top-level triple."""
    cls = spec.cls
    where = f"{owner.__qualname__}.{name}"
    if not isinstance(cls, type) or not issubclass(cls, nlmsg_base):
        return _refuse(f"{where}: pyroute2 resolves its class to {cls!r}")
    try:
        flags = _attr_flags(spec, cls, extra)
        if spec.array:
            return _array(where, spec.type | flags, cls, flags)
        return _kind(cls, where)(spec.type | flags)
    except Unsupported as exc:
        return _refuse(str(exc))
    except (AttributeError, TypeError, ValueError, struct.error) as exc:  # a class unlike pyroute2's own
        return _refuse(f"{where}: {cls.__qualname__}: {exc}")


def _refuse(why: str) -> Encoder:
    def refuse(value: Any) -> bytes:
        raise Unsupported(why)

    return refuse


def _chooser(owner: type, name: str, spec: _Spec) -> Callable[[Sequence[Any]], Encoder]:
    """NFTA_EXPR_DATA: the class `nft_<NFTA_EXPR_NAME>` of the expression container."""
    if spec.cls is not _EXPR_BY_NAME:
        return lambda attrs: _refuse(f"{owner.__qualname__}.{name}: unknown class chooser {spec.cls!r}")
    by_expr: dict[str, Encoder] = {}

    def choose(attrs: Sequence[Any]) -> Encoder:
        first = attrs[0]
        if first[0] == _KEY_OF_CHOOSER:  # where the rule compiler puts it
            expr = first[1]
        else:
            expr = next((a[1] for a in attrs if a[0] == _KEY_OF_CHOOSER), None)
        enc = by_expr.get(expr) if type(expr) is str else None
        if enc is None:
            cls = getattr(owner, f"nft_{expr}", None) if isinstance(expr, str) else None
            if not isinstance(cls, type):
                return _refuse(f"{owner.__qualname__}.{name}: no expression class for NFTA_EXPR_NAME {expr!r}")
            enc = by_expr[expr] = _encoder(owner, name, _Spec(spec.type, cls, spec.flags, spec.array), 0)
        return enc

    return choose


# --------------------------------------------------------------------------------------------
# Value formats: each kind makes an encoder for a given header type.


def _kind(cls: type, where: str) -> Callable[[int], Encoder]:
    """The wire format of pyroute2 class `cls`, recognised by the methods it encodes with."""
    _check_plain(cls, where)
    enc = cls.encode
    if enc is nft_flags_be32.encode:
        return _flag_set(cls, where)
    if enc is nftnl_udata.encode:
        return _udata(cls, where)
    if enc is nlmsg_atoms.string.encode:
        return _string(cls.zstring, utf8=True, where=where)
    if enc is not nlmsg_base.encode:
        raise Unsupported(f"{where}: {cls.__qualname__} has its own encoder")
    fields = list(cls.fields)
    if cls.nla_map:
        if fields:
            raise Unsupported(f"{where}: {cls.__qualname__} has both fields and attributes")
        return lambda htype: _nested(where, htype, _table(cls))
    if not fields:
        return _empty
    if len(fields) != 1 or fields[0][0] != "value":
        raise Unsupported(f"{where}: {cls.__qualname__} fields {fields}")
    fmt = fields[0][1]
    if fmt is CData:
        return lambda htype: _cdata(where, htype)
    if fmt == "s" and issubclass(cls, nla_base_string):
        return _string(getattr(cls, "zstring", 0), utf8=False, where=where)
    if isinstance(fmt, str) and fmt.lstrip("<>!=@")[-1:] in _STRUCT_INTS and len(fmt.lstrip("<>!=@")) == 1:
        return _integer(struct.Struct(fmt), where)
    raise Unsupported(f"{where}: field format {fmt!r} of {cls.__qualname__}")


def _check_plain(cls: type, where: str) -> None:
    """Only the generic machinery: an NLA header, no value maps, no custom field encoding."""
    if (
        not cls.is_nla
        or tuple(cls.header) != _NLA_HEADER
        or cls.align != 4
        or cls.value_map
        or cls.setvalue is not nlmsg_base.setvalue
        or cls.ft_encode is not nlmsg_encoder_generic.ft_encode
    ):
        raise Unsupported(f"{where}: {cls.__qualname__} is encoded outside pyroute2's generic path")


def _empty(htype: int) -> Encoder:
    tlv = _NLA(4, htype)
    return lambda value: tlv  # 'none' and 'flag': pyroute2 writes no payload whatever the value


def _integer(st: struct.Struct, where: str) -> Callable[[int], Encoder]:
    size = st.size
    pad = _PAD[(4 + size) & 3]

    def make(htype: int) -> Encoder:
        head = _NLA(4 + size, htype)
        pack = st.pack
        cache: dict[int, bytes] = {}  # registers, operators, lengths: a few values each

        def encode(value: Any) -> bytes:
            if type(value) is int:
                tlv = cache.get(value)
                if tlv is not None:
                    return tlv
            try:
                tlv = head + pack(value) + pad
            except struct.error:
                raise Unsupported(f"{where}: {value!r} is not a {st.format} integer") from None
            if type(value) is int and len(cache) < _CACHED:
                cache[value] = tlv
            return tlv

        return encode

    return make


def _string(zstring: int, *, utf8: bool, where: str) -> Callable[[int], Encoder]:
    """Bytes as they are; text as UTF-8 (asciiz, string) or, for binary formats, ASCII only:
    pyroute2 sizes a binary format's text by characters and so cuts multi-byte text short."""
    nul = b"\0" * zstring

    def make(htype: int) -> Encoder:
        cache: dict[str, bytes] = {}  # table, expression and hot chain names

        def encode(value: Any) -> bytes:
            kind = type(value)
            if kind is str:
                tlv = cache.get(value)
                if tlv is not None:
                    return tlv
                if not utf8 and not value.isascii():
                    raise Unsupported(f"{where}: non-ASCII text {value!r} for a binary attribute")
                try:
                    data = value.encode()
                except UnicodeError:
                    raise Unsupported(f"{where}: {value!r} is not UTF-8 text") from None
            elif kind is bytes or kind is bytearray:
                data = value
            else:
                raise Unsupported(f"{where}: {value!r} is not text or bytes")
            n = 4 + len(data) + zstring
            tlv = _NLA(n, htype) + data + nul + _PAD[n & 3]
            if kind is str and len(cache) < _CACHED:
                cache[value] = tlv
            return tlv

        return encode

    return make


def _cdata(where: str, htype: int) -> Encoder:
    """pyroute2's `comment`: a big-endian u16 of the UTF-8 text's length + 1, the text, a NUL."""

    def encode(value: Any) -> bytes:
        if type(value) is not str:
            raise Unsupported(f"{where}: a comment must be text, not {value!r}")
        try:
            text = value.encode()
            body = _BE16(len(text) + 1) + text + b"\0"
        except (UnicodeError, struct.error):
            raise Unsupported(f"{where}: comment {value!r}") from None
        n = 4 + len(body)
        return _NLA(n, htype) + body + _PAD[n & 3]

    return encode


def _flag_set(cls: type, where: str) -> Callable[[int], Encoder]:
    """nft_flags_be32: a set of names, bit i for the i-th of the class's `ops`."""
    if tuple(cls.fields) != (("value", ">I"),) or cls.ops is None:
        raise Unsupported(f"{where}: {cls.__qualname__} is not a be32 flag set")
    bits = {name: 1 << i for i, name in enumerate(cls.ops)}
    be32 = struct.Struct(">I").pack

    def make(htype: int) -> Encoder:
        head = _NLA(8, htype)

        def encode(value: Any) -> bytes:
            if type(value) not in (frozenset, set, tuple, list):
                raise Unsupported(f"{where}: {value!r} is not a set of flag names")
            word = 0
            for name in value:
                bit = bits.get(name) if isinstance(name, str) else None
                if bit is None:
                    raise Unsupported(f"{where}: unknown flag {name!r} (known: {sorted(map(str, bits))})")
                word |= bit
            return head + be32(word)

        return encode

    return make


def _udata(cls: type, where: str) -> Callable[[int], Encoder]:
    """nftnl_udata: bytes as they are, or a list of (name, value) as libnftnl TLVs."""
    raw = _string(cls.zstring, utf8=False, where=where)
    kinds = getattr(cls, "udata_types", None)
    if not isinstance(kinds, tuple):
        raise Unsupported(f"{where}: {cls.__qualname__} has no user data types")
    names = {name: i for i, name in reversed(list(enumerate(kinds)))}  # the first index, as .index()

    def tlvs(value: Sequence[Any]) -> bytes:
        out = []
        for item in value:
            if type(item) not in (tuple, list) or len(item) != 2:
                raise Unsupported(f"{where}: user data item {item!r} is not (name, value)")
            name, data = item
            if type(data) is str:
                data = data.encode()
            if name not in names or type(data) is not bytes:
                raise Unsupported(f"{where}: user data item {item!r}")
            if name.endswith("_COMMENT"):
                if not data:
                    raise Unsupported(f"{where}: empty comment")
                if data[-1] != 0:
                    data += b"\0"
            if len(data) > 255:
                raise Unsupported(f"{where}: user data item of {len(data)} bytes")
            out.append(bytes((names[name], len(data))) + data)
        return b"".join(out)

    def make(htype: int) -> Encoder:
        plain = raw(htype)

        def encode(value: Any) -> bytes:
            if type(value) in (list, tuple):
                value = tlvs(value)
            return plain(value)

        return encode

    return make


# --------------------------------------------------------------------------------------------
# Nests and arrays.


def _nested(where: str, htype: int, table: _Table) -> Encoder:
    if table.choosers:
        body = _chosen_body(table, where)

        def encode_chosen(value: Any) -> bytes:
            data = body(value)
            return _NLA(4 + len(data), htype) + data

        return encode_chosen
    encoders = table.encoders

    def encode(value: Any) -> bytes:  # _body, inlined: a rule has a dozen nests
        if type(value) is not dict or len(value) != 1:
            raise _bad_nest(table, value, where)
        try:
            data = b"".join([encoders[a[0]](a[1]) for a in value["attrs"]])
        except (KeyError, IndexError, TypeError):
            raise _bad_nest(table, value, where) from None
        return _NLA(4 + len(data), htype) + data

    return encode


def _body(table: _Table, where: str) -> Encoder:
    """A nest's payload from {'attrs': [(NAME, value), ...]}: its attributes, each padded.
    Below the message level pyroute2 keeps only NAME and value of each attribute."""
    if table.choosers:
        return _chosen_body(table, where)
    encoders = table.encoders

    def body(value: Any) -> bytes:
        if type(value) is not dict or len(value) != 1:
            raise _bad_nest(table, value, where)
        try:
            return b"".join([encoders[a[0]](a[1]) for a in value["attrs"]])
        except (KeyError, IndexError, TypeError):
            raise _bad_nest(table, value, where) from None

    return body


def _chosen_body(table: _Table, where: str) -> Encoder:
    """A nest with an attribute whose class its siblings choose (an expression's data). The
    expression's own shape, [(the chooser's key, name), (the chosen, data)], goes straight."""
    encoders, choosers = table.encoders, table.choosers
    (chosen, choose), *more = choosers.items()
    fast = not more and _KEY_OF_CHOOSER in encoders
    name_encoder = encoders.get(_KEY_OF_CHOOSER)

    def body(value: Any) -> bytes:
        if type(value) is not dict or len(value) != 1:
            raise _bad_nest(table, value, where)
        try:
            attrs = value["attrs"]
            if fast and len(attrs) == 2:
                first, second = attrs
                if first[0] == _KEY_OF_CHOOSER and second[0] == chosen:
                    return name_encoder(first[1]) + choose(attrs)(second[1])  # type: ignore[misc]
            out = []
            for a in attrs:
                enc = encoders.get(a[0])
                if enc is None:
                    enc = choosers[a[0]](attrs)
                out.append(enc(a[1]))
        except (KeyError, IndexError, TypeError, ValueError):
            raise _bad_nest(table, value, where) from None
        return b"".join(out)

    return body


def _bad_nest(table: _Table, value: Any, where: str) -> Unsupported:
    """Why a nest could not be encoded: its shape, or its first unknown attribute."""
    if type(value) is not dict or list(value) != ["attrs"] or type(value["attrs"]) not in (list, tuple):
        return Unsupported(f"{where}: {value!r} is not {{'attrs': [...]}}")
    return _bad_attrs(table, value["attrs"])


def _bad_attrs(table: _Table, attrs: Sequence[Any]) -> Unsupported:
    for a in attrs:
        if type(a) not in (tuple, list) or len(a) < 2:
            return Unsupported(f"{table.cls.__qualname__}: attribute {a!r} is not (NAME, value)")
        if not isinstance(a[0], str) or a[0] not in table.specs:
            return Unsupported(f"{table.cls.__qualname__}: unknown attribute {a[0]!r}")
    return Unsupported(f"{table.cls.__qualname__}: cannot encode {attrs!r}")


def _array(where: str, htype: int, cls: type, flags: int) -> Encoder:
    """'*cls': one cell per value, typed by the class's header_type or numbered 1, 2, 3 ...
    with the array's own flags."""
    if cls.cell_header is not None:
        raise Unsupported(f"{where}: {cls.__qualname__} has a cell header")
    fixed = cls.header_type
    cell = _kind(cls, where)
    if not cls.nla_map:  # cells of a plain value: rare, so an encoder per cell and call
        def encode_values(value: Any) -> bytes:
            if type(value) not in (list, tuple):
                raise Unsupported(f"{where}: {value!r} is not a list")
            data = b"".join([cell(fixed or (i | flags))(v) for i, v in enumerate(value, 1)])
            return _NLA(4 + len(data), htype) + data

        return encode_values
    body = _body(_table(cls), where)

    def encode(value: Any) -> bytes:
        if type(value) not in (list, tuple):
            raise Unsupported(f"{where}: {value!r} is not a list")
        out = []
        i = 1
        for v in value:
            data = body(v)
            out.append(_NLA(4 + len(data), fixed or (i | flags)))
            out.append(data)
            i += 1
        data = b"".join(out)
        return _NLA(4 + len(data), htype) + data

    return encode


# --------------------------------------------------------------------------------------------
# Messages.


def _top(table: _Table, attr: Any) -> Encoder:
    """A message-level attribute's encoder: a (NAME, value, flags) triple ORs its flags in."""
    name = attr[0]
    if isinstance(attr, tuple) and len(attr) > 2 and attr[2]:
        key = (name, attr[2])
        enc = table.flagged.get(key)
        if enc is None:
            spec = table.specs.get(name)
            if spec is None or not isinstance(attr[2], int):
                raise _bad_attrs(table, [attr])
            if isinstance(spec.cls, types.FunctionType):
                raise Unsupported(f"{table.cls.__qualname__}.{name}: a chosen class at message level")
            enc = table.flagged[key] = _encoder(table.cls, name, spec, attr[2])
        return enc
    enc = table.encoders.get(name)
    if enc is None:
        raise _bad_attrs(table, [attr])
    return enc


def encode_message(message: Message, family: int, seq: int, *, ack: bool = True, pid: int = 0) -> bytes:
    """The netlink message pyroute2 would write for `messages.build(message, family, seq)` (kernel/nfnetlink).

    `pid` is the header's port id (0, as build() leaves it; pyroute2's NetlinkRequest writes
    the socket's). Raises Unsupported for an attribute or value outside pyroute2's classes.
    """
    try:
        table = _table(message.msg_class)
        attrs = message.attrs
        body = b"".join([_top(table, a)(a[1]) for a in attrs])
        flags = NLM_F_REQUEST | (NLM_F_ACK if ack else 0) | message.flags
        head = _NLMSGHDR(20 + len(body), (NFNL_SUBSYS_NFTABLES << 8) | message.msg_type, flags, seq, pid)
        return head + _NFGENMSG(family, 0) + b"\0\0" + body
    except Unsupported as exc:
        raise Unsupported(f"{exc}: {message.command}") from None
    except (struct.error, TypeError, IndexError, KeyError, ValueError, AttributeError) as exc:
        raise Unsupported(f"cannot encode {message.msg_class.__qualname__} ({exc}): {message.command}") from None


def batch_begin(seq: int, *, pid: int = 0) -> bytes:
    """NFNL_MSG_BATCH_BEGIN for nf_tables (res_id = NFNL_SUBSYS_NFTABLES), as _send frames it."""
    return batch_frame(NFNL_MSG_BATCH_BEGIN, seq, pid)


def batch_end(seq: int, *, pid: int = 0) -> bytes:
    """NFNL_MSG_BATCH_END: the kernel commits the batch when it reads this."""
    return batch_frame(NFNL_MSG_BATCH_END, seq, pid)

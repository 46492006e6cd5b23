"""Declarations as nf_tables messages, written from the objects: tables, chains, sets, maps and
counters with exactly the attributes libnftables 1.0.6 sends for them.

Besides what the kernel reads, a declaration carries libnftnl's user data, read only by nft:
comments, a set's key and data byte order (how nft prints its elements) and, for a set declared
by `typeof`, the expressions (how nft prints the declaration). Written wrong, the kernel would
take the set and `nft list` would show another one, so the bytes are libnftables' own, held
equal to what it sends for every declaration the renderers make (tests/test_nft_declarations.py).
Anything else (another datatype, typeof expression or flag, a named priority) raises
`Unsupported` before a byte is sent, and the caller hands the transaction to libnftables.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass

from nfproxy.kernel.nfnetlink.framing import attr, strz
from nfproxy.kernel.nfnetlink.values import HOST, TYPE_BITS, TYPE_VERDICT, SetType, Unsupported, fields_of
from nfproxy.nftables import Chain, Counter, Map, Set, Table
from nfproxy.nftables.objects import quote_comment

NEWTABLE, NEWCHAIN, NEWSET, NEWOBJ = 0, 3, 9, 18
_NESTED = 0x8000
_HOST_ORDER, _BIG_ENDIAN = 1, 2  # nft's byte orders; 0 for none (concatenations, verdicts)
_SET_FLAGS = {"constant": 0x2, "interval": 0x4, "timeout": 0x10, "dynamic": 0x20}
_INTERVAL, _MAP, _TIMEOUT = 0x4, 0x8, 0x10
_HOOKS = {"prerouting": 0, "input": 1, "forward": 2, "output": 3, "postrouting": 4}
_PAYLOAD, _CONCAT, _NUMGEN = 7, 13, 23  # nft's expression types, in typeof user data
# Datatypes by name: kernel id, length, byte order (nft's datatype.c).
_TYPES = {"ipv4_addr": (7, 4, _BIG_ENDIAN), "ipv6_addr": (8, 16, _BIG_ENDIAN), "inet_proto": (12, 1, 0),
          "inet_service": (13, 2, _BIG_ENDIAN), "mark": (19, 4, _HOST_ORDER), "verdict": (TYPE_VERDICT, 0, 0)}
# Payload fields a typeof names: nft's protocol description and field numbers, the datatype.
_PAYLOADS = {
    "ip saddr": (12, 11, "ipv4_addr"), "ip daddr": (12, 12, "ipv4_addr"),
    "ip6 saddr": (13, 8, "ipv6_addr"), "ip6 daddr": (13, 9, "ipv6_addr"),
    **{f"{proto} {port}": (desc, field, "inet_service")
       for proto, desc in (("udp", 6), ("tcp", 8), ("sctp", 10)) for port, field in (("sport", 1), ("dport", 2))},
}

Declaration = Table | Chain | Set | Map | Counter


@dataclass(frozen=True, slots=True)
class Declared:
    """One declaration's message: its type, its attributes after its table's (NFTA_*_TABLE, the
    first of every message), and a set's element types."""

    msg_type: int
    attrs: bytes
    set_type: SetType | None = None


def declared(obj: Declaration, set_id: int = 0) -> Declared:
    """`add <obj>` as libnftables sends it; `set_id` numbers a set within its batch."""
    kind = type(obj)
    if kind is Table:
        return Declared(NEWTABLE, _u32(2, 0) + _comment(6, obj.comment))  # flags, user data
    if kind is Chain:
        return Declared(NEWCHAIN, _chain(obj))  # type: ignore[arg-type]
    if kind is Counter:  # name, type (counter), user data, data (bytes and packets from zero)
        data = attr(4 | _NESTED, attr(1, bytes(8)) + attr(2, bytes(8)))
        return Declared(NEWOBJ, strz(2, obj.name) + _u32(3, 1) + _comment(8, obj.comment) + data)  # type: ignore[union-attr]
    if kind is Set or kind is Map:
        return _set(obj, set_id)  # type: ignore[arg-type]
    raise Unsupported(f"{obj!r}: not a declaration")


def _u32(kind: int, value: int) -> bytes:
    return attr(kind, struct.pack(">I", value))


def _ud(kind: int, value: bytes) -> bytes:
    """One item of libnftnl user data: type, length, value (opaque to the kernel)."""
    if len(value) > 255:
        raise Unsupported(f"user data of {len(value)} bytes")
    return bytes((kind, len(value))) + value


def _ud32(kind: int, value: int) -> bytes:
    return _ud(kind, value.to_bytes(4, HOST))  # libnftnl's u32: host order


def _text(comment: str) -> bytes:
    return quote_comment(comment)[1:-1].encode() + b"\0"  # cut as the script cuts it


def _comment(kind: int, comment: str | None) -> bytes:
    """A table's, chain's or object's user data: its comment (item 0), or nothing."""
    return attr(kind, _ud(0, _text(comment))) if comment else b""


def _chain(chain: Chain) -> bytes:
    """NAME, then for a base chain TYPE and HOOK { NUM, PRIORITY }, then the comment."""
    body = strz(3, chain.name)
    if chain.hook is not None:
        number = _HOOKS.get(chain.hook)
        if number is None or chain.type not in ("filter", "nat", "route"):
            raise Unsupported(f"chain {chain.name}: hook {chain.hook!r} of type {chain.type!r}")
        try:
            priority = struct.pack(">i", int(chain.priority or "", 10))
        except ValueError:
            raise Unsupported(f"chain {chain.name}: priority {chain.priority!r} is not a number") from None
        body += strz(7, chain.type) + attr(4 | _NESTED, _u32(1, number) + attr(2, priority))
    return body + _comment(12, chain.comment)


@dataclass(frozen=True, slots=True)
class _Side:
    """A set's key or a map's data: kernel datatype and length, nft's byte order, and its typeof
    user data (None where libnftables writes none)."""

    type: int
    length: int
    byteorder: int
    typeof: bytes | None = None


def _set(obj: Set | Map, set_id: int) -> Declared:
    """NAME, FLAGS, KEY_TYPE, KEY_LEN, [DATA_TYPE, DATA_LEN], ID, [DESC], [TIMEOUT], USERDATA,
    [EXPR]: libnftnl's order."""
    is_map = type(obj) is Map
    spec = obj.type if obj.type is not None else obj.typeof or ""
    key_text, colon, data_text = spec.partition(" : ")
    key, data = _side(key_text, obj.typeof is not None), _side(data_text, obj.typeof is not None) if colon else None
    try:
        flags = sum({_SET_FLAGS[f] for f in obj.flags}) | (_MAP if is_map else 0)
    except KeyError as exc:
        raise Unsupported(f"set {obj.name}: flag {exc.args[0]!r}") from None
    timeout = obj.timeout if type(obj) is Set else None  # type: ignore[union-attr]
    flags |= _TIMEOUT if timeout is not None else 0
    if colon != (" : " if is_map else "") or key.type == TYPE_VERDICT or flags & _INTERVAL and " . " in key_text \
            or timeout is not None and timeout <= 0:  # an interval of concatenations needs DESC_CONCAT
        raise Unsupported(f"{'map' if is_map else 'set'} {obj.name} of {spec!r}, flags {obj.flags}, timeout {timeout}")
    body = strz(2, obj.name) + _u32(3, flags) + _u32(4, key.type) + _u32(5, key.length)
    if data is not None:
        body += _u32(6, data.type) + _u32(7, data.length)
    body += _u32(10, set_id)
    if is_map and obj.size is not None:  # type: ignore[union-attr]
        body += attr(9 | _NESTED, _u32(1, obj.size))  # type: ignore[union-attr]
    if timeout is not None:
        body += attr(11, struct.pack(">Q", timeout * 1000))
    body += attr(13, _set_udata(key, data, obj.comment))
    if is_map and obj.counter:  # type: ignore[union-attr]
        body += attr(17 | _NESTED, strz(1, "counter") + attr(2 | _NESTED, b""))
    return Declared(NEWSET, body, _set_type(obj.name, key, data, bool(flags & _INTERVAL)))


def _set_udata(key: _Side, data: _Side | None, comment: str | None) -> bytes:
    """Key byte order, [data byte order], [key typeof], [data typeof], [data interval], [comment]."""
    out = _ud32(0, key.byteorder) + (_ud32(1, data.byteorder) if data is not None else b"")
    out += _ud(3, key.typeof) if key.typeof is not None else b""
    if data is not None:
        out += (_ud(4, data.typeof) if data.typeof is not None else b"") + _ud32(6, 0)  # the data is no interval
    return out + (_ud(7, _text(comment)) if comment else b"")


def _set_type(name: str, key: _Side, data: _Side | None, interval: bool) -> SetType:
    """The element types, as nft_elements reads them from the kernel for this declaration."""
    keys = fields_of(key.type, key.length, key.byteorder == _HOST_ORDER, f"set {name}")
    if data is None or data.type == TYPE_VERDICT:
        return SetType(name, keys, None if data is None else (), data is not None, interval)
    return SetType(name, keys, fields_of(data.type, data.length, False, f"set {name}"), False, interval)


@functools.lru_cache(maxsize=64)
def _side(text: str, typeof: bool) -> _Side:
    """` . `-joined datatype names, or typeof expressions, each nested by its place in a
    concatenation's user data (a concatenation of datatypes: no items)."""
    parts = [_typeof(p) if typeof else _named(p) for p in text.split(" . ")]
    if len(parts) == 1:
        return parts[0]
    if any(p.type == TYPE_VERDICT for p in parts):
        raise Unsupported(f"{text!r}: a verdict in a concatenation")
    composite = functools.reduce(lambda acc, p: acc << TYPE_BITS | p.type, parts, 0)
    nested = b"".join(_ud(i, p.typeof) for i, p in enumerate(parts)) if typeof else b""  # type: ignore[arg-type]
    return _Side(composite, sum(-(-p.length // 4) * 4 for p in parts), 0, _ud32(0, _CONCAT) + _ud(1, nested))


def _named(name: str) -> _Side:
    found = _TYPES.get(name)
    if found is None:
        raise Unsupported(f"datatype {name!r} outside the declaration vocabulary")
    return _Side(*found)


def _typeof(text: str) -> _Side:
    """`numgen random mod N [offset K]` or a payload field (`ip daddr`, `tcp dport`)."""
    words = text.split()
    if words[:3] == ["numgen", "random", "mod"] and len(words) in (4, 6) and words[4:5] in ([], ["offset"]):
        if not all(w.isdigit() for w in words[3::2]):
            raise Unsupported(f"typeof {text!r}")
        numbers = [1, int(words[3]), int(words[5]) if len(words) == 6 else 0]  # random, modulus, offset
        return _Side(4, 4, _HOST_ORDER, _ud32(0, _NUMGEN) + _ud(1, b"".join(_ud32(i, n) for i, n in enumerate(numbers))))
    found = _PAYLOADS.get(" ".join(words))
    if found is None:
        raise Unsupported(f"typeof {text!r} outside the declaration vocabulary")
    desc, field, datatype = found
    side = _named(datatype)
    return _Side(side.type, side.length, side.byteorder, _ud32(0, _PAYLOAD) + _ud(1, _ud32(0, desc) + _ud32(1, field)))

"""The nf_tables vocabulary every part of the nfnetlink room shares: datatypes and how a
literal becomes bytes, a set's declared types, names, verdicts, and one message of a
batch. It imports nothing else of the room, so the encoders, the batch compiler, the sender
and the dump reader all build on it and none of them on each other's internals (issue Q)."""

from __future__ import annotations

import ipaddress
import re
import socket
import sys
from dataclasses import dataclass
from typing import Any

NFNL_MSG_BATCH_BEGIN = 0x10
NFNL_MSG_BATCH_END = 0x11


class Unsupported(Exception):
    """A command outside the vocabulary: nothing was sent; use libnftables for the transaction."""


# nftables datatype ids (include/datatype.h) and the sizes of the fixed-size ones.
TYPE_INTEGER = 4
TYPE_IPV4 = 7
TYPE_IPV6 = 8
TYPE_INET_PROTO = 12
TYPE_INET_SERVICE = 13
TYPE_MARK = 19
TYPE_VERDICT = 0xFFFFFF00  # NFT_DATA_VERDICT as a set's data type
TYPE_BITS = 6  # concatenated types: (t1 << 6 | t2) << 6 | t3 ...
SIZES = {TYPE_IPV4: 4, TYPE_IPV6: 16, TYPE_INET_PROTO: 1, TYPE_INET_SERVICE: 2, TYPE_MARK: 4}
HOST = sys.byteorder

PROTOCOLS = {"tcp": 6, "udp": 17, "sctp": 132, "icmp": 1, "icmpv6": 58}
VERDICT_CODES = {"accept": 1, "drop": 0, "return": -5, "continue": -1}
CHAIN_VERDICTS = {"jump": -3, "goto": -4}


@dataclass(frozen=True, slots=True)
class Field:
    """One field of a key or data concatenation: its datatype, size in bytes and byte order."""

    type: int
    size: int
    host_order: bool = False


@dataclass(frozen=True, slots=True)
class SetType:
    """A named set as the kernel declares it, enough to encode its elements."""

    name: str
    key: tuple[Field, ...]
    data: tuple[Field, ...] | None  # None: a plain set
    verdict: bool = False  # data is a verdict
    interval: bool = False


def encode_value(text: str, f: Field, what: str) -> bytes:
    """One literal of datatype `f`, unpadded."""
    t = f.type
    try:
        if t == TYPE_IPV4:  # inet_pton: as strict as ipaddress (no leading zeros), 5x faster
            return socket.inet_pton(socket.AF_INET, text)
        if t == TYPE_IPV6:
            if "%" in text:  # a scope: inet_pton would ignore what nft refuses
                raise ValueError(text)
            return socket.inet_pton(socket.AF_INET6, text)
        if t == TYPE_INET_PROTO:
            n = PROTOCOLS[text] if text in PROTOCOLS else int(text, 0)
            return n.to_bytes(1, "big")
        if t == TYPE_INET_SERVICE:
            return int(text, 10).to_bytes(2, "big")
        if t in (TYPE_INTEGER, TYPE_MARK):
            return int(text, 0).to_bytes(f.size, HOST if f.host_order else "big")
    except (ValueError, KeyError, OverflowError, OSError):
        raise Unsupported(f"{what}: {text!r} is not a value of datatype {t}") from None
    raise Unsupported(f"{what}: datatype {t} is outside the netlink vocabulary")


def pad4(b: bytes) -> bytes:
    return b + b"\0" * (-len(b) % 4)


def encode_concat(texts: list[str], fields: tuple[Field, ...], what: str) -> bytes:
    if len(texts) != len(fields):
        raise Unsupported(f"{what}: {len(texts)} fields where the set has {len(fields)}")
    if len(fields) == 1:
        return encode_value(texts[0], fields[0], what)
    return b"".join(pad4(encode_value(x, f, what)) for x, f in zip(texts, fields))


def split_types(composite: int) -> list[int]:
    out: list[int] = []
    while composite:
        out.append(composite & ((1 << TYPE_BITS) - 1))
        composite >>= TYPE_BITS
    return out[::-1]


def fields_of(composite: int, total: int, host_order: bool, what: str) -> tuple[Field, ...]:
    types = split_types(composite)
    if len(types) == 1 and types[0] in (TYPE_INTEGER, TYPE_MARK):
        return (Field(types[0], total, host_order),)
    fields = []
    for t in types:
        size = SIZES.get(t)
        if size is None:
            raise Unsupported(f"{what}: datatype {t} is outside the netlink vocabulary")
        fields.append(Field(t, size))
    size = fields[0].size if len(fields) == 1 else sum(-(-f.size // 4) * 4 for f in fields)
    if size != total:
        raise Unsupported(f"{what}: declared length {total} does not match its types {types}")
    return tuple(fields)


def set_type_from_kernel(name: str, attrs: dict[str, Any]) -> SetType:
    """Decode a GETSET reply (its attributes by name) into the types elements are encoded with."""
    flags = attrs.get("NFTA_SET_FLAGS") or frozenset()
    udata = attrs.get("NFTA_SET_USERDATA") or []
    key_host = False
    if isinstance(udata, list) and udata and udata[0][0] == "NFTNL_UDATA_SET_KEYBYTEORDER":
        key_host = int.from_bytes(udata[0][1][:4], HOST) == 1  # BYTEORDER_HOST_ENDIAN
    what = f"set {name}"
    key = fields_of(attrs["NFTA_SET_KEY_TYPE"], attrs["NFTA_SET_KEY_LEN"], key_host, what)
    data: tuple[Field, ...] | None = None
    verdict = False
    if "NFT_SET_MAP" in flags:
        dtype = attrs.get("NFTA_SET_DATA_TYPE")
        if dtype == TYPE_VERDICT:
            verdict, data = True, ()
        else:
            data = fields_of(dtype, attrs["NFTA_SET_DATA_LEN"], False, what)
    if "NFT_SET_OBJECT" in flags:
        raise Unsupported(f"{what}: object maps are outside the netlink vocabulary")
    return SetType(name, key, data, verdict, "NFT_SET_INTERVAL" in flags)


# Names are bare: nfproxy never quotes one.


def bare_name(token: str, what: str) -> str:
    if not re.fullmatch(r"[A-Za-z_.][A-Za-z0-9_./-]*", token) or len(token) > 256:
        raise Unsupported(f"{what}: {token!r} is not a bare nft name")
    return token


def verdict_of(toks: list[str], command: str) -> tuple[int, str | None]:
    if len(toks) == 2 and toks[0] in CHAIN_VERDICTS:
        return CHAIN_VERDICTS[toks[0]], bare_name(toks[1], command)
    if len(toks) == 1 and toks[0] in VERDICT_CODES:
        return VERDICT_CODES[toks[0]], None
    raise Unsupported(f"verdict {' '.join(toks)!r}: {command}")


def interval_bounds(text: str, f: Field, command: str) -> tuple[int, int]:
    """The first and last value of an interval element's key."""
    try:
        if f.type in (TYPE_IPV4, TYPE_IPV6):
            if "/" in text:
                net = ipaddress.ip_network(text, strict=False)
                return int(net.network_address), int(net.broadcast_address)
            low_text, _, high_text = text.partition("-")
            return int(ipaddress.ip_address(low_text)), int(ipaddress.ip_address(high_text or low_text))
        low_text, _, high_text = text.partition("-")
        return int(low_text, 10), int(high_text or low_text, 10)
    except ValueError:
        raise Unsupported(f"{text!r} is not an interval: {command}") from None


@dataclass(frozen=True, slots=True)
class Message:
    """One nfnetlink message of a batch, and the command text it came from (for errors)."""

    msg_class: type
    msg_type: int
    flags: int
    attrs: tuple[Any, ...]
    command: str

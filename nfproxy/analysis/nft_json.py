"""`nft -j list ruleset` / `nft -j list table` output, read into the rule IR.

Public API: `parse(doc: dict) -> Ruleset` (one JSON document; it may hold several tables, of any
family, nfproxy's `nfproxy` and upstream kube-proxy's `kube-proxy` alike), `loads(text)` (JSON
read with nft's own bounds: 64-bit integers, finite reals, no NaN), `ParseError` and its
`NumberError` (a number `loads` refuses, with its line).

A document is held to what `nft -j list` prints and `nft -j -f` would load: each listed key of
the type nft prints it with, numbers within the kernel's fields, addresses of the family their
type or payload names, each table, set and chain declared once. Anything else is a ParseError
naming the object (`NotFromAKernel`), so `check` never calls clean a dump no kernel could hold.

Expressions are translated generically, one JSON node kind at a time, so a change of layout
(e.g. a numgen-computed slot looked up in a shared map instead of an anonymous vmap) reads into
the same IR without a change here. Constants are read according to the kind of what they are
compared with: a set's declared type for its elements, the left-hand expression for a match.
"""

from __future__ import annotations

import ipaddress
import json
import math
import re
from collections.abc import Callable
from typing import Any

from nfproxy.core.gc_pause import gc_paused
from nfproxy.analysis.ir import (
    address,
    AnonSet,
    Bitwise,
    Chain,
    Concat,
    Const,
    Ct,
    Dnat,
    Element,
    Expr,
    Fib,
    Field,
    Kind,
    MapLookup,
    Masquerade,
    Match,
    MarkSet,
    Numgen,
    OutOfRange,
    Prefix,
    Range,
    Rule,
    Ruleset,
    SetDef,
    SetRef,
    SetUpdate,
    Statement,
    Table,
    Unknown,
    Verdict,
    VerdictMap,
    canonical,
    kind_of,
)

_TYPE_KINDS: dict[str, Kind] = {
    "ipv4_addr": "addr",
    "ipv6_addr": "addr",
    "inet_proto": "proto",
    "inet_service": "int",
    "mark": "int",
    "integer": "int",
    "verdict": "verdict",
    "ct_state": "symbol",
    "ct_status": "symbol",
    "fib_addrtype": "symbol",
    "ifname": "symbol",
}
_VERDICTS = ("accept", "drop", "return", "continue", "jump", "goto")
_BITWISE = ("&", "|", "^")


class ParseError(ValueError):
    """The document is not `nft -j` output we can read; the message names the object (its
    index in the "nftables" list, its kind and name)."""


class NumberError(ParseError):
    """A number nft's JSON reader (jansson) refuses, at `line` of the text: there is no object
    to name yet, so the line is the place."""

    def __init__(self, reason: str, line: int) -> None:
        super().__init__(f"line {line}: {reason}")
        self.reason = reason
        self.line = line


# jansson holds an integer in 64 bits ("too big integer") and a real in a double ("real number
# overflow"); NaN and Infinity are no JSON at all. Checking the digits before `int()` also keeps
# Python's int-string limit (4 300 digits, a ValueError) out of reach.
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
_INT64_DIGITS = 19


class _Refused(ValueError):
    def __init__(self, literal: str, reason: str) -> None:
        super().__init__(reason)
        self.literal = literal


def _json_int(text: str) -> int:
    digits = len(text) - text.startswith("-")
    if digits > _INT64_DIGITS:
        raise _Refused(text, f"an integer of {digits} digits: nft reads 64-bit integers")
    value = int(text)
    if not INT64_MIN <= value <= INT64_MAX:
        raise _Refused(text, f"integer {text} does not fit in 64-bit (nft: too big integer)")
    return value


def _json_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise _Refused(text, f"{_shortened(text)} is past the largest double (nft: real number overflow)")
    return value


def _json_constant(text: str) -> float:
    raise _Refused(text, f"{text} is not JSON: nft refuses it")


def _shortened(text: str) -> str:
    return text if len(text) <= 40 else f"{text[:20]}...{text[-10:]} ({len(text)} characters)"


def loads(text: str) -> Any:
    """`json.loads` bounded as nft's reader is; a number it refuses is a NumberError with its
    line. Other syntax errors stay json.JSONDecodeError, which has its own line."""
    try:
        return json.loads(text, parse_int=_json_int, parse_float=_json_float, parse_constant=_json_constant)
    except _Refused as exc:
        raise NumberError(str(exc), _line_of_literal(text, exc.literal)) from None


def _line_of_literal(text: str, literal: str) -> int:
    """The line of the first `literal` outside a string (only on the error path)."""
    pattern = re.compile(r'"(?:[^"\\]|\\.)*"|(?<![\w.+-])(' + re.escape(literal) + r")(?![\w.])")
    for m in pattern.finditer(text):
        if m.group(1) is not None:
            return text.count("\n", 0, m.start()) + 1
    return 1


# What a malformed document makes the readers below raise: a wrong type, a missing key, a
# nesting too deep. Each is turned into a ParseError naming the item.
_MALFORMED = (KeyError, ValueError, TypeError, AttributeError, IndexError, RecursionError, OverflowError)
_FAMILIES = ("ip", "ip6", "inet", "arp", "bridge", "netdev")


# Where a set's elements come from when the document holds none for it (`nft -j -t`): called
# with (family, table, name, key kinds, data kinds, memo); None leaves the set as listed.
ElementSource = Callable[[str, str, str, tuple[Kind, ...], tuple[Kind, ...], dict[tuple[Any, ...], Any]], "tuple[Element, ...] | None"]


@gc_paused()  # a 10 000-service dump: 1.2 million objects, no cycles
def parse(doc: dict[str, Any] | str, elements: ElementSource | None = None) -> Ruleset:
    if isinstance(doc, str):
        try:
            doc = loads(doc)
        except NumberError:
            raise
        except (ValueError, RecursionError) as exc:
            raise ParseError(f"not valid JSON: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("nftables"), list):
        raise ParseError("not an `nft -j` document: no top-level \"nftables\" list")
    tables: dict[tuple[str, str], dict[str, Any]] = {}
    items = doc["nftables"]
    memo: Memo = {}  # one for the document: a hairpin set repeats the endpoint maps' addresses
    # Sets first: rules are read against their declared types.
    declared: dict[tuple[str, ...], int] = {}  # each table, set and chain: where first
    for number, item in enumerate(items):
        with _Item(number, item) as (kind, obj):
            if kind == "table":
                _check_fields(kind, obj)
                _table_of(tables, obj)
                _declare(declared, number, "table", _name(obj, "family"), _name(obj, "name"))
            elif kind in ("set", "map"):
                _check_fields(kind, obj)
                t = _table_of(tables, obj)
                _declare(declared, number, "set", obj["family"], obj["table"], _name(obj, "name"))
                t["sets"][obj["name"]] = _set(kind, obj, memo, elements)
    for number, item in enumerate(items):
        with _Item(number, item) as (kind, obj):
            if kind == "chain":
                _check_fields(kind, obj)
                t = _table_of(tables, obj)
                _declare(declared, number, "chain", obj["family"], obj["table"], _name(obj, "name"))
                t["chains"][obj["name"]] = obj
                t["rules"].setdefault(obj["name"], [])
            elif kind == "rule":
                _check_fields(kind, obj)
                t = _table_of(tables, obj)
                rule = _rule(obj, t["sets"], obj["family"])
                t["rules"].setdefault(_name(obj, "chain"), []).append(rule)
    out: list[Table] = []
    for (family, name), t in tables.items():
        chains: dict[str, Chain] = {}
        for cname, rules in t["rules"].items():
            c = t["chains"].get(cname, {})
            try:
                chains[cname] = Chain(
                    cname,
                    tuple(rules),
                    hook=_one_of("hook", c.get("hook"), _HOOKS),
                    type=_one_of("type", c.get("type"), _CHAIN_TYPES),
                    priority=_priority(c.get("prio", 0)),
                    policy=_one_of("policy", c.get("policy", "accept"), _POLICIES) or "accept",
                )
            except _MALFORMED as exc:
                raise ParseError(f"{family} {name}: chain {cname!r}: {_reason(exc)}") from None
        out.append(Table(family, name, "nft", chains, t["sets"]))
    return Ruleset(tuple(out))


class _Item:
    """Context for reading item `number`: yields (kind, body) and names the item on failure."""

    def __init__(self, number: int, item: Any) -> None:
        self.number = number
        self.item = item
        self.label = f"nftables[{number}]"

    def __enter__(self) -> tuple[str, dict[str, Any]]:
        item = self.item
        if not isinstance(item, dict) or len(item) != 1:
            raise ParseError(f"{self.label}: expected one {{kind: object}}, got {_short(item)}")
        ((kind, obj),) = item.items()
        if not isinstance(obj, dict):
            raise ParseError(f"{self.label}: {kind}: expected an object, got {_short(obj)}")
        name = obj.get("name", obj.get("chain"))
        self.label = f"{self.label} ({kind}{f' {name!r:.60}' if isinstance(name, str) else ''})"
        return kind, obj

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> bool:
        if exc is None or isinstance(exc, ParseError) and str(exc).startswith("nftables["):
            return False
        if isinstance(exc, _MALFORMED):
            raise ParseError(f"{self.label}: {_reason(exc)}") from None
        return False


# What `nft -j list` prints under each key of a top-level object, as (test, what it must be).
# A key not listed is left alone (nft adds keys); a listed one of another type was not printed
# by nft, and nft's own reader would refuse or drop it.
Check = tuple[Callable[[Any], bool], str]
INT32_MIN, INT32_MAX = -(1 << 31), (1 << 31) - 1
U32_MAX = (1 << 32) - 1
# nf_msecs_to_jiffies64 refuses a timeout of U64_MAX / NSEC_PER_MSEC milliseconds or more (ERANGE).
TIMEOUT_MS_LIMIT = ((1 << 64) - 1) // 1_000_000
NAME_BYTES = 255  # NFT_NAME_MAXLEN, its NUL left out
COMMENT_BYTES = 253  # NFT_USERDATA_MAXLEN (256) less the attribute's type, length and NUL


def _is_u64(v: Any) -> bool:
    return type(v) is int and 0 <= v <= INT64_MAX


def _is_u32(v: Any) -> bool:
    return type(v) is int and 0 <= v <= U32_MAX


def _is_str(v: Any) -> bool:
    return type(v) is str


def _is_strs(v: Any) -> bool:
    return type(v) is str or type(v) is list and all(type(x) is str for x in v)


def _is_list(v: Any) -> bool:
    return type(v) is list


def _is_comment(v: Any) -> bool:
    return type(v) is str and (len(v) <= COMMENT_BYTES // 4 or len(v.encode()) <= COMMENT_BYTES)


def _is_timeout(v: Any) -> bool:
    return type(v) is int and 0 <= v and v * 1000 < TIMEOUT_MS_LIMIT


def _is_priority(v: Any) -> bool:
    return type(v) is int and INT32_MIN <= v <= INT32_MAX or type(v) is str or type(v) is dict


_HANDLE: Check = (_is_u64, "a non-negative 64-bit integer")
_STRING: Check = (_is_str, "a string")
_STRINGS: Check = (_is_strs, "a string or a list of strings")
_COMMENT: Check = (_is_comment, f"a string of at most {COMMENT_BYTES} bytes")
_TIMEOUT: Check = (_is_timeout, f"a whole number of seconds from 0 to {TIMEOUT_MS_LIMIT // 1000 - 1}")
_COMMON_FIELDS: dict[str, Check] = {"family": _STRING, "table": _STRING, "handle": _HANDLE, "comment": _COMMENT}
_FIELDS: dict[str, dict[str, Check]] = {
    "table": {"family": _STRING, "name": _STRING, "handle": _HANDLE, "comment": _COMMENT, "flags": _STRINGS},
    "chain": {**_COMMON_FIELDS, "name": _STRING, "type": _STRING, "hook": _STRING, "policy": _STRING,
              "prio": (_is_priority, "a 32-bit integer or a priority's name"), "dev": _STRINGS},
    "set": {**_COMMON_FIELDS, "name": _STRING, "type": _STRINGS, "map": _STRINGS, "flags": _STRINGS,
            "timeout": _TIMEOUT, "gc-interval": (_is_u32, "a 32-bit unsigned integer"),
            "size": (_is_u32, "a 32-bit unsigned integer"), "policy": _STRING, "elem": (_is_list, "a list"),
            "stmt": (_is_list, "a list")},
    "rule": {**_COMMON_FIELDS, "chain": _STRING, "expr": (_is_list, "a list"),
             "index": (_is_u32, "a 32-bit unsigned integer"), "position": _HANDLE},
}
_FIELDS["map"] = _FIELDS["set"]


def _check_fields(kind: str, obj: dict[str, Any]) -> None:
    """Each key `nft -j list` prints has the type it prints it with (bounded like the kernel)."""
    fields = _FIELDS.get(kind)
    if fields is None:
        return
    for key, value in obj.items():
        check = fields.get(key)
        if check is not None and not check[0](value):
            raise NotFromAKernel(f"{key} must be {check[1]}, not {_short(value)}")


def _declare(declared: dict[tuple[str, ...], int], number: int, *key: str) -> None:
    """`nft -j list` lists each table, set and chain once: a second declaration is a dump
    pieced together, whose two halves may disagree (the reader kept the last one)."""
    first = declared.setdefault(key, number)
    if first != number:
        raise NotFromAKernel(f"declared again (first at nftables[{first}]): `nft -j list` lists each {key[0]} once")


def _reason(exc: BaseException) -> str:
    if isinstance(exc, KeyError):
        return f"missing key {exc.args[0]!r}" if exc.args else "missing key"
    if isinstance(exc, RecursionError):
        return "nested too deeply"
    return str(exc)[:300] or type(exc).__name__


def _short(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _name(obj: dict[str, Any], key: str) -> str:
    value = obj[key]
    if not isinstance(value, str):
        raise ValueError(f"{key} must be a string, not {_short(value)}")
    if len(value) > NAME_BYTES // 4 and len(value.encode()) > NAME_BYTES:
        raise NotFromAKernel(f"{key} of {len(value.encode())} bytes: the kernel's names have at most {NAME_BYTES}")
    return value


# What nft lists for a base chain (a dump with anything else was not listed by a kernel).
_HOOKS = frozenset({"prerouting", "input", "forward", "output", "postrouting", "ingress", "egress"})
_CHAIN_TYPES = frozenset({"filter", "nat", "route"})
_POLICIES = frozenset({"accept", "drop"})


def _one_of(field: str, value: Any, allowed: frozenset[str]) -> str | None:
    name = _optional_name(value)
    if name is not None and name not in allowed:
        raise ValueError(f"{field} {_short(name)} is not one of {', '.join(sorted(allowed))}")
    return name


def _optional_name(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise ValueError(f"expected a name, not {_short(value)}")


def _table_of(tables: dict[tuple[str, str], dict[str, Any]], obj: dict[str, Any]) -> dict[str, Any]:
    family = _name(obj, "family")
    if family not in _FAMILIES:
        raise ValueError(f"unknown family {family!r}")
    key = (family, _name(obj, "table") if "table" in obj else _name(obj, "name"))
    return tables.setdefault(key, {"chains": {}, "rules": {}, "sets": {}})


_NAMED_PRIORITIES = {"raw": -300, "mangle": -150, "dstnat": -100, "filter": 0, "security": 50, "srcnat": 100}


def _priority(value: Any) -> int:
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value in _NAMED_PRIORITIES:
        return _NAMED_PRIORITIES[value]
    if isinstance(value, dict) and "name" in value:  # nft may print {"name": "dstnat", ...}
        return _NAMED_PRIORITIES.get(value["name"], 0)
    return int(value)


def _type_names(type_: Any) -> list[Any]:
    if isinstance(type_, list):
        return type_
    if isinstance(type_, str):
        return [p.strip() for p in type_.split(" . ")]
    return []


def _kinds(type_: Any) -> tuple[Kind, ...]:
    return tuple(_TYPE_KINDS.get(n, "unknown") for n in _type_names(type_))


PORT_MAX = 65_535


class NotFromAKernel(ValueError):
    """A value no kernel holds: the dump is refused, not the statement kept as unknown (an
    unknown statement is one the reader has no model for, not one nft would refuse)."""


def check_port(value: object) -> None:
    """A DNAT port must fit 16 bits: nft and iptables refuse anything else (`Service out of
    range`, `Port '99999' not valid`), so a dump holding one was not listed by a kernel."""
    if isinstance(value, int) and not 0 <= value <= PORT_MAX:
        raise NotFromAKernel(f"port {value} out of range (0-{PORT_MAX})")


_ADDRESS_TYPES = {"ipv4_addr": 4, "ipv6_addr": 6}


def check_version(value: object, version: int, what: str) -> None:
    """An address (or prefix, or range of them) of `version`: nft refuses `ip daddr fd00::1`
    and an IPv6 element in an ipv4_addr set, so a dump holding one was not listed by a kernel."""
    low = value.low if isinstance(value, Range) else value.network if isinstance(value, Prefix) else \
        value.value if isinstance(value, Const) else value
    if isinstance(low, (ipaddress.IPv4Address, ipaddress.IPv6Address, ipaddress.IPv4Network, ipaddress.IPv6Network)) \
            and low.version != version:
        raise NotFromAKernel(f"{low} is an IPv{low.version} address where {what} holds IPv{version} ones")


def _element_text(el: Element) -> str:
    key = " . ".join(f"{k.low}-{k.high}" if isinstance(k, Range) else str(getattr(k, "value", k)) for k in el.key)
    return key[:80]


def _check_elements(key_types: list[Any], data_types: list[Any], elements: tuple[Element, ...]) -> None:
    """Each element as its declared types bound it: addresses of the type's family, the
    inet_service parts of a map's data (an endpoint map's `ip . port`) in range. A plain
    address of the right family is let through inline: an endpoint map has 100 000 of them."""
    keys = [(i, _ADDRESS_TYPES[t]) for i, t in enumerate(key_types) if t in _ADDRESS_TYPES]
    data = [(i, _ADDRESS_TYPES.get(t, 0)) for i, t in enumerate(data_types) if t in _ADDRESS_TYPES or t == "inet_service"]
    if not keys and not data:
        return
    single = len(data_types) == 1
    for el in elements:
        try:
            for i, version in keys:
                key = el.key[i]
                if type(key) is not Const or type(key.value) is not _ADDRESS_CLASSES[version]:
                    check_version(key, version, f"the set's type {key_types[i]}")
            if not data or type(el.data) is not Const:
                continue
            values = (el.data.value,) if single else el.data.value
            for i, version in data:
                value = values[i]  # type: ignore[index]
                if not version:
                    if type(value) is not int or not 0 <= value <= PORT_MAX:
                        check_port(value)
                elif type(value) is not _ADDRESS_CLASSES[version]:
                    check_version(value, version, f"the map's type {data_types[i]}")
        except ValueError as exc:
            raise NotFromAKernel(f"element {_element_text(el)}: {exc}") from None


_ADDRESS_CLASSES = {4: ipaddress.IPv4Address, 6: ipaddress.IPv6Address}


def _set(kind: str, obj: dict[str, Any], memo: Memo | None = None, source: ElementSource | None = None) -> SetDef:
    key_kinds = _kinds(obj.get("type"))
    data_kinds = _kinds(obj.get("map")) if kind == "map" else ()
    if memo is None:
        memo = {}
    elements = None
    if source is not None and "elem" not in obj:
        elements = source(obj.get("family"), obj.get("table"), obj["name"], key_kinds, data_kinds, memo)  # type: ignore[arg-type]
    if elements is None:
        elements = _elements(obj.get("elem", []), key_kinds, data_kinds, memo)
    _check_elements(_type_names(obj.get("type")), _type_names(obj.get("map")) if kind == "map" else [], elements)
    flags = obj.get("flags", [])
    flags = frozenset([flags] if isinstance(flags, str) else flags)
    return SetDef(obj["name"], kind, key_kinds, data_kinds, elements, flags, int(obj.get("timeout", 0)))  # type: ignore[arg-type]


# Constants already read in this set, by (kind, type, printed value): a 10 000-service map
# repeats its protocols, ports and verdicts in every element; each is read once.
Memo = dict[tuple[Any, ...], Any]


def _elements(raws: Any, key_kinds: tuple[Kind, ...], data_kinds: tuple[Kind, ...], memo: Memo) -> tuple[Element, ...]:
    """Every element of a set, as `_element` reads each one, with the common shapes (scalars and
    concatenations of scalars, keys with a counter or comment) read inline: a 10 000-service
    ruleset holds 220 000 elements."""
    if not isinstance(raws, list):
        return tuple(_element(e, key_kinds, data_kinds, memo) for e in raws)
    # Per key component, printed value -> Const; filled from (and into) the shared memo.
    consts: list[dict[Any, Any]] = [memo.setdefault(("consts", k), {}) for k in key_kinds]  # type: ignore[misc]
    # Per data component, printed value -> canonical value (a map's data is a plain value).
    values: list[dict[Any, Any]] = [memo.setdefault(("values", k), {}) for k in data_kinds]  # type: ignore[misc]
    width = len(key_kinds)
    verdicts = data_kinds == ("verdict",)
    out: list[Element] = []
    append = out.append
    for raw in raws:
        key_raw, data_raw = raw, None
        if data_kinds:
            if type(raw) is not list or len(raw) != 2:
                append(_element(raw, key_kinds, data_kinds, memo))
                continue
            key_raw, data_raw = raw
        comment = ""
        if type(key_raw) is dict:
            inner = key_raw.get("elem")
            if inner is not None:
                if type(inner) is not dict:
                    append(_element(raw, key_kinds, data_kinds, memo))
                    continue
                comment = inner.get("comment", "")
                key_raw = inner.get("val")
        if type(key_raw) is dict:
            parts = key_raw.get("concat")
            if type(parts) is not list:
                bounds = key_raw.get("range")
                if width == 1 and type(bounds) is list and len(bounds) == 2 and len(key_raw) == 1 \
                        and all(type(b) is str or type(b) is int for b in bounds):
                    # An interval map's key (the endpoint lanes): read as _value reads it.
                    kind = key_kinds[0]
                    key_range = Range(memo_canonical(bounds[0], kind, memo), memo_canonical(bounds[1], kind, memo))  # type: ignore[arg-type]
                    append(Element((key_range,), _data_of(data_raw, data_kinds, verdicts, values, memo), comment))
                else:  # a prefix, or something to complain about
                    append(_element(raw, key_kinds, data_kinds, memo))
                continue
        else:
            parts = (key_raw,)
        if len(parts) != width:
            append(_element(raw, key_kinds, data_kinds, memo))
            continue
        key = []
        for part, known, kind in zip(parts, consts, key_kinds):
            t = type(part)
            if t is not str and t is not int:
                break
            c = known.get(part)
            if c is None:
                c = known[part] = memo_value(part, kind, memo)
            key.append(c)
        else:
            append(Element(tuple(key), _data_of(data_raw, data_kinds, verdicts, values, memo), comment))
            continue
        append(_element(raw, key_kinds, data_kinds, memo))
    return tuple(out)


def _data_of(data_raw: Any, data_kinds: Any, verdicts: bool, values: Any, memo: Any) -> Any:
    """An element's data as the fast path reads it: none for a set, a verdict, or values."""
    if not data_kinds:
        return None
    if verdicts:
        return _memo_verdict(data_raw, memo)
    return _fast_data(data_raw, data_kinds, values, memo)


def _fast_data(raw: Any, kinds: tuple[Kind, ...], known: list[dict[Any, Any]], memo: Memo) -> Const:
    """`_data_const` for scalars and concatenations of scalars, from per-component caches."""
    if type(raw) is dict:
        parts = raw.get("concat")
        if type(parts) is not list:
            return _data_const(raw, kinds, memo)
    else:
        parts = (raw,)
    if len(parts) != len(kinds):
        return _data_const(raw, kinds, memo)
    out = []
    for part, cache, kind in zip(parts, known, kinds):
        t = type(part)
        if t is not str and t is not int:
            return _data_const(raw, kinds, memo)
        v = cache.get(part)
        if v is None:
            v = cache[part] = memo_canonical(part, kind, memo)
        out.append(v)
    return Const(tuple(out) if len(out) > 1 else out[0])


def _element(raw: Any, key_kinds: tuple[Kind, ...], data_kinds: tuple[Kind, ...], memo: Memo) -> Element:
    data: Verdict | Const | None = None
    if data_kinds:
        if not (isinstance(raw, list) and len(raw) == 2):
            raise ValueError(f"map element {raw!r} is not a [key, data] pair")
        raw, raw_data = raw
        if data_kinds == ("verdict",):
            data = _memo_verdict(raw_data, memo)
        else:
            data = _data_const(raw_data, data_kinds, memo)
    comment = ""
    if isinstance(raw, dict) and "elem" in raw:
        comment = raw["elem"].get("comment", "")
        raw = raw["elem"]["val"]
    return Element(_key(raw, key_kinds, memo), data, comment)


def _memo_verdict(raw: Any, memo: Memo) -> Verdict:
    if isinstance(raw, dict) and len(raw) == 1:
        ((kind, body),) = raw.items()
        target = body.get("target") if isinstance(body, dict) else None
        if kind in ("jump", "goto") and isinstance(target, str):
            key = ("verdict", kind, target)
            found = memo.get(key)
            if found is None:
                found = memo[key] = _verdict(raw)
            return found  # type: ignore[no-any-return]
    return _verdict(raw)


def _key(raw: Any, kinds: tuple[Kind, ...], memo: Memo | None = None) -> tuple[Const | Prefix | Range, ...]:
    if isinstance(raw, dict) and "elem" in raw:
        raw = raw["elem"]["val"]
    if isinstance(raw, dict) and "concat" in raw:
        parts = raw["concat"]
    else:
        parts = [raw]
    if len(parts) != len(kinds):
        raise ValueError(f"element {raw!r} does not fit type {kinds}")
    if memo is None:
        return tuple(_value(p, k) for p, k in zip(parts, kinds))
    return tuple(memo_value(p, k, memo) for p, k in zip(parts, kinds))


def memo_value(raw: Any, kind: Kind, memo: Memo) -> Const | Prefix | Range:
    if not isinstance(raw, (str, int)):
        return _value(raw, kind)
    key = (kind, type(raw), raw)
    found = memo.get(key)
    if found is None:
        # The canonical value as a map's data would hold it, read once per document (a hairpin
        # set's addresses are the endpoint maps' ones): what _value makes of a scalar.
        found = memo[key] = Const(memo_canonical(raw, kind, memo))  # type: ignore[arg-type]
    return found  # type: ignore[no-any-return]


def _value(raw: Any, kind: Kind) -> Const | Prefix | Range:
    if isinstance(raw, dict):
        if "prefix" in raw:
            p = raw["prefix"]
            return Prefix(ipaddress.ip_network(f"{p['addr']}/{p['len']}", strict=False))
        if "range" in raw:
            lo, hi = raw["range"]
            return Range(canonical(lo, kind), canonical(hi, kind))  # type: ignore[arg-type]
        raise ValueError(f"unsupported value {raw!r}")
    if isinstance(raw, list):
        # A list of flags (ct state established,related): any of them.
        raise ValueError("flag list where one value was expected")
    return Const(canonical(raw, kind))


def _data_const(raw: Any, kinds: tuple[Kind, ...], memo: Memo) -> Const:
    if isinstance(raw, dict) and "concat" in raw:
        parts = raw["concat"]
    else:
        parts = [raw]
    if len(parts) != len(kinds):
        raise ValueError(f"map data {raw!r} does not fit type {kinds}")
    values = tuple(memo_canonical(p, k, memo) for p, k in zip(parts, kinds))
    return Const(values if len(values) > 1 else values[0])


def memo_canonical(raw: Any, kind: Kind, memo: Memo) -> object:
    if not isinstance(raw, (str, int)):
        return canonical(raw, kind)
    key = ("canonical", kind, type(raw), raw)
    found = memo.get(key)
    if found is None:
        found = memo[key] = canonical(raw, kind)
    return found


def _verdict(raw: Any) -> Verdict:
    if isinstance(raw, str) and raw in _VERDICTS:
        return Verdict(raw)  # type: ignore[arg-type]
    if isinstance(raw, dict) and len(raw) == 1:
        ((kind, body),) = raw.items()
        if kind in ("jump", "goto"):
            target = body["target"]
            if not isinstance(target, str):
                raise ValueError(f"{kind} target must be a chain name, not {_short(target)}")
            return Verdict(kind, target)
        if kind in _VERDICTS:
            return Verdict(kind)  # type: ignore[arg-type]
    raise ValueError(f"not a verdict: {raw!r}")


# --------------------------------------------------------------------------------------------
# Rules.


def _rule(obj: dict[str, Any], sets: dict[str, SetDef], family: str = "inet") -> Rule:
    statements: list[Statement] = []
    exprs = obj.get("expr", [])
    if not isinstance(exprs, list):
        raise ValueError(f"expr must be a list, not {_short(exprs)}")
    for raw in exprs:
        st = _statement(raw, sets, family)
        if st is not None:
            statements.append(st)
    comment = obj.get("comment", "")
    return Rule(tuple(statements), comment if isinstance(comment, str) else str(comment), json.dumps(exprs))


def _statement(raw: Any, sets: dict[str, SetDef], family: str = "inet") -> Statement | None:
    if not isinstance(raw, dict) or len(raw) != 1:
        return Unknown(json.dumps(raw))
    ((kind, body),) = raw.items()
    try:
        if kind == "match":
            return _match(body, sets)
        if kind == "counter":
            _check_counter(body)
            return None
        if kind in ("log", "comment", "notrack_ignored"):
            return None
        if kind in _VERDICTS:
            return _verdict(raw)
        if kind == "reject":
            return Verdict("reject")
        if kind == "vmap":
            return VerdictMap(_expr(body["key"]), _map_operand(body["data"], ("verdict",), sets))
        if kind == "mangle":
            if _expr(body["key"]) != Field("mark"):
                return Unknown(json.dumps(raw))
            return MarkSet(_expr(body["value"]))
        if kind == "set":
            if body.get("op") not in ("update", "add"):
                return Unknown(json.dumps(raw))
            elem = body["elem"]
            if isinstance(elem, dict) and "elem" in elem:
                elem = elem["elem"]["val"]
            return SetUpdate(body["set"].lstrip("@"), _expr(elem))
        if kind == "dnat":
            return _dnat(body, sets, family)
        if kind == "masquerade":
            if isinstance(body, dict) and "port" in body:
                return Unknown(json.dumps(raw))
            return Masquerade()
    except (NotFromAKernel, OutOfRange):
        raise
    except (KeyError, ValueError, TypeError, AttributeError, IndexError) as exc:
        return Unknown(f"{json.dumps(raw)} ({exc})")
    return Unknown(json.dumps(raw))


def _check_counter(body: Any) -> None:
    """`counter` as nft lists it: null (anonymous, fresh), a named counter's name, or its
    packets and bytes, each a 64-bit count."""
    if body is None or isinstance(body, str):
        return
    if not isinstance(body, dict):
        raise NotFromAKernel(f"counter must be an object, not {_short(body)}")
    for key in ("packets", "bytes"):
        if key in body and not _is_u64(body[key]):
            raise NotFromAKernel(f"counter {key} must be {_HANDLE[1]}, not {_short(body[key])}")


def _expr(raw: Any) -> Expr:
    if isinstance(raw, dict) and len(raw) == 1:
        ((kind, body),) = raw.items()
        if kind == "payload" and "field" in body:
            proto = body.get("protocol")
            if proto in ("ip", "ip6", "th"):
                return Field(body["field"])
            if proto in ("tcp", "udp", "sctp", "dccp", "udplite") and body["field"] in ("sport", "dport"):
                return Field(body["field"], proto)
        if kind == "meta":
            return Field(body["key"])
        if kind == "fib" and body.get("result") == "type":
            flags = body.get("flags", [])
            flags = [flags] if isinstance(flags, str) else flags
            if flags in (["saddr"], ["daddr"]):
                return Fib(flags[0])
        if kind == "ct" and body.get("key") in ("state", "status") and "dir" not in body:
            return Ct(body["key"])
        if kind == "numgen" and body.get("mode") == "random":
            mod, offset = body["mod"], body.get("offset", 0)
            for key, value in (("mod", mod), ("offset", offset)):
                if type(value) is not int:
                    raise NotFromAKernel(f"numgen {key} must be an integer, not {_short(value)}")
            if type(offset) is int and -(1 << 31) <= offset < 0:
                offset += 1 << 32  # nft 1.0.6 prints the u32 offset as a signed 32-bit number
            if type(mod) is not int or type(offset) is not int or mod <= 0 or offset < 0:
                raise ValueError(f"numgen: mod must be a positive and offset a non-negative integer: {_short(body)}")
            return Numgen(mod, offset)
        if kind == "concat":
            return Concat(tuple(_expr(x) for x in body))
        if kind in _BITWISE:
            left, right = body
            if isinstance(right, int):
                return Bitwise(kind, _expr(left), right)  # type: ignore[arg-type]
        if kind == "map":
            key = _expr(body["key"])
            return MapLookup(key, _map_operand(body["data"], None, {}))
    raise ValueError(f"unsupported expression {json.dumps(raw)}")


def _map_operand(raw: Any, data_kinds: tuple[Kind, ...] | None, sets: dict[str, SetDef]) -> SetRef | AnonSet:
    if isinstance(raw, str) and raw.startswith("@"):
        return SetRef(raw[1:])
    if isinstance(raw, dict) and "set" in raw:
        # Key kinds of an anonymous map are decided by its key expression: resolved lazily by
        # the caller, so here keep the printed values and read them generically.
        elements = []
        for pair in raw["set"]:
            key, data = pair
            if data_kinds == ("verdict",):
                d: Verdict | Const = _verdict(data)
            else:
                d = _generic_const(data)
            elements.append(Element(_generic_key(key), d))
        return AnonSet(tuple(elements))
    raise ValueError(f"unsupported map {raw!r}")


def _generic_scalar(raw: Any) -> Const | Prefix | Range:
    """A value whose type is not declared: ints stay ints, addresses become addresses,
    everything else a lower-case symbol (protocol names included)."""
    if isinstance(raw, dict):
        if "prefix" in raw:
            p = raw["prefix"]
            return Prefix(ipaddress.ip_network(f"{p['addr']}/{p['len']}", strict=False))
        if "range" in raw:
            lo, hi = (_generic_scalar(x) for x in raw["range"])
            assert isinstance(lo, Const) and isinstance(hi, Const)
            return Range(lo.value, hi.value)  # type: ignore[arg-type]
        raise ValueError(f"unsupported value {raw!r}")
    if isinstance(raw, bool):
        raise ValueError(f"unsupported value {raw!r}")
    if isinstance(raw, int):
        return Const(raw)
    try:
        return Const(address(raw))
    except ValueError:
        return Const(canonical(raw, "proto") if raw.lower() in ("tcp", "udp", "sctp", "icmp", "icmpv6") else str(raw).lower())


def _generic_key(raw: Any) -> tuple[Const | Prefix | Range, ...]:
    if isinstance(raw, dict) and "elem" in raw:
        raw = raw["elem"]["val"]
    if isinstance(raw, dict) and "concat" in raw:
        return tuple(_generic_scalar(p) for p in raw["concat"])
    return (_generic_scalar(raw),)


def _generic_const(raw: Any) -> Const:
    if isinstance(raw, dict) and "concat" in raw:
        parts = tuple(_generic_scalar(p) for p in raw["concat"])
        return Const(tuple(p.value for p in parts if isinstance(p, Const)))
    v = _generic_scalar(raw)
    if not isinstance(v, Const):
        raise ValueError(f"map data {raw!r} is not a single value")
    return v


def _match(body: dict[str, Any], sets: dict[str, SetDef]) -> Statement:
    match = _match_unchecked(body, sets)
    version = _payload_version(body["left"])
    if version and isinstance(match, Match):
        right = match.right
        for value in (el.key[0] for el in right.elements) if isinstance(right, AnonSet) else (right,):
            check_version(value, version, _short(body["left"]))
    return match


def _payload_version(left: Any) -> int:
    """4 for `ip saddr`/`ip daddr`, 6 for their ip6 twins, else 0."""
    if type(left) is dict and len(left) == 1 and type(left.get("payload")) is dict:
        payload = left["payload"]
        if payload.get("field") in ("saddr", "daddr"):
            return {"ip": 4, "ip6": 6}.get(payload.get("protocol"), 0)  # type: ignore[arg-type]
    return 0


def _match_unchecked(body: dict[str, Any], sets: dict[str, SetDef]) -> Statement:
    left = _expr(body["left"])
    op = body.get("op", "==")
    right = body["right"]
    kinds = kind_of(left)
    if op == "in":
        op = "=="
    if op not in ("==", "!=", "<", "<=", ">", ">="):
        raise ValueError(f"operator {op!r}")
    if isinstance(right, str) and right.startswith("@"):
        return Match(left, op, SetRef(right[1:]))
    ktuple = kinds if isinstance(kinds, tuple) else (kinds,)
    if isinstance(right, dict) and "set" in right:
        elements = tuple(Element(_key(e, ktuple)) for e in right["set"])
        return Match(left, op, AnonSet(elements))
    if isinstance(right, list):  # flags: ct state established,related
        elements = tuple(Element(_key(e, ktuple)) for e in right)
        return Match(left, op, AnonSet(elements))
    if isinstance(right, dict) and "concat" in right:
        return Match(left, op, AnonSet((Element(_key(right, ktuple)),)))
    (value,) = _key(right, ktuple)
    return Match(left, op, value)


def _dnat(body: dict[str, Any], sets: dict[str, SetDef], family: str = "inet") -> Statement:
    if not isinstance(body, dict) or "addr" not in body:
        return Unknown(json.dumps({"dnat": body}))
    addr_raw = body["addr"]
    if isinstance(addr_raw, str):
        addr: Expr = Const(address(addr_raw))
        version = {"ip": 4, "ip6": 6}.get(body.get("family", family), 0)
        if version:
            check_version(addr, version, f"`dnat {body.get('family', family)}`")
    else:
        addr = _expr(addr_raw)
        _check_dnat_map(addr, sets)
    port: Expr | None = None
    if "port" in body:
        p = body["port"]
        port = Const(int(p)) if isinstance(p, int) else _expr(p)
        if isinstance(port, Const):
            check_port(port.value)
    return Dnat(addr, port)


def _check_dnat_map(addr: Expr, sets: dict[str, SetDef]) -> None:
    """nft refuses `dnat to … map M` unless M's data is an address, or an address and a port
    (datatype mismatch): the walk would otherwise take whatever M holds for an address."""
    if not isinstance(addr, MapLookup):
        return
    if isinstance(addr.map, SetRef):
        sdef = sets.get(addr.map.name)
        if sdef is not None and sdef.data_kinds not in (("addr",), ("addr", "int")):
            kinds = " . ".join(sdef.data_kinds) or "no data"
            raise NotFromAKernel(f"dnat to map @{addr.map.name[:60]}, whose data ({kinds}) is not an address")
        return
    for el in addr.map.elements:
        value = el.data.value if isinstance(el.data, Const) else el.data
        if not (isinstance(value, _ADDRESSES) or isinstance(value, tuple) and len(value) == 2
                and isinstance(value[0], _ADDRESSES) and type(value[1]) is int):
            raise NotFromAKernel(f"dnat to a map whose data {_short(str(value))} is not an address")


_ADDRESSES = (ipaddress.IPv4Address, ipaddress.IPv6Address)

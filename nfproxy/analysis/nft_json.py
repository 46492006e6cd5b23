"""`nft -j list ruleset` / `nft -j list table` output, read into the rule IR.

Public API: `parse(doc: dict) -> Ruleset` (one JSON document; it may hold several tables, of any
family, nfproxy's `nfproxy` and upstream kube-proxy's `kube-proxy` alike), and `ParseError`.

Expressions are translated generically, one JSON node kind at a time, so a change of layout
(e.g. a numgen-computed slot looked up in a shared map instead of an anonymous vmap) reads into
the same IR without a change here. Constants are read according to the kind of what they are
compared with: a set's declared type for its elements, the left-hand expression for a match.
"""

from __future__ import annotations

import ipaddress
import json
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
            doc = json.loads(doc)
        except (ValueError, RecursionError) as exc:
            raise ParseError(f"not valid JSON: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("nftables"), list):
        raise ParseError("not an `nft -j` document: no top-level \"nftables\" list")
    tables: dict[tuple[str, str], dict[str, Any]] = {}
    items = doc["nftables"]
    memo: _Memo = {}  # one for the document: a hairpin set repeats the endpoint maps' addresses
    # Sets first: rules are read against their declared types.
    for number, item in enumerate(items):
        with _Item(number, item) as (kind, obj):
            if kind == "table":
                _table_of(tables, obj)
            elif kind in ("set", "map"):
                _table_of(tables, obj)["sets"][_name(obj, "name")] = _set(kind, obj, memo, elements)
    for number, item in enumerate(items):
        with _Item(number, item) as (kind, obj):
            if kind == "chain":
                t = _table_of(tables, obj)
                t["chains"][_name(obj, "name")] = obj
                t["rules"].setdefault(obj["name"], [])
            elif kind == "rule":
                t = _table_of(tables, obj)
                rule = _rule(obj, t["sets"])
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


def _check_ports(data_types: list[Any], elements: tuple[Element, ...]) -> None:
    """The inet_service parts of a map's data (an endpoint map's `ip . port`) in range."""
    at = [i for i, name in enumerate(data_types) if name == "inet_service"]
    if not at:
        return
    single = len(data_types) == 1
    for el in elements:
        if el.data is None or not isinstance(el.data, Const):
            continue
        values = (el.data.value,) if single else el.data.value
        for i in at:
            try:
                check_port(values[i])  # type: ignore[index]
            except ValueError as exc:
                key = " . ".join(f"{k.low}-{k.high}" if isinstance(k, Range) else str(getattr(k, "value", k))
                                 for k in el.key)
                raise ValueError(f"element {key[:80]}: {exc}") from None


def _set(kind: str, obj: dict[str, Any], memo: _Memo | None = None, source: ElementSource | None = None) -> SetDef:
    key_kinds = _kinds(obj.get("type"))
    data_kinds = _kinds(obj.get("map")) if kind == "map" else ()
    if memo is None:
        memo = {}
    elements = None
    if source is not None and "elem" not in obj:
        elements = source(obj.get("family"), obj.get("table"), obj["name"], key_kinds, data_kinds, memo)  # type: ignore[arg-type]
    if elements is None:
        elements = _elements(obj.get("elem", []), key_kinds, data_kinds, memo)
    if kind == "map":
        _check_ports(_type_names(obj.get("map")), elements)
    flags = obj.get("flags", [])
    flags = frozenset([flags] if isinstance(flags, str) else flags)
    return SetDef(obj["name"], kind, key_kinds, data_kinds, elements, flags, int(obj.get("timeout", 0)))  # type: ignore[arg-type]


# Constants already read in this set, by (kind, type, printed value): a 10 000-service map
# repeats its protocols, ports and verdicts in every element; each is read once.
_Memo = dict[tuple[Any, ...], Any]


def _elements(raws: Any, key_kinds: tuple[Kind, ...], data_kinds: tuple[Kind, ...], memo: _Memo) -> tuple[Element, ...]:
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
                    key_range = Range(_memo_canonical(bounds[0], kind, memo), _memo_canonical(bounds[1], kind, memo))  # type: ignore[arg-type]
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
                c = known[part] = _memo_value(part, kind, memo)
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


def _fast_data(raw: Any, kinds: tuple[Kind, ...], known: list[dict[Any, Any]], memo: _Memo) -> Const:
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
            v = cache[part] = _memo_canonical(part, kind, memo)
        out.append(v)
    return Const(tuple(out) if len(out) > 1 else out[0])


def _element(raw: Any, key_kinds: tuple[Kind, ...], data_kinds: tuple[Kind, ...], memo: _Memo) -> Element:
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


def _memo_verdict(raw: Any, memo: _Memo) -> Verdict:
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


def _key(raw: Any, kinds: tuple[Kind, ...], memo: _Memo | None = None) -> tuple[Const | Prefix | Range, ...]:
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
    return tuple(_memo_value(p, k, memo) for p, k in zip(parts, kinds))


def _memo_value(raw: Any, kind: Kind, memo: _Memo) -> Const | Prefix | Range:
    if not isinstance(raw, (str, int)):
        return _value(raw, kind)
    key = (kind, type(raw), raw)
    found = memo.get(key)
    if found is None:
        # The canonical value as a map's data would hold it, read once per document (a hairpin
        # set's addresses are the endpoint maps' ones): what _value makes of a scalar.
        found = memo[key] = Const(_memo_canonical(raw, kind, memo))  # type: ignore[arg-type]
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


def _data_const(raw: Any, kinds: tuple[Kind, ...], memo: _Memo) -> Const:
    if isinstance(raw, dict) and "concat" in raw:
        parts = raw["concat"]
    else:
        parts = [raw]
    if len(parts) != len(kinds):
        raise ValueError(f"map data {raw!r} does not fit type {kinds}")
    values = tuple(_memo_canonical(p, k, memo) for p, k in zip(parts, kinds))
    return Const(values if len(values) > 1 else values[0])


def _memo_canonical(raw: Any, kind: Kind, memo: _Memo) -> object:
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


def _rule(obj: dict[str, Any], sets: dict[str, SetDef]) -> Rule:
    statements: list[Statement] = []
    exprs = obj.get("expr", [])
    if not isinstance(exprs, list):
        raise ValueError(f"expr must be a list, not {_short(exprs)}")
    for raw in exprs:
        st = _statement(raw, sets)
        if st is not None:
            statements.append(st)
    comment = obj.get("comment", "")
    return Rule(tuple(statements), comment if isinstance(comment, str) else str(comment), json.dumps(exprs))


def _statement(raw: Any, sets: dict[str, SetDef]) -> Statement | None:
    if not isinstance(raw, dict) or len(raw) != 1:
        return Unknown(json.dumps(raw))
    ((kind, body),) = raw.items()
    try:
        if kind == "match":
            return _match(body, sets)
        if kind in ("counter", "log", "comment", "notrack_ignored"):
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
            return _dnat(body, sets)
        if kind == "masquerade":
            if isinstance(body, dict) and "port" in body:
                return Unknown(json.dumps(raw))
            return Masquerade()
    except NotFromAKernel:
        raise
    except (KeyError, ValueError, TypeError, AttributeError, IndexError) as exc:
        return Unknown(f"{json.dumps(raw)} ({exc})")
    return Unknown(json.dumps(raw))


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


def _dnat(body: dict[str, Any], sets: dict[str, SetDef]) -> Statement:
    if not isinstance(body, dict) or "addr" not in body:
        return Unknown(json.dumps({"dnat": body}))
    addr_raw = body["addr"]
    if isinstance(addr_raw, str):
        addr: Expr = Const(address(addr_raw))
    else:
        addr = _expr(addr_raw)
    port: Expr | None = None
    if "port" in body:
        p = body["port"]
        port = Const(int(p)) if isinstance(p, int) else _expr(p)
        if isinstance(port, Const):
            check_port(port.value)
    return Dnat(addr, port)

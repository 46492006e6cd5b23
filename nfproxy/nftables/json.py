"""nft's JSON for nfproxy's objects: what `nft -j list table` prints after they are applied.

The in-memory kernel dumps it so that analysis/ (which reads kernel JSON) works without a
kernel. Rule bodies are printed from their statements (expr.py); a body of text has no JSON
here and raises ValueError naming it, rather than producing JSON the kernel would not print. The
output follows nft 1.0.6, quirks included (ct matches print op "in", chain and table comments
are not printed, a dynamic set prints flags ["timeout"] and size 65535, a numgen offset of
2^31 and more prints negative); a kernel test checks it against the kernel.
"""

from __future__ import annotations

import ipaddress
from typing import Any

from nfproxy.nftables import expr as x
from nfproxy.nftables.objects import Chain, Element, Map, Set

_INT_TYPES = {"inet_service", "integer", "mark"}
_MANGLE_OPS = {"or": "|", "xor": "^", "and": "&"}


def _scalar(text: str, kind: str | None = None) -> Any:
    """One constant as nft prints it: ints for ports, marks and integers, prefixes as objects."""
    if text.startswith("@"):
        return text
    if kind in _INT_TYPES or (kind is None and text.isdigit()):
        return int(text, 0)
    if "/" in text:
        addr, length = text.split("/")
        full = 32 if ":" not in addr else 128
        if int(length) == full:
            return addr
        return {"prefix": {"addr": addr, "len": int(length)}}
    if text.startswith("0x"):
        return int(text, 16)
    return text


def _value(v: x.Value) -> Any:
    return v if type(v) is int else _scalar(v)  # type: ignore[arg-type]


def _concat(texts: list[str], kinds: list[str | None]) -> Any:
    values = [_scalar(t, k) for t, k in zip(texts, kinds)]
    return values[0] if len(values) == 1 else {"concat": values}


def expression(e: x.Expr) -> Any:
    """A selector (or a concatenation, or bitwise) as nft's JSON prints it."""
    kind = type(e)
    if kind is x.Payload:
        return {"payload": {"protocol": e.protocol, "field": e.field}}  # type: ignore[union-attr]
    if kind is x.Meta:
        return {"meta": {"key": e.key}}  # type: ignore[union-attr]
    if kind is x.Ct:
        return {"ct": {"key": e.key}}  # type: ignore[union-attr]
    if kind is x.Fib:
        return {"fib": {"result": e.result, "flags": [e.field]}}  # type: ignore[union-attr]
    if kind is x.Numgen:
        offset = e.offset or 0  # type: ignore[union-attr]
        # nft 1.0.6 prints the u32 offset as a signed 32-bit number (2^31 and above negative)
        signed = offset - (1 << 32) if offset >= 1 << 31 else offset
        return {"numgen": {"mode": "random", "mod": e.mod, "offset": signed}}  # type: ignore[union-attr]
    if kind is x.Concat:
        return {"concat": [expression(p) for p in e.parts]}  # type: ignore[union-attr]
    if kind is x.Bitwise:
        return {_MANGLE_OPS[e.op]: [expression(e.left), e.value]}  # type: ignore[union-attr]
    raise ValueError(f"not an nft expression: {e!r}")


def verdict(v: x.Verdict) -> Any:
    return {v.kind: None} if v.chain is None else {v.kind: {"target": v.chain}}


def _anon_set(s: x.AnonSet) -> Any:
    # The kernel keeps an anonymous interval set sorted and prints a lone element bare.
    texts = sorted(map(str, s.items), key=lambda t: ipaddress.ip_network(t, strict=False) if t[0].isdigit() or ":" in t else t)
    items = [_scalar(t) for t in texts]
    return items[0] if len(items) == 1 else {"set": items}


def _vmap_data(target: str | x.AnonMap) -> Any:
    if type(target) is str:
        return f"@{target}"
    items = []
    for key, v in target.items:  # type: ignore[union-attr]
        items.append([{"range": [key.low, key.high]} if type(key) is x.Range else key, verdict(v)])
    return {"set": items}


def _match(m: x.Match) -> Any:
    right = _anon_set(m.right) if type(m.right) is x.AnonSet else _value(m.right)  # type: ignore[arg-type]
    op = "in" if type(m.left) is x.Ct and m.op == "==" else m.op
    return {"match": {"op": op, "left": expression(m.left), "right": right}}


def _dnat(d: x.Dnat) -> Any:
    to = d.to
    if type(to) is x.MapLookup:
        stmt: dict[str, Any] = {"addr": {"map": {"key": expression(to.key), "data": f"@{to.map}"}}}
        return {"dnat": {"family": d.family, **stmt} if d.family else stmt}
    out: dict[str, Any] = {"addr": to}
    if d.port is not None:
        out["port"] = d.port
    return {"dnat": out}


def statement(s: x.Statement, family: str) -> Any:
    """One statement of a rule body as nft's JSON prints it (a comment is the rule's, not one)."""
    kind = type(s)
    if kind is x.Match:
        return _match(s)  # type: ignore[arg-type]
    if kind is x.Verdict:
        return verdict(s)  # type: ignore[arg-type]
    if kind is x.Lookup:
        return {"match": {"op": "==", "left": expression(s.key), "right": f"@{s.set}"}}  # type: ignore[union-attr]
    if kind is x.VerdictMap:
        return {"vmap": {"key": expression(s.key), "data": _vmap_data(s.map)}}  # type: ignore[union-attr]
    if kind is x.Counter:
        return {"counter": s.name if s.name is not None else {"packets": 0, "bytes": 0}}  # type: ignore[union-attr]
    if kind is x.Dnat:
        return _dnat(s)  # type: ignore[arg-type]
    if kind is x.Masquerade:
        return {"masquerade": {"flags": "fully-random"} if s.fully_random else None}  # type: ignore[union-attr]
    if kind is x.Reject:
        return {"reject": {"type": "icmp" if family == "ip" else "icmpv6", "expr": "port-unreachable"}}
    if kind is x.MetaSet:
        return {"mangle": {"key": expression(s.meta), "value": expression(s.value)}}  # type: ignore[union-attr]
    if kind is x.SetUpdate:
        return {"set": {"op": "update", "elem": expression(s.key), "set": f"@{s.set}"}}  # type: ignore[union-attr]
    raise ValueError(f"not a statement nft's JSON prints: {s!r}")


def rule(family: str, table: str, chain: str, body: x.Body | str, handle: int) -> dict[str, Any]:
    if type(body) is str or x.is_raw(body):  # type: ignore[arg-type]
        raise ValueError(f"rule body outside the JSON vocabulary (text): {body}")
    comment = None
    exprs = []
    for s in body:
        if type(s) is x.Comment:
            comment = s.text  # type: ignore[union-attr]
        else:
            exprs.append(statement(s, family))
    out: dict[str, Any] = {"family": family, "table": table, "chain": chain, "handle": handle}
    if comment is not None:
        out["comment"] = comment
    out["expr"] = exprs
    return {"rule": out}


def chain(family: str, table: str, c: Chain, handle: int) -> dict[str, Any]:
    out: dict[str, Any] = {"family": family, "table": table, "name": c.name, "handle": handle}
    if c.hook is not None:
        out.update(type=c.type, hook=c.hook, prio=int(c.priority or 0), policy="accept")
    return {"chain": out}


def _types(text: str) -> list[str]:
    return [t.strip() for t in text.split(" . ")]


def set_(family: str, table: str, s: Set | Map, elements: list[Element], handle: int) -> dict[str, Any]:
    kind = "map" if isinstance(s, Map) else "set"
    if s.type is not None:
        key_text, _, data_text = s.type.partition(" : ")
        key_types = _types(key_text)
        data_types = _types(data_text) if data_text else []
        type_field: Any = key_types if len(key_types) > 1 else key_types[0]
        data_field: Any = data_text
    else:  # typeof numgen ... : ADDR . PROTO dport (the shard maps)
        key_types, data_types = ["integer"], [f"{family}_addr".replace("ip_", "ipv4_").replace("ip6_", "ipv6_"), "inet_service"]
        type_field, data_field = "integer", " . ".join(data_types)
    out: dict[str, Any] = {"family": family, "name": s.name, "table": table, "type": type_field, "handle": handle}
    flags = list(s.flags)
    if isinstance(s, Map) and s.size is not None:
        out["size"] = s.size
    if "dynamic" in flags:
        out["size"] = 65535
        flags = [f for f in flags if f != "dynamic"]
    if flags:
        out["flags"] = flags
    if isinstance(s, Set) and s.timeout is not None:
        out["timeout"] = s.timeout
    if s.comment:
        out["comment"] = s.comment
    if kind == "map":
        out["map"] = data_field
    counted = isinstance(s, Map) and s.counter
    if elements:
        interval = "interval" in s.flags
        out["elem"] = [_element(e, key_types, data_types, kind, counted, interval) for e in elements]
    if counted:  # per-element counters, as fresh (nothing counted in memory)
        out["stmt"] = [{"counter": None}]
    return {kind: out}


def _element(
    e: Element, key_types: list[str], data_types: list[str], kind: str, counted: bool = False, interval: bool = False
) -> Any:
    if interval and "-" in e.key:  # `LOW-HIGH` of an interval set (a range of one value is bare)
        low, _, high = e.key.partition("-")
        key: Any = {"range": [_scalar(low, key_types[0]), _scalar(high, key_types[0])]}
    else:
        key = _concat(e.key.split(" . "), key_types)  # type: ignore[arg-type]
    if e.comment or counted:
        key = {"elem": {"val": key, **({"comment": e.comment} if e.comment else {}),
                        **({"counter": {"packets": 0, "bytes": 0}} if counted else {})}}
    if kind == "set":
        return key
    if data_types == ["verdict"]:
        v = e.value.split(" ")
        value: Any = {v[0]: {"target": v[1]}} if len(v) == 2 else {v[0]: None}
    else:
        value = _concat(e.value.split(" . "), data_types)  # type: ignore[arg-type]
    return [key, value]

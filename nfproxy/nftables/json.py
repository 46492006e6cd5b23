"""nft's JSON for nfproxy's objects: what `nft -j list table` prints after they are applied.

The in-memory kernel dumps it so that analysis/ (which reads kernel JSON) works without a
kernel. Rule bodies are read for the statement vocabulary nfproxy writes (selectors, relations,
verdicts, NAT, mark arithmetic, anonymous sets and vmaps); a body outside it raises ValueError
naming it, rather than producing JSON the kernel would not print. The output follows nft 1.0.6,
quirks included (ct state matches print op "in", chain and table comments are not printed, a
dynamic set prints flags ["timeout"] and size 65535); a kernel test checks it against the
kernel.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Any

from nfproxy.nftables.objects import Chain, Element, Map, Set

_TOKEN = re.compile(r'"[^"]*"|[{},]|[^\s{},]+')
_INT_TYPES = {"inet_service", "integer", "mark"}
_SELECTORS = {
    ("ip", "saddr"), ("ip", "daddr"), ("ip6", "saddr"), ("ip6", "daddr"), ("th", "dport"), ("th", "sport"),
    ("tcp", "dport"), ("udp", "dport"), ("sctp", "dport"),
}
_VERDICTS = ("accept", "drop", "return", "continue")


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


def _concat(texts: list[str], kinds: list[str | None]) -> Any:
    values = [_scalar(t, k) for t, k in zip(texts, kinds)]
    return values[0] if len(values) == 1 else {"concat": values}


class _Body:
    """Reads one rule body into nft JSON statements."""

    def __init__(self, body: str, family: str) -> None:
        self.toks = _TOKEN.findall(body)
        self.i = 0
        self.family = family
        self.body = body
        self.comment: str | None = None

    def fail(self, why: str) -> ValueError:
        return ValueError(f"rule body outside the JSON vocabulary ({why}): {self.body}")

    def peek(self, k: int = 0) -> str | None:
        j = self.i + k
        return self.toks[j] if j < len(self.toks) else None

    def take(self) -> str:
        t = self.peek()
        if t is None:
            raise self.fail("unexpected end")
        self.i += 1
        return t

    def selector(self) -> Any | None:
        a, b = self.peek(), self.peek(1)
        if (a, b) in _SELECTORS:
            self.i += 2
            return {"payload": {"protocol": a, "field": b}}
        if a == "meta" and b in ("l4proto", "mark"):
            self.i += 2
            return {"meta": {"key": b}}
        if a == "ct" and b in ("state", "status"):
            self.i += 2
            return {"ct": {"key": b}}
        if a == "fib" and b in ("saddr", "daddr") and self.peek(2) == "type":
            self.i += 3
            return {"fib": {"result": "type", "flags": [b]}}
        if a == "numgen" and b == "random" and self.peek(2) == "mod":
            self.i += 3
            mod = int(self.take())
            offset = 0
            if self.peek() == "offset":
                self.i += 1
                offset = int(self.take())
            # nft 1.0.6 prints the u32 offset as a signed 32-bit number (2^31 and above negative)
            signed = offset - (1 << 32) if offset >= 1 << 31 else offset
            return {"numgen": {"mode": "random", "mod": mod, "offset": signed}}
        return None

    def selectors(self) -> list[Any] | None:
        first = self.selector()
        if first is None:
            return None
        out = [first]
        while self.peek() == ".":
            self.i += 1
            nxt = self.selector()
            if nxt is None:
                raise self.fail("a concatenation of something else")
            out.append(nxt)
        return out

    def verdict(self) -> Any | None:
        t = self.peek()
        if t in ("jump", "goto"):
            self.i += 1
            return {t: {"target": self.take()}}
        if t in _VERDICTS:
            self.i += 1
            return {t: None}
        return None

    def anon_vmap(self) -> Any:
        if self.take() != "{":
            raise self.fail("vmap without braces")
        items = []
        while self.peek() != "}":
            key = self.take()
            if self.take() != ":":
                raise self.fail("vmap element")
            v = self.verdict()
            if v is None:
                raise self.fail("vmap value")
            low, dash, high = key.partition("-")  # `LOW-HIGH`: an interval map's range
            items.append([{"range": [int(low), int(high)]} if dash else int(key), v])
            if self.peek() == ",":
                self.i += 1
        self.i += 1
        return {"set": items}

    def anon_set(self) -> Any:
        self.i += 1  # {
        texts = []
        while self.peek() != "}":
            t = self.take()
            if t != ",":
                texts.append(t)
        self.i += 1
        # The kernel keeps an anonymous interval set sorted and prints a lone element bare.
        texts.sort(key=lambda t: ipaddress.ip_network(t, strict=False) if t[0].isdigit() or ":" in t else t)
        items = [_scalar(t) for t in texts]
        return items[0] if len(items) == 1 else {"set": items}

    def statements(self) -> list[Any]:
        out: list[Any] = []
        while self.peek() is not None:
            t = self.peek()
            if t == "comment":
                self.i += 1
                self.comment = self.take().strip('"')
                continue
            v = self.verdict()
            if v is not None:
                out.append(v)
                continue
            if t == "counter":
                self.i += 1
                if self.peek() == "name":
                    self.i += 1
                    out.append({"counter": self.take()})
                else:
                    out.append({"counter": {"packets": 0, "bytes": 0}})
                continue
            if t == "reject":
                self.i += 1
                out.append({"reject": {"type": "icmp" if self.family == "ip" else "icmpv6", "expr": "port-unreachable"}})
                continue
            if t == "masquerade":
                self.i += 1
                stmt: dict[str, Any] = {}
                if self.peek() == "fully-random":
                    self.i += 1
                    stmt["flags"] = "fully-random"
                out.append({"masquerade": stmt or None})
                continue
            if t == "update":
                self.i += 1
                name = self.take()
                if self.take() != "{":
                    raise self.fail("update without an element")
                elem = self.selectors()
                if elem is None or self.take() != "}":
                    raise self.fail("update element")
                out.append({"set": {"op": "update", "elem": elem[0] if len(elem) == 1 else {"concat": elem}, "set": name}})
                continue
            if t == "dnat":
                out.append(self.dnat())
                continue
            if t == "meta" and self.peek(1) == "mark" and self.peek(2) == "set":
                self.i += 3
                if self.take() != "meta" or self.take() != "mark":
                    raise self.fail("mark arithmetic")
                op = {"or": "|", "xor": "^", "and": "&"}.get(self.take())
                if op is None:
                    raise self.fail("mark operator")
                out.append({"mangle": {"key": {"meta": {"key": "mark"}}, "value": {op: [{"meta": {"key": "mark"}}, _scalar(self.take())]}}})
                continue
            out.append(self.relation())
        return out

    def dnat(self) -> Any:
        self.i += 1
        family = None
        if self.peek() in ("ip", "ip6"):
            family = self.take()
        if self.take() != "to":
            raise self.fail("dnat without to")
        if self.peek() == "numgen":
            key = self.selector()
            if self.take() != "map":
                raise self.fail("dnat map")
            stmt: dict[str, Any] = {"addr": {"map": {"key": key, "data": self.take()}}}
            return {"dnat": {"family": family, **stmt} if family else stmt}
        dest = self.take()
        m = re.fullmatch(r"\[(.+)\]:(\d+)|([^:]+):(\d+)", dest)
        if m is None:
            raise self.fail("dnat destination")
        addr, port = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
        return {"dnat": {"addr": addr, "port": int(port)}}

    def relation(self) -> Any:
        sels = self.selectors()
        if sels is None:
            raise self.fail(f"{self.peek()!r}")
        left = sels[0] if len(sels) == 1 else {"concat": sels}
        if self.peek() == "vmap":
            self.i += 1
            data = self.anon_vmap() if self.peek() == "{" else self.take()
            return {"vmap": {"key": left, "data": data}}
        if self.peek() == "and":
            self.i += 1
            mask = _scalar(self.take())
            left = {"&": [left, mask]}
        op = "=="
        if self.peek() in ("==", "!="):
            op = self.take()
        if self.peek() == "{":
            right = self.anon_set()
        else:
            right = _scalar(self.take())
        if "ct" in sels[0] and op == "==":
            op = "in"
        return {"match": {"op": op, "left": left, "right": right}}


def rule(family: str, table: str, chain: str, body: str, handle: int) -> dict[str, Any]:
    b = _Body(body, family)
    expr = b.statements()
    out: dict[str, Any] = {"family": family, "table": table, "chain": chain, "handle": handle}
    if b.comment is not None:
        out["comment"] = b.comment
    out["expr"] = expr
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

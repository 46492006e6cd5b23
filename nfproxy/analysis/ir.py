"""One rule IR for everything the analysis reads back: iptables-save/restore text and nft JSON.

Public API (other modules code against these names):

- `Ruleset(tables)`: what one dump holds; `Ruleset.table(family, name)`, `.chain(...)`.
- `Table(family, name, dialect, chains, sets)`: `dialect` is "iptables" or "nft"; `family` "ip"/"ip6".
- `Chain(name, rules, hook, type, priority, policy)`: a base chain has a hook; iptables built-in
  chains get their table's fixed priority so that both dialects are ordered on one scale.
- `Rule(statements, comment, text)`: statements run in order; `text` is the rule as read, for
  messages.
- `SetDef(name, kind, key_kinds, data_kinds, elements, flags, timeout)`: named sets and maps.

The IR is nft-shaped (a rule is a list of statements, a match compares an expression with an
operand) because nft's model is the more general one: every iptables match used by kube-proxy
has an exact nft counterpart (`-m addrtype --dst-type LOCAL` is `fib daddr type local`, `-m mark`
is `meta mark & mask == value`, `-m recent --rcheck` is a lookup in a dynamic set). The
interpreter therefore needs one evaluation rule per concept, not one per dialect. Anything a
parser does not understand becomes `Unknown(text)`, which the interpreter refuses to guess about.

Values are canonical: addresses are `ipaddress` objects, ports and marks ints, protocols their
lower-case names (`tcp`), symbols (`local`, `new`, `dnat`) lower-case strings. Each operand is
converted according to the kind of the expression it is compared with (`Kind`), so "6" and "tcp"
mean the same protocol whichever dialect wrote them.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Literal, Union

Address = Union[ipaddress.IPv4Address, ipaddress.IPv6Address]
Network = Union[ipaddress.IPv4Network, ipaddress.IPv6Network]

# What kind of value an expression yields; decides how constants compared with it are read.
Kind = Literal["addr", "proto", "int", "symbol", "verdict", "unknown"]

PROTOCOL_NAMES = {1: "icmp", 6: "tcp", 17: "udp", 58: "ipv6-icmp", 132: "sctp", 33: "dccp"}
PROTOCOL_NUMBERS = {v: k for k, v in PROTOCOL_NAMES.items()} | {"icmpv6": 58}


# --------------------------------------------------------------------------------------------
# Expressions: what a rule reads from the packet or its state.


@dataclass(frozen=True, slots=True)
class Field:
    """A packet or metadata field: saddr, daddr, sport, dport, l4proto, mark, iifname, ...

    `proto` is set when the field only exists for one transport protocol (nft `tcp dport`,
    iptables `-m tcp --dport`): the expression then does not match other protocols at all.
    """

    name: str
    proto: str | None = None


@dataclass(frozen=True, slots=True)
class Fib:
    """Address type of saddr or daddr (`fib daddr type`, `-m addrtype --dst-type`)."""

    target: Literal["saddr", "daddr"]


@dataclass(frozen=True, slots=True)
class Ct:
    """Conntrack state or status, as a set of flags (`ct state new`, `--ctstate NEW,DNAT`)."""

    key: Literal["state", "status"]


@dataclass(frozen=True, slots=True)
class Numgen:
    """`numgen random mod N offset K`: uniform-ish over K..K+N-1 (see quantize.numgen_buckets)."""

    mod: int
    offset: int = 0


@dataclass(frozen=True, slots=True)
class Concat:
    items: tuple[Expr, ...]


@dataclass(frozen=True, slots=True)
class Bitwise:
    op: Literal["&", "|", "^"]
    left: Expr
    right: int


@dataclass(frozen=True, slots=True)
class MapLookup:
    """`KEY map @m` / `KEY map { k : v, ... }`: a value looked up in a data map."""

    key: Expr
    map: SetRef | AnonSet


@dataclass(frozen=True, slots=True)
class Const:
    value: int | str | Address | tuple


# --------------------------------------------------------------------------------------------
# Operands: the right-hand side of a match, and set elements.


@dataclass(frozen=True, slots=True)
class Prefix:
    network: Network


@dataclass(frozen=True, slots=True)
class Range:
    low: int | Address
    high: int | Address


@dataclass(frozen=True, slots=True)
class SetRef:
    name: str


@dataclass(frozen=True, slots=True)
class AnonSet:
    """An anonymous set (values) or map (`data` per element, None for a plain set)."""

    elements: tuple[Element, ...]


@dataclass(frozen=True, slots=True)
class Element:
    """One key (a tuple with one item per concatenated component) and its data, if a map."""

    key: tuple[Const | Prefix | Range, ...]
    data: Verdict | Const | None = None
    comment: str = ""


Expr = Union[Field, Fib, Ct, Numgen, Concat, Bitwise, MapLookup, Const]
Operand = Union[Const, Prefix, Range, SetRef, AnonSet]


# --------------------------------------------------------------------------------------------
# Statements.


@dataclass(frozen=True, slots=True)
class Match:
    """`left op right`. `==` is equality or membership; `!=` its negation. For flag values
    (ct state/status) `==` means "any of the flags is set", as nft's implicit `in` does."""

    left: Expr
    op: Literal["==", "!=", "<", "<=", ">", ">="]
    right: Operand


@dataclass(frozen=True, slots=True)
class Statistic:
    """iptables `-m statistic --mode random --probability P`, P kept exactly as printed."""

    probability: str
    negate: bool = False


@dataclass(frozen=True, slots=True)
class SetUpdate:
    """Record the key in a dynamic set (nft `update @s { ip saddr }`, iptables `recent --set`):
    session-affinity pinning. No effect on a first packet's own path."""

    set: str
    key: Expr


@dataclass(frozen=True, slots=True)
class MarkSet:
    value: Expr


@dataclass(frozen=True, slots=True)
class Dnat:
    """DNAT to `addr` (an expression yielding an address, or an address . port concat) and an
    optional `port` expression."""

    addr: Expr
    port: Expr | None = None


@dataclass(frozen=True, slots=True)
class Masquerade:
    pass


@dataclass(frozen=True, slots=True)
class Verdict:
    kind: Literal["accept", "drop", "reject", "return", "jump", "goto", "continue"]
    target: str = ""


@dataclass(frozen=True, slots=True)
class VerdictMap:
    key: Expr
    map: SetRef | AnonSet


@dataclass(frozen=True, slots=True)
class Unknown:
    """Something no parser here understands; the interpreter refuses to assume it matches."""

    text: str


Statement = Union[Match, Statistic, SetUpdate, MarkSet, Dnat, Masquerade, Verdict, VerdictMap, Unknown]


# --------------------------------------------------------------------------------------------
# Containers.


@dataclass(frozen=True, slots=True)
class Rule:
    statements: tuple[Statement, ...]
    comment: str = ""
    text: str = ""
    line: int = field(default=0, compare=False)  # where the text format read it; 0: no lines

    def verdicts(self) -> Iterator[Verdict]:
        """Every verdict this rule can take, including those inside verdict maps it uses
        with an anonymous map (named maps are resolved by the caller)."""
        for st in self.statements:
            if isinstance(st, Verdict):
                yield st
            elif isinstance(st, VerdictMap) and isinstance(st.map, AnonSet):
                for el in st.map.elements:
                    if isinstance(el.data, Verdict):
                        yield el.data


@dataclass(frozen=True, slots=True)
class Chain:
    name: str
    rules: tuple[Rule, ...] = ()
    hook: str | None = None  # prerouting, input, forward, output, postrouting
    type: str | None = None  # filter, nat, route
    priority: int = 0
    policy: str = "accept"

    @property
    def is_base(self) -> bool:
        return self.hook is not None


@dataclass(frozen=True, slots=True)
class SetDef:
    """A named set or map. `key_kinds`/`data_kinds` say how its elements were read; a set
    with `dynamic` True is filled by the packet path (affinity), not by the dump's author."""

    name: str
    kind: Literal["set", "map"]
    key_kinds: tuple[Kind, ...]
    data_kinds: tuple[Kind, ...] = ()
    elements: tuple[Element, ...] = ()
    flags: frozenset[str] = frozenset()
    timeout: int = 0

    @property
    def dynamic(self) -> bool:
        return bool({"dynamic", "timeout"} & self.flags)


@dataclass(frozen=True, slots=True)
class Table:
    family: str  # "ip", "ip6", "inet"
    name: str
    dialect: Literal["iptables", "nft"]
    chains: Mapping[str, Chain] = field(default_factory=dict)
    sets: Mapping[str, SetDef] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, weakref_slot=True)
class Ruleset:
    tables: tuple[Table, ...] = ()

    def table(self, family: str, name: str) -> Table | None:
        for t in self.tables:
            if t.family == family and t.name == name:
                return t
        return None

    def merged(self, other: Ruleset) -> Ruleset:
        return Ruleset(self.tables + other.tables)

    @property
    def families(self) -> frozenset[str]:
        return frozenset(t.family for t in self.tables)


# --------------------------------------------------------------------------------------------
# Canonical values, shared by both parsers.


def kind_of(expr: Expr) -> Kind | tuple[Kind, ...]:
    """What kind of value `expr` yields, so constants compared with it can be read right."""
    if isinstance(expr, Field):
        if expr.name in ("saddr", "daddr"):
            return "addr"
        if expr.name == "l4proto":
            return "proto"
        if expr.name in ("sport", "dport", "mark"):
            return "int"
        return "symbol"
    if isinstance(expr, (Fib, Ct)):
        return "symbol"
    if isinstance(expr, (Numgen, Bitwise)):
        return "int"
    if isinstance(expr, Concat):
        out: list[Kind] = []
        for item in expr.items:
            k = kind_of(item)
            out.extend(k if isinstance(k, tuple) else (k,))
        return tuple(out)
    return "unknown"


def address(text: object) -> Address:
    """`ipaddress.ip_address`, 4x faster for dotted quads: a 10 000-service node's dump holds
    340 000 of them, and parsing them was two thirds of reading it back. `inet_pton` is as
    strict (no leading zeros, no short forms, no spaces); anything else (IPv6, errors) goes the
    general way, with its messages."""
    try:
        return ipaddress.IPv4Address(int.from_bytes(socket.inet_pton(socket.AF_INET, text), "big"))
    except (OSError, TypeError):
        return ipaddress.ip_address(text)


class OutOfRange(ValueError):
    """A value past what the kernel's field holds: a dump holding one was not read from a
    kernel, so a reader refuses it rather than keep the statement as one it cannot model."""


def canonical(value: object, kind: Kind) -> int | str | Address:
    """Read one printed value as `kind`; raises ValueError when it cannot be."""
    if kind == "addr":
        return address(str(value))
    if kind == "proto":
        if isinstance(value, int) or (isinstance(value, str) and value.isdigit()):
            n = int(_bounded(value, 3))
            if not 0 <= n <= 255:
                raise OutOfRange(f"protocol {n} out of range (0-255)")
            return PROTOCOL_NAMES.get(n, str(n))
        text = str(value).lower()
        return "ipv6-icmp" if text == "icmpv6" else text
    if kind == "int":
        if isinstance(value, int):
            return value
        return int(_bounded(str(value), 24), 0)
    return str(value).lower()


def _bounded(value: object, digits: int) -> object:
    """`value`, unless a text longer than any number the kernel's fields hold: refused before
    int() reads it, whose own limit (4 300 digits) would say so in Python's words."""
    if isinstance(value, str) and len(value) > digits:
        raise OutOfRange(f"{value[:20]!r}... ({len(value)} characters) is no number the kernel holds")
    return value


def endpoint_text(addr: object, port: object) -> str:
    """An endpoint as the reports print it: `ip:port`, IPv6 in brackets as in a URL."""
    text = str(addr)
    return f"[{text}]:{port}" if ":" in text else f"{text}:{port}"

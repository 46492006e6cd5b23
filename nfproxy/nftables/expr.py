"""nft rule bodies as data: the expressions and statements nfproxy's rules are made of.

A rule body is a `Body`, a tuple of statements (a match, a lookup, a verdict, a DNAT...), each a
frozen value whose fields are what nft's own grammar names: payload, meta, ct and fib
selectors, numgen, concatenations, relational matches, set lookups, verdict maps, NAT, counters.
The renderer knows all of that when it builds a rule, so nothing downstream reads it back out
of text: each printer (nft script text here, `nft -j` JSON in json.py, netlink messages in the
kernel) walks the same objects.

`str()` of an expression, and of a Body, is its nft syntax exactly as `nft -f` takes it; it is
the one text printer. `Raw` is the escape hatch: nft text for a rule that must go through
libnftables, which only the script text says. nfproxy's renderers never write one.

Rules are many (two per service port, 20 000 at 10 000 × 10) and a daemon keeps the last
ruleset it wrote, so values are small, hashable and shared: the fixed ones are module constants
(`ACCEPT`, `DROP`, `COUNTER`, the common selectors) and `numgen` draws are interned.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

# A constant as nft writes it: an address, a prefix, a word (`tcp`, `new`, `dnat`) or a number.
Value = str | int


# --------------------------------------------------------------------------------------------
# Selectors: what a packet or its connection is, as an expression of a match or a key.


@dataclass(frozen=True, slots=True)
class Payload:
    """A header field: `ip saddr`, `ip6 daddr`, `th dport`."""

    protocol: str
    field: str

    def __str__(self) -> str:
        return f"{self.protocol} {self.field}"


# Meta keys nft writes without the `meta` keyword.
UNQUALIFIED_META = frozenset({"iifname", "oifname"})
# Keys whose values are strings, which nft writes quoted.
STRING_META = frozenset({"iifname", "oifname"})


@dataclass(frozen=True, slots=True)
class Meta:
    """Packet metadata: `meta l4proto`, `meta mark`, `iifname`."""

    key: str

    def __str__(self) -> str:
        return self.key if self.key in UNQUALIFIED_META else f"meta {self.key}"


@dataclass(frozen=True, slots=True)
class Ct:
    """Connection tracking state of the packet's connection: `ct state`, `ct status`."""

    key: str

    def __str__(self) -> str:
        return f"ct {self.key}"


@dataclass(frozen=True, slots=True)
class Fib:
    """A routing lookup on one address of the packet: `fib daddr type` (is it local?)."""

    field: str  # "saddr" or "daddr"
    result: str = "type"

    def __str__(self) -> str:
        return f"fib {self.field} {self.result}"


@dataclass(frozen=True, slots=True)
class Numgen:
    """A random number in [offset, offset + mod): `numgen random mod 3 offset 6`. Without an
    offset nft draws from 0 and the text says none."""

    mod: int
    offset: int | None = None

    def __str__(self) -> str:
        if self.offset is None:
            return f"numgen random mod {self.mod}"
        return f"numgen random mod {self.mod} offset {self.offset}"


@dataclass(frozen=True, slots=True)
class Concat:
    """Selectors joined into one key: `ip daddr . meta l4proto . th dport`."""

    parts: tuple[Expr, ...]

    def __str__(self) -> str:
        return " . ".join(map(str, self.parts))


@dataclass(frozen=True, slots=True)
class Bitwise:
    """A selector combined with a constant: `meta mark and 0x4000`. Marks are written in hex."""

    left: Expr
    op: str  # "and", "or", "xor"
    value: int

    def __str__(self) -> str:
        return f"{self.left!s} {self.op} {self.value:#x}"


# --------------------------------------------------------------------------------------------
# Anonymous sets and maps, written inside a rule.


@dataclass(frozen=True, slots=True)
class Range:
    """A closed interval of integers, a key of an interval vmap: `0-4`."""

    low: int
    high: int

    def __str__(self) -> str:
        return f"{self.low}-{self.high}"


@dataclass(frozen=True, slots=True)
class AnonSet:
    """`{ 10.0.0.0/8, 192.168.0.1 }`: constants a match compares against."""

    items: tuple[Value, ...]

    def __str__(self) -> str:
        return f"{{ {', '.join(map(str, self.items))} }}"


@dataclass(frozen=True, slots=True)
class Verdict:
    """`accept`, `drop`, `return`, `continue`, or `jump`/`goto` a chain."""

    kind: str
    chain: str | None = None

    def __str__(self) -> str:
        return self.kind if self.chain is None else f"{self.kind} {self.chain}"


@dataclass(frozen=True, slots=True)
class AnonMap:
    """`{ 0 : goto a , 1-3 : goto b }`: a verdict per key, written inside the rule."""

    items: tuple[tuple[int | Range, Verdict], ...]

    def __str__(self) -> str:
        return f"{{ {' , '.join([f'{k!s} : {v!s}' for k, v in self.items])} }}"


# --------------------------------------------------------------------------------------------
# Statements: what a body is a tuple of.


@dataclass(frozen=True, slots=True)
class Match:
    """A relational match: `ip daddr 10.0.0.1`, `ip saddr != { ... }`, `meta mark and 0x4000 ==
    0`. The operator `==` is implicit in the text but after a bitwise selector, as nft prints it."""

    left: Expr
    right: Value | AnonSet
    op: str = "=="  # or "!="

    def __str__(self) -> str:
        left, right = self.left, self.right
        kind = type(left)
        if kind is Meta and left.key in STRING_META and type(right) is str:  # type: ignore[union-attr]
            right = f'"{right}"'
        if kind is Bitwise or self.op != "==":
            return f"{left!s} {self.op} {right!s}"
        return f"{left!s} {right!s}"


@dataclass(frozen=True, slots=True)
class Lookup:
    """Is the key in a named set: `ip daddr @cluster-ips`."""

    key: Expr
    set: str

    def __str__(self) -> str:
        return f"{self.key!s} @{self.set}"


@dataclass(frozen=True, slots=True)
class MapLookup:
    """The value a named data map holds for the key: `numgen random mod 10 map @endpoints-0`."""

    key: Expr
    map: str

    def __str__(self) -> str:
        return f"{self.key!s} map @{self.map}"


@dataclass(frozen=True, slots=True)
class VerdictMap:
    """The verdict a map holds for the key: `... vmap @service-ips` or `... vmap { 0 : goto a }`."""

    key: Expr
    map: str | AnonMap

    def __str__(self) -> str:
        target = self.map
        return f"{self.key!s} vmap {target!s}" if type(target) is AnonMap else f"{self.key!s} vmap @{target}"


@dataclass(frozen=True, slots=True)
class Counter:
    """The counter statement: anonymous (`counter`) or into a named counter (`counter name x`)."""

    name: str | None = None

    def __str__(self) -> str:
        return "counter" if self.name is None else f"counter name {self.name}"


@dataclass(frozen=True, slots=True)
class Dnat:
    """Destination NAT to an address and port (`dnat to 10.0.0.1:80`, `dnat to [fd00::1]:80`)
    or to what a data map holds (`dnat ip to numgen random mod 2 map @m`: address . port)."""

    to: str | MapLookup
    port: int | None = None
    family: str | None = None

    def __str__(self) -> str:
        head = f"dnat {self.family} to " if self.family is not None else "dnat to "
        to = self.to
        if self.port is None:
            return f"{head}{to!s}"
        return f"{head}[{to}]:{self.port}" if ":" in to else f"{head}{to}:{self.port}"  # type: ignore[operator]


@dataclass(frozen=True, slots=True)
class Masquerade:
    fully_random: bool = False

    def __str__(self) -> str:
        return "masquerade fully-random" if self.fully_random else "masquerade"


@dataclass(frozen=True, slots=True)
class Reject:
    """`reject`: nft's default, an ICMP(v6) port unreachable."""

    def __str__(self) -> str:
        return "reject"


@dataclass(frozen=True, slots=True)
class MetaSet:
    """Packet metadata written: `meta mark set meta mark or 0x4000`."""

    meta: Meta
    value: Expr

    def __str__(self) -> str:
        return f"{self.meta!s} set {self.value!s}"


@dataclass(frozen=True, slots=True)
class SetUpdate:
    """Add the key to a dynamic set, or refresh its timeout: `update @affinity-x { ip saddr }`."""

    set: str
    key: Expr

    def __str__(self) -> str:
        return f"update @{self.set} {{ {self.key!s} }}"


@dataclass(frozen=True, slots=True)
class Comment:
    """The rule's comment. nft keeps it beside the expressions (user data), not among them; it
    is written last, as nft lists it."""

    text: str

    def __str__(self) -> str:
        return f'comment "{self.text}"'


@dataclass(frozen=True, slots=True)
class Raw:
    """nft rule text kept as text: the escape hatch for a rule no typed statement says, which
    must go through libnftables (only the script text carries it)."""

    text: str

    def __str__(self) -> str:
        return self.text


Expr = Payload | Meta | Ct | Fib | Numgen | Concat | Bitwise
Statement = Match | Lookup | VerdictMap | Verdict | Counter | Dnat | Masquerade | Reject | MetaSet | SetUpdate | Comment | Raw
STATEMENTS: tuple[type, ...] = (
    Match, Lookup, VerdictMap, Verdict, Counter, Dnat, Masquerade, Reject, MetaSet, SetUpdate, Comment, Raw,
)


class Body(tuple):  # type: ignore[type-arg]
    """A rule body: its statements in order. `str()` is the body's nft text (the script, a log
    line, the command an error names)."""

    __slots__ = ()

    def __str__(self) -> str:
        return " ".join(map(str, self))

    def __repr__(self) -> str:
        return f"Body({tuple.__repr__(self)})"


def body(*statements: Statement) -> Body:
    """A Body of `statements`."""
    return Body(statements)


def raw(text: str) -> Body:
    """A body of nft text, kept as text (`Raw`)."""
    return Body((Raw(text),))


def text(b: Body | Iterable[Statement]) -> str:
    """The body's nft syntax (`str()` of a Body)."""
    return " ".join(map(str, b))


def is_raw(b: Body) -> bool:
    """Whether `b` holds text that only the text printer can say."""
    return any(type(s) is Raw for s in b)


# --------------------------------------------------------------------------------------------
# Shared values: the words most rules use, one object each.

ACCEPT = Verdict("accept")
DROP = Verdict("drop")
RETURN = Verdict("return")
CONTINUE = Verdict("continue")
COUNTER = Counter()
REJECT = Reject()
MASQUERADE = Masquerade()
L4PROTO = Meta("l4proto")
MARK = Meta("mark")
CT_STATE = Ct("state")
CT_STATUS = Ct("status")

_PAYLOADS: dict[tuple[str, str], Payload] = {}
_NUMGENS: dict[tuple[int, int | None], Numgen] = {}


def payload(protocol: str, field: str) -> Payload:
    """The shared Payload of `protocol field`."""
    found = _PAYLOADS.get((protocol, field))
    if found is None:
        found = _PAYLOADS[(protocol, field)] = Payload(protocol, field)
    return found


TH_DPORT = payload("th", "dport")


def numgen(mod: int, offset: int | None = None) -> Numgen:
    """The shared Numgen of (mod, offset): a cluster's chains draw from a few hundred lanes."""
    found = _NUMGENS.get((mod, offset))
    if found is None:
        if len(_NUMGENS) > 65536:
            _NUMGENS.clear()
        found = _NUMGENS[(mod, offset)] = Numgen(mod, offset)
    return found


def jump(chain: str) -> Verdict:
    return Verdict("jump", chain)


def goto(chain: str) -> Verdict:
    return Verdict("goto", chain)


# --------------------------------------------------------------------------------------------
# Reading the objects: what a body names.


@dataclass(frozen=True, slots=True)
class Names:
    """The chains, sets (and maps) and named counters a body refers to."""

    chains: tuple[str, ...] = ()
    sets: tuple[str, ...] = ()
    counters: tuple[str, ...] = ()


NO_NAMES = Names()


def names(b: Iterable[Statement]) -> Names:
    """What `b` refers to by name. A Raw statement's names are not known: a reader that needs
    them refuses Raw first (`is_raw`)."""
    chains: list[str] = []
    sets: list[str] = []
    counters: list[str] = []
    for s in b:
        kind = type(s)
        if kind is Verdict:
            if s.chain is not None:  # type: ignore[union-attr]
                chains.append(s.chain)  # type: ignore[union-attr]
        elif kind is Lookup or kind is SetUpdate:
            sets.append(s.set)  # type: ignore[union-attr]
        elif kind is VerdictMap:
            target = s.map  # type: ignore[union-attr]
            if type(target) is AnonMap:
                chains.extend(v.chain for _, v in target.items if v.chain is not None)
            else:
                sets.append(target)  # type: ignore[arg-type]
        elif kind is Dnat:
            if type(s.to) is MapLookup:  # type: ignore[union-attr]
                sets.append(s.to.map)  # type: ignore[union-attr]
        elif kind is Counter:
            if s.name is not None:  # type: ignore[union-attr]
                counters.append(s.name)  # type: ignore[union-attr]
    if not (chains or sets or counters):
        return NO_NAMES
    return Names(tuple(chains), tuple(sets), tuple(counters))


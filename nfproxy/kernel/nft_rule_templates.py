"""Rule templates: a full sync's rules are a few shapes with different numbers in them.

At 10 000 services a full sync sends 20 000 rules, and nearly all are two shapes per endpoint
map: `ip daddr <A> ip saddr != <pods> jump mark-for-masquerade` and `meta l4proto tcp dnat ip to
numgen random mod <N> offset <K> map @<map>`. Compiling each through the rule compiler (kernel/nfnetlink/messages.py) and
encoding it (kernel/nft_wire.py) costs 35-50 µs a rule, most of a second of a full sync. A shape
is compiled here once per transaction; later rules of that shape copy its bytes and write
their own numbers in.

A shape is read from the rule's typed statements (nftables/expr.py), not from its text: the
statements in order, each number and IPv4 address they hold replaced by its kind.

Where a number's bytes are is not assumed, it is found: the rule is compiled again with that
one number changed, and the bytes that differ must be exactly the number's encoding (the
address's four bytes, an integer's low bytes in either byte order), everything else equal.
A shape that fails this (a number that changes the structure, is encoded twice or some other
way, a rule of more than one message) is compiled every time, as before. Integers are
templated per byte length and zero on its own, so a template is only ever used for values of
the size its bytes were checked with.

A map the batch declares (`@endpoints-tcp-ranges-12`) is a slot too, for names of one length
and one element type: the compiler's output depends on the name only through that type and the
name's own bytes, which the check above confirms (the rule compiled again with every character
of the name changed, the changed name standing for the same map, must differ in exactly the
name's bytes). Without it every endpoint map would be a shape of its own, learned by compiling
its rule three times: ~0.3 ms per map, and the maps are many when a map holds few lanes.

tests/test_nft_rule_templates.py holds the templated bytes equal to the compiler's for every rule
the renderers write in the test clusters.
"""

from __future__ import annotations

import dataclasses
import re
import socket
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass

from nfproxy.kernel.nfnetlink.messages import statements
from nfproxy.kernel.nfnetlink.values import Unsupported
from nfproxy.nftables import expr as x

_IPV4 = re.compile(r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)(?:\.(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)){3}")
_INT_LIMIT = 10**19  # numbers of up to 19 digits, as a template's slot holds at most 8 bytes
# Values written whole into a shape: no number of theirs is a slot (a counter's or a chain's name).
_ATOMS = frozenset({x.Payload, x.Meta, x.Ct, x.Fib, x.Verdict, x.Counter, x.Comment, x.Raw, x.Reject, x.Masquerade})
# The field that names a set or map, per statement.
_NAMED = {x.Lookup: "set", x.SetUpdate: "set", x.MapLookup: "map", x.VerdictMap: "map"}
_FIELDS: dict[type, tuple[str, ...]] = {}


@dataclass(frozen=True, slots=True)
class _Slot:
    """Where one number of the rule goes in the template's bytes."""

    at: int
    size: int
    order: str  # "big" or "little"; "ipv4" for an address, "name" for a map's name


@dataclass(frozen=True, slots=True)
class _MapName:
    """A map's name in a rule (`@name`), a value of the shape like its numbers."""

    name: str


Value = int | str | _MapName


@dataclass(frozen=True, slots=True)
class Template:
    body: bytes  # the rule's attributes after its table and chain, for the values it was made of
    slots: tuple[_Slot, ...]

    def fill(self, values: list[Value]) -> bytes:
        out = bytearray(self.body)
        for slot, value in zip(self.slots, values):
            if slot.order == "name":
                out[slot.at : slot.at + slot.size] = value.name.encode()  # type: ignore[union-attr]
            elif slot.order == "ipv4":
                out[slot.at : slot.at + 4] = socket.inet_aton(value)  # type: ignore[arg-type]
            else:
                out[slot.at : slot.at + slot.size] = value.to_bytes(slot.size, slot.order)  # type: ignore[union-attr, arg-type]
        return bytes(out)


# A rule body (its statements) -> its attributes after table and chain; may raise Unsupported.
# Called with a second argument, {changed name: map} (see _MapName), only when `map_kind` is given.
Compile = Callable[..., bytes]
MapKind = Callable[[str], Hashable | None]  # a map's name -> what its rules' bytes depend on, or None
Body = tuple[x.Statement, ...]


class RuleTemplates:
    """The shapes of one transaction's rules, learned as they come (their statements, and the
    kind of each map they name, are part of the shape, so a template never outlives what it was
    checked against)."""

    def __init__(self, compile_body: Compile, map_kind: MapKind | None = None) -> None:
        self._compile = compile_body
        self._map_kind = map_kind
        self._known: dict[tuple[Hashable, ...], Template | None] = {}

    def body(self, body: str | Iterable[x.Statement]) -> bytes | None:
        """The rule's attributes after table and chain, or None: compile it the usual way."""
        try:
            typed = statements(body, "")
        except Unsupported:
            return None
        shape, values = _shape(typed, self._map_kind)
        known = self._known.get(shape, False)
        if known is False:
            known = self._known[shape] = self._learn(typed, values)
        if known is None:
            return None
        return known.fill(values)

    def _learn(self, typed: Body, values: list[Value]) -> Template | None:
        try:
            body = self._compile(typed)
            slots: list[_Slot] = []
            for n, value in enumerate(values):
                if isinstance(value, _MapName):
                    other = _changed_name(value.name)
                    changed = _replaced(typed, n, other, self._map_kind)
                    slot = _locate_name(body, self._compile(changed, {other: value.name}), value.name)
                else:
                    changed = _replaced(typed, n, _changed(value), self._map_kind)
                    slot = _locate(body, self._compile(changed), value)
                if slot is None:
                    return None
                slots.append(slot)
        except Unsupported:
            return None
        return Template(body, tuple(slots))


def _fields(kind: type) -> tuple[str, ...]:
    found = _FIELDS.get(kind)
    if found is None:
        found = _FIELDS[kind] = tuple(f.name for f in dataclasses.fields(kind))
    return found


def _is_value(leaf: object) -> bool:
    """A number or an address: a slot of the shape. Zero stays a word (it may be said differently)."""
    if type(leaf) is int:
        return 0 < leaf < _INT_LIMIT  # type: ignore[operator]
    return type(leaf) is str and leaf[:1] in "123456789" and _IPV4.fullmatch(leaf) is not None  # type: ignore[index]


def _shape(typed: Body, map_kind: MapKind | None) -> tuple[tuple[Hashable, ...], list[Value]]:
    """A body's shape: its objects flattened in order (as _rebuild walks them), each number,
    address and declared map replaced by its kind; and the values so replaced."""
    shape: list[Hashable] = []
    values: list[Value] = []
    _flatten(typed, map_kind, shape, values)
    return tuple(shape), values


def _flatten(obj: object, map_kind: MapKind | None, shape: list[Hashable], values: list[Value]) -> None:
    """_shape's walk: a module function, not a closure, so that it makes no cycle holding the
    batch compiler (`map_kind` is its bound method) for a cyclic collection to free."""
    kind = type(obj)
    if kind is tuple or kind is x.Body:
        shape.append(len(obj))  # type: ignore[arg-type]
        for item in obj:  # type: ignore[attr-defined]
            _flatten(item, map_kind, shape, values)
    elif (kind is int or kind is str) and _is_value(obj):
        shape.append(f"\0int{(obj.bit_length() + 7) // 8}" if kind is int else "\0ipv4")  # type: ignore[union-attr]
        values.append(obj)  # type: ignore[arg-type]
    elif kind in _ATOMS or kind is int or kind is str or kind is bool or obj is None:
        shape.append(obj)  # type: ignore[arg-type]
    else:
        shape.append(kind)
        named = _NAMED.get(kind)
        for name in _fields(kind):
            value = getattr(obj, name)
            found = map_kind(value) if name == named and type(value) is str and map_kind is not None else None
            if found is not None:
                shape.append(("\0map", len(value), found))
                values.append(_MapName(value))
            else:
                _flatten(value, map_kind, shape, values)


def _replaced(typed: Body, n: int, new: str | int, map_kind: MapKind | None) -> Body:
    """`typed` with its n-th value (in _shape's order) replaced by `new`."""
    seen = [0]

    def leaf(value: object) -> object:
        seen[0] += 1
        return new if seen[0] == n + 1 else value

    return tuple(_rebuild(s, leaf, map_kind) for s in typed)


def _rebuild(obj: object, leaf: Callable[[object], object], map_kind: MapKind | None) -> object:
    """`obj` with each value _shape counts passed through `leaf`, in _shape's order."""
    kind = type(obj)
    if kind is tuple or kind is x.Body:
        return tuple(_rebuild(item, leaf, map_kind) for item in obj)  # type: ignore[attr-defined]
    if kind is int or kind is str:
        return leaf(obj) if _is_value(obj) else obj
    if kind in _ATOMS or kind is bool or obj is None:
        return obj
    changes = {}
    named = _NAMED.get(kind)
    for name in _fields(kind):
        value = getattr(obj, name)
        if name == named and type(value) is str and map_kind is not None and map_kind(value) is not None:
            changes[name] = leaf(value)
        else:
            changes[name] = _rebuild(value, leaf, map_kind)
    return dataclasses.replace(obj, **changes)  # type: ignore[type-var]


def _changed(value: int | str) -> int | str:
    """Another value of the same kind and size, differing in every byte that is written."""
    if isinstance(value, str):
        return ".".join(str(int(octet) ^ 0x5A or 0xA5) for octet in value.split("."))
    low = value & 0xFF
    other = low ^ 0x5A if low ^ 0x5A else low ^ 0xA5
    return value - low + other


def _changed_name(name: str) -> str:
    """A name of the same length differing in every character."""
    return "".join("b" if c == "a" else "a" for c in name)


def _locate_name(body: bytes, other: bytes, name: str) -> _Slot | None:
    """Where the map's name is in `body`, given `other` (the rule naming it otherwise): exactly
    the name's bytes must differ, and they must be the name."""
    if len(body) != len(other):
        return None
    diff = [i for i in range(len(body)) if body[i] != other[i]]
    at = diff[0] if diff else -1
    if diff != list(range(at, at + len(name))) or body[at : at + len(name)] != name.encode():
        return None
    return _Slot(at, len(name), "name")


def _locate(body: bytes, other: bytes, value: int | str) -> _Slot | None:
    """Where `value` is in `body`, given `other` (the same rule with it changed): exactly its
    bytes must differ."""
    if len(body) != len(other):
        return None
    diff = [i for i in range(len(body)) if body[i] != other[i]]
    if isinstance(value, str):
        at = diff[0] if diff else -1
        if diff != [at, at + 1, at + 2, at + 3] or body[at : at + 4] != socket.inet_aton(value):
            return None
        return _Slot(at, 4, "ipv4")
    if len(diff) != 1:
        return None
    size = (value.bit_length() + 7) // 8
    p = diff[0]
    if p - size + 1 >= 0 and body[p - size + 1 : p + 1] == value.to_bytes(size, "big"):
        return _Slot(p - size + 1, size, "big")
    if body[p : p + size] == value.to_bytes(size, "little"):
        return _Slot(p, size, "little")
    return None

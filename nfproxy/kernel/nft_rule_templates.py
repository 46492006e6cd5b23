"""Rule templates: a full sync's rules are a few shapes with different numbers in them.

At 10 000 services a full sync sends 20 000 rules, and nearly all are two shapes per endpoint
map: `ip daddr <A> ip saddr != <pods> jump mark-for-masquerade` and `meta l4proto tcp dnat ip to
numgen random mod <N> offset <K> map @<map>`. Compiling each through the rule compiler (kernel/nfnetlink/messages.py) and
encoding it (kernel/nft_wire.py) costs 35-50 µs a rule, most of a second of a full sync. A shape
is compiled here once per transaction; later rules of that shape copy its bytes and write
their own numbers in.

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

import re
import socket
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from nfproxy.kernel.nfnetlink.values import Unsupported, tokens

_IPV4 = re.compile(r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)(?:\.(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)){3}")
_INT = re.compile(r"[1-9]\d{0,18}")


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


# A rule body -> its attributes after table and chain; may raise Unsupported. Called with a second
# argument, {changed name: map} (see _MapName), only when `map_kind` is given.
Compile = Callable[..., bytes]
MapKind = Callable[[str], Hashable | None]  # a map's name -> what its rules' bytes depend on, or None


class RuleTemplates:
    """The shapes of one transaction's rules, learned as they come (their words, and the kind of
    each map they name, are part of the shape, so a template never outlives what it was checked
    against)."""

    def __init__(self, compile_body: Compile, map_kind: MapKind | None = None) -> None:
        self._compile = compile_body
        self._map_kind = map_kind
        self._known: dict[tuple[Hashable, ...], Template | None] = {}

    def body(self, text: str) -> bytes | None:
        """The rule's attributes after table and chain, or None: compile it the usual way."""
        toks = tokens(text)
        shape, values, where = _shape(toks, self._map_kind)
        known = self._known.get(shape, False)
        if known is False:
            known = self._known[shape] = self._learn(toks, values, where)
        if known is None:
            return None
        return known.fill(values)

    def _learn(self, toks: list[str], values: list[Value], where: list[int]) -> Template | None:
        try:
            body = self._compile(" ".join(toks))
            slots: list[_Slot] = []
            for value, at in zip(values, where):
                changed = list(toks)
                if isinstance(value, _MapName):
                    other = _changed_name(value.name)
                    changed[at] = "@" + other
                    slot = _locate_name(body, self._compile(" ".join(changed), {other: value.name}), value.name)
                else:
                    changed[at] = _changed(value)
                    slot = _locate(body, self._compile(" ".join(changed)), value)
                if slot is None:
                    return None
                slots.append(slot)
        except Unsupported:
            return None
        return Template(body, tuple(slots))


def _shape(toks: list[str], map_kind: MapKind | None) -> tuple[tuple[Hashable, ...], list[Value], list[int]]:
    """The rule's words with each number (and declared map) replaced by its kind, the values,
    their places."""
    shape: list[Hashable] = []
    values: list[Value] = []
    where: list[int] = []
    for i, tok in enumerate(toks):
        if tok[0] == "@" and map_kind is not None:
            kind = map_kind(tok[1:])
            if kind is not None:
                shape.append(("\0map", len(tok), kind))
                values.append(_MapName(tok[1:]))
                where.append(i)
                continue
        if tok[0] in "123456789":  # zero stays a word: it may be said differently
            if _INT.fullmatch(tok):
                value = int(tok)
                shape.append(f"\0int{(value.bit_length() + 7) // 8}")
                values.append(value)
                where.append(i)
                continue
            if _IPV4.fullmatch(tok):
                shape.append("\0ipv4")
                values.append(tok)
                where.append(i)
                continue
        shape.append(tok)
    return tuple(shape), values, where


def _changed(value: int | str) -> str:
    """Another value of the same kind and size, differing in every byte that is written."""
    if isinstance(value, str):
        return ".".join(str(int(octet) ^ 0x5A or 0xA5) for octet in value.split("."))
    low = value & 0xFF
    other = low ^ 0x5A if low ^ 0x5A else low ^ 0xA5
    return str(value - low + other)


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

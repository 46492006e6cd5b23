"""Rule templates: a full sync's rules are a few shapes with different numbers in them.

At 10 000 services a full sync sends 20 000 rules, and nearly all are two shapes per endpoint
map: `ip daddr <A> ip saddr != <pods> jump mark-for-masquerade` and `meta l4proto tcp dnat ip to
numgen random mod <N> offset <K> map @<map>`. Compiling each through nft_netlink's compiler and
encoding it (kernel/nft_wire.py) cost 35-50 µs a rule, 0.7-1.0 s of a 3.5 s full sync. A shape
is compiled here once per transaction; later rules of that shape copy its bytes and write
their own numbers in.

Where a number's bytes are is not assumed, it is found: the rule is compiled again with that
one number changed, and the bytes that differ must be exactly the number's encoding (the
address's four bytes, an integer's low bytes in either byte order), everything else equal.
A shape that fails this (a number that changes the structure, is encoded twice or some other
way, a rule of more than one message) is compiled every time, as before. Integers are
templated per byte length and zero on its own, so a template is only ever used for values of
the size its bytes were checked with. tests/test_nft_rule_templates.py holds the templated bytes
equal to the compiler's for every rule the renderers write in the test clusters.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Callable
from dataclasses import dataclass

from nfproxy.kernel.nft_netlink import Unsupported, _tokens

_IPV4 = re.compile(r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)(?:\.(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)){3}")
_INT = re.compile(r"[1-9]\d{0,18}")


@dataclass(frozen=True, slots=True)
class _Slot:
    """Where one number of the rule goes in the template's bytes."""

    at: int
    size: int
    order: str  # "big" or "little"; "ipv4" for an address


@dataclass(frozen=True, slots=True)
class Template:
    body: bytes  # the rule's attributes after its table and chain, for the values it was made of
    slots: tuple[_Slot, ...]

    def fill(self, values: list[int | str]) -> bytes:
        out = bytearray(self.body)
        for slot, value in zip(self.slots, values):
            if slot.order == "ipv4":
                out[slot.at : slot.at + 4] = socket.inet_aton(value)  # type: ignore[arg-type]
            else:
                out[slot.at : slot.at + slot.size] = value.to_bytes(slot.size, slot.order)  # type: ignore[union-attr, arg-type]
        return bytes(out)


Compile = Callable[[str], bytes]  # a rule body -> its attributes after table and chain; may raise Unsupported


class RuleTemplates:
    """The shapes of one transaction's rules, learned as they come (their map names and other
    words are part of the shape, so a template never outlives what it was checked against)."""

    def __init__(self, compile_body: Compile) -> None:
        self._compile = compile_body
        self._known: dict[tuple[str, ...], Template | None] = {}

    def body(self, text: str) -> bytes | None:
        """The rule's attributes after table and chain, or None: compile it the usual way."""
        toks = _tokens(text)
        shape, values, where = _shape(toks)
        known = self._known.get(shape, False)
        if known is False:
            known = self._known[shape] = self._learn(toks, values, where)
        if known is None:
            return None
        return known.fill(values)

    def _learn(self, toks: list[str], values: list[int | str], where: list[int]) -> Template | None:
        try:
            body = self._compile(" ".join(toks))
            slots: list[_Slot] = []
            for value, at in zip(values, where):
                changed = list(toks)
                changed[at] = _changed(value)
                slot = _locate(body, self._compile(" ".join(changed)), value)
                if slot is None:
                    return None
                slots.append(slot)
        except Unsupported:
            return None
        return Template(body, tuple(slots))


def _shape(toks: list[str]) -> tuple[tuple[str, ...], list[int | str], list[int]]:
    """The rule's words with each number replaced by its kind, the numbers, their places."""
    shape: list[str] = []
    values: list[int | str] = []
    where: list[int] = []
    for i, tok in enumerate(toks):
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

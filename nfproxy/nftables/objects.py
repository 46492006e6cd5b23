"""The nft objects nfproxy writes: plain values, one class per kind of kernel object.

Rule bodies stay nft syntax (built by `rule()`, as knftables' `Concat`): nfproxy's rules are
few shapes, and a typed expression tree would be a second nft grammar to keep. Everything else
(names, types, flags, element keys and values) is a field, so a kernel path can encode it
without reading text back.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

NAME_LENGTH_MAX = 256
COMMENT_LENGTH_MAX = 128  # nft refuses longer comments ("comment too long")

_NAME_RE = re.compile(r"[A-Za-z_.][A-Za-z0-9_./-]*")
_COMMENT_RE = re.compile(r"[A-Za-z0-9 _./:@,()+=-]*")


def check_name(text: str) -> str | None:
    """Why `text` cannot be a bare nft name, or None when it can.

    Names are written unquoted (as kube-proxy writes them), so anything else could change the
    meaning of the statement it sits in.
    """
    if len(text) > NAME_LENGTH_MAX or _NAME_RE.fullmatch(text) is None:
        return f"not a safe nftables name: {text!r}"
    return None


def check_comment(text: str) -> str | None:
    """Why `text` cannot be an nft comment (nft has no escape for `"`), or None."""
    if _COMMENT_RE.fullmatch(text) is None:
        return f"not safe in an nftables comment: {text!r}"
    return None


def quote_comment(text: str) -> str:
    """`text` as a double-quoted nft comment, cut (not refused) when over-long: a comment is
    only a label, never worth failing a sync for."""
    if len(text) > COMMENT_LENGTH_MAX:
        text = text[: COMMENT_LENGTH_MAX - 3] + "..."
    return f'"{text}"'


def rule(*parts: str) -> str:
    """One rule body from its parts, skipping empty ones: the one way rule text is joined."""
    return " ".join(p for p in parts if p)


@dataclass(frozen=True, slots=True)
class Table:
    family: str  # "ip" or "ip6"
    name: str
    comment: str | None = None


@dataclass(frozen=True, slots=True)
class Chain:
    """A chain; `type`, `hook` and `priority` together make it a base chain."""

    name: str
    type: str | None = None
    hook: str | None = None
    priority: str | None = None
    comment: str | None = None

    @property
    def base(self) -> bool:
        return self.hook is not None


@dataclass(frozen=True, slots=True)
class Rule:
    """One rule appended to `chain`; `body` is nft rule syntax (see `rule()`)."""

    chain: str
    body: str


@dataclass(frozen=True, slots=True)
class Set:
    """A named set: `type` (nft type names, ` . `-joined) or `typeof` (expressions)."""

    name: str
    type: str | None = None
    typeof: str | None = None
    flags: tuple[str, ...] = ()
    timeout: int | None = None  # seconds
    comment: str | None = None


@dataclass(frozen=True, slots=True)
class Map:
    """A named map: `type`/`typeof` hold `KEY : VALUE` (the value `verdict` for a vmap)."""

    name: str
    type: str | None = None
    typeof: str | None = None
    flags: tuple[str, ...] = ()
    comment: str | None = None
    counter: bool = False  # a packet/byte counter on every element, updated by each lookup


@dataclass(frozen=True, slots=True)
class Element:
    """One element of set or map `set`. nft identifies (and deletes) an element by its key
    alone; `value` is "" for set elements. Keys and values are ` . `-joined nft values."""

    set: str
    key: str
    value: str = ""
    comment: str = ""


# A full sync builds 200 000 elements. The generated __init__ of a frozen dataclass sets each
# field through object.__setattr__ by name; setting the slot descriptors directly is a third
# faster. Still frozen: assigning after construction raises FrozenInstanceError as before.
_rule_chain, _rule_body = Rule.chain.__set__, Rule.body.__set__  # type: ignore[attr-defined]
_el_set, _el_key = Element.set.__set__, Element.key.__set__  # type: ignore[attr-defined]
_el_value, _el_comment = Element.value.__set__, Element.comment.__set__  # type: ignore[attr-defined]


def _rule_init(self: Rule, chain: str, body: str) -> None:
    _rule_chain(self, chain)
    _rule_body(self, body)


def _element_init(self: Element, set: str, key: str, value: str = "", comment: str = "") -> None:  # noqa: A002
    _el_set(self, set)
    _el_key(self, key)
    _el_value(self, value)
    _el_comment(self, comment)


Rule.__init__ = _rule_init  # type: ignore[method-assign]
Element.__init__ = _element_init  # type: ignore[method-assign]


@dataclass(frozen=True, slots=True)
class Counter:
    """A named counter object (`counter name N` in a rule counts into it): the kernel keeps
    its packets and bytes across syncs, as long as the object is only added, never recreated."""

    name: str
    comment: str | None = None


@dataclass(frozen=True, slots=True)
class Note:
    """A `# ...` line in the script: for a reader of `nfproxy render`, never sent to a kernel."""

    text: str


Object = Table | Chain | Rule | Set | Map | Element | Counter

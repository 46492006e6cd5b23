"""The nft objects nfproxy writes: plain values, one class per kind of kernel object.

A rule's body is a tuple of typed statements (expr.py), as every other part of an object is a
field (names, types, flags), so that each printer (script text, JSON, netlink) reads what the
renderer meant instead of parsing it back out of text. Element keys and values are still nft
text (` . `-joined values, `goto chain`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from operator import attrgetter

from nfproxy.nftables.expr import Body

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
    """One rule appended to `chain`. `body` is its statements (expr.Body), as the renderers
    build it. A body of text (tests, benches) is nft syntax that only the rule compiler reads,
    through nftables' reader (script.rule_body); the memory kernel and the JSON printer take
    statements only."""

    chain: str
    body: Body | str


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
    # Elements the map may hold. With a size (and no interval flag) the kernel picks its fixed
    # hash over the resizable one, and refuses an element past it (ENFILE).
    size: int | None = None


@dataclass(frozen=True, slots=True)
class Element:
    """One element of set or map `set`. nft identifies (and deletes) an element by its key
    alone; `value` is "" for set elements. Keys and values are ` . `-joined nft values."""

    set: str
    key: str
    value: str = ""
    comment: str = ""


# A full sync builds 200 000 elements and 20 000 chains. The generated __init__ of a frozen dataclass sets each
# field through object.__setattr__ by name; setting the slot descriptors directly is a third
# faster. Still frozen: assigning after construction raises FrozenInstanceError as before.
_rule_chain, _rule_body = Rule.chain.__set__, Rule.body.__set__  # type: ignore[attr-defined]
_el_set, _el_key = Element.set.__set__, Element.key.__set__  # type: ignore[attr-defined]
_el_value, _el_comment = Element.value.__set__, Element.comment.__set__  # type: ignore[attr-defined]


def _rule_init(self: Rule, chain: str, body: Body | tuple | str) -> None:  # type: ignore[type-arg]
    _rule_chain(self, chain)
    _rule_body(self, body if type(body) is Body or type(body) is str else Body(body))


def _element_init(self: Element, set: str, key: str, value: str = "", comment: str = "") -> None:  # noqa: A002
    _el_set(self, set)
    _el_key(self, key)
    _el_value(self, value)
    _el_comment(self, comment)


_ch_name, _ch_type, _ch_hook = Chain.name.__set__, Chain.type.__set__, Chain.hook.__set__  # type: ignore[attr-defined]
_ch_priority, _ch_comment = Chain.priority.__set__, Chain.comment.__set__  # type: ignore[attr-defined]


def _chain_init(
    self: Chain, name: str, type: str | None = None, hook: str | None = None,  # noqa: A002
    priority: str | None = None, comment: str | None = None,
) -> None:
    _ch_name(self, name)
    _ch_type(self, type)
    _ch_hook(self, hook)
    _ch_priority(self, priority)
    _ch_comment(self, comment)


Chain.__init__ = _chain_init  # type: ignore[method-assign]
Rule.__init__ = _rule_init  # type: ignore[method-assign]
Element.__init__ = _element_init  # type: ignore[method-assign]


_SET, _KEY, _VALUE, _COMMENT = attrgetter("set"), attrgetter("key"), attrgetter("value"), attrgetter("comment")


@dataclass(frozen=True, slots=True)
class Elements:
    """Many elements of one set or map, as one queued operation: what a full sync adds (200 000
    elements at 10 000 services) in a few hundred operations, checked in one pass per field and
    written as one command. Parallel columns, not Element objects: a renderer that holds keys
    (the hairpin and cluster-ip sets) queues them without building an object per key.

    `values` and `comments` are empty, or as long as `keys` ("" where an element has none).
    A kernel path that wants single elements reads them from `Transaction.operations()`.
    """

    set: str
    keys: tuple[str, ...]
    values: tuple[str, ...] = ()
    comments: tuple[str, ...] = ()

    @classmethod
    def of(cls, name: str, elements: Iterable[Element]) -> Elements:
        """The batch of `elements`, all of set `name`, columns taken at C speed."""
        els = elements if isinstance(elements, (list, tuple)) else list(elements)
        try:
            others = set(map(_SET, els)) - {name}
        except AttributeError:
            raise TypeError(f"not all elements: {next(e for e in els if type(e) is not Element)!r}") from None
        if others:
            raise ValueError(f"elements of {sorted(others)} in the batch of {name}")
        values, comments = tuple(map(_VALUE, els)), tuple(map(_COMMENT, els))
        return cls(name, tuple(map(_KEY, els)), values if any(values) else (), comments if any(comments) else ())

    def __len__(self) -> int:
        return len(self.keys)

    def each(self) -> Iterator[Element]:
        """The elements one at a time."""
        n = len(self.keys)
        values = self.values or ("",) * n
        comments = self.comments or ("",) * n
        name = self.set
        for key, value, comment in zip(self.keys, values, comments):
            yield Element(name, key, value, comment)


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


_note_text = Note.text.__set__  # type: ignore[attr-defined]


def _note_init(self: Note, text: str) -> None:
    _note_text(self, text)


Note.__init__ = _note_init  # type: ignore[method-assign]  # one per service port, as Rule


Object = Table | Chain | Rule | Set | Map | Element | Elements | Counter

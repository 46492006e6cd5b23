"""A Transaction: an append-only list of (verb, object) that a kernel applies atomically.

Each object is checked as it is queued and the first error is latched, so a sync is a straight
line of `tx.add(...)` calls checked once (`tx.check()`), as in knftables. A full sync queues
~250 000 objects at 10 000 services, so three bulk verbs say the same in fewer calls, with the
same checks: `Elements` batches (one per set), `refill` (add and flush chains, then add their
rules) and `add_rules`; `operations()` hands kernels single objects either way. The verbs are nft's:
`add` is idempotent, `create` fails on an existing object, `flush` and `delete` need it to exist.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from enum import Enum

from nfproxy.nftables.expr import STATEMENTS, Body, Raw
from nfproxy.nftables.objects import (
    Chain,
    Element,
    Elements,
    Map,
    Counter,
    Note,
    Object,
    Rule,
    Set,
    Table,
    check_comment,
    check_name,
)


class Verb(Enum):
    ADD = "add"
    CREATE = "create"
    FLUSH = "flush"
    DELETE = "delete"
    NOTE = "note"  # a comment line in the script; no kernel operation


# Which verbs each kind of object takes (nft's grammar: no flushing a rule or an element).
_VERBS: dict[type, frozenset[Verb]] = {
    Table: frozenset({Verb.ADD, Verb.CREATE, Verb.FLUSH, Verb.DELETE}),
    Chain: frozenset({Verb.ADD, Verb.CREATE, Verb.FLUSH, Verb.DELETE}),
    Set: frozenset({Verb.ADD, Verb.CREATE, Verb.FLUSH, Verb.DELETE}),
    Map: frozenset({Verb.ADD, Verb.CREATE, Verb.FLUSH, Verb.DELETE}),
    Rule: frozenset({Verb.ADD}),
    Element: frozenset({Verb.ADD, Verb.CREATE, Verb.DELETE}),
    Elements: frozenset({Verb.ADD}),
    Counter: frozenset({Verb.ADD, Verb.CREATE, Verb.DELETE}),
}


_STATEMENTS = frozenset(STATEMENTS)


def _body_problem(body: tuple | str) -> str | None:  # type: ignore[type-arg]
    """Why `body` cannot be one rule: empty, not statements, or text that would say more than
    one command."""
    if type(body) is str:
        if not body or "\n" in body or ";" in body:
            return f"rule body must be one statement list: {body!r}"
        return None
    if not body:
        return f"rule body must be one statement list: {body!r}"
    for s in body:
        kind = type(s)
        if kind not in _STATEMENTS:
            return f"rule body must be one statement list: {body!r}"
        if kind is Raw and (not s.text or "\n" in s.text or ";" in s.text):
            return f"rule body must be one statement list: {s.text!r}"
    return None


def _rule_problem(verb: Verb, obj: Rule, names: set[str]) -> str | None:
    if obj.chain not in names:
        if (why := check_name(obj.chain)) is not None:
            return why
        names.add(obj.chain)
    return _body_problem(obj.body)


def _element_problem(verb: Verb, obj: Element, names: set[str]) -> str | None:
    if obj.set not in names:
        if (why := check_name(obj.set)) is not None:
            return why
        names.add(obj.set)
    if not obj.key or "\n" in obj.key or "\n" in obj.value:
        return f"bad element key {obj.key!r} of {obj.set}"
    if obj.comment and (why := check_comment(obj.comment)) is not None:
        return why
    if verb is Verb.DELETE and (obj.value or obj.comment):
        return f"delete element {obj.key!r} of {obj.set}: identified by its key alone"
    return None


def _elements_problem(verb: Verb, obj: Elements, names: set[str]) -> str | None:
    """The checks of `_element_problem` for a whole batch, one pass over each column."""
    keys, values, comments = obj.keys, obj.values, obj.comments
    n = len(keys)
    if (values and len(values) != n) or (comments and len(comments) != n):
        return f"elements of {obj.set}: {n} keys, {len(values)} values, {len(comments)} comments"
    try:
        suspect = "" in keys or "\n" in "".join(keys) or "\n" in "".join(values)
    except TypeError:
        return f"elements of {obj.set}: keys and values must be text"
    if suspect:
        for el in obj.each():  # name the culprit exactly as a single element would
            if (why := _element_problem(verb, el, names)) is not None:
                return why
    if obj.set not in names:
        if (why := check_name(obj.set)) is not None:
            return why
        names.add(obj.set)
    for comment in sorted(set(comments) - {""}):
        if (why := check_comment(comment)) is not None:
            return why
    return None


def _chain_problem(verb: Verb, obj: Chain, names: set[str]) -> str | None:
    """A plain chain (10 000 of them, each added and flushed, in a full sync) has only a name
    to check, once; anything more goes through `_named_problem`."""
    if obj.hook is None and obj.comment is None and obj.type is None and obj.priority is None:
        if obj.name not in names:
            if (why := check_name(obj.name)) is not None:
                return why
            names.add(obj.name)
        return None
    return _named_problem(verb, obj, names)


def _named_problem(verb: Verb, obj: Table | Chain | Set | Map | Counter, names: set[str]) -> str | None:
    name = obj.name
    if name not in names:
        if (why := check_name(name)) is not None:
            return why
        names.add(name)
    if obj.comment and (why := check_comment(obj.comment)) is not None:
        return why
    if type(obj) is Chain:
        parts = (obj.type, obj.hook, obj.priority)  # type: ignore[union-attr]
        if any(p is not None for p in parts) and any(p is None for p in parts):
            return f"base chain {name} needs type, hook and priority"
    if type(obj) in (Set, Map) and verb in (Verb.ADD, Verb.CREATE):
        if (obj.type is None) == (obj.typeof is None):  # type: ignore[union-attr]
            return f"{type(obj).__name__.lower()} {name} needs exactly one of type and typeof"
    return None


_CHECKS = {Rule: _rule_problem, Element: _element_problem, Elements: _elements_problem,
           Table: _named_problem, Chain: _chain_problem,
           Set: _named_problem, Map: _named_problem, Counter: _named_problem}


# Per kind: its verbs and its check, found with one lookup per queued object.
_RULES = {kind: (verbs, _CHECKS[kind]) for kind, verbs in _VERBS.items()}
_NO_RULES: tuple[frozenset[Verb], None] = (frozenset(), None)


def problem(verb: Verb, obj: Object, names: set[str] | None = None) -> str | None:
    """What is wrong with queueing `verb obj`, or None. `names` holds names already found
    safe (a transaction checks each name once, not once per rule)."""
    kind = type(obj)
    if verb not in _VERBS.get(kind, frozenset()):
        return f"{verb.value} {kind.__name__.lower()} is not an nft command"
    return _CHECKS[kind](verb, obj, set() if names is None else names)  # type: ignore[operator]


class Transaction:
    """One atomic change to one table (`family`, `table`)."""

    __slots__ = ("family", "table", "ops", "error", "_names", "_operations")

    def __init__(self, family: str, table: str) -> None:
        if family not in ("ip", "ip6"):
            raise ValueError(f"unknown nft family {family!r}")
        self.family = family
        self.table = table
        self.ops: list[tuple[Verb, Object | Note]] = []
        self.error: str | None = check_name(table)
        self._names: set[str] = set()
        self._operations = 0  # ops that are not notes

    def _queue(self, verb: Verb, obj: Object) -> None:
        if self.error is not None:
            return
        kind = type(obj)
        if kind is Chain and obj.name in self._names and obj.hook is None and obj.comment is None:  # type: ignore[union-attr]
            # A known plain chain (a full sync adds and flushes 10 000): any verb, nothing to check.
            if obj.type is None and obj.priority is None:  # type: ignore[union-attr]
                self.ops.append((verb, obj))
                self._operations += 1
                return
        verbs, check = _RULES.get(kind, _NO_RULES)
        if verb not in verbs:
            self.error = f"{verb.value} {kind.__name__.lower()} is not an nft command"
            return
        why = check(verb, obj, self._names)  # type: ignore[operator]
        if why is not None:
            self.error = why
            return
        self.ops.append((verb, obj))
        self._operations += len(obj) if kind is Elements else 1  # type: ignore[arg-type]

    def add(self, obj: Object) -> None:
        self._queue(Verb.ADD, obj)

    def add_rules(self, chain: str, bodies: Sequence[Body | str]) -> None:
        """`add` a Rule of `chain` for each body: the name checked once, then each body."""
        if self.error is not None or not bodies:
            return
        names = self._names
        if chain not in names:
            if (why := check_name(chain)) is not None:
                self.error = why
                return
            names.add(chain)
        rules = [Rule(chain, body) for body in bodies]
        for rule in rules:
            if (why := _body_problem(rule.body)) is not None:
                self.error = why
                return
        add = Verb.ADD
        self.ops.extend([(add, rule) for rule in rules])
        self._operations += len(rules)

    def refill(self, chains: Mapping[str, Sequence[Body | str]]) -> None:
        """`add` and `flush` each plain chain of `chains`, then `add` its rules: a full sync's
        way of rewriting chains the kernel may or may not hold. One call per service port (10 000
        in a full sync): the same checks as one `add` at a time, each name once, bodies in bulk."""
        if self.error is not None:
            return
        names, append = self._names, self.ops.append
        add, flush = Verb.ADD, Verb.FLUSH
        for name in chains:
            if name not in names:
                if (why := check_name(name)) is not None:
                    self.error = why
                    return
                names.add(name)
            chain = Chain(name)
            append((add, chain))
            append((flush, chain))
        n = 2 * len(chains)
        for name, bodies in chains.items():
            for body in bodies:  # a service port's chain holds one or two rules
                rule = Rule(name, body)
                if (why := _body_problem(rule.body)) is not None:
                    self.error = why
                    return
                append((add, rule))
            n += len(bodies)
        self._operations += n

    def add_elements(self, elements: Iterable[Element]) -> None:
        """`add` each element, queued as one `Elements` batch per run of one set."""
        if self.error is not None:
            return
        run: list[Element] = []
        for el in elements:
            if type(el) is not Element:
                self.error = f"not an element: {el!r}"
                return
            if run and el.set != run[0].set:
                self.add(Elements.of(run[0].set, run))
                run = []
            run.append(el)
        if run:
            self.add(Elements.of(run[0].set, run))

    def create(self, obj: Object) -> None:
        self._queue(Verb.CREATE, obj)

    def flush(self, obj: Object) -> None:
        self._queue(Verb.FLUSH, obj)

    def delete(self, obj: Object) -> None:
        self._queue(Verb.DELETE, obj)

    def note(self, text: str) -> None:
        if "\n" in text:
            self.error = self.error or f"note spans lines: {text!r}"
            return
        self.ops.append((Verb.NOTE, Note(text)))

    def check(self) -> None:
        """Raise the first error queued, if any (ValueError: the objects came from bad input)."""
        if self.error is not None:
            raise ValueError(self.error)

    def operations(self) -> Iterator[tuple[Verb, Object]]:
        """The kernel operations one object at a time (a batch as its elements), without notes."""
        for verb, obj in self.ops:
            if type(obj) is Elements:
                for el in obj.each():
                    yield verb, el
            elif verb is not Verb.NOTE:
                yield verb, obj  # type: ignore[misc]

    def __len__(self) -> int:
        """Kernel operations (what the sync log and metrics count): notes are not."""
        return self._operations

    def __bool__(self) -> bool:
        return self._operations > 0

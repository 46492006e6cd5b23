"""An in-memory nf_tables table with the kernel's existence semantics (knftables' Fake).

`apply` runs a Transaction on a copy and commits only if every operation succeeds: `add` is
idempotent, `create` fails on an existing object, `flush` and `delete` need the object, a chain
is deleted only empty and unreferenced, an element key is held once, and at commit every
chain, set and counter a rule names (read from its statements, expr.names; a body of text is
refused) or a verdict map's element jumps to must exist, and no two ranges of an interval
set may overlap (checked at commit, as the kernel checks them against the next generation: a
range deleted and an overlapping one added in one batch is fine). `dump` is canonical sorted text:
the table as the `add` commands that would rebuild it, chains and sets in name order, rules in
chain order, elements sorted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nfproxy.core.model import IPFamily
from nfproxy.core.owned import Owned
from nfproxy.kernel.process import KernelError
from nfproxy.nftables import OFF_TABLE, TABLE, Chain, Counter, Element, Map, Rule, Set, Table, Transaction, Verb
from nfproxy.nftables import text as nft_text
from nfproxy.nftables.expr import Body, Names, is_raw, names

_VERDICT_JUMPS = ("jump", "goto")


@dataclass(slots=True)
class _Chain:
    """A chain's rules, and what each names (read once, when the rule is added)."""

    decl: Chain
    rules: list[Body] = field(default_factory=list)
    names: list[Names] = field(default_factory=list)

    def clear(self) -> None:
        self.rules.clear()
        self.names.clear()


@dataclass(slots=True)
class _Set:
    decl: Set | Map
    elements: dict[str, Element] = field(default_factory=dict)


@dataclass(slots=True)
class _Table:
    decl: Table
    chains: dict[str, _Chain] = field(default_factory=dict)
    sets: dict[str, _Set] = field(default_factory=dict)
    counters: dict[str, Counter] = field(default_factory=dict)

    def copy(self) -> _Table:
        return _Table(
            self.decl,
            {n: _Chain(c.decl, list(c.rules), list(c.names)) for n, c in self.chains.items()},
            {n: _Set(s.decl, dict(s.elements)) for n, s in self.sets.items()},
            dict(self.counters),
        )


def _declaration(obj: Set | Map) -> tuple[object, ...]:
    """What must agree when an existing set is added again (the comment may differ)."""
    return (type(obj), obj.type, obj.typeof, obj.flags, getattr(obj, "timeout", None), getattr(obj, "counter", False),
            getattr(obj, "size", None))


def _owned(t: _Table | None) -> Owned | None:
    if t is None:
        return None
    return Owned(frozenset(t.chains), frozenset(t.sets), frozenset(t.counters))


class MemoryNft:
    """One family's `nfproxy` table and its off table (nftables.OFF_TABLE), or none, in memory.

    A payload is a Transaction or a tuple of them, applied in order, each atomically, as the
    real kernel (kernel/nft.py) applies them."""

    def __init__(self, family: IPFamily = IPFamily.V4, *, table: str = TABLE, **_: object) -> None:
        self.family = family
        self.nft_family = "ip" if family is IPFamily.V4 else "ip6"
        self.table_name = table
        self.names = (table, OFF_TABLE) if table == TABLE else (table,)
        self.tables: dict[str, _Table] = {}
        self.last: Transaction | None = None
        self.applied = 0  # transactions committed

    @property
    def table(self) -> _Table | None:
        """The main table (`nfproxy`)."""
        return self.tables.get(self.table_name)

    # -- Kernel --------------------------------------------------------------------------------
    def generation(self) -> int:
        """The transactions committed: as nf_tables' generation, it moves with every write."""
        return self.applied

    def owned(self) -> Owned:
        main = _owned(self.table) or Owned()
        off = _owned(self.tables.get(OFF_TABLE))
        return main if off is None else Owned(main.chains, main.sets, main.counters, off)

    def apply(self, payload: object) -> None:
        if isinstance(payload, tuple):
            for tx in payload:
                self.apply(tx)
            return
        if not isinstance(payload, Transaction):
            raise TypeError(f"an nft kernel applies Transactions, not {type(payload).__name__}")
        try:
            payload.check()
        except ValueError as exc:
            raise KernelError(f"nft (memory) rejected the transaction: {exc}") from None
        if payload.family != self.nft_family or payload.table not in self.names:
            raise KernelError(f"nft (memory) holds {self.nft_family} {' and '.join(self.names)}, not {payload.family} {payload.table}")
        held = self.tables.get(payload.table)
        work = held.copy() if held is not None else None
        where = f"{payload.family} {payload.table}"
        touched: set[str] = set()
        for verb, obj in payload.operations():
            try:
                work = _run(work, verb, obj)
            except _Refused as exc:
                raise KernelError(
                    f"nft (memory) rejected the transaction: {exc}: {nft_text.command(verb, obj, where)}"
                ) from None
            if verb is not Verb.DELETE and isinstance(obj, Element):
                touched.add(obj.set)
        if work is not None:
            dangling = _dangling(work) or _overlapping(work, touched)
            if dangling:
                raise KernelError(f"nft (memory) rejected the transaction: {dangling}")
        if work is None:
            self.tables.pop(payload.table, None)
        else:
            self.tables[payload.table] = work
        self.last = payload
        self.applied += 1

    def close(self) -> None:
        """Nothing held open."""

    def dump(self) -> str:
        return "".join(self._dump(name) for name in self.names)

    def _dump(self, table: str) -> str:
        t = self.tables.get(table)
        if t is None:
            return ""
        where = f"{self.nft_family} {table}"
        out = [nft_text.command(Verb.ADD, t.decl, where)]
        for name in sorted(t.counters):
            out.append(nft_text.command(Verb.ADD, t.counters[name], where))
        for name in sorted(t.sets):
            out.append(nft_text.command(Verb.ADD, t.sets[name].decl, where))
        for name in sorted(t.chains):
            out.append(nft_text.command(Verb.ADD, t.chains[name].decl, where))
        for name in sorted(t.chains):
            out.extend(f"add rule {where} {name} {body}" for body in t.chains[name].rules)
        for name in sorted(t.sets):
            for key in sorted(t.sets[name].elements):
                out.append(nft_text.command(Verb.ADD, t.sets[name].elements[key], where))
        return "\n".join(out) + "\n"

    def json(self) -> dict[str, object]:
        """The table as `nft -j list table` prints it (nftables/json.py), for analysis/."""
        from nfproxy.nftables import json as nft_json

        fam = self.nft_family
        out: list[object] = [{"metainfo": {"version": "1.0.6", "json_schema_version": 1}}]
        handle = iter(range(1, 1 << 30))
        for name in self.names:
            t = self.tables.get(name)
            if t is None:
                continue
            out.append({"table": {"family": fam, "name": name, "handle": next(handle)}})
            for c in t.counters.values():
                out.append({"counter": {"family": fam, "name": c.name, "table": name,
                                        "handle": next(handle), "packets": 0, "bytes": 0}})
            for s in t.sets.values():
                out.append(nft_json.set_(fam, name, s.decl, list(s.elements.values()), next(handle)))
            for c in t.chains.values():
                out.append(nft_json.chain(fam, name, c.decl, next(handle)))
            for c in t.chains.values():
                for body in c.rules:
                    out.append(nft_json.rule(fam, name, c.decl.name, body, next(handle)))
        return {"nftables": out}

    # -- reading back --------------------------------------------------------------------------
    def rules(self, chain: str) -> list[Body]:
        assert self.table is not None
        return list(self.table.chains[chain].rules)

    def elements(self, name: str) -> dict[str, Element]:
        assert self.table is not None
        return dict(self.table.sets[name].elements)


class _Refused(Exception):
    pass


def _run(t: _Table | None, verb: Verb, obj: object) -> _Table | None:
    """One operation on the working copy; returns the table (None: there is none)."""
    if isinstance(obj, Table):
        return _table_op(t, verb, obj)
    if t is None:
        raise _Refused("No such file or directory (no table)")
    if isinstance(obj, Chain):
        _chain_op(t, verb, obj)
    elif isinstance(obj, Rule):
        chain = t.chains.get(obj.chain)
        if chain is None:
            raise _Refused(f"No such file or directory (chain {obj.chain})")
        if type(obj.body) is not Body or is_raw(obj.body):
            raise _Refused("Operation not supported (a rule body of text: the memory kernel reads statements)")
        chain.rules.append(obj.body)
        chain.names.append(names(obj.body))
    elif isinstance(obj, (Set, Map)):
        _set_op(t, verb, obj)
    elif isinstance(obj, Element):
        _element_op(t, verb, obj)
    elif isinstance(obj, Counter):
        _counter_op(t, verb, obj)
    else:
        raise _Refused(f"not an nft object: {obj!r}")
    return t


def _table_op(t: _Table | None, verb: Verb, obj: Table) -> _Table | None:
    if verb in (Verb.ADD, Verb.CREATE):
        if t is not None:
            if verb is Verb.CREATE:
                raise _Refused("File exists (table)")
            return t
        return _Table(obj)
    if t is None:
        raise _Refused("No such file or directory (table)")
    if verb is Verb.FLUSH:
        for c in t.chains.values():
            c.clear()
        for s in t.sets.values():
            s.elements.clear()
        return t
    return None  # delete


def _chain_op(t: _Table, verb: Verb, obj: Chain) -> None:
    held = t.chains.get(obj.name)
    if verb in (Verb.ADD, Verb.CREATE):
        if held is None:
            t.chains[obj.name] = _Chain(obj)
        elif verb is Verb.CREATE:
            raise _Refused(f"File exists (chain {obj.name})")
        elif obj.hook is not None and (held.decl.type, held.decl.hook, held.decl.priority) != (obj.type, obj.hook, obj.priority):
            raise _Refused(f"Operation not supported (chain {obj.name} changes its hook)")
        return
    if held is None:
        raise _Refused(f"No such file or directory (chain {obj.name})")
    if verb is Verb.FLUSH:
        held.clear()
        return
    # The kernel deletes a chain's own rules with it; a jump or goto from elsewhere holds it.
    own = held.names
    held.names = []
    if _chain_referenced(t, obj.name):
        held.names = own
        raise _Refused(f"Device or resource busy (chain {obj.name} is referenced)")
    del t.chains[obj.name]


def _set_op(t: _Table, verb: Verb, obj: Set | Map) -> None:
    held = t.sets.get(obj.name)
    if verb in (Verb.ADD, Verb.CREATE):
        if held is None:
            t.sets[obj.name] = _Set(obj)
        elif verb is Verb.CREATE:
            raise _Refused(f"File exists (set {obj.name})")
        elif _declaration(held.decl) != _declaration(obj):
            raise _Refused(f"File exists (set {obj.name} declared otherwise)")
        return
    if held is None:
        raise _Refused(f"No such file or directory (set {obj.name})")
    if verb is Verb.FLUSH:
        held.elements.clear()
        return
    if any(obj.name in n.sets for c in t.chains.values() for n in c.names):
        raise _Refused(f"Device or resource busy (set {obj.name} is referenced)")
    del t.sets[obj.name]


def _counter_op(t: _Table, verb: Verb, obj: Counter) -> None:
    held = t.counters.get(obj.name)
    if verb in (Verb.ADD, Verb.CREATE):
        if held is not None and verb is Verb.CREATE:
            raise _Refused(f"File exists (counter {obj.name})")
        t.counters.setdefault(obj.name, obj)
        return
    if held is None:
        raise _Refused(f"No such file or directory (counter {obj.name})")
    if any(obj.name in n.counters for c in t.chains.values() for n in c.names):
        raise _Refused(f"Device or resource busy (counter {obj.name} is referenced)")
    del t.counters[obj.name]


def _element_op(t: _Table, verb: Verb, el: Element) -> None:
    held = t.sets.get(el.set)
    if held is None:
        raise _Refused(f"No such file or directory (set {el.set})")
    if verb is Verb.DELETE:
        if el.key not in held.elements:
            raise _Refused(f"No such file or directory (element {el.key} of {el.set})")
        del held.elements[el.key]
        return
    if bool(el.value) != isinstance(held.decl, Map):
        raise _Refused(f"Invalid argument (element {el.key} does not fit {el.set})")
    old = held.elements.get(el.key)
    if old is not None and (verb is Verb.CREATE or old.value != el.value):
        raise _Refused(f"File exists (element {el.key} of {el.set})")
    size = getattr(held.decl, "size", None)
    if old is None and size is not None and len(held.elements) >= size:
        # The kernel counts the elements this transaction deleted as gone (set->ndeact).
        raise _Refused(f"Too many open files in system (set {el.set} holds its size, {size})")
    held.elements[el.key] = el


def _span(key: str) -> tuple[int, int] | None:
    """An integer interval key (`5`, `5-9`) as (low, high); None for any other key."""
    low, _, high = key.partition("-")
    if not low.isdigit() or (high and not high.isdigit()):
        return None
    return int(low), int(high or low)


def _overlapping(t: _Table, names: set[str]) -> str | None:
    """The first overlap of two ranges in an interval set that `names` had elements added to."""
    for name in sorted(names):
        held = t.sets.get(name)
        if held is None or "interval" not in held.decl.flags:
            continue
        spans = sorted(s for s in map(_span, held.elements) if s is not None)
        for (_, high), (low, _) in zip(spans, spans[1:]):
            if low <= high:
                return f"File exists (overlapping ranges in interval set {name})"
    return None


def _references(t: _Table) -> tuple[set[str], set[str], set[str]]:
    """The chains, sets and counters that the table's rules and verdict map elements name."""
    chains: set[str] = set()
    sets: set[str] = set()
    counters: set[str] = set()
    for c in t.chains.values():
        for n in c.names:
            chains.update(n.chains)
            sets.update(n.sets)
            counters.update(n.counters)
    for s in t.sets.values():
        if isinstance(s.decl, Map) and s.decl.type is not None and s.decl.type.endswith(": verdict"):
            for el in s.elements.values():
                verdict, _, chain = el.value.partition(" ")  # an element's value is still text
                if verdict in _VERDICT_JUMPS:
                    chains.add(chain)
    return chains, sets, counters


def _chain_referenced(t: _Table, name: str) -> bool:
    return name in _references(t)[0]


def _dangling(t: _Table) -> str | None:
    chains, sets, counters = _references(t)
    missing_chains = sorted(chains - set(t.chains))
    missing_sets = sorted(sets - set(t.sets))
    missing_counters = sorted(counters - set(t.counters))
    if missing_counters:
        return f"No such file or directory (counter {missing_counters[0]})"
    if missing_chains:
        return f"No such file or directory (jump/goto to chain {missing_chains[0]})"
    if missing_sets:
        return f"No such file or directory (set @{missing_sets[0]})"
    return None

"""The exact interpreter: a first packet in, a distribution over outcomes out.

Public API:
- `Packet(src, dst, port, proto, origin)`; origin "pod" or "outside" (enters at prerouting, then
  input or forward by its destination after DNAT) or "node" (output, then postrouting; and, when
  it stays on the node, back in through prerouting's filter chains and input).
- `Outcome(verdict, endpoint, masquerade)`: verdict "dnat" (to `endpoint`, "ip:port" or
  "[ip6]:port"), "reject", "drop" or "accept" (left untouched); `masquerade` says whether nat
  postrouting would masquerade it (hairpin included).
- `interpret(ruleset, packet, *, node_ips=(), mode="kernel") -> dict[Outcome, Fraction]`:
  probabilities sum to exactly 1.
- `trace(...) -> list[Path]`: the same walk, one `Path` per random branch, with the rules each
  branch matched (`Step`s), the affinity sets it consulted and the ones it would pin. Branches
  that reach a rule in the same state are merged into one `Path` (`count` says how many), so
  the work is bounded by rules x distinct states, never by the number of paths (2^40 for 40
  chains of two rules each).
- `walk_chain(ruleset, table, chain, packet, ...) -> list[Path]`: the walk started inside one
  chain (as if jumped to from nat prerouting); falling off its end gives Outcome("accept").
- `InterpretError`: an Unknown statement, a missing chain or set, a loop; the message names the
  table, chain and rule.

Modes: "kernel" uses the kernel's integer arithmetic (quantize.py): statistic thresholds out of
2^31, numgen buckets out of 2^32. "ideal" uses the probabilities as written: 1/N per numgen slot
and, for a statistic match, the simplest rational the printed value stands for (1/3 for
0.3333333333 and for 0.33333333349 alike).

Memo: a chain's walk is kept with what it read of the state it entered with (fields, and the
elements that set and map lookups of addresses found) and serves every later entry that agrees
on those; `interpret` and `interpret_both` keep one interpreter per ruleset, node addresses and
mode while the ruleset lives, so the thousands of probes of one `compare` share their walks of
the filter and postrouting chains. The answers are those of a fresh walk
(tests/test_analysis_memo.py).

Affinity: lookups in dynamic sets (nft `ip saddr @affinity-…`, iptables `-m recent --rcheck`)
are evaluated as for a client with no history (the set is empty), and reported on the path;
whatever the dump holds in such a set is ignored. Nat chains run once per connection, so a nat
manipulation at one hook stops later nat chains of that hook, as nf_nat does.
"""

from __future__ import annotations

import dataclasses
import heapq
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Literal, Union

from nfproxy.analysis import quantize
from nfproxy.analysis.index import ElementIndex, indexes, key_matches
from nfproxy.analysis.ir import (
    Address,
    AnonSet,
    Bitwise,
    Chain,
    Concat,
    Const,
    Ct,
    Dnat,
    Element,
    Expr,
    Fib,
    Field,
    MapLookup,
    Masquerade,
    Match,
    MarkSet,
    Numgen,
    Prefix,
    Range,
    Rule,
    Ruleset,
    SetDef,
    SetRef,
    SetUpdate,
    Statement,
    Statistic,
    Table,
    Unknown,
    Verdict,
    VerdictMap,
    canonical,
)
from nfproxy.analysis.nft_rule_text import readable

Origin = Literal["pod", "outside", "node"]
Mode = Literal["kernel", "ideal"]
_WalkMode = Literal["kernel", "ideal", "both"]


class InterpretError(ValueError):
    """The interpreter cannot decide what a rule does; the message names the rule, and `line`
    is where the dump holds it (0 when the format has no lines)."""

    def __init__(self, message: str, line: int = 0) -> None:
        super().__init__(message)
        self.line = line


@dataclass(frozen=True, slots=True)
class Packet:
    src: str
    dst: str
    port: int
    proto: str
    origin: Origin = "pod"


@dataclass(frozen=True, slots=True, order=True)
class Outcome:
    verdict: Literal["dnat", "reject", "drop", "accept"]
    endpoint: str | None = None
    masquerade: bool = False

    def __str__(self) -> str:
        text = f"DNAT {self.endpoint}" if self.verdict == "dnat" else self.verdict.upper()
        return text + (" +masquerade" if self.masquerade else "")


@dataclass(frozen=True, slots=True)
class Step:
    """One matched rule on a path (or a base chain's policy when `rule` is -1)."""

    table: str
    chain: str
    rule: int
    text: str


@dataclass(frozen=True, slots=True)
class Path:
    outcome: Outcome
    probability: Fraction
    steps: tuple[Step, ...] = ()
    lookups: tuple[str, ...] = ()  # dynamic (affinity) sets consulted: empty for a new client
    pins: tuple[str, ...] = ()  # dynamic sets this connection would be recorded in
    count: int = 1  # how many walks, equal from here on, this one stands for (steps: the first's)
    unlisted: int = 0  # rules this path matched beyond the first _MAX_STEPS, counted, not listed


# --------------------------------------------------------------------------------------------
# Exact weights. Kernel-mode weights are dyadic (k / 2^31, k / 2^32): products are kept as
# (numerator, exponent) so a 1000-rule cascade costs no gcd on 31 000-bit numbers.


@dataclass(frozen=True, slots=True)
class _Dyadic:
    num: int
    exp: int

    def __mul__(self, other: _Dyadic) -> _Dyadic:
        return _Dyadic(self.num * other.num, self.exp + other.exp)

    def __add__(self, other: _Dyadic) -> _Dyadic:
        if self.exp >= other.exp:
            return _Dyadic(self.num + (other.num << (self.exp - other.exp)), self.exp)
        return other + self

    def complement(self) -> _Dyadic:
        return _Dyadic((1 << self.exp) - self.num, self.exp)

    def is_zero(self) -> bool:
        return self.num == 0

    def fraction(self) -> Fraction:
        key = (self.num, self.exp)
        found = _FRACTIONS.get(key)
        if found is None:
            found = _bounded(_FRACTIONS)[key] = self._fraction()
        return found

    def _fraction(self) -> Fraction:
        if self.num == 0:
            return Fraction(0)
        shift = min((self.num & -self.num).bit_length() - 1, self.exp)
        try:
            return Fraction(self.num >> shift, 1 << (self.exp - shift), _normalize=False)  # type: ignore[call-arg]
        except TypeError:  # Python >= 3.12 dropped _normalize; the gcd is then paid once here
            return Fraction(self.num >> shift, 1 << (self.exp - shift))


# Weights are immutable, and the same few recur in every service's walk (a numgen of n slots
# gives n weights, the same for every chain of n endpoints): made once per process.
_FRACTIONS: dict[tuple[int, int], Fraction] = {}
_SLOT_WEIGHTS: dict[tuple[str, int, int, int], Any] = {}
_STATISTIC_WEIGHTS: dict[tuple[str, str], Any] = {}
_CACHE_LIMIT = 1 << 16


def _bounded(cache: dict) -> dict:  # type: ignore[type-arg]
    """`cache`, emptied first when full: a dump with many distinct weights costs memory once."""
    if len(cache) >= _CACHE_LIMIT:
        cache.clear()
    return cache


class _Exact:
    """Fraction weights for ideal mode, with the _Dyadic interface."""

    __slots__ = ("value",)

    def __init__(self, value: Fraction) -> None:
        self.value = value

    def __mul__(self, other: _Exact) -> _Exact:
        return _Exact(self.value * other.value)

    def __add__(self, other: _Exact) -> _Exact:
        return _Exact(self.value + other.value)

    def complement(self) -> _Exact:
        return _Exact(1 - self.value)

    def is_zero(self) -> bool:
        return self.value == 0

    def fraction(self) -> Fraction:
        return self.value


class _Both:
    """Kernel and ideal weights side by side, for a walk that answers both modes at once
    (`interpret_both`): the paths are the same in either mode, only their weights differ, so
    `compare` walks each probe once per backend instead of twice. A branch is pruned only when
    it is impossible in both modes."""

    __slots__ = ("kernel", "ideal")

    def __init__(self, kernel: _Dyadic, ideal: _Exact) -> None:
        self.kernel = kernel
        self.ideal = ideal

    def __mul__(self, other: _Both) -> _Both:
        return _Both(self.kernel * other.kernel, self.ideal * other.ideal)

    def __add__(self, other: _Both) -> _Both:
        return _Both(self.kernel + other.kernel, self.ideal + other.ideal)

    def complement(self) -> _Both:
        return _Both(self.kernel.complement(), self.ideal.complement())

    def is_zero(self) -> bool:
        return self.kernel.is_zero() and self.ideal.is_zero()


Weight = Union[_Dyadic, _Exact, _Both]

_MASK32 = 0xFFFFFFFF
_NOMATCH = ("nomatch",)


@dataclass(frozen=True, slots=True)
class _State:
    src: Address
    dst: Address
    dport: int
    proto: str
    mark: int = 0
    dnat: tuple[Address, int] | None = None
    masq: bool = False
    # History: what the walk reports, not what decides it. Walks that reach one rule in equal
    # states are merged (weights summed, `paths` counted, the first one's history kept), so a
    # chain of 40 two-way choices costs 80 rule evaluations, not 2^40.
    steps: tuple[Step, ...] = ()
    lookups: tuple[str, ...] = ()
    pins: tuple[str, ...] = ()
    paths: int = 1


_StateKey = tuple

# Bounds on work, so that a dump the kernel accepts (or one written by hand) cannot make the
# walk run for ever or overflow Python's stack; docs/semantics.md, "Bounded work".
# - A path lists at most this many matched rules; the others are counted (`Path.unlisted`). A
#   chain that jumps to two chains that each jump to the next two... (a "diamond" of n levels)
#   is one path through 2^n rule matches: the walk is memoised and cheap, the list is not.
_MAX_STEPS = 10_000
# - Expressions nested deeper than this are not interpreted (a kernel rule holds at most 128
#   expressions; nft never nests `concat` in `concat`): the evaluation recurses on them.
_MAX_EXPR_DEPTH = 64
# - Work, in rule evaluations and chain exits (states visited): at most the larger of these,
#   per walk of one packet (or one chain, for `check`), counting the dump's rules and named set
#   and map elements. A ruleset whose random choices lead to ever more distinct states (a mark
#   changed by each of 24 coin flips: 2^24 marks) is stopped with an error naming the limit
#   rather than followed to the end. Real walks stay far below: a 20 000-endpoint service costs
#   about 3 per rule, a 10 000-service check 7 per walk.
_WORK_FLOOR = 100_000
_WORK_PER_RULE = 8
_ELIDED = -2  # Step.rule of the count of unlisted steps, last in a truncated tuple


def _cat(a: tuple[Step, ...], b: tuple[Step, ...]) -> tuple[Step, ...]:
    """Steps `a` then `b`, listing at most _MAX_STEPS of them: the rest are counted in a last
    Step whose rule is _ELIDED and whose text is the count."""
    if not b:
        return a
    if not a:
        return b
    if a[-1].rule != _ELIDED and len(a) + len(b) <= _MAX_STEPS:
        return a + b
    skipped = 0
    if a[-1].rule == _ELIDED:
        skipped, a = int(a[-1].text), a[:-1]
    if b[-1].rule == _ELIDED:
        skipped, b = skipped + int(b[-1].text), b[:-1]
    room = max(_MAX_STEPS - len(a), 0)
    if len(b) > room:
        skipped += len(b) - room
        b = b[:room]
    return a + b + ((Step("", "", _ELIDED, str(skipped)),) if skipped else ())


def _step(steps: tuple[Step, ...], step: Step) -> tuple[Step, ...]:
    """`steps` and one more (counted only, past _MAX_STEPS)."""
    if len(steps) < _MAX_STEPS and (not steps or steps[-1].rule != _ELIDED):
        return steps + (step,)
    return _cat(steps, (step,))


def _expr_depth(expr: Any) -> int:
    """How deeply `expr` nests (1 for a flat one), with a stack rather than recursion."""
    deepest = 0
    stack = [(expr, 1)]
    while stack:
        e, d = stack.pop()
        deepest = max(deepest, d)
        if d > _MAX_EXPR_DEPTH:
            break
        if isinstance(e, Concat):
            stack.extend((item, d + 1) for item in e.items)
        elif isinstance(e, Bitwise):
            stack.append((e.left, d + 1))
        elif isinstance(e, MapLookup):
            stack.append((e.key, d + 1))
    return deepest


def _rule_depth(rule: Rule) -> int:
    deepest = 0
    for st in rule.statements:
        if isinstance(st, Match):
            exprs: tuple = (st.left,)
        elif isinstance(st, VerdictMap):
            exprs = (st.key,)
        elif isinstance(st, MarkSet):
            exprs = (st.value,)
        elif isinstance(st, Dnat):
            exprs = (st.addr,) if st.port is None else (st.addr, st.port)
        else:
            continue
        for e in exprs:
            if isinstance(e, (Concat, Bitwise, MapLookup)):
                deepest = max(deepest, _expr_depth(e))
    return deepest


def _key(st: _State) -> _StateKey:
    # Addresses as ints: ipaddress's own __hash__ formats a hex string on every call. One walk
    # is of one family, so the ints cannot collide across families.
    dnat = st.dnat
    if dnat is not None:
        dnat = (dnat[0]._ip, dnat[1])
    return (st.src._ip, st.dst._ip, st.dport, st.proto, st.mark, dnat, st.masq)


def _with_history(st: _State, steps: tuple, lookups: tuple, pins: tuple, paths: int) -> _State:
    return _State(st.src, st.dst, st.dport, st.proto, st.mark, st.dnat, st.masq, steps, lookups, pins, paths)


def _fresh(st: _State) -> _State:
    """`st` without its history: how a memoised chain walk starts."""
    if not (st.steps or st.lookups or st.pins or st.paths != 1):
        return st
    return _with_history(st, (), (), (), 1)


def _join(before: _State, after: _State) -> _State:
    """A memoised chain's exit state `after`, preceded by the history of `before`."""
    if not (before.steps or before.lookups or before.pins or before.paths != 1):
        return after
    return _with_history(
        after,
        _cat(before.steps, after.steps),
        before.lookups + after.lookups,
        before.pins + after.pins,
        before.paths * after.paths,
    )


# What a chain's walk read of the state it entered with, as bits: a memoised walk answers for
# every state that agrees on those fields (the decisions it took depend on nothing else), so the
# filter and postrouting chains every endpoint of every service passes through, reading only
# conntrack flags and marks, are walked once per compare rather than once per endpoint and
# probe. A field a walk writes counts as read: its value at the exit is then known from the key.
_SRC, _DST, _DPORT, _PROTO, _MARK, _DNAT, _DNATTED, _MASQ = 1, 2, 4, 8, 16, 32, 64, 128
_ALL = 255  # _DNATTED: only whether the connection was DNATted (ct state/status), not where to


def _project(st: _State, reads: int) -> tuple:
    """The fields of `st` that `reads` names (and its family, which every walk depends on)."""
    dnat = st.dnat
    return (
        reads,
        st.src._version,
        st.src._ip if reads & _SRC else None,
        st.dst._ip if reads & _DST else None,
        st.dport if reads & _DPORT else None,
        st.proto if reads & _PROTO else None,
        st.mark if reads & _MARK else None,
        (None if dnat is None else (dnat[0]._ip, dnat[1])) if reads & _DNAT else (dnat is not None) if reads & _DNATTED else None,
        st.masq if reads & _MASQ else None,
    )


def _rebase(before: _State, after: _State | None, reads: int) -> _State:
    """A memoised exit state `after` of a walk that read `reads`, for a walk entered in state
    `before` (which agrees with the memoised one on those fields), with `before`'s history.
    None: the walk left the state as it was, and recorded no history."""
    if after is None:
        return before
    if reads == _ALL:
        return _join(before, after)
    return _State(
        after.src if reads & _SRC else before.src,
        after.dst if reads & _DST else before.dst,
        after.dport if reads & _DPORT else before.dport,
        after.proto if reads & _PROTO else before.proto,
        after.mark if reads & _MARK else before.mark,
        after.dnat if reads & _DNAT else before.dnat,
        after.masq if reads & _MASQ else before.masq,
        _cat(before.steps, after.steps) if before.steps else after.steps,
        before.lookups + after.lookups if before.lookups else after.lookups,
        before.pins + after.pins if before.pins else after.pins,
        before.paths * after.paths,
    )


def _unchanged(start: _State, exits: list[tuple[Weight, _State, str]]) -> list[tuple[Weight, _State | None, str]]:
    """`exits` with None for `start` itself (no history: `_fresh`): most chains only read, and
    their memoised exits then cost nothing to rebase."""
    return [(w, None if ex is start else ex, r) for w, ex, r in exits]


# Signatures (what a walk read and asked) kept per chain: each is tried on every entry, and a
# chain that reaches per-service chains (nat prerouting) has one per service; past this many,
# its walks with a new signature are not memoised.
_SIGNATURES = 8
# A walk that asked more than this many queries is not memoised (one that met a service's own
# sets, as kube-proxy's layout has them): checking them would cost what walking does.
_QUERIES = 6
# A chain is no longer looked up once it was tried this many times with fewer than one hit in
# _HIT_RATE tries.
_TRIES = 64
_HIT_RATE = 16

# Memoised chain walks kept per interpreter; past this many, the memo starts afresh.
_MEMO_LIMIT = 20_000


class _Merge:
    """Items (weight, state) with equal decision state folded into one."""

    __slots__ = ("items",)

    def __init__(self) -> None:
        self.items: dict[_StateKey, tuple[Weight, _State]] = {}

    def add(self, w: Weight, st: _State) -> None:
        k = _key(st)
        old = self.items.get(k)
        if old is None:
            self.items[k] = (w, st)
        else:
            o = old[1]
            self.items[k] = (old[0] + w, _with_history(o, o.steps, o.lookups, o.pins, o.paths + st.paths))

    def __bool__(self) -> bool:
        return bool(self.items)


# A numgen used as a plain value (not a map key, not compared) is enumerated slot by slot only
# up to this modulus; the map and comparison forms cost the same for any modulus.
_ENUMERABLE_NUMGEN = 4096
_EMPTY = ElementIndex(())


class _Unknown(Exception):
    pass


def work_budget(ruleset: Ruleset) -> int:
    """The work one walk may do in `ruleset` (see _WORK_FLOOR)."""
    def size() -> int:
        n = 0
        for table in ruleset.tables:
            n += sum(len(chain.rules) for chain in table.chains.values())
            n += sum(len(sdef.elements) for sdef in table.sets.values())
            if table.dialect == "nft":  # anonymous sets and maps are elements too (iptables has none)
                n += sum(_anonymous_elements(rule) for chain in table.chains.values() for rule in chain.rules)
        return max(_WORK_FLOOR, _WORK_PER_RULE * n)
    return indexes(ruleset).cached(("work budget",), size)  # type: ignore[no-any-return]


def _anonymous_elements(rule: Rule) -> int:
    n = 0
    for st in rule.statements:
        if isinstance(st, VerdictMap) and isinstance(st.map, AnonSet):
            n += len(st.map.elements)
        elif isinstance(st, Match) and isinstance(st.right, AnonSet):
            n += len(st.right.elements)
    return n


def _over_budget(budget: int) -> str:
    return (f"more than {budget} rule evaluations and chain exits in one walk: the rules branch "
            f"into too many distinct states to follow (limit: max({_WORK_FLOOR}, {_WORK_PER_RULE} "
            f"per rule and set element of the dump, anonymous ones included); docs/semantics.md, \"Bounded work\"")


class _Interpreter:
    def __init__(self, ruleset: Ruleset, node_ips: Sequence[str], mode: _WalkMode, tracing: bool) -> None:
        if mode not in ("kernel", "ideal", "both"):
            raise ValueError(f"mode must be 'kernel' or 'ideal', not {mode!r}")
        self.ruleset = ruleset
        self.mode = mode
        self.tracing = tracing
        self.local = frozenset(ipaddress.ip_address(ip) for ip in node_ips)
        self._local = frozenset((a.version, a._ip) for a in self.local)
        self.one: Weight = {
            "kernel": lambda: _Dyadic(1, 0),
            "ideal": lambda: _Exact(Fraction(1)),
            "both": lambda: _Both(_Dyadic(1, 0), _Exact(Fraction(1))),
        }[mode]()
        self.index = indexes(ruleset)
        self.work = 0  # rule evaluations and chain exits of the current walk (`_walk` resets it)
        self.budget = work_budget(ruleset)
        self._numgen_cache: dict[tuple[int, int], list[tuple[Weight, int]]] = {}
        # ((table, chain), _project(state, reads)) -> [the chain's exits for a walk entering with
        # weight 1, reads, used since the last sweep]; per chain, the read sets its walks have had
        self._memo: dict[tuple, list[Any]] = {}
        # per chain: [memo lookups, hits, the signatures (reads, queries) its walks have had]
        self._stats: dict[tuple[int, str], list[Any]] = {}
        self._reads = 0  # what the chain being walked has read so far
        self._queries: list[tuple[Any, ElementIndex, int]] = []  # and which lookups it made (_query)
        self._written = 0  # the fields it has written since it was entered
        self.entered: set[str] | None = None  # when set, the name of every chain walked
        # table -> rule -> its leading plain matches (_leading), by id; shared per ruleset
        self._leading: dict[int, dict[int, tuple[Any, ...]]] = self.index.cached(("leading",), dict)

    # ---- weights

    def _spend(self, n: int) -> None:
        """Count `n` states made inside one rule (a product of enumerated values)."""
        self.work += n
        if self.work > self.budget:
            raise _Unknown(_over_budget(self.budget))

    def _numgen(self, expr: Numgen) -> list[tuple[Weight, int]]:
        if expr.mod > _ENUMERABLE_NUMGEN:
            raise _Unknown(
                f"numgen random mod {expr.mod} used as a plain value: only map lookups and "
                f"comparisons are evaluated for a modulus above {_ENUMERABLE_NUMGEN}"
            )
        key = (expr.mod, expr.offset)
        cached = self._numgen_cache.get(key)
        if cached is None:
            cached = [(self._slots(expr, k, k), expr.offset + k) for k in range(expr.mod)]
            self._numgen_cache[key] = cached
        return cached

    def _slots(self, expr: Numgen, first: int, last: int) -> Weight:
        """The weight of slots first..last (relative to the offset) of a numgen: closed form."""
        key = (self.mode, expr.mod, first, last)
        found = _SLOT_WEIGHTS.get(key)
        if found is None:
            found = _bounded(_SLOT_WEIGHTS)[key] = self._slots_uncached(expr.mod, first, last)
        return found  # type: ignore[no-any-return]

    def _slots_uncached(self, mod: int, first: int, last: int) -> Weight:
        if self.mode == "kernel":
            return _Dyadic(quantize.numgen_slot_count(first, last, mod), 32)
        ideal = _Exact(Fraction(last - first + 1, mod))
        if self.mode == "both":
            return _Both(_Dyadic(quantize.numgen_slot_count(first, last, mod), 32), ideal)
        return ideal

    def _numgen_split(self, expr: Numgen, index: ElementIndex) -> list[tuple[Weight, Element | None]]:
        """A numgen value looked up in a map or set: each element's share, and the rest (no
        element) as None. Costs the elements in the numgen's range, whatever its modulus."""
        out: list[tuple[Weight, Element | None]] = []
        low, high = expr.offset, expr.offset + expr.mod - 1
        taken: Weight | None = None
        for first, last, el in index.slots(low, high):
            w = self._slots(expr, first - low, last - low)
            if w.is_zero():
                continue
            out.append((w, el))
            taken = w if taken is None else taken + w
        rest = self.one if taken is None else taken.complement()
        if not rest.is_zero():
            out.append((rest, None))
        return out

    def _numgen_match(self, table: Table, expr: Numgen, op: str, operand: Any, st: _State) -> list[tuple[Weight, bool]]:
        """`numgen … == / != / < … operand`: the weights of true and false, in closed form."""
        low, high = expr.offset, expr.offset + expr.mod - 1
        if op in ("<", "<=", ">", ">="):
            if not isinstance(operand, Const) or not isinstance(operand.value, int):
                raise _Unknown(f"ordered comparison with {operand!r}")
            r = operand.value
            span = {"<": (low, r - 1), "<=": (low, r), ">": (r + 1, high), ">=": (r, high)}[op]
            spans = [(max(span[0], low), min(span[1], high))]
        elif isinstance(operand, (SetRef, AnonSet)):
            spans = [(a, b) for a, b, _ in self._elements(table, operand, st, record=True).slots(low, high)]
        elif isinstance(operand, Const) and isinstance(operand.value, int):
            spans = [(operand.value, operand.value)]
        elif isinstance(operand, Range) and isinstance(operand.low, int) and isinstance(operand.high, int):
            spans = [(max(operand.low, low), min(operand.high, high))]
        else:
            spans = []
        hit: Weight | None = None
        for a, b in spans:
            if a <= b and a <= high and b >= low:
                w = self._slots(expr, max(a, low) - low, min(b, high) - low)
                hit = w if hit is None else hit + w
        if hit is None:
            hit = self.one.complement()
        miss = hit.complement()
        if op == "!=":
            hit, miss = miss, hit
        return [(w, v) for w, v in ((hit, True), (miss, False)) if not w.is_zero()]

    def _statistic(self, st: Statistic) -> tuple[Weight, Weight]:
        """The weight of a statistic match firing, and of it not firing."""
        key = (self.mode, st.probability)
        found = _STATISTIC_WEIGHTS.get(key)
        if found is None:
            q = self._statistic_uncached(st)
            found = _bounded(_STATISTIC_WEIGHTS)[key] = (q, q.complement())
        return found  # type: ignore[no-any-return]

    def _statistic_uncached(self, st: Statistic) -> Weight:
        if self.mode == "kernel":
            return _Dyadic(quantize.iptables_threshold(st.probability), 31)
        ideal = _Exact(quantize.ideal_probability(st.probability))
        if self.mode == "both":
            return _Both(_Dyadic(quantize.iptables_threshold(st.probability), 31), ideal)
        return ideal

    # ---- values

    def is_local(self, addr: Address) -> bool:
        # On ints: an ipaddress object hashes through a hex string, and `in` a network
        # builds one. Loopback: 127.0.0.0/8 and ::1/128.
        ip = addr._ip
        if addr._version == 4:
            return ip >> 24 == 127 or (4, ip) in self._local
        return ip == 1 or (6, ip) in self._local

    def values(self, table: Table, expr: Expr, st: _State) -> list[tuple[Weight, Any]]:
        one = self.one
        if isinstance(expr, Field):
            name = expr.name
            if name == "saddr":
                self._reads |= _SRC
                return [(one, st.src)]
            if name == "daddr":
                self._reads |= _DST
                return [(one, st.dst)]
            if name == "dport":
                if expr.proto is not None:
                    self._reads |= _PROTO
                    if expr.proto != st.proto:
                        return [(one, None)]
                self._reads |= _DPORT
                return [(one, st.dport)]
            if name == "l4proto":
                self._reads |= _PROTO
                return [(one, st.proto)]
            if name == "mark":
                self._reads |= _MARK
                return [(one, st.mark)]
            if name == "nfproto":
                return [(one, "ipv4" if st.src.version == 4 else "ipv6")]
            raise _Unknown(f"packet field {name!r} is not modelled")
        if isinstance(expr, Const):
            return [(one, expr.value)]
        if isinstance(expr, Fib):
            self._reads |= _SRC if expr.target == "saddr" else _DST
            addr = st.src if expr.target == "saddr" else st.dst
            return [(one, "local" if self.is_local(addr) else "unicast")]
        if isinstance(expr, Ct):
            self._reads |= _DNATTED | _MASQ
            if expr.key == "state":
                flags = {"new"} | ({"dnat"} if st.dnat else set()) | ({"snat"} if st.masq else set())
            else:
                flags = ({"dnat"} if st.dnat else set()) | ({"snat"} if st.masq else set())
            return [(one, frozenset(flags))]
        if isinstance(expr, Numgen):
            return self._numgen(expr)
        if isinstance(expr, Bitwise):
            out = []
            for w, v in self.values(table, expr.left, st):
                if v is None:
                    out.append((w, None))
                elif expr.op == "&":
                    out.append((w, v & expr.right & _MASK32))
                elif expr.op == "|":
                    out.append((w, (v | expr.right) & _MASK32))
                else:
                    out.append((w, (v ^ expr.right) & _MASK32))
            return out
        if isinstance(expr, Concat):
            acc: list[tuple[Weight, Any]] = [(one, ())]
            for item in expr.items:
                nxt = []
                for w, prefix in acc:
                    for w2, v in self.values(table, item, st):
                        ww = w if w2 is one else w2 if w is one else w * w2
                        if prefix is None or v is None:
                            nxt.append((ww, None))
                        else:
                            nxt.append((ww, prefix + (v,)))
                acc = nxt
                if len(acc) > 1:
                    self._spend(len(acc))
            return acc
        if isinstance(expr, MapLookup):
            index = self._elements(table, expr.map, st, record=False)
            if isinstance(expr.key, Numgen):
                found = self._numgen_split(expr.key, index)
            else:
                found = [(w, index.find(key)) for w, key in self.values(table, expr.key, st)]
            return [(w, None if el is None or not isinstance(el.data, Const) else el.data.value) for w, el in found]
        raise _Unknown(f"expression {expr!r} is not modelled")

    def _query(self, get: Any, index: ElementIndex, st: _State) -> tuple[Any, Element | None]:
        """`get`'s value in `st` and the element of `index` it finds. When the value is made of
        addresses, ports and the protocol alone, the walk depends on the answer, not on the
        fields: the lookup is recorded as a query instead of a read, so that a memoised walk
        serves every state with the same answers (every endpoint a set holds no element for)."""
        outer = self._reads
        self._reads = 0
        v = get(self, st)
        bits = self._reads
        # Only of the state the chain was entered with: a field it has written since is read.
        if bits & (_SRC | _DST) and not bits & ~(_SRC | _DST | _DPORT | _PROTO) and not bits & self._written:
            self._reads = outer
            self._queries.append((get, index, bits))
        else:
            self._reads = outer | bits
        return v, None if v is None else index.find(v)

    def _absorb(self, reads: int, queries: tuple, written: int) -> None:
        """What a chain walked from here read, asked and wrote, into the walk that called it. A
        query of fields this walk had written before the call is a read of them here."""
        self._reads |= reads
        for q in queries:
            if q[2] & self._written:
                self._reads |= q[2]
            else:
                self._queries.append(q)
        self._written |= written

    def _sig_key(self, st: _State, sig: tuple[int, tuple]) -> tuple:
        """The memo key of `st` for a walk that read `sig`: (fields read, queries made)."""
        reads, queries = sig
        if not queries:
            return _project(st, reads)
        outer = self._reads
        answers = []
        for get, index, _ in queries:
            v = get(self, st)
            answers.append(-1 if v is None else id(index.find(v)))  # id(None) for no element
        self._reads = outer
        return (_project(st, reads), tuple(answers))

    def _elements(self, table: Table, operand: SetRef | AnonSet, st: _State, record: bool) -> ElementIndex:
        if isinstance(operand, AnonSet):
            return self.index.elements(operand.elements)
        sdef: SetDef | None = table.sets.get(operand.name)
        if sdef is None:
            raise _Unknown(f"set or map @{operand.name} does not exist")
        if sdef.dynamic:
            return _EMPTY  # a client with no history
        return self.index.elements(sdef.elements)

    # ---- statements

    def statement(self, table: Table, stmt: Statement, st: _State) -> list[tuple[Weight, _State, tuple | None]]:
        one = self.one
        if isinstance(stmt, Match):
            out = []
            operand = stmt.right
            dynamic = isinstance(operand, SetRef) and self._is_dynamic(table, operand)
            if dynamic:
                st = _with_history(st, st.steps, st.lookups + (operand.name,), st.pins, st.paths)  # type: ignore[union-attr]
            if isinstance(stmt.left, Numgen):
                return [(w, st, None if hit else _NOMATCH) for w, hit in self._numgen_match(table, stmt.left, stmt.op, operand, st)]
            for w, v in self.values(table, stmt.left, st):
                hit = self._compare(table, v, stmt.op, operand, st)
                out.append((w, st, None if hit else _NOMATCH))
            return out
        if isinstance(stmt, Statistic):
            q, not_q = self._statistic(stmt)
            fire, miss = (q, not_q) if not stmt.negate else (not_q, q)
            out = []
            if not fire.is_zero():
                out.append((fire, st, None))
            if not miss.is_zero():
                out.append((miss, st, _NOMATCH))
            return out
        if isinstance(stmt, Verdict):
            if stmt.kind == "continue":
                return [(one, st, None)]
            return [(one, st, (stmt.kind, stmt.target))]
        if isinstance(stmt, VerdictMap):
            index = self._elements(table, stmt.map, st, record=True)
            out = []
            get = None if isinstance(stmt.key, Numgen) else _getter(stmt.key)
            if isinstance(stmt.key, Numgen):
                found = self._numgen_split(stmt.key, index)
            elif get is not None:
                found = [(one, self._query(get, index, st)[1])]
            else:
                found = [(w, index.find(key)) for w, key in self.values(table, stmt.key, st)]
            for w, el in found:
                if el is None or not isinstance(el.data, Verdict):
                    out.append((w, st, _NOMATCH))
                elif el.data.kind == "continue":
                    out.append((w, st, None))
                else:
                    out.append((w, st, (el.data.kind, el.data.target)))
            return out
        if isinstance(stmt, MarkSet):
            self._reads |= _MARK
            self._written |= _MARK
            return [
                (w, st, _NOMATCH) if v is None else (w, _State(st.src, st.dst, st.dport, st.proto, v & _MASK32, st.dnat, st.masq, st.steps, st.lookups, st.pins, st.paths), None)
                for w, v in self.values(table, stmt.value, st)
            ]
        if isinstance(stmt, SetUpdate):
            return [(one, _with_history(st, st.steps, st.lookups, st.pins + (stmt.set,), st.paths), None)]
        if isinstance(stmt, Dnat):
            self._reads |= _DST | _DPORT | _DNAT
            self._written |= _DST | _DPORT | _DNAT
            out = []
            ports = self.values(table, stmt.port, st) if stmt.port is not None else [(one, None)]
            addrs = self.values(table, stmt.addr, st)
            if len(ports) > 1 and len(addrs) > 1:
                self._spend(len(ports) * len(addrs))
            for w, addr in addrs:
                for w2, port in ports:
                    ww = w if w2 is one else w2 if w is one else w * w2
                    if addr is None:
                        out.append((ww, st, _NOMATCH))
                        continue
                    if isinstance(addr, tuple):
                        addr, port = addr
                    new_port = st.dport if port is None else int(port)
                    new = _State(st.src, addr, new_port, st.proto, st.mark, (addr, new_port), st.masq,
                                 st.steps, st.lookups, st.pins, st.paths)
                    out.append((ww, new, ("nat", "")))
            return out
        if isinstance(stmt, Masquerade):
            self._reads |= _MASQ
            self._written |= _MASQ
            return [(one, _State(st.src, st.dst, st.dport, st.proto, st.mark, st.dnat, True,
                                 st.steps, st.lookups, st.pins, st.paths), ("nat", ""))]
        if isinstance(stmt, Unknown):
            raise _Unknown(f"unsupported match or statement: {stmt.text}")
        raise _Unknown(f"statement {stmt!r} is not modelled")

    def _is_dynamic(self, table: Table, ref: SetRef) -> bool:
        sdef = table.sets.get(ref.name)
        return sdef is not None and sdef.dynamic

    def _compare(self, table: Table, value: Any, op: str, operand: Any, st: _State) -> bool:
        if value is None:
            return False
        if op in ("<", "<=", ">", ">="):
            if not isinstance(operand, Const) or not isinstance(value, int):
                raise _Unknown(f"ordered comparison with {operand!r}")
            r = operand.value
            return {"<": value < r, "<=": value <= r, ">": value > r, ">=": value >= r}[op]  # type: ignore[operator]
        if isinstance(operand, (SetRef, AnonSet)):
            hit = self._elements(table, operand, st, record=True).find(value) is not None
        else:
            hit = key_matches(value, operand)
        return hit if op == "==" else not hit

    # ---- chains and hooks

    def run_chain(self, table: Table, chain: Chain, w: Weight, st: _State, depth: int = 0) -> list[tuple[Weight, _State, str]]:
        """The chain's exits (weight, state, verdict; "return" for falling off its end), for a
        walk entering with weight `w` in state `st`. Memoised per decision state: a chain that
        many paths reach in the same state is walked once."""
        if depth > 64:
            raise InterpretError(f"{table.family} {table.name}: chain {chain.name}: jumps nest deeper than 64 (a loop?)")
        if self.entered is not None and not w.is_zero():
            self.entered.add(chain.name)
        ck = (id(table), chain.name)
        found = None
        stats = self._stats.get(ck)
        if stats is None:
            stats = self._stats[ck] = [0, 0, []]
        # A chain whose walks are seldom shared (one that leads to every service's chains) is
        # no longer looked up: trying its signatures would cost more than walking it.
        useful = stats[0] < _TRIES or stats[1] * _HIT_RATE >= stats[0]
        if useful:
            stats[0] += 1
            for sig in stats[2]:
                found = self._memo.get((ck, self._sig_key(st, sig)))
                if found is not None:
                    stats[1] += 1
                    break
        if found is None:
            outer, outer_queries, outer_written = self._reads, self._queries, self._written
            self._reads, self._queries, self._written = 0, [], 0
            start = _fresh(st) if st.steps or st.lookups or st.pins or st.paths != 1 else st
            exits = self._walk_rules(table, chain, start, depth)
            self._count_exits(table, chain, len(exits))
            written = self._written
            # With `entered` asked for, only equal states share a walk: a shared one would not
            # name the chains it entered.
            if self.entered is not None:
                sig = (_ALL, ())
            else:
                sig = (self._reads, tuple(dict.fromkeys(self._queries)))
            self._reads, self._queries, self._written = outer, outer_queries, outer_written
            self._absorb(sig[0], sig[1], written)
            if len(self._memo) >= _MEMO_LIMIT:
                # Keep the walks used since the last sweep (the shared filter and postrouting
                # chains), drop the others (a service's own chains, met by one probe).
                self._memo = {k: v for k, v in self._memo.items() if v[2]}
                for v in self._memo.values():
                    v[2] = False
            known = stats[2]
            if useful and sig not in known and len(known) < _SIGNATURES and len(sig[1]) <= _QUERIES:
                known.append(sig)
            if useful and sig in known:
                self._memo[(ck, self._sig_key(st, sig))] = [_unchanged(start, exits), sig[0], False, sig[1], written]
            # Walked from this very state: its exits need no rebasing, only `st`'s history.
            one = self.one
            if w is one:
                return [(f, _join(st, ex), r) for f, ex, r in exits]
            return [(w if f is one else w * f, _join(st, ex), r) for f, ex, r in exits]
        else:
            exits, reads, _, queries, written = found
            self._count_exits(table, chain, len(exits))
            found[2] = True
            self._absorb(reads, queries, written)
        one = self.one
        if w is one:
            return [(f, _rebase(st, ex, reads), r) for f, ex, r in exits]
        return [(w if f is one else w * f, _rebase(st, ex, reads), r) for f, ex, r in exits]

    def _count_exits(self, table: Table, chain: Chain, n: int) -> None:
        self.work += n
        if self.work > self.budget:
            raise InterpretError(f"{table.family} {table.name}: chain {chain.name}: {_over_budget(self.budget)}")

    def _walk_rules(self, table: Table, chain: Chain, start: _State, depth: int) -> list[tuple[Weight, _State, str]]:
        out: list[tuple[Weight, _State, str]] = []
        rules = chain.rules
        count = len(rules)
        skip = self.index.rules(chain)
        leads = self._leads(table)
        if skip.field is not None:
            self._reads |= _DST if skip.field == "daddr" else _DPORT
        one = self.one
        pending: dict[int, _Merge] = {}
        heap: list[int] = []

        def reach(i: int, w: Weight, st: _State) -> None:
            i = skip.next(i, st.dst, st.dport)
            if i >= count:
                out.append((w, st, "return"))
                return
            merge = pending.get(i)
            if merge is None:
                merge = pending[i] = _Merge()
                heapq.heappush(heap, i)
            merge.add(w, st)

        def follow(i: int, rule: Rule, w: Weight, branches: list[tuple[Weight, _State, tuple | None]]) -> None:
            for f, st2, act in branches:
                w2 = f if w is one else w if f is one else w * f
                if act is _NOMATCH:
                    reach(i + 1, w2, st2)
                    continue
                if self.tracing:
                    st2 = _with_history(st2, _step(st2.steps, Step(table.name, chain.name, i, rule.text)),
                                        st2.lookups, st2.pins, st2.paths)
                if act is None:
                    reach(i + 1, w2, st2)
                    continue
                kind, target = act
                if kind not in ("jump", "goto"):
                    out.append((w2, st2, kind))
                    continue
                for w3, st3, r in self.run_chain(table, self._target(table, chain, i, rule, kind, target), w2, st2, depth + 1):
                    if r == "return" and kind == "jump":
                        reach(i + 1, w3, st3)
                    else:
                        out.append((w3, st3, r))

        # One walk while it stays one (most chains, for most packets): rule after rule, without
        # the merging below. `i` is None once it has branched.
        i: int | None = skip.next(0, start.dst, start.dport)
        w: Weight = one
        st = start
        while i is not None:
            if i >= count:
                return [(w, st, "return")]
            rule = rules[i]
            branches = self._rule_at(table, chain, i, rule, st, leads)
            if len(branches) != 1:
                follow(i, rule, w, branches)
                break
            f, st2, act = branches[0]
            w2 = f if w is one else w if f is one else w * f
            if act is not _NOMATCH:
                if self.tracing:
                    st2 = _with_history(st2, _step(st2.steps, Step(table.name, chain.name, i, rule.text)),
                                        st2.lookups, st2.pins, st2.paths)
                if act is not None:
                    kind, target = act
                    if kind not in ("jump", "goto"):
                        return [(w2, st2, kind)]
                    exits = self.run_chain(table, self._target(table, chain, i, rule, kind, target), w2, st2, depth + 1)
                    if not (kind == "jump" and len(exits) == 1 and exits[0][2] == "return"):
                        for w3, st3, r in exits:
                            if r == "return" and kind == "jump":
                                reach(i + 1, w3, st3)
                            else:
                                out.append((w3, st3, r))
                        break
                    w2, st2 = exits[0][0], exits[0][1]
            w, st = w2, st2
            i = skip.next(i + 1, st.dst, st.dport)
        while heap:
            i = heapq.heappop(heap)
            rule = rules[i]
            for w, st in pending.pop(i).items.values():
                follow(i, rule, w, self._rule_at(table, chain, i, rule, st, leads))
        return _merged(out)

    def _leads(self, table: Table) -> dict[int, tuple[Any, ...]]:
        leads = self._leading.get(id(table))
        if leads is None:
            leads = self._leading[id(table)] = {}
        return leads

    def _rule_at(
        self, table: Table, chain: Chain, i: int, rule: Rule, st: _State, leads: dict[int, tuple[Any, ...]]
    ) -> list[tuple[Weight, _State, tuple | None]]:
        self.work += 1
        if self.work > self.budget:
            raise InterpretError(f"{table.family} {table.name}: chain {chain.name} rule {i + 1}: {_over_budget(self.budget)}", rule.line)
        try:
            return self.rule(table, rule, st, leads)
        except (_Unknown, ValueError, TypeError, ArithmeticError) as exc:
            # _Unknown: not modelled. The others: values of a type the rule cannot hold (a
            # dump edited by hand), which a parser let through.
            raise InterpretError(
                f"{table.family} {table.name}: chain {chain.name} rule {i + 1}: {exc} (rule: {readable(rule.text)[:300]})",
                rule.line,
            ) from None

    def _target(self, table: Table, chain: Chain, i: int, rule: Rule, kind: str, target: str) -> Chain:
        sub = table.chains.get(target)
        if sub is None:
            raise InterpretError(
                f"{table.family} {table.name}: chain {chain.name} rule {i + 1}: {kind} to missing chain {target!r}",
                rule.line,
            )
        return sub

    def rule(
        self, table: Table, rule: Rule, st: _State, leads: dict[int, tuple[Any, ...]] | None = None
    ) -> list[tuple[Weight, _State, tuple | None]]:
        one = self.one
        if leads is None:
            leads = self._leads(table)
        lead = leads.get(id(rule))
        if lead is None:
            depth = _rule_depth(rule)
            if depth > _MAX_EXPR_DEPTH:
                raise _Unknown(f"expressions nested more than {_MAX_EXPR_DEPTH} deep (a kernel rule holds at most 128 expressions)")
            lead = leads[id(rule)] = _leading(self, table, rule)
        for get, op, operand, in_set in lead:
            if in_set:
                # Membership: asked as a query (see _query), not as a read of the addresses.
                v, el = self._query(get, self._elements(table, operand, st, record=True), st)
                hit = v is not None and (el is not None) is (op == "==")
            else:
                hit = self._compare(table, get(self, st), op, operand, st)
            if not hit:
                return [(one, st, _NOMATCH)]
        statements = rule.statements
        if lead:
            if len(lead) == len(statements):
                return [(one, st, None)]
            statements = statements[len(lead):]
        branches: list[tuple[Weight, _State]] = [(one, st)]
        out: list[tuple[Weight, _State, tuple | None]] = []
        for stmt in statements:
            nxt: list[tuple[Weight, _State]] = []
            for w, s in branches:
                for f, s2, act in self.statement(table, stmt, s):
                    wf = f if w is one else w if f is one else w * f
                    if act is None:
                        nxt.append((wf, s2))
                    else:
                        out.append((wf, s2, act))
            branches = nxt
            if len(branches) > 1:
                self._spend(len(branches))
            if not branches:
                break
        out.extend((w, s, None) for w, s in branches)
        return out

    def base_chains(self, hook: str, version: int) -> list[tuple[Table, Chain]]:
        return self.index.cached(("hook", hook, version), lambda: self._base_chains(hook, version))

    def _base_chains(self, hook: str, version: int) -> list[tuple[Table, Chain]]:
        family = "ip" if version == 4 else "ip6"
        found = []
        for order, table in enumerate(self.ruleset.tables):
            if table.family not in (family, "inet"):
                continue
            for chain in table.chains.values():
                if chain.hook == hook:
                    found.append((chain.priority, order, table, chain))
        found.sort(key=lambda x: (x[0], x[1]))
        return [(t, c) for _, _, t, c in found]

    def run_hook(
        self, hook: str, items: list[tuple[Weight, _State]], nat: bool
    ) -> tuple[list[tuple[Weight, _State]], list[tuple[Weight, _State, str]]]:
        """Run every base chain of `hook` in priority order. Returns (continuing, terminal)."""
        terminal: list[tuple[Weight, _State, str]] = []
        if not items:
            return items, terminal
        version = items[0][1].src.version
        for table, chain in self.base_chains(hook, version):
            if chain.type == "nat" and not nat:
                continue
            nxt = _Merge()
            for w, st in items:
                if chain.type == "nat" and _nat_done(hook, st):
                    nxt.add(w, st)
                    continue
                for w2, st2, r in self.run_chain(table, chain, w, st):
                    if r == "return":
                        r = chain.policy
                        if self.tracing and chain.policy != "accept":
                            st2 = dataclasses.replace(
                                st2, steps=_step(st2.steps, Step(table.name, chain.name, -1, f"policy {chain.policy}"))
                            )
                    if r in ("drop", "reject"):
                        terminal.append((w2, st2, r))
                    else:
                        nxt.add(w2, st2)
            items = list(nxt.items.values())
        return items, terminal


# --------------------------------------------------------------------------------------------
# Leading plain matches, compiled: most rules a packet meets fail on their first or second match
# (another destination, another protocol), and `Interpreter.statement` builds lists of weighted
# values for them. A plain match compares one value (no numgen, no map lookup: one branch of
# weight one) and records no history (no dynamic set); `_leading` gives a rule's leading plain
# matches as (getter, op, operand), which `Interpreter.rule` tests as `statement` would.


def _getter(expr: Expr) -> Any:
    """`fn(interp, state) -> value` for an expression of one value, or None; one per distinct
    expression (every rule's `ip daddr` shares one)."""
    try:
        found = _GETTERS.get(expr, _GETTERS)
    except TypeError:  # an unhashable constant
        return _make_getter(expr)
    if found is _GETTERS:
        found = _bounded(_GETTERS)[expr] = _make_getter(expr)
    return found


_GETTERS: dict[Any, Any] = {}


def _make_getter(expr: Expr) -> Any:
    if isinstance(expr, Field):
        name, proto = expr.name, expr.proto
        if name == "saddr":
            def get(it: _Interpreter, st: _State) -> Any:
                it._reads |= _SRC
                return st.src
        elif name == "daddr":
            def get(it: _Interpreter, st: _State) -> Any:
                it._reads |= _DST
                return st.dst
        elif name == "dport":
            def get(it: _Interpreter, st: _State) -> Any:
                if proto is not None:
                    it._reads |= _PROTO
                    if proto != st.proto:
                        return None
                it._reads |= _DPORT
                return st.dport
        elif name == "l4proto":
            def get(it: _Interpreter, st: _State) -> Any:
                it._reads |= _PROTO
                return st.proto
        elif name == "mark":
            def get(it: _Interpreter, st: _State) -> Any:
                it._reads |= _MARK
                return st.mark
        else:
            return None
        return get
    if isinstance(expr, Fib):
        source = expr.target == "saddr"

        def fib(it: _Interpreter, st: _State) -> Any:
            it._reads |= _SRC if source else _DST
            return "local" if it.is_local(st.src if source else st.dst) else "unicast"
        return fib
    if isinstance(expr, Ct):
        state = expr.key == "state"

        def ct(it: _Interpreter, st: _State) -> Any:
            it._reads |= _DNATTED | _MASQ
            flags = ({"dnat"} if st.dnat else set()) | ({"snat"} if st.masq else set())
            return frozenset(flags | {"new"} if state else flags)
        return ct
    if isinstance(expr, Const):
        value = expr.value
        return lambda it, st: value
    if isinstance(expr, Bitwise):
        left = _getter(expr.left)
        if left is None:
            return None
        op, right = expr.op, expr.right

        def bitwise(it: _Interpreter, st: _State) -> Any:
            v = left(it, st)
            if v is None:
                return None
            if op == "&":
                return v & right & _MASK32
            if op == "|":
                return (v | right) & _MASK32
            return (v ^ right) & _MASK32
        return bitwise
    if isinstance(expr, Concat):
        items = [_getter(item) for item in expr.items]
        if any(g is None for g in items):
            return None

        def concat(it: _Interpreter, st: _State) -> Any:
            out = []
            for g in items:
                v = g(it, st)
                if v is None:
                    return None
                out.append(v)
            return tuple(out)
        return concat
    return None


def _leading(interp: _Interpreter, table: Table, rule: Rule) -> tuple[Any, ...]:
    tests: list[tuple[Any, str, Any, bool]] = []
    for stmt in rule.statements:
        if not isinstance(stmt, Match) or isinstance(stmt.left, Numgen):
            break
        operand = stmt.right
        if isinstance(operand, SetRef) and interp._is_dynamic(table, operand):
            break
        get = _getter(stmt.left)
        if get is None:
            break
        tests.append((get, stmt.op, operand, isinstance(operand, (SetRef, AnonSet)) and stmt.op in ("==", "!=")))
    return tuple(tests) if tests else ()


def _merged(exits: list[tuple[Weight, _State, str]]) -> list[tuple[Weight, _State, str]]:
    """Exits with equal decision state and verdict folded into one (the first one's history)."""
    if len(exits) < 2:
        return exits
    folded: dict[tuple, tuple[Weight, _State, str]] = {}
    for w, st, r in exits:
        k = (_key(st), r)
        old = folded.get(k)
        if old is None:
            folded[k] = (w, st, r)
        else:
            o = old[1]
            folded[k] = (old[0] + w, _with_history(o, o.steps, o.lookups, o.pins, o.paths + st.paths), r)
    return list(folded.values())


def _nat_done(hook: str, st: _State) -> bool:
    if hook in ("prerouting", "output"):
        return st.dnat is not None
    return st.masq


def _state(packet: Packet) -> _State:
    try:
        src = ipaddress.ip_address(packet.src)
        dst = ipaddress.ip_address(packet.dst)
    except ValueError as exc:
        raise InterpretError(f"packet: {exc}") from None
    if src.version != dst.version:
        raise InterpretError(f"packet: {packet.src} and {packet.dst} are of different families")
    if not 0 <= packet.port <= 65535:
        raise InterpretError(f"packet: port {packet.port} out of range")
    return _State(src, dst, packet.port, str(canonical(packet.proto, "proto")))


def _endpoint(dnat: tuple[Address, int]) -> str:
    addr, port = dnat
    key = (addr._version, addr._ip, port)
    found = _ENDPOINTS.get(key)
    if found is None:
        # str(), not an f-string: ipaddress's __format__ parses a format spec on every call.
        found = "[" + str(addr) + "]:" + str(port) if addr._version == 6 else str(addr) + ":" + str(port)
        _bounded(_ENDPOINTS)[key] = found
    return found


_ENDPOINTS: dict[tuple[int, int, int], str] = {}


def _outcome(st: _State, verdict: str) -> Outcome:
    if verdict in ("drop", "reject"):
        key: tuple = (verdict,)
    elif st.dnat is not None:
        key = ("dnat", st.dnat[0]._version, st.dnat[0]._ip, st.dnat[1], st.masq)
    else:
        key = ("accept", st.masq)
    found = _OUTCOMES.get(key)
    if found is None:
        if verdict in ("drop", "reject"):
            found = Outcome(verdict, None, False)  # type: ignore[arg-type]
        elif st.dnat is not None:
            found = Outcome("dnat", _endpoint(st.dnat), st.masq)
        else:
            found = Outcome("accept", None, st.masq)
        _bounded(_OUTCOMES)[key] = found
    return found


# Outcomes and the exact probabilities of distributions handed out, one object per value: the
# 50 000 probes of a 10 000-service `compare` hold four distributions each, over the same few
# endpoints and shares.
_OUTCOMES: dict[tuple, Outcome] = {}
_SHARES: dict[tuple[int, int], Fraction] = {}


def _shared_fraction(value: Fraction) -> Fraction:
    key = (value.numerator, value.denominator)
    found = _SHARES.get(key)
    if found is None:
        found = _bounded(_SHARES)[key] = value
    return found


def _paths(results: list[tuple[Weight, _State, str]]) -> list[Path]:
    out = []
    for w, st, verdict in results:
        steps, unlisted = st.steps, 0
        if steps and steps[-1].rule == _ELIDED:
            steps, unlisted = steps[:-1], int(steps[-1].text)
        out.append(Path(_outcome(st, verdict), w.fraction(), steps, tuple(dict.fromkeys(st.lookups)), st.pins, st.paths, unlisted))
    return out


def _walk(interp: _Interpreter, packet: Packet) -> list[tuple[Weight, _State, str]]:
    if packet.origin not in ("pod", "outside", "node"):
        raise InterpretError(f"packet: origin must be pod, outside or node, not {packet.origin!r}")
    items: list[tuple[Weight, _State]] = [(interp.one, _state(packet))]
    done: list[tuple[Weight, _State, str]] = []
    interp.work = 0
    if packet.origin == "node":
        items, term = interp.run_hook("output", items, nat=True)
        done += term
        items, term = interp.run_hook("postrouting", items, nat=True)
        done += term
        # A packet for a local address loops back in: filter chains of prerouting and input.
        staying = [(w, s) for w, s in items if interp.is_local(s.dst)]
        leaving = [(w, s) for w, s in items if not interp.is_local(s.dst)]
        staying, term = interp.run_hook("prerouting", staying, nat=False)
        done += term
        staying, term = interp.run_hook("input", staying, nat=False)
        done += term
        items = leaving + staying
    else:
        items, term = interp.run_hook("prerouting", items, nat=True)
        done += term
        staying = [(w, s) for w, s in items if interp.is_local(s.dst)]
        leaving = [(w, s) for w, s in items if not interp.is_local(s.dst)]
        staying, term = interp.run_hook("input", staying, nat=False)
        done += term
        leaving, term = interp.run_hook("forward", leaving, nat=False)
        done += term
        leaving, term = interp.run_hook("postrouting", leaving, nat=True)
        done += term
        items = leaving + staying
    return done + [(w, s, "accept") for w, s in items]


def trace(ruleset: Ruleset, packet: Packet, *, node_ips: Sequence[str] = (), mode: Mode = "kernel") -> list[Path]:
    return _paths(_walk(_Interpreter(ruleset, node_ips, mode, tracing=True), packet))


def _shared(ruleset: Ruleset, node_ips: Sequence[str], mode: _WalkMode) -> _Interpreter:
    """One interpreter per ruleset, node addresses and mode, kept while the ruleset lives: the
    probes of one `compare` share its memoised chain walks."""
    ips = tuple(node_ips)
    return indexes(ruleset).cached(("interpreter", mode, ips), lambda: _Interpreter(ruleset, ips, mode, tracing=False))  # type: ignore[no-any-return]


def interpret(
    ruleset: Ruleset, packet: Packet, *, node_ips: Sequence[str] = (), mode: Mode = "kernel"
) -> dict[Outcome, Fraction]:
    interp = _shared(ruleset, node_ips, mode)
    return _aggregate(interp, _walk(interp, packet))


def interpret_both(
    ruleset: Ruleset, packet: Packet, *, node_ips: Sequence[str] = ()
) -> tuple[dict[Outcome, Fraction], dict[Outcome, Fraction]]:
    """`interpret` in kernel mode and in ideal mode, from one walk: (kernel, ideal)."""
    interp = _shared(ruleset, node_ips, "both")
    results = _walk(interp, packet)
    kernel = [(w.kernel, st, v) for w, st, v in results if not w.kernel.is_zero()]  # type: ignore[union-attr]
    ideal = [(w.ideal, st, v) for w, st, v in results if not w.ideal.is_zero()]  # type: ignore[union-attr]
    return _aggregate(interp, kernel), _aggregate(interp, ideal)


def _aggregate(interp: _Interpreter, results: list[tuple[Weight, _State, str]]) -> dict[Outcome, Fraction]:
    sums: dict[Outcome, Weight] = {}
    for w, st, verdict in results:
        o = _outcome(st, verdict)
        sums[o] = sums[o] + w if o in sums else w
    if len(sums) == 1:
        ((o, w),) = sums.items()
        return {o: _shared_fraction(w.fraction())}
    # Outcome's own order (its fields in turn), without the dataclass's Python-level __lt__.
    return {o: _shared_fraction(w.fraction()) for o, w in sorted(sums.items(), key=_outcome_order)}


def _outcome_order(item: tuple[Outcome, Any]) -> tuple:
    o = item[0]
    return (o.verdict, o.endpoint, o.masquerade)


def walk_chain(
    ruleset: Ruleset,
    table: Table,
    chain: str,
    packet: Packet,
    *,
    node_ips: Sequence[str] = (),
    mode: Mode = "kernel",
    tracing: bool = False,
    entered: set[str] | None = None,
    budget: int | None = None,
    spent: list[int] | None = None,
) -> list[Path]:
    """`entered`, when given, receives the name of every chain the walk enters with a
    probability above 0 (paths merged into one keep only the first one's steps). `budget`:
    the work the walk may do (default `work_budget(ruleset)`); `spent`, when given, receives
    the work it did (also when it stops with an error)."""
    interp = _Interpreter(ruleset, node_ips, mode, tracing=tracing)
    interp.entered = entered
    if budget is not None:
        interp.budget = budget
    start = table.chains.get(chain)
    if start is None:
        raise InterpretError(f"{table.family} {table.name}: no chain {chain!r}")
    try:
        results = interp.run_chain(table, start, interp.one, _state(packet))
    finally:
        if spent is not None:
            spent.append(interp.work)
    return _paths([(w, s, "accept" if r == "return" else r) for w, s, r in results])


def distribution(paths: Sequence[Path]) -> dict[Outcome, Fraction]:
    """Each outcome's probability: its paths' summed over one common denominator
    (quantize.fsum), as a deep cascade's k / 2^(31 i) would cost a big gcd per added path."""
    groups: dict[Outcome, list[Fraction]] = {}
    for p in paths:
        groups.setdefault(p.outcome, []).append(p.probability)
    return {o: ps[0] if len(ps) == 1 else quantize.fsum(ps) for o, ps in sorted(groups.items())}

"""Indexes over a ruleset's sets, maps and long chains, so a lookup costs what the kernel's does.

Public API:
- `ElementIndex(elements)`: `.find(value) -> Element | None` (the first element, in dump order,
  whose key matches; the same answer as a linear scan) and `.slots(low, high)` (the elements
  whose single integer key lies in [low, high], for numgen slot lookups).
- `RuleIndex(rules)`: `.next(i, dst, dport) -> int`, the first rule at or after `i` that can
  match a packet to `dst`/`dport`; rules that demand another destination are skipped.
- `key_matches(value, key_component) -> bool`: the match rule for one component.
- `indexes(ruleset) -> RulesetIndex`: one per ruleset, built lazily and kept while the ruleset
  lives, so the thousands of probes of one `compare` share them.

Why: iptables' KUBE-SERVICES holds one rule per service port and nft's service-ips map one
element per service port; a walk that scans them per packet makes `compare` and `check`
quadratic in the number of services. Exact keys go in dicts, prefixes in one dict per prefix
length, ranges and numgen slots in sorted lists searched with bisect.
"""

from __future__ import annotations

import bisect
import ipaddress
import weakref
from collections.abc import Sequence
from typing import Any

from nfproxy.analysis.ir import (
    AnonSet,
    Chain,
    Const,
    Element,
    Field,
    Match,
    Prefix,
    Range,
    Rule,
    Ruleset,
    Statistic,
)

_Positioned = tuple[int, Element]


def key_matches(value: Any, key: Const | Prefix | Range) -> bool:
    """Does one component of a packet's key match one component of an element's key?"""
    if isinstance(value, frozenset):  # flags: any of them
        return isinstance(key, Const) and key.value in value
    if isinstance(key, Const):
        return value == key.value
    if isinstance(key, Prefix):
        return isinstance(value, (ipaddress.IPv4Address, ipaddress.IPv6Address)) and value in key.network
    try:
        return key.low <= value <= key.high  # type: ignore[operator]
    except TypeError:
        return False


class ElementIndex:
    """Elements grouped by which key components are exact, each group a dict on those."""

    __slots__ = ("elements", "_exact", "_prefixes", "_ranges", "_ranges_sorted", "_ints", "_int_elements")

    def __init__(self, elements: Sequence[Element]) -> None:
        self.elements = tuple(elements)
        # (key length, positions of Const components) -> {values at those positions: [(pos, el)]}
        self._exact: dict[tuple[int, tuple[int, ...]], dict[tuple, list[_Positioned]]] = {}
        self._prefixes: dict[tuple[int, int], dict[Any, _Positioned]] = {}  # (version, len) -> net
        self._ranges: list[tuple[Any, Any, int, Element]] = []
        self._ranges_sorted = True
        ints: list[tuple[int, int, Element]] = []
        for pos, el in enumerate(self.elements):
            key = el.key
            if len(key) == 1 and isinstance(key[0], Prefix):
                net = key[0].network
                self._prefixes.setdefault((net.version, net.prefixlen), {}).setdefault(net, (pos, el))
                continue
            if len(key) == 1 and isinstance(key[0], Range):
                self._ranges.append((key[0].low, key[0].high, pos, el))
                continue
            if len(key) == 1 and isinstance(key[0], Const) and type(key[0].value) is int:
                ints.append((key[0].value, pos, el))
            exact = tuple(i for i, k in enumerate(key) if isinstance(k, Const))
            sub = tuple(key[i].value for i in exact)  # type: ignore[union-attr]
            self._exact.setdefault((len(key), exact), {}).setdefault(sub, []).append((pos, el))
        ints.sort(key=lambda t: (t[0], t[1]))
        self._ints = [v for v, _, _ in ints]
        self._int_elements = [(p, e) for _, p, e in ints]
        try:
            self._ranges.sort(key=lambda r: (r[0], r[2]))
            self._ranges_sorted = all(a[1] < b[0] for a, b in zip(self._ranges, self._ranges[1:]))
        except TypeError:  # ranges of mixed kinds: scan them
            self._ranges_sorted = False

    def find(self, value: Any) -> Element | None:
        if value is None:
            return None
        if isinstance(value, frozenset):
            for el in self.elements:
                if len(el.key) == 1 and key_matches(value, el.key[0]):
                    return el
            return None
        parts = value if isinstance(value, tuple) else (value,)
        best: _Positioned | None = None
        for (length, exact), groups in self._exact.items():
            if length != len(parts):
                continue
            try:
                candidates = groups.get(tuple(parts[i] for i in exact))
            except TypeError:  # an unhashable value matches no exact key
                continue
            for pos, el in candidates or ():
                if best is not None and pos > best[0]:
                    break
                if len(exact) == length or all(key_matches(v, k) for v, k in zip(parts, el.key)):
                    best = (pos, el)
                    break
        if len(parts) == 1:
            for hit in (self._prefix(parts[0]), self._range(parts[0])):
                if hit is not None and (best is None or hit[0] < best[0]):
                    best = hit
        return None if best is None else best[1]

    def _prefix(self, value: Any) -> _Positioned | None:
        if not self._prefixes or not isinstance(value, (ipaddress.IPv4Address, ipaddress.IPv6Address)):
            return None
        best = None
        for (version, length), nets in self._prefixes.items():
            if version != value.version:
                continue
            hit = nets.get(ipaddress.ip_network((value, length), strict=False))
            if hit is not None and (best is None or hit[0] < best[0]):
                best = hit
        return best

    def _range(self, value: Any) -> _Positioned | None:
        if not self._ranges:
            return None
        if not self._ranges_sorted:
            hits = [(pos, el) for lo, hi, pos, el in self._ranges if key_matches(value, Range(lo, hi))]
            return min(hits, key=lambda h: h[0]) if hits else None
        try:
            i = bisect.bisect_right(self._ranges, value, key=lambda r: r[0]) - 1
        except TypeError:
            return None
        if i >= 0:
            lo, hi, pos, el = self._ranges[i]
            if key_matches(value, Range(lo, hi)):
                return pos, el
        return None

    def slots(self, low: int, high: int) -> list[tuple[int, int, Element]]:
        """(first, last, element) for every element covering integers in [low, high], clipped
        to it and in ascending order; an integer covered twice counts for its first element."""
        out: list[tuple[int, int, int, Element]] = []  # (first, last, pos, el)
        i = bisect.bisect_left(self._ints, low)
        j = bisect.bisect_right(self._ints, high)
        previous = None
        for k in range(i, j):
            v = self._ints[k]
            if v != previous:  # duplicates: the earliest position comes first in the sort
                pos, el = self._int_elements[k]
                out.append((v, v, pos, el))
                previous = v
        for lo, hi, pos, el in self._ranges_between(low, high):
            if isinstance(lo, int) and isinstance(hi, int) and lo <= high and hi >= low:
                out.append((max(lo, low), min(hi, high), pos, el))
        if self._ranges:
            out = _first_wins(out)
        return [(a, b, el) for a, b, _, el in out]


    def _ranges_between(self, low: int, high: int) -> list[tuple[Any, Any, int, Element]]:
        """The ranges that may cover integers in [low, high]: found by bisection when they are
        sorted and disjoint (an endpoint map holds a range per endpoint of 64 chains), all of
        them otherwise."""
        ranges = self._ranges
        if not self._ranges_sorted:
            return ranges
        try:
            i = max(bisect.bisect_right(ranges, low, key=lambda r: r[0]) - 1, 0)
            j = bisect.bisect_right(ranges, high, key=lambda r: r[0])
        except TypeError:  # ranges of addresses: not compared with an integer
            return ranges
        return ranges[i:j]


def _first_wins(spans: list[tuple[int, int, int, Element]]) -> list[tuple[int, int, int, Element]]:
    """Clip overlapping spans so each integer belongs to the span of the earliest element.

    Disjoint spans (every map nfproxy or the kernel writes: an interval set refuses overlaps)
    are returned sorted at once; the clipping below compares each span with all before it."""
    ordered = sorted(spans)
    if all(ordered[i][1] < ordered[i + 1][0] for i in range(len(ordered) - 1)):
        return ordered
    out: list[tuple[int, int, int, Element]] = []
    for span in sorted(spans, key=lambda s: s[2]):
        pieces = [span]
        for a, b, _, _ in out:
            nxt = []
            for lo, hi, pos, el in pieces:
                if hi < a or lo > b:
                    nxt.append((lo, hi, pos, el))
                    continue
                if lo < a:
                    nxt.append((lo, a - 1, pos, el))
                if hi > b:
                    nxt.append((b + 1, hi, pos, el))
            pieces = nxt
        out.extend(pieces)
    return sorted(out)


# --------------------------------------------------------------------------------------------
# Rules of long chains, by the destination they demand.

# Chains shorter than this are scanned: an index costs more than it saves.
_INDEXED_CHAIN = 16


def _demand(rule: Rule, field: str) -> Any:
    """The single value `field` must equal for `rule` to match, or None when any may do.
    Only leading matches count: a match after a statement with effects still lets the effects
    happen, so such a rule must be evaluated."""
    for st in rule.statements:
        if isinstance(st, Statistic):
            continue
        if not isinstance(st, Match):
            return None
        if st.op != "==" or not isinstance(st.left, Field) or st.left.name != field:
            continue
        right = st.right
        if isinstance(right, AnonSet) and len(right.elements) == 1 and len(right.elements[0].key) == 1:
            right = right.elements[0].key[0]
        if isinstance(right, Const):
            return right.value
        if isinstance(right, Prefix) and right.network.prefixlen == right.network.max_prefixlen:
            return right.network.network_address
        return None
    return None


class RuleIndex:
    """For one chain: rule positions per demanded destination (address or port), and the
    positions of the rules that demand neither."""

    __slots__ = ("field", "_by_value", "_generic", "length")

    def __init__(self, rules: Sequence[Rule]) -> None:
        self.length = len(rules)
        self.field: str | None = None
        self._by_value: dict[Any, list[int]] = {}
        self._generic: list[int] = list(range(len(rules)))
        if len(rules) < _INDEXED_CHAIN:
            return
        best: tuple[int, str, list[Any]] | None = None
        for name in ("daddr", "dport"):
            demands = [_demand(r, name) for r in rules]
            covered = sum(d is not None for d in demands)
            if best is None or covered > best[0]:
                best = (covered, name, demands)
        assert best is not None
        covered, name, demands = best
        if covered < len(rules) // 2:
            return
        self.field = name
        self._generic = [i for i, d in enumerate(demands) if d is None]
        for i, d in enumerate(demands):
            if d is not None:
                self._by_value.setdefault(d, []).append(i)

    def next(self, i: int, dst: Any, dport: Any) -> int:
        if self.field is None:
            return i
        g = self._generic
        k = bisect.bisect_left(g, i)
        out = g[k] if k < len(g) else self.length
        own = self._by_value.get(dst if self.field == "daddr" else dport)
        if own:
            k = bisect.bisect_left(own, i)
            if k < len(own) and own[k] < out:
                out = own[k]
        return out


class RulesetIndex:
    """Every index of one ruleset, built on first use."""

    __slots__ = ("_elements", "_rules", "_hooks", "__weakref__")

    def __init__(self) -> None:
        self._elements: dict[int, tuple[tuple[Element, ...], ElementIndex]] = {}
        self._rules: dict[int, tuple[Chain, RuleIndex]] = {}
        self._hooks: dict[tuple, Any] = {}

    def elements(self, elements: tuple[Element, ...]) -> ElementIndex:
        # Keyed by identity: the tuple is kept alive with its index, so the id cannot be reused.
        entry = self._elements.get(id(elements))
        if entry is None:
            entry = (elements, ElementIndex(elements))
            self._elements[id(elements)] = entry
        return entry[1]

    def rules(self, chain: Chain) -> RuleIndex:
        entry = self._rules.get(id(chain))
        if entry is None:
            entry = (chain, RuleIndex(chain.rules))
            self._rules[id(chain)] = entry
        return entry[1]

    def cached(self, key: tuple, build: Any) -> Any:
        """Anything else derived from the ruleset alone (base chains per hook, pod CIDRs)."""
        found = self._hooks.get(key)
        if found is None:
            found = self._hooks[key] = build()
        return found


_INDEXES: dict[int, RulesetIndex] = {}


def indexes(ruleset: Ruleset) -> RulesetIndex:
    found = _INDEXES.get(id(ruleset))
    if found is None:
        found = _INDEXES[id(ruleset)] = RulesetIndex()
        weakref.finalize(ruleset, _INDEXES.pop, id(ruleset), None)
    return found

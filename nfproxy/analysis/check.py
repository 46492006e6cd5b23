"""`check`: what a node's rules do per service port, and what is wrong with them.

Public API: `check(ruleset, *, node_ips=(), mode="kernel") -> Report`; `Report.services`
(`ServiceReport`: endpoints with exact probabilities, worst deviation from 1/n in parts per
billion, affinity timeout) and `Report.problems` (`Problem(kind, where, detail)`).

Service ports are found by what their chains do, not by their names: a chain that makes a random
choice (a statistic match, a numgen expression) and leads to DNATs is an endpoint-selection
chain. Each is walked with the exact interpreter from its first rule, for a client with no
affinity history, so the numbers are the kernel's. Problem kinds:

- `cascade-probability`: a statistic rule's threshold differs from 1/(n-i) for its position;
- `last-rule-probability`: the last rule of a cascade carries a probability (traffic falls through);
- `numgen-slots`: a numgen modulus or the slots of the map it indexes differ from the endpoints
  (some values find no slot, or some slots can never be drawn);
- `fallthrough`: some probability leaves a selection chain without an endpoint, other causes;
- `unreachable-endpoint`: an endpoint (DNAT) chain no path can reach;
- `missing-chain`: a jump, goto or verdict-map entry names a chain that does not exist;
- `jump-loop`: chains jump or go to one another in a cycle (the kernel refuses a loop; the
  interpreter would stop on it, and `trace` does);
- `jump-depth`: nft only, jumps and gotos (verdict maps included) nest 16 deep or more below a
  base chain (the kernel refuses that table: at most 15, its jump stack holds 16);
- `ungated-filter-jump`: a filter base chain jumps to a chain that can drop or reject, without
  a `ct state new` gate (it would then drop packets of established connections);
- `uninterpretable`: a rule the interpreter does not understand sits on a service's path;
- `weight-mismatch`: given the intended weights (`weights`, from the model: analysis.weights),
  an endpoint's share differs from w_i / sum(w) by more than 1e-9 (stale weights, a drained
  endpoint still picked). Without them every chain is held to 1/n, and unequal shares are
  reported with a hint to give the model.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from fractions import Fraction

from nfproxy.core.forked import split_map
from nfproxy.core.gc_pause import gc_paused
from nfproxy.analysis import quantize
from nfproxy.analysis.interpret import InterpretError, Mode, Packet, walk_chain, work_budget
from nfproxy.analysis.weights import Weights, intended_shares
from nfproxy.analysis.ir import (
    AnonSet,
    Bitwise,
    Chain,
    Concat,
    Const,
    Ct,
    Dnat,
    Expr,
    MapLookup,
    MarkSet,
    Match,
    Numgen,
    Range,
    Rule,
    Ruleset,
    SetRef,
    Statistic,
    Table,
    Unknown,
    Verdict,
    VerdictMap,
)

PPB = 10**9
# Both kernels' quantisation stays within this of w_i / sum(w) (docs/weights.md); a stale weight
# moves a share by 1/(sum * sum') at least, far more unless the sums run past ~30 000.
WEIGHT_TOLERANCE = Fraction(1, 10**9)
_MODEL_HINT = " (weighted rules? give the model, --manifests, to check them against the intended weights)"


@dataclass(frozen=True, slots=True)
class Problem:
    kind: str
    where: str
    detail: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.where}: {self.detail}"


@dataclass(frozen=True, slots=True)
class ServiceReport:
    name: str
    table: str
    chain: str
    protocol: str
    endpoints: tuple[tuple[str, Fraction], ...]
    fallthrough: Fraction
    affinity_timeout: int
    # Each endpoint's intended share (the model's weights), when they were given and known.
    intended: tuple[tuple[str, Fraction], ...] | None = None

    @property
    def worst_deviation_ppb(self) -> float:
        """From the intended shares when known, else from 1/n."""
        n = len(self.endpoints)
        if n == 0:
            return 0.0
        if self.intended is None:
            # max |p - 1/n| on integers over one denominator: the same float, without a
            # Fraction per endpoint (10 000 services x 10 endpoints in `check`).
            nums, den = quantize.common_denominator([p for _, p in self.endpoints])
            far = max(abs(num * n - den) for num in nums)
            return far * PPB / (den * n)
        want = dict(self.intended)
        got = [p for _, p in self.endpoints]
        nums, den = quantize.common_denominator(got + [want.get(e, Fraction(1, n)) for e, _ in self.endpoints])
        far = max(abs(a - b) for a, b in zip(nums[:n], nums[n:]))
        return far * PPB / den


@dataclass(frozen=True, slots=True)
class Report:
    services: tuple[ServiceReport, ...] = ()
    problems: tuple[Problem, ...] = field(default_factory=tuple)

    @property
    def clean(self) -> bool:
        return not self.problems


def _fsum(values: Iterable[Fraction]) -> Fraction:
    """`sum(values, Fraction(0))` over one common denominator (quantize.fsum): the shares of an
    iptables cascade have denominators up to 2^(31 n), and a gcd per term of that size made
    a 2 000-endpoint chain quadratic in its bits twice over."""
    return quantize.fsum(values)


def _where(table: Table, chain: str, rule: int | None = None) -> str:
    text = f"{table.family} {table.name} {chain}"
    return text if rule is None else f"{text} rule {rule + 1}"


def _exprs(expr: Expr) -> Iterator[Expr]:
    """`expr` and every expression inside it, outermost first. With a stack, not recursion: a
    dump may nest `concat`s hundreds deep (the kernel would not take it; the parser does)."""
    stack = [expr]
    while stack:
        e = stack.pop()
        yield e
        if isinstance(e, Concat):
            stack.extend(reversed(e.items))
        elif isinstance(e, Bitwise):
            stack.append(e.left)
        elif isinstance(e, MapLookup):
            stack.append(e.key)


def _rule_exprs(rule: Rule) -> Iterator[Expr]:
    for st in rule.statements:
        if isinstance(st, Match):
            yield from _exprs(st.left)
        elif isinstance(st, VerdictMap):
            yield from _exprs(st.key)
        elif isinstance(st, MarkSet):
            yield from _exprs(st.value)
        elif isinstance(st, Dnat):
            yield from _exprs(st.addr)
            if st.port is not None:
                yield from _exprs(st.port)


def _is_random(table: Table, rule: Rule) -> bool:
    """A statistic match, or a numgen anywhere in the rule's expressions (`_rule_exprs`);
    without generators: every rule of a 10 000-service iptables dump is asked."""
    for st in rule.statements:
        if isinstance(st, Statistic):
            return True
    return _numgen_dialect(table) and _draws_numgen(rule)


def _numgen_dialect(table: Table) -> bool:
    """Only nft has numgen: a table read from iptables text has none to look for (300 000
    rules at 10 000 services, each asked twice)."""
    return table.dialect == "nft"


def _draws_numgen(rule: Rule) -> bool:
    """A numgen anywhere in the rule's expressions (`_rule_exprs`)."""
    for st in rule.statements:
        if isinstance(st, Match):
            if _has_numgen(st.left):
                return True
        elif isinstance(st, VerdictMap):
            if _has_numgen(st.key):
                return True
        elif isinstance(st, MarkSet):
            if _has_numgen(st.value):
                return True
        elif isinstance(st, Dnat):
            if _has_numgen(st.addr) or (st.port is not None and _has_numgen(st.port)):
                return True
    return False


def _has_numgen(expr: Expr) -> bool:
    """`any(isinstance(e, Numgen) for e in _exprs(expr))`, without a generator for the common
    flat expressions (every rule of a 10 000-service dump is asked)."""
    if isinstance(expr, Numgen):
        return True
    if not isinstance(expr, (Concat, Bitwise, MapLookup)):
        return False
    return any(isinstance(e, Numgen) for e in _exprs(expr))


def _label(table: Table, chain: Chain, jumped: _JumpLabels | None = None) -> str:
    for rule in chain.rules:
        if " -> " in rule.comment:
            return rule.comment.split(" -> ")[0]
    if table.dialect == "iptables":
        for rule in chain.rules:  # a KUBE-SVC chain's masquerade rule: `ns/name:port cluster IP`
            if rule.comment and (found := _service_port(rule.comment)):
                return found
        if jumped is not None and (found := jumped.of(chain.name)):
            return found
    if "/" in chain.name and "-" in chain.name:
        # nft: kind-HASH-ns/name/proto/port
        ident = chain.name.split("-", 2)[-1]
        parts = ident.split("/")
        if len(parts) == 4:
            ns, name, proto, port = parts
            return f"{ns}/{name}:{port}" if port else f"{ns}/{name}"
        return ident
    for rule in chain.rules:
        if rule.comment:
            return rule.comment.removesuffix(" cluster IP")
    return chain.name


def _service_port(comment: str) -> str:
    """The service port a kube-proxy comment starts with (`ns/name:port cluster IP`, a node
    port's bare `ns/name:port`), or ""."""
    head = comment.split(" ", 1)[0]
    ns, slash, rest = head.partition("/")
    return head if slash and ns and rest and not rest.startswith(":") else ""


class _JumpLabels:
    """Which service port an iptables chain serves, from the comments of the rules that jump
    to it. Past 1 000 endpoints kube-proxy (and nfproxy) write the SVC and SEP rules without
    comments, and a KUBE-SVC chain without a masquerade rule (no cluster CIDR) then names no
    service itself: only KUBE-SERVICES' `ns/name:port cluster IP` (or a node port's, or a
    labelled KUBE-EXT chain jumping on) still says which. Read on the first chain that needs
    it: one pass over the table's rules."""

    def __init__(self, table: Table) -> None:
        self._table = table
        self._labels: dict[str, str] | None = None

    def of(self, chain: str) -> str:
        if self._labels is None:
            self._labels = self._read()
        return self._labels.get(chain, "")

    def _read(self) -> dict[str, str]:
        labels: dict[str, str] = {}
        unnamed: dict[str, list[str]] = {}  # a chain -> the chains it jumps to without a label
        for chain in self._table.chains.values():
            for rule in chain.rules:  # iptables: the target, if any, is the last statement
                v = rule.statements[-1] if rule.statements else None
                if type(v) is not Verdict or v.kind not in ("jump", "goto") or not v.target:
                    continue
                if rule.comment and (label := _service_port(rule.comment)):
                    labels.setdefault(v.target, label)
                else:
                    unnamed.setdefault(chain.name, []).append(v.target)
        todo = [c for c in unnamed if c in labels]
        while todo:  # a label flows on along unlabelled jumps (EXT -> SVL), each chain once
            src = todo.pop()
            for dst in unnamed.get(src, ()):
                if dst not in labels:
                    labels[dst] = labels[src]
                    todo.append(dst)
        return labels


def _probe(table: Table) -> tuple[str, str]:
    if table.family == "ip6":
        return "2001:db8:ffff::fe", "2001:db8:ffff::fd"
    return "203.0.113.254", "203.0.113.253"


@gc_paused()  # every service walked: memos and paths, no cycles
def check(
    ruleset: Ruleset, *, node_ips: Sequence[str] = (), mode: Mode = "kernel", weights: Weights | None = None
) -> Report:
    services: list[ServiceReport] = []
    problems: list[Problem] = []
    for table in ruleset.tables:
        survey = _survey(table)
        problems.extend(_missing_chains(table, survey))
        graph = _JumpGraph.of(table, survey)
        problems.extend(_loops(table, graph))
        problems.extend(_too_deep(table, graph))
        problems.extend(_ungated(table))
        problems.extend(_undrawable_slots(table))
        reached: set[str] = set()
        referenced = {v.target for targets in survey.targets.values() for v in targets if v.kind in ("jump", "goto")}
        selecting = [chain for chain in table.chains.values() if _selects(chain, survey)]
        budget = _Budget(work_budget(ruleset))
        jumped = _JumpLabels(table)
        walks = split_map(lambda chain: _selection(ruleset, table, chain, node_ips, mode, weights, budget, jumped),
                          selecting)
        for report, found, reached_here in walks:
            problems.extend(found)
            reached |= reached_here
            if report is not None:
                services.append(report)
        if survey.opaque:
            # A chain whose endpoint choice cannot be read (a DNAT or numgen the parser kept as
            # unknown) is not recognised as a selection chain: walk it too, so that it is
            # reported `uninterpretable` instead of vanishing from the report; unless a walk
            # above already stopped on one of its rules.
            told = {p.detail for p in problems if p.kind == "uninterpretable"}
            for name in survey.opaque:
                chain = table.chains[name]
                if _selects(chain, survey) or any(f"chain {name} rule " in d for d in told):
                    continue
                report, found, reached_here = _selection(ruleset, table, chain, node_ips, mode, weights, budget, jumped)
                problems.extend(found)
                reached |= reached_here
                if report is not None:
                    services.append(report)
        selected: frozenset[str] | None = None
        for chain in table.chains.values():
            if chain.name not in survey.dnat or chain.is_base:
                continue
            if chain.name not in referenced:
                problems.append(Problem("unreachable-endpoint", _where(table, chain.name), "no rule or map refers to this endpoint chain"))
                continue
            if chain.name in reached:
                continue
            if selected is None:
                selected = frozenset(v.target for name in survey.random for v in survey.targets[name])
            if chain.name in selected:
                problems.append(Problem("unreachable-endpoint", _where(table, chain.name), "its selection chain never picks it (probability 0)"))
    services.sort(key=lambda s: (s.name, s.chain))
    return Report(tuple(services), tuple(problems))


class _Budget:
    """The work `check` may spend on one table's selection walks (per process: split_map's
    children each have their own): each walk may do `per_walk` (interpret.work_budget), all of
    them together TOTAL_WALKS times that; once that is spent, each further walk may still do
    MIN_WALK, which every ordinary selection chain needs far less than. So a table of chains
    that each branch without end (a diamond of coin flips) costs a few full walks, not one per
    chain. docs/semantics.md, "Bounded work"."""

    TOTAL_WALKS = 4
    MIN_WALK = 5_000

    def __init__(self, per_walk: int) -> None:
        self.per_walk = per_walk
        self.left = per_walk * self.TOTAL_WALKS

    def next(self) -> int:
        return max(min(self.per_walk, self.left), self.MIN_WALK)

    def spend(self, work: int) -> None:
        self.left -= work


@dataclass(frozen=True, slots=True)
class _Survey:
    """What `check` asks of every chain of a table, found in one pass over its rules (320 000
    at 10 000 services in iptables): where each chain's rules can go, which chains DNAT and
    which make a random choice."""

    targets: dict[str, tuple[Verdict, ...]]  # named verdict maps included
    dnat: frozenset[str]
    random: frozenset[str]
    # Non-base chains with a rule the parser could not read that would pick an endpoint (an
    # unknown DNAT, numgen or statistic): walked, so that they are reported.
    opaque: tuple[str, ...] = ()


def _opaque_pick(st: Unknown) -> bool:
    """An unknown statement that stands where an endpoint is picked: nft JSON keeps the
    statement's own JSON (`{"dnat": …}`, a `numgen` inside), iptables its target or match."""
    text = st.text
    return text.startswith(('{"dnat"', "-j DNAT", "-m statistic")) or '"numgen"' in text


def _survey(table: Table) -> _Survey:
    """Written out over the statements (`_targets` and `_is_random` per rule cost twice as much)."""
    numgen = _numgen_dialect(table)
    targets: dict[str, tuple[Verdict, ...]] = {}
    dnat: list[str] = []
    random: list[str] = []
    opaque: list[str] = []
    for name, chain in table.chains.items():
        found: list[Verdict] = []
        draws = does_dnat = unknown = False
        for rule in chain.rules:
            for st in rule.statements:
                if isinstance(st, Verdict):
                    found.append(st)
                elif isinstance(st, Dnat):
                    does_dnat = True
                elif isinstance(st, Statistic):
                    draws = True
                elif isinstance(st, VerdictMap):
                    found.extend(_map_verdicts(table, st))
                elif isinstance(st, Unknown) and not unknown:
                    unknown = _opaque_pick(st)
            if numgen and not draws and _draws_numgen(rule):
                draws = True
        targets[name] = tuple(found)
        if does_dnat:
            dnat.append(name)
        if draws:
            random.append(name)
        if unknown and not chain.is_base:
            opaque.append(name)
    return _Survey(targets, frozenset(dnat), frozenset(random), tuple(opaque))


def _map_verdicts(table: Table, st: VerdictMap) -> Iterator[Verdict]:
    """The verdicts of a verdict map's elements, anonymous or named."""
    if isinstance(st.map, SetRef):
        sdef = table.sets.get(st.map.name)
        elements = sdef.elements if sdef is not None else ()
    else:
        elements = st.map.elements
    for el in elements:
        if isinstance(el.data, Verdict):
            yield el.data


def _selects(chain: Chain, survey: _Survey) -> bool:
    """An endpoint-selection chain: a random choice, or jumps straight to DNAT chains."""
    if chain.is_base:
        return False
    if chain.name in survey.random:
        return True  # a cascade, a numgen vmap, or a DNAT through a numgen-indexed map
    if chain.name in survey.dnat:
        return False
    return any(v.kind in ("jump", "goto") and v.target in survey.dnat for v in survey.targets[chain.name])


def _selection(
    ruleset: Ruleset, table: Table, chain: Chain, node_ips: Sequence[str], mode: Mode, weights: Weights | None = None,
    budget: _Budget | None = None, jumped: _JumpLabels | None = None,
) -> tuple[ServiceReport | None, list[Problem], set[str]]:
    problems: list[Problem] = []
    src, dst = _probe(table)
    best = None
    for proto in ("tcp", "udp", "sctp"):
        packet = Packet(src, dst, 1, proto, "pod")
        entered: set[str] = set()
        spent: list[int] = []
        allowed = None if budget is None else budget.next()
        try:
            paths = walk_chain(ruleset, table, chain.name, packet, node_ips=node_ips, mode=mode, entered=entered,
                               budget=allowed, spent=spent)
        except InterpretError as exc:
            detail = str(exc)
            if budget is not None and allowed < budget.per_walk and "rule evaluations" in detail:
                detail += f" (check had spent its work on this table's walks above, so this walk could do {allowed})"
            return None, [Problem("uninterpretable", _where(table, chain.name), detail)], set()
        finally:
            if budget is not None:
                budget.spend(sum(spent))
        dnat = _fsum(p.probability for p in paths if p.outcome.verdict == "dnat")
        if best is None or dnat > best[0]:
            best = (dnat, proto, paths, entered)
        if dnat == 1:
            break
    assert best is not None
    _, proto, paths, entered = best
    shares: dict[str, list[Fraction]] = {}
    rest: list[Fraction] = []
    reached = set(entered) - {chain.name}
    timeout = 0
    for p in paths:
        if p.outcome.verdict == "dnat":
            reached.add(chain.name)
        for name in p.lookups:
            sdef = table.sets.get(name)
            if sdef is not None:
                timeout = max(timeout, sdef.timeout)
        if p.outcome.verdict == "dnat" and p.outcome.endpoint:
            shares.setdefault(p.outcome.endpoint, []).append(p.probability)
        else:
            rest.append(p.probability)
    endpoints = {e: ps[0] if len(ps) == 1 else _fsum(ps) for e, ps in shares.items()}
    fallthrough = _fsum(rest)
    if not endpoints:
        return None, problems, reached
    label = _label(table, chain, jumped)
    intended = intended_shares(weights, label, sorted(endpoints)) if weights is not None else None
    report = ServiceReport(label, table.name, chain.name, proto, tuple(sorted(endpoints.items())), fallthrough, timeout,
                           tuple(sorted(intended.items())) if intended is not None else None)
    uniform = intended is None or len(set(intended.values())) == 1
    problems.extend(_cascade_problems(table, chain, hint=intended is None) if uniform else [])
    problems.extend(_numgen_problems(table, chain))
    if intended is not None:
        problems.extend(_weight_problems(table, chain, endpoints, intended))
    if fallthrough and not any(p.kind in ("last-rule-probability", "numgen-slots") for p in problems):
        problems.append(Problem("fallthrough", _where(table, chain.name), f"{float(fallthrough):.3e} of new connections leave without an endpoint"))
    elif not problems and report.worst_deviation_ppb > 1000:
        hint = _MODEL_HINT if intended is None else ""
        problems.append(Problem("cascade-probability", _where(table, chain.name), f"endpoint shares deviate from 1/{len(endpoints)} by {report.worst_deviation_ppb:.0f} ppb{hint}"))
    return report, problems, reached


def _weight_problems(table: Table, chain: Chain, found: dict[str, Fraction], intended: dict[str, Fraction]) -> list[Problem]:
    """Each endpoint whose share is not its intended one (within both kernels' quantisation)."""
    out = []
    for ep in sorted(found):
        got, want = found[ep], intended[ep]
        if abs(got - want) > WEIGHT_TOLERANCE:
            out.append(Problem("weight-mismatch", _where(table, chain.name), f"{ep} gets {float(got):.9f}, its weight says {quantize.shown(want)} ({float(want):.9f}): stale weights?"))
    return out


def _cascade_problems(table: Table, chain: Chain, hint: bool = False) -> list[Problem]:
    """The statistic cascade: rule i of n candidates must carry 1/(n-i), the last none."""
    candidates: list[tuple[int, Rule, Statistic | None]] = []
    for i, rule in enumerate(chain.rules):
        jumps = [v for v in rule.verdicts() if v.kind in ("jump", "goto")]
        if not jumps:
            continue
        if any(isinstance(s, Match) and isinstance(s.right, SetRef) for s in rule.statements):
            continue  # an affinity lookup, not part of the random choice
        stats = [s for s in rule.statements if isinstance(s, Statistic)]
        if stats:
            candidates.append((i, rule, stats[0]))
        elif candidates:
            candidates.append((i, rule, None))
            break
    if not candidates:
        return []
    out = []
    n = len(candidates)
    last_i, _, last_stat = candidates[-1]
    if last_stat is not None:
        out.append(Problem("last-rule-probability", _where(table, chain.name, last_i), f"the last of {n} endpoint rules has --probability {last_stat.probability}: what it does not take falls through"))
    for k, (i, _, stat) in enumerate(candidates[:-1] if last_stat is None else candidates):
        if stat is None:
            continue
        expected = f"{1 / (n - k):.10f}"
        if quantize.iptables_threshold(stat.probability) != quantize.iptables_threshold(expected):
            out.append(Problem("cascade-probability", _where(table, chain.name, i), f"--probability {stat.probability} at position {k + 1} of {n}: expected {expected} (1/{n - k}){_MODEL_HINT if hint else ''}"))
    return out


def _numgen_problems(table: Table, chain: Chain) -> list[Problem]:
    out: list[Problem] = []
    if not _numgen_dialect(table):
        return out
    for i, rule in enumerate(chain.rules):
        if not _draws_numgen(rule):
            continue  # every rule of an iptables cascade
        for st in rule.statements:
            maps: list[tuple[Expr, SetRef | AnonSet]] = []
            if isinstance(st, VerdictMap):
                maps.append((st.key, st.map))
            for e in _rule_exprs(Rule((st,))):
                if isinstance(e, MapLookup):
                    maps.append((e.key, e.map))
            for key, m in maps:
                if not isinstance(key, Numgen):
                    continue
                shared = isinstance(m, SetRef)
                if shared:
                    sdef = table.sets.get(m.name)
                    if sdef is None:
                        continue
                    elements = sdef.elements
                else:
                    elements = m.elements
                spans = _spans_cached(elements)
                low, high = key.offset, key.offset + key.mod - 1
                inside = _covered(spans, low, high)
                missing = _first_missing(spans, low, high, 8)
                # A shared map holds other chains' values too: only an anonymous one can have
                # keys that belong to this numgen and can never be drawn.
                extra = [] if shared else [lo for lo, hi in spans.pairs if lo < low or hi > high]
                if missing or extra:
                    total = inside if shared else spans.values
                    detail = f"numgen random mod {key.mod} offset {key.offset} indexes {total} slots"
                    if missing:
                        more = key.mod - inside - len(missing)
                        detail += f"; values {missing}{f' and {more} more' if more > 0 else ''} find no slot"
                    if extra:
                        detail += f"; slots {extra[:8]} can never be drawn"
                    out.append(Problem("numgen-slots", _where(table, chain.name, i), detail))
    return out


@dataclass(frozen=True, slots=True)
class _Spans:
    """A map's integer keys as inclusive (low, high) spans, a single value being (v, v):
    `pairs` as the elements give them (sorted), `starts`/`ends` their disjoint union, and
    `values` how many integers the keys name."""

    pairs: tuple[tuple[int, int], ...]
    starts: tuple[int, ...]
    ends: tuple[int, ...]
    values: int


_SPANS: dict[int, tuple[tuple, _Spans]] = {}


def _spans_cached(elements: tuple) -> _Spans:
    """A shared map's spans, read once for all the chains that index it (kept with the tuple,
    so an id is never reused while its entry lives; bounded to the last few maps)."""
    entry = _SPANS.get(id(elements))
    if entry is None or entry[0] is not elements:
        if len(_SPANS) > 64:
            _SPANS.clear()
        entry = _SPANS[id(elements)] = (elements, _spans(elements))
    return entry[1]


def _spans(elements: tuple) -> _Spans:
    pairs: list[tuple[int, int]] = []
    for el in elements:
        if len(el.key) != 1:
            continue
        k = el.key[0]
        if isinstance(k, Const) and isinstance(k.value, int):
            pairs.append((k.value, k.value))
        elif isinstance(k, Range) and isinstance(k.low, int) and isinstance(k.high, int) and k.low <= k.high:
            pairs.append((k.low, k.high))
    pairs.sort()
    starts: list[int] = []
    ends: list[int] = []
    for lo, hi in pairs:
        if ends and lo <= ends[-1] + 1:
            ends[-1] = max(ends[-1], hi)
        else:
            starts.append(lo)
            ends.append(hi)
    values = sum(e - s + 1 for s, e in zip(starts, ends))
    return _Spans(tuple(pairs), tuple(starts), tuple(ends), values)


def _covered(spans: _Spans, low: int, high: int) -> int:
    """How many integers of [low, high] the keys name: costs the spans inside, not the range
    (a numgen may have 2^32 values)."""
    n = 0
    i = max(bisect.bisect_right(spans.starts, low) - 1, 0)
    while i < len(spans.starts) and spans.starts[i] <= high:
        a, b = max(spans.starts[i], low), min(spans.ends[i], high)
        if a <= b:
            n += b - a + 1
        i += 1
    return n


def _first_missing(spans: _Spans, low: int, high: int, limit: int) -> list[int]:
    """The first `limit` integers of [low, high] no key names: costs the spans before them."""
    out: list[int] = []
    value = low
    i = max(bisect.bisect_right(spans.starts, low) - 1, 0)
    while value <= high and len(out) < limit:
        if i < len(spans.starts) and spans.starts[i] <= value:
            value = max(value, spans.ends[i] + 1)
            i += 1
            continue
        stop = spans.starts[i] if i < len(spans.starts) else high + 1
        while value < min(stop, high + 1) and len(out) < limit:
            out.append(value)
            value += 1
        value = max(value, stop)
    return out


def _numgen_keys(table: Table) -> Iterator[tuple[Numgen, SetRef | AnonSet]]:
    """Every (numgen, map) a rule draws from. Rules without a numgen anywhere are passed over
    by `_draws_numgen` first, and tables that cannot have one are not read at all."""
    if not _numgen_dialect(table):
        return
    for chain in table.chains.values():
        for rule in chain.rules:
            if not _draws_numgen(rule):
                continue
            for st in rule.statements:
                if isinstance(st, VerdictMap) and isinstance(st.key, Numgen):
                    yield st.key, st.map
                for e in _rule_exprs(Rule((st,))):
                    if isinstance(e, MapLookup) and isinstance(e.key, Numgen):
                        yield e.key, e.map


def _undrawable_slots(table: Table) -> Iterator[Problem]:
    """A named map indexed by numgen expressions: every key must be some numgen's value."""
    covered: dict[str, list[range]] = {}
    for key, m in _numgen_keys(table):
        if isinstance(m, SetRef):
            covered.setdefault(m.name, []).append(range(key.offset, key.offset + key.mod))
    for name, ranges in covered.items():
        sdef = table.sets.get(name)
        if sdef is None:
            continue
        starts, stops = _union(ranges)
        stray = [
            lo for lo, hi in _spans(sdef.elements).pairs
            if (i := bisect.bisect_right(starts, lo) - 1) < 0 or hi >= stops[i]
        ]
        if stray:
            yield Problem("numgen-slots", f"{table.family} {table.name} map {name}", f"slots {stray[:8]} are no numgen's value: their endpoints can never be drawn")


def _union(ranges: list[range]) -> tuple[list[int], list[int]]:
    """Disjoint, sorted [start, stop) intervals covering `ranges`: one bisect per key instead
    of a scan of every numgen's range (a shared map is indexed by one numgen per service)."""
    starts: list[int] = []
    stops: list[int] = []
    for r in sorted(ranges, key=lambda r: r.start):
        if stops and r.start <= stops[-1]:
            stops[-1] = max(stops[-1], r.stop)
        else:
            starts.append(r.start)
            stops.append(r.stop)
    return starts, stops


@dataclass(frozen=True, slots=True)
class _JumpGraph:
    """Where each chain jumps or goes (verdict maps included), and the chains peeled off in
    topological order: those no loop can pass through (nothing jumps to them, or only chains
    already peeled). A sane table is a tree of jumps and peels whole."""

    edges: dict[str, list[str]]
    peeled: list[str]
    cyclic: frozenset[str]  # what is left: loops and the chains below them

    @staticmethod
    def of(table: Table, survey: _Survey) -> _JumpGraph:
        chains = table.chains
        edges: dict[str, list[str]] = {}
        for name, targets in survey.targets.items():
            if targets:  # most chains of a big table end in a DNAT and jump nowhere
                outs = [v.target for v in targets if v.target in chains and v.kind in ("jump", "goto")]
                if outs:  # a target listed twice is harmless to the walks below
                    edges[name] = outs
        incoming = dict.fromkeys(edges, 0)
        for outs in edges.values():
            for target in outs:
                incoming[target] = incoming.get(target, 0) + 1
        peeled = [name for name, n in incoming.items() if not n]
        for name in peeled:
            for target in edges.get(name, ()):
                incoming[target] -= 1
                if not incoming[target]:
                    peeled.append(target)
        return _JumpGraph(edges, peeled, frozenset(name for name, n in incoming.items() if n))


def _loops(table: Table, graph: _JumpGraph) -> Iterator[Problem]:
    """One problem per set of chains that jump or go to one another in a cycle (a strongly
    connected component of the jump graph, verdict maps included, or a chain that jumps to
    itself), naming one cycle through it. Tarjan's algorithm with an explicit stack: linear in
    the jumps, and a straight run of thousands of chains is no deeper for it. It runs only over
    what peeling left (a second of Python at 10 000 services, saved)."""
    if not graph.cyclic:
        return
    edges = {name: outs for name, outs in graph.edges.items() if name in graph.cyclic}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    for root in edges:
        if root in index:
            continue
        work = [(root, 0)]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, i = work[-1]
            out = edges.get(node, ())
            if i < len(out):
                work[-1] = (node, i + 1)
                nxt = out[i]
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] != index[node]:
                continue
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in edges.get(node, ()):
                cycle = _cycle(node, set(component), edges)
                yield Problem("jump-loop", _where(table, node), f"{' -> '.join(cycle)}: chains that jump to one another in a loop (the kernel refuses it)")


# The kernel's jump stack (NFT_JUMP_STACK_SIZE): a chain 16 jumps or gotos below a base chain
# is refused ("Too many links"; tests/test_check.py finds the edge on the running kernel).
JUMP_STACK = 16


def _too_deep(table: Table, graph: _JumpGraph) -> Iterator[Problem]:
    """One problem per base chain of an nft table below which jumps and gotos nest JUMP_STACK
    deep or more, naming the deepest run (iptables has no such limit; chains no base chain
    reaches are not counted, as the kernel does not). Heights in reverse topological order, one
    pass; a loop, and what lies below it, ends a run: `jump-loop` reports it."""
    if table.dialect != "nft":
        return
    edges = graph.edges
    height: dict[str, int] = {}
    below: dict[str, str] = {}
    for node in reversed(graph.peeled):
        outs = edges.get(node)
        if outs is None:  # most chains (a DNAT each) jump nowhere: height 0
            continue
        best, nxt = 0, None
        for child in outs:
            h = height.get(child, 0) + 1
            if h > best:
                best, nxt = h, child
        height[node] = best
        if nxt is not None:
            below[node] = nxt
    for base in (c.name for c in table.chains.values() if c.is_base):
        if height.get(base, 0) < JUMP_STACK:
            continue
        run = [base]
        while run[-1] in below and len(run) <= JUMP_STACK:
            run.append(below[run[-1]])
        more = " -> …" if run[-1] in below else ""
        yield Problem("jump-depth", _where(table, base),
                      f"{' -> '.join(run)}{more}: jumps and gotos nest {height[base]} deep below this base chain "
                      f"(the kernel refuses more than {JUMP_STACK - 1})")


def _cycle(start: str, members: set[str], edges: dict[str, list[str]]) -> list[str]:
    """A shortest cycle from `start` back to itself within `members` (breadth first)."""
    parent: dict[str, str] = {}
    queue = [start]
    for node in queue:
        for nxt in edges.get(node, ()):
            if nxt not in members:
                continue
            if nxt == start:
                path = [node]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return [start] + path[::-1][1:] + [start] if node != start else [start, start]
            if nxt not in parent:
                parent[nxt] = node
                queue.append(nxt)
    return [start]


def _missing_chains(table: Table, survey: _Survey) -> Iterator[Problem]:
    """Rule by rule only in the chains whose targets, as surveyed, name a missing chain."""
    chains = table.chains
    for chain in chains.values():
        if all(v.target in chains for v in survey.targets[chain.name] if v.kind in ("jump", "goto")):
            continue
        for i, rule in enumerate(chain.rules):
            for v in rule.verdicts():
                if v.kind in ("jump", "goto") and v.target not in table.chains:
                    yield Problem("missing-chain", _where(table, chain.name, i), f"{v.kind} to {v.target}, which does not exist")
    for sdef in table.sets.values():
        if sdef.kind != "map":
            continue  # no data, no verdicts
        for el in sdef.elements:
            if isinstance(el.data, Verdict) and el.data.kind in ("jump", "goto") and el.data.target not in table.chains:
                yield Problem("missing-chain", f"{table.family} {table.name} map {sdef.name}", f"an element goes to {el.data.target}, which does not exist")


def _ct_gated(rule: Rule, flag: str | None = "new") -> bool:
    for st in rule.statements:
        if isinstance(st, Match) and isinstance(st.left, Ct) and st.left.key == "state":
            if flag is None:
                return True
            ops = st.right.elements if isinstance(st.right, AnonSet) else (st.right,)
            values = {k.value for el in ops for k in (el.key if hasattr(el, "key") else (el,)) if isinstance(k, Const)}
            if st.op == "==" and values == {flag}:
                return True
    return False


def _blocking_chains(table: Table) -> frozenset[str]:
    """The chains in which a packet can be dropped or rejected by a rule that does not itself
    look at conntrack state, there or in a chain such a rule jumps or goes to. One pass over the
    rules and one walk back from the chains that drop (iterative: a straight run of thousands
    of jumps is no deeper for it), so the question costs each base-chain rule a set lookup, not
    a graph search of its own."""
    callers: dict[str, list[str]] = {}
    blocking: set[str] = set()
    summaries: dict[str, tuple[bool, tuple[tuple[str, str], ...]]] = {}
    for name, chain in table.chains.items():
        for rule in chain.rules:
            if _ct_gated(rule, None):
                continue
            for st in rule.statements:
                if isinstance(st, Verdict):
                    if st.kind in ("drop", "reject"):
                        blocking.add(name)
                    elif st.kind in ("jump", "goto"):
                        callers.setdefault(st.target, []).append(name)
                elif isinstance(st, VerdictMap):
                    found = _map_summary(table, st, summaries)
                    if found[0]:
                        blocking.add(name)
                    for _, target in found[1]:
                        callers.setdefault(target, []).append(name)
    stack = list(blocking)
    while stack:
        for caller in callers.get(stack.pop(), ()):
            if caller not in blocking:
                blocking.add(caller)
                stack.append(caller)
    return frozenset(blocking)


def _map_summary(
    table: Table, st: VerdictMap, summaries: dict[str, tuple[bool, tuple[tuple[str, str], ...]]]
) -> tuple[bool, tuple[tuple[str, str], ...]]:
    """Whether a verdict map's elements drop or reject, and the chains they jump or go to (in
    element order); a named map's read once into `summaries`, however many rules use it."""
    if isinstance(st.map, SetRef):
        found = summaries.get(st.map.name)
        if found is None:
            found = summaries[st.map.name] = _map_summary_uncached(table, st)
        return found
    return _map_summary_uncached(table, st)


def _map_summary_uncached(table: Table, st: VerdictMap) -> tuple[bool, tuple[tuple[str, str], ...]]:
    blocks = False
    targets: dict[tuple[str, str], None] = {}
    for v in _map_verdicts(table, st):
        if v.kind in ("drop", "reject"):
            blocks = True
        elif v.kind in ("jump", "goto"):
            targets[(v.kind, v.target)] = None
    return blocks, tuple(targets)


def _ungated(table: Table) -> Iterator[Problem]:
    """Linear in the rules and map elements: which chains can block is found once per table
    (`_blocking_chains`), and a named verdict map is read once however many rules use it."""
    blocking: frozenset[str] | None = None
    summaries: dict[str, tuple[bool, tuple[tuple[str, str], ...]]] = {}
    for chain in table.chains.values():
        if not chain.is_base or chain.type != "filter":
            continue
        if blocking is None:
            blocking = _blocking_chains(table)
        for i, rule in enumerate(chain.rules):
            if _ct_gated(rule):
                continue
            for st in rule.statements:
                if isinstance(st, Verdict):
                    targets: tuple[tuple[str, str], ...] = ((st.kind, st.target),) if st.kind in ("jump", "goto") else ()
                elif isinstance(st, VerdictMap):
                    targets = _map_summary(table, st, summaries)[1]
                else:
                    continue
                hit = next(((kind, target) for kind, target in targets if target in blocking), None)
                if hit is not None:
                    yield Problem("ungated-filter-jump", _where(table, chain.name, i), f"{hit[0]} to {hit[1]}, which can drop or reject, without ct state new")
                    break


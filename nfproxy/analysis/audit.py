"""`audit`: did the new connections of a window land on the endpoints as the rules promise?

Public API: `reading(ruleset, counts, pins=None, *, node_ips=(), mode="kernel") -> Reading`,
`window(first, second) -> dict[PortKey, WindowPort]` (`first` None: counts since each
counter was created), `audit(first, second, *, alpha=0.001, only=None) -> AuditReport`.

In the NAT table only a connection's first packet is evaluated, so the packet counter of an
endpoint's DNAT counts the new connections to that endpoint. `check`'s exact interpreter says
what share of new connections each endpoint should get; a goodness-of-fit test per service
port says how surprising the counts are under that split. Reading the kernel is the caller's
business (the `audit` command): everything here is arithmetic on what was read, so it is tested
without root.

The test: Pearson's chi-square when every expected count is at least 5 (Cochran's rule, below
which the chi-square approximation can be far off), else the exact multinomial test by
enumeration, as long as the outcomes are few enough to enumerate. When even the most lopsided
outcome could not reach `alpha`, or there are too many outcomes to enumerate, the counts cannot
mean anything yet: `too few connections`. p-values are corrected across the tested service
ports with Holm's step-down method (as strong as Bonferroni, never weaker), so a node with many
services does not cry wolf.

Legitimate skew is explained, not flagged, when the rules show its cause:
- ClientIP affinity: connections that followed a client's pin did not go through the random
  choice. When the backend counts them per endpoint (`pins`), only the others are tested; when
  it does not, a skew on a service whose affinity sets hold clients is `explained` untested.
- Local traffic policy (and any other port with several selection chains sharing endpoints):
  the counts are a mixture of the chains' splits in proportions the counters do not give, so
  the proportions are fitted (maximum likelihood) and the test loses one degree of freedom per
  fitted proportion.
- Terminating fallback needs no model: when only terminating endpoints are left, the rules
  select among them, and the expected shares read from the rules already say so.
A port whose rules or counters changed between the readings (endpoint added, removed, counter
reset) is reported `changed` with what changed, and not tested: its expectation moved mid-window.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Protocol

from nfproxy.analysis.check import check
from nfproxy.analysis.interpret import Mode
from nfproxy.analysis.ir import Ruleset

COCHRAN_MIN_EXPECTED = 5
"""Every expected count at least this, or the chi-square approximation is not trusted."""
MAX_ENUMERATION = 200_000
"""Outcomes the exact multinomial test may enumerate (C(N+k-1, k-1)); beyond: too few."""

OK, SKEWED, TOO_FEW, EXPLAINED, CHANGED = "ok", "skewed", "too few connections", "explained", "changed"


class CountLike(Protocol):
    """One endpoint's counter (nfproxy.analysis.counters.EndpointCount has these fields)."""

    namespace: str
    service: str
    port: str
    protocol: str
    endpoint: str
    connections: int


@dataclass(frozen=True, slots=True, order=True)
class PortKey:
    """A service port as the rules spell it: `ns/name:port`, protocol and table family."""

    name: str
    protocol: str
    family: str

    def __str__(self) -> str:
        return f"{self.name}/{self.protocol} ({self.family})"

    @property
    def namespace_service_port(self) -> tuple[str, str, str]:
        ns_name, _, port = self.name.partition(":")
        ns, _, name = ns_name.partition("/")
        return ns, name, port


@dataclass(frozen=True, slots=True)
class Selection:
    """One endpoint-selection chain of a port: the exact share of each endpoint it picks."""

    chain: str
    shares: tuple[tuple[str, Fraction], ...]
    affinity_timeout: int = 0
    fallthrough: Fraction = Fraction(0)


@dataclass(frozen=True, slots=True)
class Reading:
    """What one look at the kernel saw: counters, and the selection chains of the same rules."""

    counts: Mapping[PortKey, Mapping[str, int]]
    selections: Mapping[PortKey, tuple[Selection, ...]]
    pins: Mapping[PortKey, Mapping[str, int]] | None = None
    """Connections that arrived through an affinity lookup, per endpoint; None: not counted."""
    pinned_clients: Mapping[PortKey, int] = field(default_factory=dict)
    """Clients held in a port's affinity sets (nft sets list their elements), when known."""
    taken_at: float | None = None
    """When the kernel was read (time.monotonic()): the window is the time between snapshots,
    not the sleep between readings (parsing a large ruleset takes minutes)."""


def endpoint_label(endpoint: str) -> str:
    """`ip:port` with IPv6 bracketed: one spelling for counters and interpreter alike."""
    if endpoint.startswith("["):
        return endpoint
    host, sep, port = endpoint.rpartition(":")
    if sep and ":" in host:
        return f"[{host}]:{port}"
    return endpoint


def _family(table_family: str, endpoint: str) -> str:
    if table_family in ("ip", "ip6"):
        return table_family
    return "ip6" if endpoint.startswith("[") else "ip"


def reading(
    ruleset: Ruleset,
    counts: Iterable[CountLike],
    pins: Mapping[str, Mapping[str, int]] | None = None,
    pinned_clients: Mapping[PortKey, int] | None = None,
    *,
    node_ips: Sequence[str] = (),
    mode: Mode = "kernel",
    taken_at: float | None = None,
) -> Reading:
    """One reading from counters and the rules they were read with (one snapshot of both).
    `pins`: connections that followed an affinity pin per selection chain and endpoint
    (`iptables_pins`, `nft_pins`); None when the backend does not count them."""
    per_port: dict[PortKey, dict[str, int]] = {}
    for c in counts:
        ep = endpoint_label(c.endpoint)
        key = PortKey(f"{c.namespace}/{c.service}:{c.port}" if c.port else f"{c.namespace}/{c.service}",
                      c.protocol.lower(), "ip6" if ep.startswith("[") else "ip")
        per_port.setdefault(key, {})
        per_port[key][ep] = per_port[key].get(ep, 0) + c.connections
    selections: dict[PortKey, list[Selection]] = {}
    # A ServiceReport names its table but not the family: iptables has a `nat` of each.
    for table_family in sorted({t.family for t in ruleset.tables}):
        part = Ruleset(tuple(t for t in ruleset.tables if t.family == table_family))
        for s in check(part, node_ips=node_ips, mode=mode).services:
            shares = tuple((endpoint_label(e), p) for e, p in s.endpoints)
            key = PortKey(s.name, s.protocol, _family(table_family, shares[0][0]))
            selections.setdefault(key, []).append(Selection(s.chain, shares, s.affinity_timeout, s.fallthrough))
    return Reading(
        counts=per_port,
        selections={k: tuple(v) for k, v in selections.items()},
        pins=None if pins is None else _pins_by_port(pins, selections),
        pinned_clients=dict(pinned_clients or {}),
        taken_at=taken_at,
    )


def _pins_by_port(
    pins: Mapping[str, Mapping[str, int]], selections: Mapping[PortKey, list[Selection]]
) -> dict[PortKey, dict[str, int]]:
    """Pinned connections per selection chain, summed per port (a Local port's cluster and
    local chains each look up the pins)."""
    out: dict[PortKey, dict[str, int]] = {}
    for key, chains in selections.items():
        per = out.setdefault(key, {})
        for s in chains:
            for ep, n in pins.get(s.chain, {}).items():
                if ep.startswith("[") == (key.family == "ip6"):  # ip and ip6 share chain names
                    per[ep] = per.get(ep, 0) + n
    return out


# ---- the window


@dataclass(frozen=True, slots=True)
class WindowPort:
    """A port's new connections per endpoint in the window, and what changed under them."""

    counts: Mapping[str, int]
    pins: Mapping[str, int] | None
    selections: tuple[Selection, ...]
    changes: tuple[str, ...] = ()


def _delta(before: Mapping[str, int] | None, after: Mapping[str, int]) -> tuple[dict[str, int], list[str]]:
    if before is None:
        return dict(after), []
    out: dict[str, int] = {}
    changes: list[str] = []
    for ep, n in after.items():
        if ep not in before:
            changes.append(f"{ep} appeared (counted since it was created: {n})")
            out[ep] = n
        elif n < before[ep]:
            changes.append(f"{ep}: counter reset ({before[ep]} -> {n}: the endpoint was recreated)")
            out[ep] = n
        else:
            out[ep] = n - before[ep]
    changes.extend(f"{ep} vanished ({before[ep]} before)" for ep in before if ep not in after)
    return out, changes


def window(first: Reading | None, second: Reading) -> dict[PortKey, WindowPort]:
    """Per port, the connections between two readings (`first` None: since each counter's
    creation). Resets, endpoints that came or went and changed selection rules are listed in
    `changes`, never smoothed over."""
    ports: dict[PortKey, WindowPort] = {}
    for key in sorted(set(second.counts) | set(second.selections)):
        after = second.counts.get(key, {})
        before = None if first is None else first.counts.get(key, {})
        counts, changes = _delta(before, after)
        pins = None
        if second.pins is not None and (first is None or first.pins is not None):
            pins, _ = _delta(None if first is None else first.pins.get(key, {}), second.pins.get(key, {}))  # type: ignore[union-attr]
        selections = second.selections.get(key, ())
        if first is not None and first.selections.get(key, ()) != selections:
            old = {e for s in first.selections.get(key, ()) for e, _ in s.shares}
            new = {e for s in selections for e, _ in s.shares}
            if old == new:
                changes.append("the endpoints' shares changed")
            else:
                changes.extend([*(f"{e} left the selection rules" for e in sorted(old - new)),
                                *(f"{e} joined the selection rules" for e in sorted(new - old))])
        ports[key] = WindowPort(counts, pins, selections, tuple(dict.fromkeys(changes)))
    return ports


# ---- statistics


@dataclass(frozen=True, slots=True)
class Fit:
    """A goodness-of-fit result: p is None when the counts cannot mean anything."""

    p: float | None
    method: str
    expected: Mapping[str, float]
    """Expected share per endpoint (after fitting, for mixtures)."""


def _log_pmf(counts: Sequence[int], probs: Sequence[float]) -> float:
    n = sum(counts)
    out = math.lgamma(n + 1)
    for c, p in zip(counts, probs):
        out += c * math.log(p) - math.lgamma(c + 1) if c else 0.0
    return out


def _compositions(n: int, k: int) -> Iterable[tuple[int, ...]]:
    if k == 1:
        yield (n,)
        return
    for first in range(n + 1):
        for rest in _compositions(n - first, k - 1):
            yield (first, *rest)


def exact_multinomial(counts: Sequence[int], probs: Sequence[float]) -> tuple[float, float]:
    """(p-value, the smallest p-value any outcome of this size could have).

    The p-value sums the probability of every outcome no more likely than the observed one
    (with a relative tolerance for float ties). scipy has no multinomial test; the enumeration
    is short and its cost is bounded by MAX_ENUMERATION."""
    observed = _log_pmf(counts, probs)
    logs = [_log_pmf(c, probs) for c in _compositions(sum(counts), len(counts))]
    slack = 1e-7 * max(1.0, abs(observed))
    p = sum(math.exp(v) for v in logs if v <= observed + slack)
    lowest = min(logs)
    floor = sum(math.exp(v) for v in logs if v <= lowest + 1e-7 * max(1.0, abs(lowest)))
    return min(1.0, p), min(1.0, floor)


def _outcomes(n: int, k: int) -> int:
    return math.comb(n + k - 1, k - 1)


def chi_square_sf(x: float, df: int) -> float:
    """P(X >= x) for X chi-square with `df` degrees of freedom: the regularized upper incomplete
    gamma Q(df/2, x/2) by its finite series for integer df, summed in log space so that large
    df and x neither underflow nor overflow.

    Why not scipy: the node image leaves the lab extra's scipy out (over 100 MB installed) and
    `audit` runs on nodes. The tests check this against scipy.stats.chi2.sf."""
    if x <= 0:
        return 1.0
    y = x / 2
    if df % 2 == 0:
        logs = [-y + i * math.log(y) - math.lgamma(i + 1) for i in range(df // 2)]
        head = 0.0
    else:
        logs = [-y + (i - 0.5) * math.log(y) - math.lgamma(i + 0.5) for i in range(1, (df - 1) // 2 + 1)]
        head = math.erfc(math.sqrt(y))
    if not logs:
        return min(1.0, head)
    top = max(logs)
    return min(1.0, head + math.exp(top) * math.fsum(math.exp(v - top) for v in logs))


def _chi_square(counts: Sequence[int], probs: Sequence[float], fitted: int) -> float:
    n = sum(counts)
    total = sum(probs)
    statistic = math.fsum((c - p / total * n) ** 2 / (p / total * n) for c, p in zip(counts, probs))
    return chi_square_sf(statistic, len(counts) - 1 - fitted)


_BOUNDARY = 1e-6  # a mixture proportion below this is on the edge of the simplex


def _mixture(observed: Mapping[str, int], selections: Sequence[Selection]) -> tuple[dict[str, float], int]:
    """The mixture of the chains' splits that best explains the counts (maximum likelihood,
    by EM on the proportions: the log-likelihood is concave in them, EM climbs it
    monotonically): (share per endpoint, number of fitted proportions)."""
    endpoints = sorted({e for s in selections for e, _ in s.shares} | set(observed))
    tables = []
    for s in selections:
        total = sum(p for _, p in s.shares)
        shares = dict(s.shares)
        tables.append([float(shares.get(e, 0) / total) for e in endpoints])
    m, n = len(tables), sum(observed.values())
    weights = [1.0 / m] * m
    for _ in range(5000):
        new = [0.0] * m
        for i, e in enumerate(endpoints):
            c = observed.get(e, 0)
            mix = sum(weights[j] * tables[j][i] for j in range(m))
            if c and mix > 0:
                for j in range(m):
                    new[j] += c * weights[j] * tables[j][i] / mix
        new = [w / n for w in new] if n else weights
        done = max(abs(a - b) for a, b in zip(new, weights)) < 1e-12
        weights = new
        if done:
            break
    shares = {e: sum(weights[j] * tables[j][i] for j in range(m)) for i, e in enumerate(endpoints)}
    # Degrees of freedom the fit took: one per direction its proportions could move in. A
    # proportion driven to 0 was not free to follow the counts (the remote endpoint of a
    # Local-policy pair, given every connection, is fitted by "all cluster traffic" and must
    # still be tested against its 1/2), and chains that split alike (a Local port whose
    # endpoints are all local) move nothing.
    free = [tables[j] for j in range(m) if weights[j] > _BOUNDARY]
    return shares, _rank([[a - b for a, b in zip(t, free[0])] for t in free[1:]])


def _rank(rows: list[list[float]]) -> int:
    """The rank of a few rows (Gram-Schmidt; a port has two or three chains)."""
    basis: list[list[float]] = []
    for row in rows:
        v = list(row)
        for b in basis:
            dot = math.fsum(x * y for x, y in zip(v, b))
            v = [x - dot * y for x, y in zip(v, b)]
        norm = math.sqrt(math.fsum(x * x for x in v))
        if norm > 1e-9:
            basis.append([x / norm for x in v])
    return len(basis)


def fit(observed: Mapping[str, int], selections: Sequence[Selection], alpha: float) -> Fit:
    """Test counts against the port's selection chains (a fitted mixture when several)."""
    if len(selections) == 1:
        s = selections[0]
        total = sum(p for _, p in s.shares)
        expected = {e: float(p / total) for e, p in s.shares}
        fitted = 0
    else:
        expected, fitted = _mixture(observed, selections)
    n = sum(observed.values())
    if any(c and expected.get(e, 0.0) <= 0 for e, c in observed.items()):
        return Fit(0.0, "impossible: connections to an endpoint the rules never pick", expected)
    keys = [e for e, p in expected.items() if p > 0]
    if n == 0:
        return Fit(None, "no connections", expected)
    if len(keys) <= 1:
        return Fit(1.0, "one possible endpoint", expected)
    if len(keys) - fitted <= 1:  # as many free proportions as the counts have: they fit exactly
        return Fit(1.0, "the chains' mixture fits these counts exactly", expected)
    counts = [observed.get(e, 0) for e in keys]
    probs = [expected[e] for e in keys]
    if min(probs) * n >= COCHRAN_MIN_EXPECTED:
        return Fit(_chi_square(counts, probs, fitted), "chi-square", expected)
    if fitted or _outcomes(n, len(keys)) > MAX_ENUMERATION:
        return Fit(None, f"expected counts below {COCHRAN_MIN_EXPECTED}", expected)
    p, floor = exact_multinomial(counts, probs)
    if floor > alpha:
        return Fit(None, f"exact multinomial: no outcome of {n} could reach p <= {alpha:g}", expected)
    return Fit(p, "exact multinomial", expected)


def holm(pvalues: Mapping[PortKey, float]) -> dict[PortKey, float]:
    """Holm-adjusted p-values: compare each with alpha to control the family-wise error."""
    ordered = sorted(pvalues.items(), key=lambda kv: (kv[1], kv[0]))
    m = len(ordered)
    out: dict[PortKey, float] = {}
    running = 0.0
    for i, (key, p) in enumerate(ordered):
        running = max(running, min(1.0, (m - i) * p))
        out[key] = running
    return out


# ---- the audit


@dataclass(frozen=True, slots=True)
class PortAudit:
    key: PortKey
    connections: int
    observed: Mapping[str, int]
    expected: Mapping[str, float]
    tested: Mapping[str, int]
    """The counts the test used: `observed` less the connections that followed an affinity pin."""
    p: float | None
    """The test's p-value, before the correction across ports."""
    p_adjusted: float | None
    method: str
    verdict: str
    explanations: tuple[str, ...] = ()
    changes: tuple[str, ...] = ()
    p_plain: float | None = None
    """Against the plain split, without explanations (equal to `p` when none applied)."""


@dataclass(frozen=True, slots=True)
class AuditReport:
    ports: tuple[PortAudit, ...]
    alpha: float
    since_creation: bool

    @property
    def skewed(self) -> tuple[PortAudit, ...]:
        return tuple(p for p in self.ports if p.verdict == SKEWED)


def _plain(selections: Sequence[Selection]) -> Selection:
    """The split a port promises its cluster traffic: its first chain by name (kube-proxy's
    KUBE-SVC-*, nfproxy's service-*), sorting before the local (KUBE-SVL-*, local-*) ones."""
    return sorted(selections, key=lambda s: (not s.chain.startswith(("KUBE-SVC-", "service-")), s.chain))[0]


def _judge(key: PortKey, port: WindowPort, alpha: float, pinned_clients: int) -> tuple[PortAudit, bool]:
    """A port's test before the correction across ports; the bool says it enters Holm."""
    observed = dict(port.counts)
    n = sum(observed.values())
    base = dict(key=key, connections=n, observed=observed, changes=port.changes)
    if not port.selections:
        why = "no selection rules left for these counters" if n else "no selection rules"
        return PortAudit(**base, expected={}, tested=observed, p=None, p_adjusted=None, method=why,
                         verdict=CHANGED if port.changes or n else TOO_FEW), False
    plain = fit(observed, [_plain(port.selections)], alpha)
    if port.changes:
        return PortAudit(**base, expected=plain.expected, tested=observed, p=None, p_adjusted=None,
                         method="not tested", verdict=CHANGED, p_plain=plain.p), False
    # Chains with the same split are one component of a mixture (nft's external-* chain of a
    # Local port picks as its local-* chain does): fitting both would waste a degree of freedom.
    selections = tuple({s.shares: s for s in port.selections}.values())
    affinity = max(s.affinity_timeout for s in selections)
    tested, explanations = _explain(port, selections, observed, affinity)
    result = fit(tested, selections, alpha) if explanations else plain
    if affinity and port.pins is None and pinned_clients and plain.p is not None and plain.p <= alpha:
        explanations.append(f"ClientIP affinity ({affinity}s): {pinned_clients} clients pinned; connections "
                            "that followed a pin are not counted apart, so the split cannot be tested")
        return PortAudit(**base, expected=plain.expected, tested=observed, p=None, p_adjusted=None,
                         method="not tested", verdict=EXPLAINED, explanations=tuple(explanations),
                         p_plain=plain.p), False
    explained = bool(explanations) and plain.p is not None and plain.p <= alpha
    verdict = OK if result.p is not None else EXPLAINED if explained else TOO_FEW
    return PortAudit(**base, expected=result.expected, tested=tested, p=result.p, p_adjusted=None,
                     method=result.method, verdict=verdict, explanations=tuple(explanations),
                     p_plain=plain.p), result.p is not None


def _explain(
    port: WindowPort, selections: tuple[Selection, ...], observed: dict[str, int], affinity: int
) -> tuple[dict[str, int], list[str]]:
    """The counts to test and the causes of legitimate skew the rules and counters show."""
    explanations: list[str] = []
    tested = observed
    n = sum(observed.values())
    pinned = sum(port.pins.values()) if port.pins is not None else 0
    if affinity and port.pins is not None and pinned:
        tested = {e: c - port.pins.get(e, 0) for e, c in observed.items()}
        explanations.append(f"ClientIP affinity ({affinity}s): {pinned} of {n} connections followed a client's pin; "
                            f"the random choice is tested on the other {n - pinned}")
    if len(selections) > 1:
        explanations.append(f"{len(port.selections)} selection chains share these endpoints "
                            f"({', '.join(s.chain for s in port.selections)}; Local traffic policy): tested against "
                            f"the best mixture of their {len(selections)} distinct splits")
    return tested, explanations


def audit(
    first: Reading | None, second: Reading, *, alpha: float = 0.001, only: str | None = None
) -> AuditReport:
    """Judge every port with selection rules or counters (`only`: one `ns/name`, all its ports)."""
    if not 0 < alpha < 1:
        raise ValueError(f"alpha {alpha}: must be between 0 and 1")
    judged: list[tuple[PortAudit, bool]] = []
    for key, port in window(first, second).items():
        if only is not None and key.name.partition(":")[0] != only:
            continue
        judged.append(_judge(key, port, alpha, second.pinned_clients.get(key, 0)))
    adjusted = holm({a.key: a.p for a, tested in judged if tested and a.p is not None})
    ports = []
    for a, _ in judged:
        q = adjusted.get(a.key)
        if q is None:
            ports.append(a)
            continue
        verdict = SKEWED if q <= alpha else EXPLAINED if a.explanations and a.p_plain is not None and a.p_plain <= alpha else OK
        ports.append(_replace(a, p_adjusted=q, verdict=verdict))
    return AuditReport(tuple(ports), alpha, first is None)


def _replace(a: PortAudit, **changes: object) -> PortAudit:
    return dataclasses.replace(a, **changes)  # type: ignore[arg-type]


def iptables_pins(save_text: str) -> dict[str, dict[str, int]]:
    """Connections that followed an affinity pin, per selection chain and endpoint: the packet
    counters of the `-m recent --rcheck` rules (`iptables-save -c`), which jump to the pinned
    endpoint's chain ahead of the random choice. Keyed by the chain holding them, which
    `reading` maps to its service port as `check` names it: above 1000 endpoints the rules
    carry no per-endpoint comments (kube-proxy's large-cluster mode), so a comment cannot be
    relied on. Only the rcheck rules and the chains they jump to are tokenised: shlex is slow,
    and a node with 10 000 services has 100 000 other rules."""
    import shlex

    def opt(tokens: list[str], name: str) -> str | None:
        i = tokens.index(name) + 1 if name in tokens else 0
        return tokens[i] if 0 < i < len(tokens) else None

    def counted(line: str) -> tuple[int, list[str]]:
        counters, _, rest = line.partition("]")
        return int(counters[1:].split(":")[0]), shlex.split(rest)

    nat = _nat_rule_lines(save_text)
    hits = [counted(line) for line in nat if "--rcheck" in line]
    targets = {opt(tokens, "-j") or "" for _, tokens in hits}
    endpoint_of: dict[str, str] = {}
    for line in nat:
        chain = line.split("-A ", 1)[-1].split(" ", 1)[0]
        if chain in targets and "DNAT" in line:
            _, tokens = counted(line)
            dest = opt(tokens, "--to-destination")
            if opt(tokens, "-j") == "DNAT" and dest is not None:
                endpoint_of[chain] = endpoint_label(dest)
    pins: dict[str, dict[str, int]] = {}
    for packets, tokens in hits:
        chain, target = opt(tokens, "-A") or "", opt(tokens, "-j") or ""
        if target in endpoint_of:
            per = pins.setdefault(chain, {})
            per[endpoint_of[target]] = per.get(endpoint_of[target], 0) + packets
    return pins


def _nat_rule_lines(save_text: str) -> list[str]:
    """The counted rule lines (`[packets:bytes] -A …`) of every nat table in the text."""
    out, table = [], ""
    for line in save_text.splitlines():
        if line.startswith("*"):
            table = line[1:].strip()
        elif table == "nat" and line.startswith("["):
            out.append(line)
    return out


def nft_pinned_clients(ruleset: Ruleset, selections: Mapping[PortKey, tuple[Selection, ...]]) -> dict[PortKey, int]:
    """Clients held in each port's affinity sets (nft lists a dynamic set's elements)."""
    out: dict[PortKey, int] = {}
    for key in selections:
        ns, name, port = key.namespace_service_port
        ident = f"-{ns}/{name}/{key.protocol}/{port}__"
        for table in ruleset.tables:
            for sdef in table.sets.values():
                if sdef.dynamic and sdef.name.startswith("affinity-") and ident in sdef.name:
                    out[key] = out.get(key, 0) + len(sdef.elements)
    return out


def nft_pins(ruleset_json: object) -> dict[str, dict[str, int]] | None:
    """Connections that followed an affinity pin, per selection chain and endpoint, from the
    counters of nft's affinity lookup rules (`ip saddr @affinity-… counter goto endpoint-…`);
    None when no such rule carries a counter (the split of affinity ports then cannot be
    separated from the pins)."""
    doc = ruleset_json if isinstance(ruleset_json, dict) else {}
    pins: dict[str, dict[str, int]] = {}
    counted = False
    for item in doc.get("nftables", []):
        rule = item.get("rule") if isinstance(item, dict) else None
        if not isinstance(rule, dict):
            continue
        packets, target, lookup = None, "", False
        for stmt in rule.get("expr", []):
            if not isinstance(stmt, dict):
                continue
            if "match" in stmt and str(stmt["match"].get("right", "")).startswith("@affinity-"):
                lookup = True
            elif "counter" in stmt and isinstance(stmt["counter"], dict):
                packets = int(stmt["counter"].get("packets", 0))
            elif "goto" in stmt or "jump" in stmt:
                target = str((stmt.get("goto") or stmt.get("jump") or {}).get("target", ""))
        endpoint = _nft_endpoint(target)
        if not lookup or endpoint is None:
            continue
        per = pins.setdefault(str(rule.get("chain", "")), {})
        per.setdefault(endpoint, 0)
        if packets is not None:
            counted = True
            per[endpoint] += packets
    return pins if counted else None


def _nft_endpoint(chain: str) -> str | None:
    """`endpoint-HASH-ns/name/proto/port__ip/port` -> `ip:port`."""
    if not chain.startswith("endpoint-"):
        return None
    ip, _, port = chain.partition("__")[2].rpartition("/")
    return endpoint_label(f"{ip}:{port}") if ip and port else None

"""`audit`'s arithmetic without root: the tests, the window, the verdicts, the command's flags.

Counts come from seeded generators or are written out, so every assertion is deterministic.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import math
import os
import random
import re
from fractions import Fraction

import pytest
from scipy import stats as scipy_stats

from nfproxy.analysis import audit as A
from nfproxy.analysis.audit import PortKey, Reading, Selection
from nfproxy.analysis.counters import endpoint_counts_iptables
from nfproxy.analysis.dump import read_text
from nfproxy.backends.registry import render_text
from nfproxy.cli.main import main
from nfproxy.core.model import (
    ClusterState,
    Endpoint,
    IPFamily,
    NodeConfig,
    Protocol,
    ServicePort,
    ServicePortName,
    ServiceType,
    sort_endpoints,
)

EPS3 = ("10.244.0.1:8080", "10.244.0.2:8080", "10.244.0.3:8080")
THREE = PortKey("ns/three:p", "tcp", "ip")
FIVE = PortKey("ns/five:p", "tcp", "ip")


def _uniform(chain: str, eps: tuple[str, ...], affinity: int = 0) -> Selection:
    return Selection(chain, tuple((e, Fraction(1, len(eps))) for e in eps), affinity)


def _draw(seed: int, n: int, eps: tuple[str, ...], weights: tuple[float, ...] | None = None) -> dict[str, int]:
    rng = random.Random(seed)
    picks = rng.choices(eps, weights=weights, k=n)
    return {e: picks.count(e) for e in eps}


# ---- the exact test


def _brute_force_p(counts: tuple[int, ...], probs: tuple[float, ...]) -> float:
    """Every outcome of the same size, by itertools: the definition, for comparison."""
    n, k = sum(counts), len(counts)
    pmf = scipy_stats.multinomial(n, probs).pmf
    observed = pmf(counts)
    total = 0.0
    for outcome in itertools.product(range(n + 1), repeat=k):
        if sum(outcome) == n and pmf(outcome) <= observed * (1 + 1e-7):
            total += pmf(outcome)
    return total


@pytest.mark.parametrize("counts, probs", [
    ((3, 0), (0.5, 0.5)),
    ((4, 1, 0), (1 / 3, 1 / 3, 1 / 3)),
    ((2, 2, 2), (1 / 3, 1 / 3, 1 / 3)),
    ((6, 0, 1), (0.5, 0.25, 0.25)),
    ((1, 1, 5, 0), (0.25, 0.25, 0.25, 0.25)),
])
def test_exact_multinomial_is_the_definition(counts: tuple[int, ...], probs: tuple[float, ...]) -> None:
    p, _ = A.exact_multinomial(counts, probs)
    assert p == pytest.approx(_brute_force_p(counts, probs), rel=1e-9)


def test_exact_multinomial_floor_is_the_most_lopsided_outcome() -> None:
    # Two endpoints, ten connections: all on one side happens with 2 * 2^-10.
    p, floor = A.exact_multinomial((10, 0), (0.5, 0.5))
    assert p == pytest.approx(2 / 1024) and floor == pytest.approx(2 / 1024)


# ---- fit: which test, and when none can mean anything


def test_large_counts_use_chi_square_as_scipy_computes_it() -> None:
    counts = {EPS3[0]: 120, EPS3[1]: 95, EPS3[2]: 85}
    result = A.fit(counts, [_uniform("service-x", EPS3)], 0.001)
    assert result.method == "chi-square"
    assert result.p == pytest.approx(scipy_stats.chisquare([120, 95, 85]).pvalue)


def test_small_counts_use_the_exact_test() -> None:
    result = A.fit({EPS3[0]: 6, EPS3[1]: 1, EPS3[2]: 0}, [_uniform("service-x", EPS3)], 0.01)
    assert result.method == "exact multinomial"
    assert result.p == pytest.approx(_brute_force_p((6, 1, 0), (1 / 3,) * 3), rel=1e-9)


def test_too_few_when_no_outcome_could_reach_alpha() -> None:
    # 3 endpoints, 6 connections: even all on one endpoint has p = 3 * 3^-6 = 0.0041 > 0.001.
    result = A.fit({EPS3[0]: 6}, [_uniform("service-x", EPS3)], 0.001)
    assert result.p is None and "no outcome of 6" in result.method
    # ... but 7 can: 3 * 3^-7 = 0.00137 is still above; 8: 0.000457 is not.
    assert A.fit({EPS3[0]: 7}, [_uniform("service-x", EPS3)], 0.001).p is None
    assert A.fit({EPS3[0]: 8}, [_uniform("service-x", EPS3)], 0.001).p == pytest.approx(3 / 3**8)


def test_too_few_when_enumeration_would_be_too_long() -> None:
    eps = tuple(f"10.244.1.{i}:80" for i in range(60))
    result = A.fit({eps[0]: 30}, [_uniform("service-x", eps)], 0.001)
    assert result.p is None and "below 5" in result.method


def test_connections_to_an_endpoint_never_picked_are_impossible() -> None:
    result = A.fit({EPS3[0]: 50, "10.9.9.9:80": 1}, [_uniform("service-x", EPS3)], 0.001)
    assert result.p == 0.0


def test_one_endpoint_cannot_be_skewed() -> None:
    assert A.fit({EPS3[0]: 500}, [_uniform("service-x", EPS3[:1])], 0.001).p == 1.0


def test_kernel_shares_not_one_over_n_are_the_expectation() -> None:
    # A cascade whose kernel thresholds give 0.6/0.4: 600/400 is a perfect fit.
    sel = Selection("KUBE-SVC-X", ((EPS3[0], Fraction(3, 5)), (EPS3[1], Fraction(2, 5))))
    assert A.fit({EPS3[0]: 600, EPS3[1]: 400}, [sel], 0.001).p == pytest.approx(1.0)


# ---- Holm


def test_holm_adjusts_step_down_and_keeps_order() -> None:
    keys = [PortKey(f"ns/s{i}:p", "tcp", "ip") for i in range(4)]
    got = A.holm(dict(zip(keys, [0.01, 0.04, 0.03, 0.005])))
    # Sorted: 0.005*4=0.02, 0.01*3=0.03, 0.03*2=0.06, 0.04*1=0.04 -> monotone 0.06.
    assert [got[k] for k in keys] == pytest.approx([0.03, 0.06, 0.06, 0.02])


def test_holm_caps_at_one() -> None:
    assert A.holm({THREE: 0.6, FIVE: 0.7}) == {THREE: 1.0, FIVE: 1.0}


# ---- the window


def _reading(counts: dict[PortKey, dict[str, int]], selections: dict[PortKey, tuple[Selection, ...]] | None = None,
             pins: dict[PortKey, dict[str, int]] | None = None, clients: dict[PortKey, int] | None = None) -> Reading:
    if selections is None:
        selections = {k: (_uniform(f"service-{k.name}", tuple(sorted(v))),) for k, v in counts.items()}
    return Reading(counts, selections, pins, clients or {})


def test_window_is_the_difference_of_two_readings() -> None:
    first = _reading({THREE: {EPS3[0]: 10, EPS3[1]: 20, EPS3[2]: 30}})
    second = _reading({THREE: {EPS3[0]: 15, EPS3[1]: 27, EPS3[2]: 30}})
    port = A.window(first, second)[THREE]
    assert port.counts == {EPS3[0]: 5, EPS3[1]: 7, EPS3[2]: 0} and port.changes == ()


def test_once_counts_since_creation() -> None:
    second = _reading({THREE: {EPS3[0]: 15, EPS3[1]: 27, EPS3[2]: 30}})
    assert A.window(None, second)[THREE].counts == {EPS3[0]: 15, EPS3[1]: 27, EPS3[2]: 30}


def test_window_says_what_changed_and_the_port_is_not_tested() -> None:
    old = {EPS3[0]: 100, EPS3[1]: 100, "10.244.0.9:8080": 5}
    new = {EPS3[0]: 300, EPS3[1]: 40, EPS3[2]: 200}
    first = _reading({THREE: old})
    second = _reading({THREE: new})
    port = A.window(first, second)[THREE]
    assert port.counts == {EPS3[0]: 200, EPS3[1]: 40, EPS3[2]: 200}
    text = " | ".join(port.changes)
    assert "10.244.0.2:8080: counter reset (100 -> 40" in text
    assert "10.244.0.3:8080 appeared" in text
    assert "10.244.0.9:8080 vanished" in text
    assert "10.244.0.9:8080 left the selection rules" in text
    report = A.audit(first, second)
    (p,) = report.ports
    assert p.verdict == A.CHANGED and p.p is None and p.changes == port.changes


# ---- verdicts and the correction across ports


def test_honest_ports_are_ok_and_a_skewed_one_is_caught() -> None:
    five = tuple(f"10.244.2.{i}:8080" for i in range(5))
    counts = {
        THREE: _draw(1, 900, EPS3),
        FIVE: _draw(2, 3000, five, weights=(0.6, 0.1, 0.1, 0.1, 0.1)),
    }
    report = A.audit(None, _reading(counts))
    by = {p.key: p for p in report.ports}
    assert by[THREE].verdict == A.OK and by[THREE].p > 0.001
    assert by[FIVE].verdict == A.SKEWED and by[FIVE].p_adjusted < 1e-6
    assert by[THREE].connections == 900 and by[FIVE].connections == 3000
    assert report.skewed == (by[FIVE],)


def test_holm_can_clear_a_port_a_single_test_would_flag() -> None:
    # p ~ 0.0008 alone is below alpha 0.001; among 4 tested ports Holm asks for 0.00025.
    keys = [PortKey(f"ns/s{i}:p", "tcp", "ip") for i in range(4)]
    counts = {k: {EPS3[0]: 100, EPS3[1]: 100, EPS3[2]: 100} for k in keys[1:]}
    counts[keys[0]] = {EPS3[0]: 130, EPS3[1]: 92, EPS3[2]: 78}
    raw = scipy_stats.chisquare([130, 92, 78]).pvalue
    assert 0.00025 < raw < 0.001
    report = A.audit(None, _reading(counts))
    first = next(p for p in report.ports if p.key == keys[0])
    assert first.verdict == A.OK and first.p_adjusted == pytest.approx(4 * raw)


def test_zero_connections_are_too_few() -> None:
    (p,) = A.audit(None, _reading({THREE: {e: 0 for e in EPS3}})).ports
    assert p.verdict == A.TOO_FEW and p.connections == 0


def test_affinity_with_counted_pins_tests_only_the_random_choice() -> None:
    sticky = (_uniform("KUBE-SVC-S", EPS3, affinity=600),)
    # 3 clients each pinned: 1 random choice + 199 pinned, all on endpoints 0, 0, 1.
    counts = {THREE: {EPS3[0]: 400, EPS3[1]: 200, EPS3[2]: 0}}
    pins = {THREE: {EPS3[0]: 398, EPS3[1]: 199, EPS3[2]: 0}}
    (p,) = A.audit(None, _reading(counts, {THREE: sticky}, pins)).ports
    assert p.verdict == A.EXPLAINED
    assert p.tested == {EPS3[0]: 2, EPS3[1]: 1, EPS3[2]: 0}
    assert p.p_plain is not None and p.p_plain < 1e-6
    assert "597 of 600 connections followed a client's pin" in p.explanations[0]


def test_affinity_whose_random_part_is_skewed_is_still_skewed() -> None:
    sticky = (_uniform("KUBE-SVC-S", EPS3, affinity=600),)
    counts = {THREE: {EPS3[0]: 700, EPS3[1]: 150, EPS3[2]: 150}}
    pins = {THREE: {EPS3[0]: 100, EPS3[1]: 50, EPS3[2]: 50}}  # random: 600/100/100
    (p,) = A.audit(None, _reading(counts, {THREE: sticky}, pins)).ports
    assert p.verdict == A.SKEWED


def test_affinity_without_pin_counts_is_explained_by_pinned_clients() -> None:
    sticky = (_uniform("service-S", EPS3, affinity=600),)
    counts = {THREE: {EPS3[0]: 400, EPS3[1]: 0, EPS3[2]: 0}}
    report = A.audit(None, _reading(counts, {THREE: sticky}, None, {THREE: 2}))
    (p,) = report.ports
    assert p.verdict == A.EXPLAINED and p.p is None and "2 clients pinned" in p.explanations[0]
    # Without any pinned client the same counts are skew.
    (p,) = A.audit(None, _reading(counts, {THREE: sticky}, None, {})).ports
    assert p.verdict == A.SKEWED


def test_local_policy_mixture_is_explained() -> None:
    # Cluster chain: 1/3 each; local chain: only endpoint 0. 600 via cluster, 600 via local.
    five = EPS3
    cluster = _uniform("KUBE-SVC-X", five)
    local = Selection("KUBE-SVL-X", ((five[0], Fraction(1)),))
    draws = _draw(7, 600, five)
    counts = {five[0]: draws[five[0]] + 600, five[1]: draws[five[1]], five[2]: draws[five[2]]}
    (p,) = A.audit(None, _reading({THREE: counts}, {THREE: (local, cluster)})).ports
    assert p.verdict == A.EXPLAINED and p.p is not None and p.p > 0.001
    assert p.p_plain is not None and p.p_plain < 1e-6
    assert "Local traffic policy" in p.explanations[0]
    assert p.expected[five[0]] == pytest.approx(counts[five[0]] / 1200, abs=0.01)


def test_a_mixture_cannot_explain_skew_between_remote_endpoints() -> None:
    cluster = _uniform("KUBE-SVC-X", EPS3)
    local = Selection("KUBE-SVL-X", ((EPS3[0], Fraction(1)),))
    counts = {EPS3[0]: 500, EPS3[1]: 400, EPS3[2]: 100}
    (p,) = A.audit(None, _reading({THREE: counts}, {THREE: (cluster, local)})).ports
    assert p.verdict == A.SKEWED


@pytest.mark.parametrize(("local", "remote", "verdict"), [
    (0, 100_000, A.SKEWED), (400, 600, A.SKEWED), (600, 400, A.EXPLAINED), (100_000, 0, A.EXPLAINED)])
def test_a_local_policy_pair_is_held_to_what_a_mixture_can_give(local: int, remote: int, verdict: str) -> None:
    """Two endpoints, one local, a Local traffic policy: no mix of the cluster chain (1/2 each)
    and the local chain (all local) gives the remote endpoint more than 1/2. The fit used to
    count its proportion as a degree of freedom even when it sat at "all cluster traffic",
    leaving none, and called 100 000 connections to the remote endpoint explained (p = 1)."""
    pair = EPS3[:2]
    cluster = _uniform("KUBE-SVC-X", pair)
    only_local = Selection("KUBE-SVL-X", ((pair[0], Fraction(1)),))
    (p,) = A.audit(None, _reading({THREE: {pair[0]: local, pair[1]: remote}}, {THREE: (cluster, only_local)})).ports
    assert p.verdict == verdict, p
    if verdict == A.SKEWED:
        assert p.p is not None and p.p < 1e-8 and p.expected[pair[1]] == pytest.approx(0.5)


def test_only_one_service() -> None:
    counts = {THREE: _draw(1, 300, EPS3), FIVE: _draw(2, 300, EPS3)}
    report = A.audit(None, _reading(counts), only="ns/five")
    assert [p.key for p in report.ports] == [FIVE]


def test_alpha_must_be_a_probability() -> None:
    with pytest.raises(ValueError, match="alpha"):
        A.audit(None, _reading({}), alpha=1.5)


# ---- from rules and counters as iptables-save -c prints them

NODE = NodeConfig(name="node-a", ips=("192.168.0.2",), cluster_cidrs=("10.244.0.0/16",), zone="zone-a")


def _state() -> ClusterState:
    def svc(name: str, ip: str, ips: list[str], **fields: object) -> tuple[ServicePort, tuple[Endpoint, ...]]:
        sp = ServicePort(ServicePortName("ns", name, "p", Protocol.TCP), IPFamily.V4, ServiceType.CLUSTER_IP, ip, 80,
                         **fields)  # type: ignore[arg-type]
        return sp, sort_endpoints([Endpoint(i, 8080, node_name="node-a") for i in ips])

    services = [svc("three", "10.96.0.3", ["10.244.0.1", "10.244.0.2", "10.244.0.3"]),
                svc("sticky", "10.96.0.6", ["10.244.0.1", "10.244.0.2"], affinity_timeout=600)]
    return ClusterState(NODE, {sp.key: sp for sp, _ in services}, {sp.key: e for sp, e in services})


def _counted(text: str, counts: dict[str, int]) -> str:
    """Put `[packets:bytes]` before each rule, as `iptables-save -c` does: the count of the
    first substring of `counts` the rule holds, zero otherwise."""
    out = []
    for line in text.splitlines():
        if line.startswith("-A "):
            n = next((v for k, v in counts.items() if k in line), 0)
            line = f"[{n}:{n * 60}] {line}"
        out.append(line)
    return "\n".join(out) + "\n"


def test_reading_from_iptables_save_with_counters() -> None:
    text = render_text("iptables", _state()).split("# IPv6")[0]
    save = _counted(text, {
        # the pinned connections: the rcheck rule that jumps to 10.244.0.1's chain
        "ns/sticky:p -> 10.244.0.1:8080\" -m recent": 299,
        "ns/sticky:p -m recent --name KUBE-SEP-": 0,
    })
    sep = {"ns/three:p": {"10.244.0.1:8080": 110, "10.244.0.2:8080": 95, "10.244.0.3:8080": 95},
           "ns/sticky:p": {"10.244.0.1:8080": 300, "10.244.0.2:8080": 0}}
    lines = []
    for line in save.splitlines():
        m = re.search(r"--comment (\S+) .*-j DNAT --to-destination (\S+)", line)
        if m:
            n = sep[m.group(1)][m.group(2)]
            line = re.sub(r"^\[\d+:\d+\]", f"[{n}:0]", line)
        lines.append(line)
    save = "\n".join(lines) + "\n"
    rules = read_text(save).ruleset
    r = A.reading(rules, endpoint_counts_iptables(save), A.iptables_pins(save))
    three, sticky = PortKey("ns/three:p", "tcp", "ip"), PortKey("ns/sticky:p", "tcp", "ip")
    assert r.counts[three] == {"10.244.0.1:8080": 110, "10.244.0.2:8080": 95, "10.244.0.3:8080": 95}
    assert [s.chain.startswith("KUBE-SVC-") for s in r.selections[three]] == [True]
    assert r.pins is not None and r.pins[sticky] == {"10.244.0.1:8080": 299, "10.244.0.2:8080": 0}
    report = A.audit(None, r)
    by = {p.key: p for p in report.ports}
    assert by[three].verdict == A.OK and by[three].connections == 300
    assert by[sticky].verdict == A.EXPLAINED and by[sticky].tested == {"10.244.0.1:8080": 1, "10.244.0.2:8080": 0}


# ---- the command's flags: exit 2, a clear message, no traceback


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(["audit", *argv])
        except SystemExit as exc:
            status = int(exc.code or 0)
    return status, out.getvalue(), err.getvalue()


# A namespace that does not exist: should a flag's check ever let a value through, the audit
# stops there instead of reading this machine's own rules.
NOWHERE = ("--netns", "does-not-exist-xyz")


@pytest.mark.parametrize("argv, message", [
    (("--alpha", "1.5", "--once"), "audit: --alpha 1.5: must be between 0 and 1"),
    (("--alpha", "0", "--once"), "audit: --alpha 0: must be between 0 and 1"),
    # As typed, not as float() reads it: 1e-400 underflows to 0.0.
    (("--alpha", "1e-400", "--once", *NOWHERE), "audit: --alpha 1e-400: must be between 0 and 1"),
    (("--alpha", "-0.5", "--once", *NOWHERE), "audit: --alpha -0.5: must be between 0 and 1"),
    (("--alpha", "nan", "--once", *NOWHERE), "audit: --alpha 'nan': not a decimal number"),
    (("--alpha", "x", *NOWHERE), "audit: --alpha 'x': not a decimal number"),
    # float() takes these; the docs promise digits only.
    (("--alpha", "0.5_0", "--once", *NOWHERE), "audit: --alpha '0.5_0': not a decimal number"),
    (("--alpha", " 0.5", "--once", *NOWHERE), "audit: --alpha ' 0.5': not a decimal number"),
    (("--alpha", "0.5 ", "--once", *NOWHERE), "audit: --alpha '0.5 ': not a decimal number"),
    (("--alpha", "٠.٥", "--once", *NOWHERE), "audit: --alpha '٠.٥': not a decimal number"),
    (("--alpha", "1" * 100_000, "--once", *NOWHERE), "audit: --alpha " + "1" * 57 + "...: must be between 0 and 1"),
    (("--interval", "30"), "--interval '30': missing unit in duration"),
    (("--interval=-5s",), "--interval '-5s': must be positive"),
    # A separate value starting with "-" is still the flag's value, not an unknown option.
    (("--interval", "-1s", *NOWHERE), "audit: --interval '-1s': must be positive"),
    (("--interval", "-.5s", *NOWHERE), "audit: --interval '-.5s': must be positive"),
    (("--interval", "0s"), "--interval '0s': must be positive"),
    (("--interval", "5s", "--once"), "not allowed with argument"),
    (("--service", "justaname", "--once"), "--service 'justaname': expected NAMESPACE/NAME"),
    (("--backend", "pf", "--once"), "argument --backend/--proxy-mode: invalid choice"),
    (("--node-ip", "bogus", "--once"), "audit: --node-ip 'bogus': not an IP address"),
    (("--backend", "iptables", "--netns", "does-not-exist-xyz", "--once"),
     "audit: --netns: no network namespace named 'does-not-exist-xyz'"),
])
def test_bad_flags_exit_2_with_a_clear_message(argv: tuple[str, ...], message: str) -> None:
    status, out, err = _cli(*argv)
    assert status == 2 and message in err and "Traceback" not in err, err
    assert out == ""


def test_report_json_shape() -> None:
    counts = {THREE: {EPS3[0]: 100, EPS3[1]: 100, EPS3[2]: 100}}
    from nfproxy.cli.commands.audit import format_report, to_json

    report = A.audit(None, _reading(counts))
    doc = json.loads(json.dumps(to_json(report, "iptables", "netns x", None)))
    (svc,) = doc["services"]
    assert svc["verdict"] == "ok" and svc["connections"] == 300 and svc["p"] == pytest.approx(1.0)
    assert [e["connections"] for e in svc["endpoints"]] == [100, 100, 100]
    assert not math.isnan(svc["endpoints"][0]["expected_share"])
    text = format_report(report, "head")
    assert "ns/three:p/tcp (ip): ok, 300 connections" in text and text.endswith("no skewed service ports")


@pytest.mark.parametrize("df", [1, 2, 3, 4, 5, 9, 10, 63, 64, 999, 1000])
def test_chi_square_survival_is_scipys(df: int) -> None:
    for x in (0.001, 0.5, 1.0, df * 0.5, float(df), df + 3 * math.sqrt(2 * df), 3.0 * df + 50, 800.0):
        want = scipy_stats.chi2.sf(x, df)
        got = A.chi_square_sf(x, df)
        assert got == pytest.approx(want, rel=1e-9, abs=1e-300), (x, df)


def test_audit_needs_no_scipy() -> None:
    """The node image has no scipy: the audit must run without it."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['scipy'] = None\n"
        "from fractions import Fraction\n"
        "from nfproxy.analysis import audit as A\n"
        "sel = [A.Selection('s', (('a', Fraction(1, 2)), ('b', Fraction(1, 2)))), A.Selection('l', (('a', Fraction(1)),))]\n"
        "print(A.fit({'a': 300, 'b': 100}, sel[:1], 0.001).p, A.fit({'a': 300, 'b': 100}, sel, 0.001).p)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert float(out[0]) < 1e-20 and float(out[1]) == 1.0


def _affinity_rule(ep: str, packets: int | None) -> dict:
    chain = f"endpoint-X-ns/sticky/tcp/p__{ep}/8080"
    expr: list[dict] = [{"match": {"op": "==", "left": {"payload": {"protocol": "ip", "field": "saddr"}},
                                   "right": f"@affinity-X-ns/sticky/tcp/p__{ep}/8080"}}]
    if packets is not None:
        expr.append({"counter": {"packets": packets, "bytes": packets * 60}})
    expr.append({"goto": {"target": chain}})
    return {"rule": {"family": "ip", "table": "nfproxy", "chain": "service-Y-ns/sticky/tcp/p", "expr": expr}}


def test_nft_pins_from_counted_affinity_rules() -> None:
    doc = {"nftables": [_affinity_rule("10.244.0.1", 7), _affinity_rule("10.244.0.2", 0)]}
    assert A.nft_pins(doc) == {"service-Y-ns/sticky/tcp/p": {"10.244.0.1:8080": 7, "10.244.0.2:8080": 0}}
    # Without counters on those rules, pins are unknown, not zero.
    assert A.nft_pins({"nftables": [_affinity_rule("10.244.0.1", None)]}) is None


def test_identical_splits_are_one_mixture_component() -> None:
    cluster = _uniform("service-X", EPS3)
    local = Selection("local-X", ((EPS3[0], Fraction(1)),))
    external = Selection("external-X", ((EPS3[0], Fraction(1)),))
    draws = _draw(11, 600, EPS3)
    counts = {EPS3[0]: draws[EPS3[0]] + 300, EPS3[1]: draws[EPS3[1]], EPS3[2]: draws[EPS3[2]]}
    (p,) = A.audit(None, _reading({THREE: counts}, {THREE: (cluster, local, external)})).ports
    assert p.verdict == A.EXPLAINED and "3 selection chains" in p.explanations[0]
    assert "their 2 distinct splits" in p.explanations[0]
    # One fitted proportion: 3 endpoints - 1 - 1 = 1 degree of freedom.
    (two,) = A.audit(None, _reading({THREE: counts}, {THREE: (cluster, local)})).ports
    assert p.p == pytest.approx(two.p)


def test_metrics_file_holds_the_latest_p_values(tmp_path) -> None:  # noqa: ANN001
    from prometheus_client.parser import text_string_to_metric_families

    from nfproxy.cli.commands.audit import _write_metrics

    five = tuple(f"10.244.2.{i}:8080" for i in range(5))
    counts = {THREE: _draw(1, 900, EPS3), FIVE: _draw(2, 3000, five, weights=(0.6, 0.1, 0.1, 0.1, 0.1)),
              PortKey("ns/idle:p", "tcp", "ip"): {EPS3[0]: 0}}
    report = A.audit(None, _reading(counts))
    path = tmp_path / "audit.prom"
    _write_metrics(str(path), report)
    samples = {(s.name, s.labels["service"]): s for f in text_string_to_metric_families(path.read_text()) for s in f.samples}
    three = samples[("nfproxy_audit_p_value", "three")]
    assert three.labels == {"namespace": "ns", "service": "three", "port": "p", "protocol": "tcp", "family": "ip"}
    assert three.value == pytest.approx(next(p.p_adjusted for p in report.ports if p.key == THREE))
    assert samples[("nfproxy_audit_p_value", "five")].value < 1e-6
    assert math.isnan(samples[("nfproxy_audit_p_value", "idle")].value)
    assert [samples[("nfproxy_audit_skewed", s)].value for s in ("three", "five", "idle")] == [0, 1, 0]


def test_metrics_file_in_a_missing_directory_is_a_clear_error(tmp_path) -> None:  # noqa: ANN001
    from nfproxy.cli.commands.audit import AuditError, _write_metrics

    with pytest.raises(AuditError, match="--metrics-file .*/missing/audit.prom: No such file"):
        _write_metrics(str(tmp_path / "missing" / "audit.prom"), A.audit(None, _reading({})))


def test_alpha_takes_plain_decimals_as_the_docs_show() -> None:
    from nfproxy.cli.commands.audit import alpha

    assert [alpha(t) for t in ("0.001", ".05", "0.5", "1e-3", "1E-06", "5.e-2")] == [
        0.001, 0.05, 0.5, 0.001, 1e-06, 0.05]


def _not_regular(tmp_path, kind: str):  # noqa: ANN001, ANN202
    import os
    import stat

    path = tmp_path / kind
    if kind == "char-device":
        if os.geteuid() != 0:
            pytest.fail("mknod of a character device needs root (run scripts/test)")
        os.mknod(path, stat.S_IFCHR | 0o644, os.makedev(1, 3))  # as /dev/null
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:
        (tmp_path / "target.prom").write_text("kept\n")
        path.symlink_to(tmp_path / "target.prom")
    return path


_NOT_REGULAR = {"char-device": "a character device, not a regular file", "fifo": "a FIFO, not a regular file",
                "directory": "a directory, not a regular file",
                "symlink": "a symbolic link, not a regular file (give the path of the file it points to)"}


# A character device needs mknod, so root: that case is a `kernel` test (deselected, not skipped,
# in the unprivileged run), the others run anywhere.
@pytest.mark.parametrize("kind", [pytest.param("char-device", marks=pytest.mark.kernel), "directory", "fifo", "symlink"])
def test_metrics_file_that_is_not_a_regular_file_is_refused_and_left_alone(tmp_path, kind: str) -> None:  # noqa: ANN001
    """The textfile is renamed over PATH: a device would have become a regular file."""
    from nfproxy.cli.commands.audit import AuditError, _write_metrics

    path = _not_regular(tmp_path, kind)
    before = os.lstat(path)
    message = f"--metrics-file {path}: {_NOT_REGULAR[kind]}"
    with pytest.raises(AuditError) as exc:
        _write_metrics(str(path), A.audit(None, _reading({})))
    assert str(exc.value) == message
    # Refused before any reading too (a netns that does not exist would be the next error).
    status, out, err = _cli("--once", "--metrics-file", str(path), *NOWHERE)
    assert (status, out, err) == (2, "", f"nfproxy: error: audit: {message}\n")
    after = os.lstat(path)
    assert (after.st_mode, after.st_ino, after.st_rdev) == (before.st_mode, before.st_ino, before.st_rdev)
    left = sorted(p.name for p in tmp_path.iterdir())  # no temporary file either
    assert left == (["symlink", "target.prom"] if kind == "symlink" else [kind])
    if kind == "symlink":
        assert (tmp_path / "target.prom").read_text() == "kept\n"


def test_metrics_file_that_is_a_regular_file_is_replaced(tmp_path) -> None:  # noqa: ANN001
    from nfproxy.cli.commands.audit import _write_metrics

    path = tmp_path / "audit.prom"
    path.write_text("stale\n")
    _write_metrics(str(path), A.audit(None, _reading({THREE: {EPS3[0]: 0}})))
    assert "nfproxy_audit_p_value" in path.read_text()
    assert [p.name for p in tmp_path.iterdir()] == ["audit.prom"]


def test_iptables_pins_without_comments_in_large_cluster_mode() -> None:
    """Above 1000 endpoints the rules carry no per-endpoint comments (kube-proxy's large-cluster
    mode): pins are found from the chains, and named as `check` names the chain."""
    import dataclasses

    from nfproxy.testing import uniform_cluster

    state = uniform_cluster(110, 10)
    key = sorted(state.services)[0]
    state = dataclasses.replace(state, services={**state.services, key: dataclasses.replace(state.services[key], affinity_timeout=600)})
    text = render_text("iptables", state).split("# IPv6")[0]
    assert "--comment" not in next(line for line in text.splitlines() if "-j DNAT" in line)
    sp = state.services[key]
    save = _counted(text, {})
    rcheck = next(line for line in save.splitlines() if "--rcheck" in line)
    save = save.replace(rcheck, rcheck.replace("[0:0]", "[41:0]", 1))
    pins = A.iptables_pins(save)
    assert sum(n for per in pins.values() for n in per.values()) == 41
    r = A.reading(read_text(save).ruleset, [], pins)
    name = f"{sp.name.namespace}/{sp.name.name}:{sp.name.port}"
    port = PortKey(name, "tcp", "ip")
    assert r.pins is not None and sum(r.pins[port].values()) == 41
    assert set(r.pins[port]) <= {e for s in r.selections[port] for e, _ in s.shares}

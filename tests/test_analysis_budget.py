"""Bounded work in `check` and `trace` on rules built to defeat it: nesting deep enough to
overflow Python's stack, jump graphs whose paths (or states) double per level, graph searches
repeated per rule, and rules that pick an endpoint in a way the parser could not read.
Nothing here measures time: each input was hopeless before (a RecursionError, 2^n steps or
states) and the tests assert the answer, or count the operations."""

from __future__ import annotations

import dataclasses
from fractions import Fraction
from typing import Any

import pytest

from nfproxy.analysis import check as check_mod
from nfproxy.analysis import interpret
from nfproxy.analysis.check import check
from nfproxy.analysis.interpret import InterpretError, Packet, trace
from nfproxy.analysis.ir import Concat, Field, Numgen, Ruleset
from nfproxy.analysis.nft_json import parse

PRE = ("pre", {"type": "nat", "hook": "prerouting", "prio": -100, "policy": "accept"})
FWD = ("fwd", {"type": "filter", "hook": "forward", "prio": 0, "policy": "accept"})
PACKET = Packet("10.244.0.5", "10.96.0.10", 80, "tcp", "pod")


def J(target: str) -> dict:
    return {"jump": {"target": target}}


def DNAT(addr: Any, port: int = 80) -> dict:
    return {"dnat": {"family": "ip", "addr": addr, "port": port}}


COIN = {"match": {"op": "==", "left": {"numgen": {"mode": "random", "mod": 2, "offset": 0}}, "right": 0}}


def XOR(bit: int) -> dict:
    return {"mangle": {"key": {"meta": {"key": "mark"}}, "value": {"^": [{"meta": {"key": "mark"}}, bit]}}}


def COIN_VMAP(a: str, b: str) -> dict:
    return {"vmap": {"key": {"numgen": {"mode": "random", "mod": 2, "offset": 0}}, "data": {"set": [[0, J(a)], [1, J(b)]]}}}


def ruleset(chains: list, rules: list):  # noqa: ANN201
    items: list[dict] = [{"table": {"family": "ip", "name": "t"}}]
    for name, extra in chains:
        items.append({"chain": {"family": "ip", "table": "t", "name": name, **extra}})
    for chain, expr in rules:
        items.append({"rule": {"family": "ip", "table": "t", "chain": chain, "expr": expr}})
    return parse({"nftables": items})


def kinds(rs) -> list[str]:  # noqa: ANN001
    return [p.kind for p in check(rs).problems]


# ---- 1. recursion


def test_nested_concat_is_refused_not_a_recursion_error() -> None:
    left: Any = {"meta": {"key": "mark"}}
    for _ in range(400):
        left = {"concat": [left]}
    rs = ruleset([PRE], [("pre", [{"match": {"op": "==", "left": left, "right": 1}}, DNAT("10.1.1.1")])])
    assert check(rs).problems == ()  # the base chain is not a selection chain: nothing to say
    with pytest.raises(InterpretError, match="nested more than 64 deep"):
        trace(rs, PACKET)


def test_numgen_found_at_the_bottom_of_deep_expressions() -> None:
    expr: Any = Numgen(2)
    for _ in range(5000):
        expr = Concat((Field("mark"), expr))
    assert check_mod._has_numgen(expr)
    assert sum(1 for _ in check_mod._exprs(expr)) == 10001


def test_filter_chain_into_5000_straight_jumps() -> None:
    n = 5000
    chains = [FWD] + [(f"c{i}", {}) for i in range(n)]
    rules = [("fwd", [J("c0")])] + [(f"c{i}", [J(f"c{i + 1}")]) for i in range(n - 1)] + [(f"c{n - 1}", [{"drop": None}])]
    # 5 000 deep: the kernel would refuse the table (jump-depth), and the walk is no recursion.
    assert kinds(ruleset(chains, rules)) == ["jump-depth", "ungated-filter-jump"]


# ---- 2. diamonds: one path through 2^n rule matches


def diamond(n: int) -> tuple[list, list]:
    chains = [PRE]
    rules = [("pre", [J("A0")])]
    for i in range(n):
        for s in "AB":
            chains.append((f"{s}{i}", {}))
            if i < n - 1:
                rules += [(f"{s}{i}", [J(f"A{i + 1}")]), (f"{s}{i}", [J(f"B{i + 1}")])]
            else:
                rules.append((f"{s}{i}", [{"counter": None}]))
    rules.append(("pre", [DNAT("10.1.1.1")]))
    return chains, rules


def test_diamond_of_40_levels_lists_the_first_steps_and_counts_the_rest() -> None:
    n = 40
    rs = ruleset(*diamond(n))
    (path,) = trace(rs, PACKET)
    assert path.outcome.endpoint == "10.1.1.1:80" and path.probability == 1
    matched = 1  # the last level's counter
    for _ in range(n - 1):
        matched = 2 + 2 * matched  # two jumps, each into a chain of the next level
    matched += 2  # pre: the jump to A0 and the DNAT
    assert len(path.steps) == interpret._MAX_STEPS
    assert len(path.steps) + path.unlisted == matched  # 2^41 - 1 + ..., exactly
    (problem,) = check(rs).problems  # 40 levels are more than the kernel takes; nothing else
    assert problem.kind == "jump-depth" and "nest 40 deep" in problem.detail


def test_short_paths_list_every_step() -> None:
    (path,) = trace(ruleset(*diamond(3)), PACKET)
    assert path.unlisted == 0 and len(path.steps) == 1 + (2 + 2 * (2 + 2 * 1)) + 1


# ---- 3. genuinely exponential: a work budget


def coin_marks(n: int):  # noqa: ANN201
    rules = [("pre", [J("casc")])] + [("casc", [COIN, XOR(1 << (i % 32))]) for i in range(n)]
    rules.append(("casc", [DNAT("10.1.1.1")]))
    return ruleset([PRE, ("casc", {})], rules)


def test_24_coin_flips_on_the_mark_stop_at_the_budget() -> None:
    rs = coin_marks(24)  # 2^24 distinct marks
    with pytest.raises(InterpretError, match=r"more than 100000 rule evaluations"):
        trace(rs, PACKET)
    (problem,) = check(rs).problems
    assert problem.kind == "uninterpretable" and "rule evaluations" in problem.detail


def test_a_few_coin_flips_are_still_exact() -> None:
    paths = trace(coin_marks(6), PACKET)
    assert {p.outcome.endpoint for p in paths} == {"10.1.1.1:80"}
    assert sum(p.probability for p in paths) == 1 and len(paths) == 64  # one per mark


def test_random_diamond_with_marks_check_spends_a_bounded_total(monkeypatch: pytest.MonkeyPatch) -> None:
    n = 24
    chains = [PRE]
    rules = [("pre", [J("A0")])]
    for i in range(n):
        for s in "AB":
            chains.append((f"{s}{i}", {}))
            if s == "B":
                rules.append((f"{s}{i}", [XOR(1 << i)]))
            rules.append((f"{s}{i}", [COIN_VMAP(f"A{i + 1}", f"B{i + 1}")] if i < n - 1 else [{"counter": None}]))
    rules.append(("pre", [DNAT("10.1.1.1")]))
    rs = ruleset(chains, rules)
    spent: list[int] = []
    real = check_mod.walk_chain

    def counting(*args: Any, **kwargs: Any) -> Any:
        own = kwargs["spent"]  # check's own account, which it charges to its budget
        try:
            return real(*args, **kwargs)
        finally:
            spent.extend(own)

    monkeypatch.setattr(check_mod, "walk_chain", counting)
    report = check(rs)
    assert "uninterpretable" in [p.kind for p in report.problems]
    per_walk = interpret.work_budget(rs)
    walks = 2 * n
    # Before: 2^24 states for A0's walk alone.
    assert sum(spent) <= check_mod._Budget.TOTAL_WALKS * per_walk + walks * (check_mod._Budget.MIN_WALK + 64)


# ---- 4. the ungated-filter-jump test is linear


def test_ungated_search_is_once_per_table(monkeypatch: pytest.MonkeyPatch) -> None:
    base_rules, depth = 3000, 1000
    chains = [FWD] + [(f"c{i}", {}) for i in range(depth)]
    rules = [("fwd", [{"match": {"op": "==", "left": {"meta": {"key": "mark"}}, "right": k + 1}}, J("c0")]) for k in range(base_rules)]
    rules += [(f"c{i}", [J(f"c{i + 1}")]) for i in range(depth - 1)] + [(f"c{depth - 1}", [{"counter": None}])]
    rs = ruleset(chains, rules)
    calls = 0
    real = check_mod._ct_gated

    def counting(*args: Any) -> bool:
        nonlocal calls
        calls += 1
        return real(*args)

    monkeypatch.setattr(check_mod, "_ct_gated", counting)
    assert "ungated-filter-jump" not in kinds(rs)  # nothing drops
    assert calls <= 2 * (base_rules + depth)  # was base_rules x depth: 3 million


# ---- 5. what check must not pass over


def service_with(dnat: dict) -> Any:
    chains = [PRE, ("svc", {}), ("ep-a", {}), ("ep-b", {})]
    rules = [
        ("pre", [J("svc")]),
        ("pre", [J("lone")]),
        ("svc", [{"vmap": {"key": {"numgen": {"mode": "random", "mod": 2, "offset": 0}}, "data": {"set": [[0, {"goto": {"target": "ep-a"}}], [1, {"goto": {"target": "ep-b"}}]]}}}]),
        ("ep-a", [DNAT("10.244.0.1")]),
        ("ep-b", [DNAT("10.244.0.2")]),
        ("lone", [dnat]),
    ]
    return ruleset(chains + [("lone", {})], rules)


@pytest.mark.parametrize(
    "dnat",
    [
        {"dnat": None},
        {"dnat": {"family": "ip", "addr": "not-an-ip"}},
        {"dnat": {"family": "ip", "addr": {"map": {"key": {"numgen": {"mode": "random", "mod": 0, "offset": 0}}, "data": {"set": [[0, "10.244.0.9"]]}}}}},
    ],
)
def test_an_endpoint_choice_that_cannot_be_read_is_a_problem(dnat: dict) -> None:
    report = check(service_with(dnat))
    assert [(p.kind, p.where) for p in report.problems] == [("uninterpretable", "ip t lone")]
    assert [s.chain for s in report.services] == ["svc"]


def test_a_readable_endpoint_choice_is_no_problem() -> None:
    assert kinds(service_with(DNAT("10.244.0.9"))) == []


def test_a_jump_loop_outside_selection_chains_is_a_problem() -> None:
    rs = ruleset([PRE, ("a", {}), ("b", {})], [("pre", [J("a")]), ("a", [J("b")]), ("b", [J("a")])])
    (problem,) = check(rs).problems
    assert problem.kind == "jump-loop" and "a -> b -> a" in problem.detail
    with pytest.raises(InterpretError, match="deeper than 64"):
        trace(rs, PACKET)


def test_a_self_jump_and_a_long_loop_are_problems() -> None:
    n = 3000
    chains = [PRE] + [(f"c{i}", {}) for i in range(n)] + [("s", {})]
    rules = [("pre", [J("c0")])] + [(f"c{i}", [J(f"c{(i + 1) % n}")]) for i in range(n)] + [("s", [J("s")])]
    problems = check(ruleset(chains, rules)).problems
    assert sorted(p.kind for p in problems) == ["jump-loop", "jump-loop"]
    assert {p.where for p in problems} == {"ip t c0", "ip t s"}


def straight_run(levels: int, *, base: bool = True, last: dict | None = None) -> tuple[list, list]:
    """`pre` (a base chain, or a plain one) jumping `levels` deep, c1 -> c2 -> ..."""
    chains = [PRE if base else ("pre", {})] + [(f"c{i}", {}) for i in range(1, levels + 1)]
    rules = [("pre", [J("c1")])] + [(f"c{i}", [J(f"c{i + 1}")]) for i in range(1, levels)]
    return chains, rules + [(f"c{levels}", [last or {"counter": None}])]


def test_jumps_16_deep_below_a_base_chain_are_a_problem() -> None:
    """The kernel takes 15 levels below a base chain and refuses 16 (tests/test_check.py finds
    that edge on the running kernel)."""
    assert kinds(ruleset(*straight_run(15))) == []
    (problem,) = check(ruleset(*straight_run(16))).problems
    assert problem.kind == "jump-depth" and problem.where == "ip t pre"
    assert problem.detail.startswith("pre -> c1 -> c2") and "c16: jumps and gotos nest 16 deep" in problem.detail
    (problem,) = check(ruleset(*straight_run(30))).problems
    assert "c16 -> …: jumps and gotos nest 30 deep" in problem.detail


def test_a_verdict_map_counts_and_unhooked_or_iptables_chains_do_not() -> None:
    chains, rules = straight_run(15, last=COIN_VMAP("x", "y"))
    assert kinds(ruleset(chains + [("x", {}), ("y", {})], rules)) == ["jump-depth"]  # the map's jumps: the 16th level
    assert kinds(ruleset(*straight_run(40, base=False))) == []  # nothing hooked: the kernel validates no depth
    rs = ruleset(*straight_run(40))
    legacy = Ruleset(tuple(dataclasses.replace(t, dialect="iptables") for t in rs.tables))
    assert "jump-depth" not in kinds(legacy)  # x_tables sizes its jump stack to the ruleset


def test_a_loop_ends_a_run_and_is_reported_as_a_loop() -> None:
    chains, rules = straight_run(10)
    chains += [(f"l{i}", {}) for i in range(20)]
    rules += [("c10", [J("l0")])] + [(f"l{i}", [J(f"l{(i + 1) % 20}")]) for i in range(20)]
    assert kinds(ruleset(chains, rules)) == ["jump-loop"]


def test_an_anonymous_vmap_counts_towards_the_budget() -> None:
    """kube-proxy's nft layout (and nfproxy's affinity ports) choose through an anonymous
    `numgen … vmap`; its elements are part of the dump as much as a named map's. The budget
    counted only named sets, so a 110 000-way choice (one branch per element) was refused."""
    n = 110_000
    items = [[i, {"goto": {"target": "a" if i % 2 else "b"}}] for i in range(n)]
    doc: dict[str, Any] = {"nftables": [
        {"table": {"family": "ip", "name": "t"}},
        {"chain": {"family": "ip", "table": "t", "name": "c", "type": "nat", "hook": "prerouting", "prio": -100}},
        *({"chain": {"family": "ip", "table": "t", "name": name}} for name in ("a", "b", "s")),
        {"rule": {"family": "ip", "table": "t", "chain": "c", "expr": [{"jump": {"target": "s"}}]}},
        {"rule": {"family": "ip", "table": "t", "chain": "s", "expr": [
            {"vmap": {"key": {"numgen": {"mode": "random", "mod": n, "offset": 0}}, "data": {"set": items}}}]}},
        {"rule": {"family": "ip", "table": "t", "chain": "a", "expr": [{"dnat": {"addr": "10.0.0.1", "port": 80}}]}},
        {"rule": {"family": "ip", "table": "t", "chain": "b", "expr": [{"dnat": {"addr": "10.0.0.2", "port": 80}}]}},
    ]}
    report = check(parse(doc))
    assert report.clean, report.problems
    (svc,) = report.services
    assert dict(svc.endpoints) == {"10.0.0.1:80": Fraction(1, 2), "10.0.0.2:80": Fraction(1, 2)}

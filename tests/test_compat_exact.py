"""Every compat scenario through the exact interpreter, on both backends' renderings read back,
and through `compare`: hand-written expectations, not our renderers, are the reference."""

from __future__ import annotations

from fractions import Fraction

import pytest

from nfproxy.analysis.interpret import Outcome, interpret
from nfproxy.verify.compare import compare, iptables_ruleset, nft_ruleset
from nfproxy.core.model import IPFamily
from tests.scenarios import load_all

SCENARIOS = load_all()


def _check(dist: dict[Outcome, Fraction], expect, exact: bool, where: str) -> None:  # noqa: ANN001
    assert sum(dist.values()) == 1, where
    if expect.verdict != "dnat":
        assert set(o.verdict for o in dist) == {expect.verdict}, (where, dist)
        return
    assert all(o.verdict == "dnat" for o in dist), (where, dist)
    got: dict[str, Fraction] = {}
    for o, p in dist.items():
        got[o.endpoint] = got.get(o.endpoint, Fraction(0)) + p
        if expect.masquerade is not None:
            assert o.masquerade == expect.masquerade, (where, o)
    assert set(got) == set(expect.uniform), (where, sorted(got))
    n = len(expect.uniform)
    for p in got.values():
        if exact:
            assert p == Fraction(1, n), where
        else:
            assert abs(p - Fraction(1, n)) < Fraction(1, 10**9), where


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_scenario_exact(scenario) -> None:  # noqa: ANN001
    rendered: dict[tuple[str, IPFamily], object] = {}
    for probe in scenario.probes:
        packet, family = probe.packet(scenario.state.node.ips), probe.family
        for backend in ("iptables", "nft"):
            if (backend, family) not in rendered:
                rendered[(backend, family)] = (
                    iptables_ruleset(scenario.state, family)
                    if backend == "iptables"
                    else nft_ruleset(scenario.state, family)
                )
            rs = rendered[(backend, family)]
            node_ips = scenario.state.node.ips_of(family)
            where = f"{scenario.name}: {probe} via {backend}"
            expect = probe.expect_for(backend)
            _check(interpret(rs, packet, node_ips=node_ips, mode="ideal"), expect, True, where)
            _check(interpret(rs, packet, node_ips=node_ips), expect, False, where)


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_scenario_backends_equivalent(scenario) -> None:  # noqa: ANN001
    result = compare(scenario.state)
    assert result.results
    bad = [r for r in result.results if not r.equivalent]
    assert not bad, [(r.probe, r.iptables, r.nft) for r in bad[:3]]
    assert result.equivalent
    assert max((r.max_difference for r in result.results), default=0) < Fraction(1, 10**9)

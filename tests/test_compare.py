"""`compare`: both backends, read back and interpreted exactly, agree on every probe."""

from __future__ import annotations

import json
import random
from fractions import Fraction
from pathlib import Path

import pytest

from nfproxy.analysis.interpret import Outcome
from nfproxy.cli.main import main
from nfproxy.verify.compare import Agreement, Comparison, compare, probes
from nfproxy.verify.probe import Probe
from nfproxy.core.model import IPFamily, NodeConfig
from nfproxy.sources import manifests
from nfproxy.testing import random_cluster

ROOT = Path(__file__).resolve().parent.parent
STATE = manifests.load(str(ROOT / "examples"), NodeConfig()).state


def test_examples_equivalent_and_numbers() -> None:
    result = compare(STATE)
    assert result.equivalent
    traffic = {(r.probe.service, r.probe.traffic) for r in result.results}
    assert ("shop/storefront:https (tcp)", "LB IP 203.0.113.10 from allowed range") in traffic
    catalog = next(r for r in result.results if r.probe.traffic == "cluster IP from pod" and "catalog" in r.probe.service)
    assert catalog.iptables[Outcome("dnat", "10.244.0.11:8080")] == Fraction(715827883, 2**31)
    assert catalog.iptables_ideal == catalog.nft_ideal and set(catalog.nft_ideal.values()) == {Fraction(1, 3)}
    blocked = next(r for r in result.results if r.probe.traffic == "LB IP 203.0.113.10 from outside")
    assert blocked.iptables == blocked.nft == {Outcome("drop"): 1}


@pytest.mark.parametrize("seed", [0, 2, 6, 8, 1, 3])
def test_random_clusters_equivalent(seed: int) -> None:
    state = random_cluster(random.Random(seed), 12)
    result = compare(state)
    assert len(result.results) > 20
    bad = [r for r in result.results if not r.equivalent]
    assert not bad, [(r.probe, r.iptables, r.nft) for r in bad[:2]]
    assert result.max_difference < Fraction(1, 10**9)


def test_node_traffic_to_external_ips_without_endpoints_is_equivalent() -> None:
    """Once a difference: nft checked external IPs without (local) endpoints on output too, so the
    node's own traffic was dropped where iptables (KUBE-EXTERNAL-SERVICES: INPUT/FORWARD only)
    short-circuits it to the cluster endpoints or leaves it alone. Seeds 1, 3, 4, 5, 7 and 11
    all had such services."""
    for seed in (1, 3, 4, 5, 7, 11):
        result = compare(random_cluster(random.Random(seed), 12))
        node_external = [
            r for r in result.results
            if r.probe.traffic.endswith("from node") and r.probe.traffic.startswith(("LB IP", "external IP"))
        ]
        assert node_external, seed
        bad = [r for r in result.results if not r.equivalent]
        assert not bad, (seed, [(r.probe, r.iptables, r.nft) for r in bad[:2]])


def test_a_difference_is_reported() -> None:
    probe = Probe("10.0.0.1", "10.96.0.1", 80, "tcp", "pod", service="x", traffic="cluster IP from pod")
    same = {Outcome("dnat", "10.0.0.2:80"): Fraction(1)}
    other = {Outcome("dnat", "10.0.0.2:80", True): Fraction(1)}
    r = Agreement(probe, same, other, same, other)
    assert not r.equivalent and r.total_variation == 1
    assert not Comparison((r,)).equivalent


def test_probes_cover_every_traffic_class() -> None:
    kinds = {p.traffic.split(" from ")[0].split(" ")[0] for p in probes(STATE, IPFamily.V4)}
    assert {"cluster", "node", "LB", "external"} <= kinds


def test_cli(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare", "--json", str(ROOT / "examples")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["equivalent"] and out["max_difference"] < 1e-9 and len(out["probes"]) > 40


@pytest.mark.parametrize("seed", range(6))
def test_one_walk_for_both_modes_equals_two_walks(seed: int) -> None:
    """compare walks each probe once for kernel and ideal mode (interpret_both): it must answer
    exactly what two separate walks answer, for both backends' rules, on every probe."""
    from nfproxy.analysis.interpret import interpret, interpret_both
    from nfproxy.verify.compare import documented_probes, families, iptables_ruleset, nft_ruleset

    state = random_cluster(random.Random(1000 + seed), 12)
    checked = 0
    for family in families(state):
        node_ips = state.node.ips_of(family)
        for ruleset in (iptables_ruleset(state, family), nft_ruleset(state, family)):
            for probe in (*probes(state, family), *documented_probes(state, family)):
                packet = probe.packet()
                both = interpret_both(ruleset, packet, node_ips=node_ips)
                assert both == (
                    interpret(ruleset, packet, node_ips=node_ips, mode="kernel"),
                    interpret(ruleset, packet, node_ips=node_ips, mode="ideal"),
                ), probe
                checked += 1
    assert checked > 0

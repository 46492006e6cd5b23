"""`nfproxy render --backend iptables` is byte-identical to what it printed before G.

The goldens in tests/golden/iptables-render/ were captured from the renderer before it was split
into steps and gained partial rendering: examples/ (whole and per file), every compat/ scenario,
and seeded random clusters (by digest, to keep the repository small; two of them are past
LARGE_CLUSTER_ENDPOINTS). Regenerate only for an intended change of output:
`python tests/test_iptables_golden.py`.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))

from nfproxy.backends.iptables.backend import IptablesBackend  # noqa: E402
from nfproxy.cli.commands.render import render_text  # noqa: E402
from nfproxy.core.model import ClusterState, IPFamily, NodeConfig  # noqa: E402
from nfproxy.sources import manifests  # noqa: E402
from nfproxy.testing import random_cluster, uniform_cluster  # noqa: E402
from tests import scenarios  # noqa: E402

GOLDEN = ROOT / "tests" / "golden" / "iptables-render"


def text_cases() -> dict[str, ClusterState]:
    cases = {"examples": manifests.load(str(ROOT / "examples"), node=NodeConfig()).state}
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        cases["examples-" + path.stem] = manifests.load(str(path), node=NodeConfig()).state
    for scenario in scenarios.load_all():
        cases["compat-" + scenario.path.stem] = scenario.state
    return cases


def digest_cases() -> dict[str, ClusterState]:
    cases = {f"random-{seed}": random_cluster(random.Random(seed), 1 + seed % 30, 12) for seed in range(40)}
    cases["large-uniform-60x20"] = uniform_cluster(60, 20)
    cases["large-random-150"] = random_cluster(random.Random(7), 150, 20)
    return cases


def _digest(state: ClusterState) -> str:
    return hashlib.sha256(render_text("iptables", state).encode()).hexdigest()


TEXT_CASES = text_cases()


@pytest.mark.parametrize("name", sorted(TEXT_CASES))
def test_render_text_is_unchanged(name: str) -> None:
    assert render_text("iptables", TEXT_CASES[name]) == (GOLDEN / f"{name}.txt").read_text()


@pytest.mark.parametrize("name", ["examples", "compat-dual-stack", "compat-ipv6-loadbalancer-source-ranges"])
def test_the_backend_renders_what_nfproxy_render_prints(name: str) -> None:
    """What a generic `render` command prints: each family's Rendered.text(), in family order."""
    backend = IptablesBackend()
    text = "".join(backend.render(TEXT_CASES[name], family).text() for family in IPFamily)
    assert text == (GOLDEN / f"{name}.txt").read_text()


def test_render_of_random_clusters_is_unchanged() -> None:
    want = json.loads((GOLDEN / "random.json").read_text())
    got = {name: _digest(state) for name, state in digest_cases().items()}
    assert got == want


def test_every_compat_scenario_has_a_golden() -> None:
    names = {p.stem for p in GOLDEN.glob("compat-*.txt")}
    assert names == {"compat-" + p.stem for p in (ROOT / "compat").glob("*.yaml")}


if __name__ == "__main__":
    for name, state in TEXT_CASES.items():
        (GOLDEN / f"{name}.txt").write_text(render_text("iptables", state))
    digests = {name: _digest(state) for name, state in digest_cases().items()}
    (GOLDEN / "random.json").write_text(json.dumps(digests, indent=1, sort_keys=True) + "\n")

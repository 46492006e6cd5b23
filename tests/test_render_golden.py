"""`nfproxy render` output is byte-identical to what it was before the typed-object rewrite.

The goldens in tests/golden/render/ were captured from the renderer as it was before nft rules
became objects (commit "render goldens"): the examples/ directory through the CLI, every compat/
scenario, and a few seeded random clusters, on both backends. A difference here is a behaviour
change; regenerate only after reading the diff (NFPROXY_UPDATE_GOLDEN=1).
"""

from __future__ import annotations

import contextlib
import io
import os
import random
from pathlib import Path

import pytest

from nfproxy.cli.commands.render import render_text
from nfproxy.cli.main import main
from nfproxy.testing import random_cluster
from tests.scenarios import load_all

ROOT = Path(__file__).parent.parent
GOLDEN = Path(__file__).parent / "golden" / "render"
BACKENDS = ("nft", "iptables")
SCENARIOS = {sc.path.stem: sc for sc in load_all()}
SEEDS = range(6)


def _check(name: str, got: str) -> None:
    path = GOLDEN / name
    if os.environ.get("NFPROXY_UPDATE_GOLDEN"):
        path.write_text(got)
    assert path.exists(), f"no golden {path}"
    assert got == path.read_text(), f"render output differs from {path}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_compat_scenario_render_unchanged(scenario: str, backend: str) -> None:
    _check(f"{scenario}.{backend}.txt", render_text(backend, SCENARIOS[scenario].state))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", SEEDS)
def test_random_cluster_render_unchanged(seed: int, backend: str) -> None:
    _check(f"random-{seed}.{backend}.txt", render_text(backend, random_cluster(random.Random(seed), 30, 8)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_examples_render_unchanged_through_the_cli(backend: str) -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["render", "--backend", backend, str(ROOT / "examples")]) == 0
    _check(f"examples.{backend}.txt", out.getvalue())

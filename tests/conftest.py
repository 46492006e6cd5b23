"""Shared fixtures. Kernel tests get a throwaway network namespace, removed even on failure."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "nfproxy", deadline=None, suppress_health_check=[HealthCheck.too_slow], max_examples=60
)
settings.load_profile("nfproxy")

os.environ["PATH"] = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"


@pytest.fixture
def netns() -> Iterator[str]:
    """A fresh network namespace; kernel tests fail loudly (never skip) without root."""
    if os.geteuid() != 0:
        pytest.fail("kernel tests need root: they create network namespaces (run scripts/test)")
    from nfproxy.kernel import netns as netns_mod

    with netns_mod.throwaway("nfp-test") as name:
        yield name

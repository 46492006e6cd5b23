"""A partial sync the nft backend cannot say (an element two services claim) becomes a full
sync decided by the backend, once, and its sync line says why (issue Q: a sync decided once)."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from nfproxy.backends.nft import render as nft_render
from nfproxy.core.model import IPFamily
from nfproxy.daemon.proxier import Proxier
from nfproxy.kernel.memory.nft import MemoryNft
from nfproxy.testing import uniform_cluster

V4 = IPFamily.V4


def _shared_external_ip() -> tuple:
    """Two services whose ports share an external IP and port: one `service-ips` element both
    claim (a contested key)."""
    state = uniform_cluster(2, 2)
    first, second = sorted(state.services, key=lambda k: k[0].name)
    services = dict(state.services)
    for key in (first, second):
        services[key] = dataclasses.replace(services[key], external_ips=("192.168.50.5",))
    return dataclasses.replace(state, services=services), first


def test_a_contested_element_makes_the_backend_plan_a_full_sync_and_say_why(caplog: pytest.LogCaptureFixture) -> None:
    state, key = _shared_external_ip()
    kernels: dict[IPFamily, MemoryNft] = {}
    proxier = Proxier("nft", kernels=lambda f: kernels.setdefault(f, MemoryNft(f)))
    assert proxier.sync(state).kind == "full"
    changed = dataclasses.replace(state, services={  # the first gives up the shared address
        **state.services, key: dataclasses.replace(state.services[key], external_ips=())})
    update = nft_render.render_update(nft_render.render(state, V4), changed, [key])
    assert isinstance(update, nft_render.Cannot) and "claimed by several services" in update.reason
    with caplog.at_level(logging.DEBUG):
        result = proxier.sync(changed)
    assert result.kind == "full" and result.families[V4].kind == "full"
    assert result.reason.startswith("partial sync impossible: element 192.168.50.5")
    assert "partial sync impossible" in caplog.text
    for _ in range(3):  # what the full sync emptied goes in a sync of its own, as the loop runs it
        if proxier.backend.pending():
            proxier.sync(changed)
    assert not proxier.backend.pending()
    fresh: dict[IPFamily, MemoryNft] = {}
    Proxier("nft", kernels=lambda f: fresh.setdefault(f, MemoryNft(f))).sync(changed)
    assert kernels[V4].dump() == fresh[V4].dump()

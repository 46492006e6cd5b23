"""A first empty state while the kernel serves services from before (daemon/empty_start.py):
a restarted daemon whose source lists no service at all holds it for --empty-source-grace
instead of removing every rule at once. In-memory kernels: no root."""

from __future__ import annotations

import dataclasses
import time

from nfproxy.daemon.empty_start import EmptyStartHold
from nfproxy.daemon.proxier import SyncLoop
from nfproxy.testing import uniform_cluster
from tests.test_proxier_memory import V4, _StaticSource, memory_proxier

STATE = uniform_cluster(5, 2)
EMPTY = dataclasses.replace(STATE, services={}, endpoints={})


def test_the_hold_waits_the_grace_then_lets_the_empty_state_through(caplog) -> None:  # noqa: ANN001
    hold = EmptyStartHold(30.0)
    with caplog.at_level("WARNING", logger="nfproxy.daemon"):
        assert hold.held(EMPTY, 100.0, lambda: 12)
        assert "holds 12 service chains" in caplog.text
        assert hold.held(EMPTY, 129.0, lambda: 12)
        assert not hold.held(EMPTY, 130.5, lambda: 12)  # the grace is over: removed, said so
        assert "removing every service" in caplog.text
    assert hold.done and not hold.held(EMPTY, 131.0, lambda: 12)


def test_no_hold_for_services_a_fresh_kernel_or_no_grace() -> None:
    assert not EmptyStartHold(30.0).held(STATE, 0.0, lambda: 12)  # services: nothing to hold
    fresh = EmptyStartHold(30.0)
    assert not fresh.held(EMPTY, 0.0, lambda: 0) and fresh.done  # nothing to lose
    assert not EmptyStartHold(0.0).held(EMPTY, 0.0, lambda: 12)


def test_a_restart_on_an_empty_source_keeps_the_rules_and_a_listing_ends_the_hold() -> None:
    first, kernels = memory_proxier()
    first.sync(STATE)  # the previous run
    served = kernels[V4].dump()
    proxier, _ = memory_proxier(kernels)  # the restart
    assert proxier.service_chains() == len(STATE.services)
    source = _StaticSource(EMPTY)
    loop = SyncLoop(source, proxier, min_sync_period=0.01, sync_period=3600, empty_grace=3600)
    held: list[bool] = []
    loop.on_empty_held.append(lambda: held.append(True))
    loop.start()
    try:
        deadline = time.monotonic() + 30
        while not held and time.monotonic() < deadline:
            time.sleep(0.01)
        assert held == [True]
        time.sleep(0.3)  # a few turns of the loop: still held, nothing synced
        assert kernels[V4].dump() == served and proxier.state is None
        source.state = STATE  # the API server lists services again
        loop.notify()
        assert loop.wait_synced(30)
    finally:
        loop.stop()
    assert proxier.state == STATE and kernels[V4].dump() == served and held == [True]


def test_without_a_grace_a_restart_on_an_empty_source_removes_the_rules() -> None:
    first, kernels = memory_proxier()
    first.sync(STATE)
    proxier, _ = memory_proxier(kernels)
    loop = SyncLoop(_StaticSource(EMPTY), proxier, min_sync_period=0.01, sync_period=3600)
    loop.start()
    try:
        assert loop.wait_synced(30)
        deadline = time.monotonic() + 30  # emptied by the full sync, deleted by the loop's next
        while proxier.service_chains() and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        loop.stop()
    assert proxier.state == EMPTY and proxier.service_chains() == 0


def errors(daemon) -> float:  # noqa: ANN001
    return daemon.metrics.registry.get_sample_value("nfproxy_source_errors_total", {"source": "api"}) or 0


def test_the_daemon_counts_the_hold_as_a_source_error() -> None:
    from nfproxy.daemon.node import Daemon, DaemonConfig

    first, kernels = memory_proxier()
    first.sync(STATE)
    proxier, _ = memory_proxier(kernels)
    daemon = Daemon(_StaticSource(EMPTY), DaemonConfig("nft", empty_grace=3600), proxier)
    daemon.loop.start()
    try:
        deadline = time.monotonic() + 30
        while not errors(daemon) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        daemon.loop.stop()
    assert errors(daemon) == 1
    assert proxier.state is None  # nothing synced: the previous run's rules stand

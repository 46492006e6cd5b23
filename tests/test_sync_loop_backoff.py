"""The sync loop's retry backoff: once a sync failed, nothing starts one before the retry time.

The probe that found it: a namespace whose `table ip nfproxy` another process owned, so every
apply failed. Once the failures outlasted --sync-period, the periodic full sync (due since the
last *successful* one) ran every --min-sync-period: 80 failed full renders in 20 s, while the
log announced a retry in 1m0s. The schedule is driven here with a fake clock; the loop itself
with an in-memory kernel that refuses every transaction (no root).
"""

from __future__ import annotations

import logging
import threading
import time

import pytest

from nfproxy.core.model import ClusterState, IPFamily, NodeConfig
from nfproxy.daemon import logs
from nfproxy.daemon.proxier import Proxier, SyncLoop, SyncSchedule
from nfproxy.kernel.memory.nft import MemoryNft
from nfproxy.kernel.process import KernelError
from tests.test_proxier_memory import _StaticSource as StaticSource

NODE = NodeConfig(name="node-a", ips=("192.168.0.2",), cluster_cidrs=("10.244.0.0/16",))


def failing_attempts(schedule: SyncSchedule, until: float, *, changes: bool) -> list[tuple[float, float]]:
    """(start, announced retry delay) of each sync the loop would start, every one failing.

    The fake clock jumps to each moment the schedule names, as the loop's waits would;
    `changes`: a change is always waiting (a busy cluster), or none ever is.
    """
    now, attempts = 0.0, []
    while now < until:
        delay = schedule.delay(now, woken=changes)
        if delay > 0:
            now += delay
            continue
        schedule.started(now)
        attempts.append((now, schedule.failed(now)))
    return attempts


@pytest.mark.parametrize("changes", [False, True], ids=["idle", "busy"])
def test_failures_back_off_past_the_sync_period(changes: bool) -> None:
    """The probe's settings: --min-sync-period 200ms, --sync-period 3s, 20 s of failures."""
    schedule = SyncSchedule(0.2, 3.0, 60.0, last_full=0.0)
    schedule.started(-1.0)  # the loop's first sync is its start's notification
    attempts = failing_attempts(schedule, 20.0, changes=changes)
    starts = [round(t, 6) for t, _ in attempts]
    assert starts[0] == (0.0 if changes else 3.0)  # idle: the first is the periodic full sync
    # Every retry comes exactly when the log said it would, however overdue the full sync is.
    for (start, retry_in), (following, _) in zip(attempts, attempts[1:]):
        assert following - start == pytest.approx(retry_in)
    assert [round(r, 6) for _, r in attempts] == [0.2 * 2**i for i in range(len(attempts))]
    assert len(attempts) <= 7, starts


def test_the_first_idle_sync_is_the_periodic_one_and_a_success_resets_the_backoff() -> None:
    schedule = SyncSchedule(0.2, 3.0, 60.0, last_full=0.0)
    assert schedule.delay(0.0, woken=False) == pytest.approx(3.0)
    assert schedule.delay(0.0, woken=True) == 0.0
    assert schedule.periodic_due(3.0) and not schedule.periodic_due(2.9)
    assert not schedule.full_due(3.0) and schedule.full_due(3600.0)  # hourly, as kube-proxy
    schedule.started(3.0)
    assert schedule.failed(3.1) == pytest.approx(0.2)
    assert schedule.failed(3.4) == pytest.approx(0.4)
    assert schedule.delay(3.5, woken=True) == pytest.approx(0.3)  # a change waits for the retry
    schedule.started(3.8)
    schedule.succeeded(3.9, full=True)  # the retry was the full sync
    assert schedule.retry_at is None and schedule.backoff == pytest.approx(0.2)
    assert schedule.delay(4.0, woken=False) == pytest.approx(2.9)  # the next periodic one
    assert schedule.delay(4.0, woken=True) == 0.0  # min_sync_period since 3.8 has passed
    assert schedule.delay(3.9, woken=True) == pytest.approx(0.1)


def test_the_backoff_stops_at_its_cap() -> None:
    schedule = SyncSchedule(1.0, 30.0, 60.0)
    assert [schedule.failed(0.0) for _ in range(8)] == [1, 2, 4, 8, 16, 32, 60, 60]


class RefusingNft(MemoryNft):
    """Someone else owns the table: every transaction is refused, each attempt timed."""

    def __init__(self, family: IPFamily, attempts: list[float]) -> None:
        super().__init__(family)
        self.attempts = attempts

    def apply(self, payload: object) -> None:
        self.attempts.append(time.monotonic())
        raise KernelError("Could not process rule: Operation not permitted (table owned by another process)")


def test_the_loop_keeps_to_the_backoff_through_periodic_syncs_and_changes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Real threads and time, scaled down: min-sync-period 10 ms (the backoff starts at its
    100 ms floor), sync-period 50 ms, 1.6 s of failures with a change notified every 5 ms. The
    old loop made an attempt every 10 ms once the first 50 ms had passed."""
    attempts: list[float] = []
    proxier = Proxier("nft", families=(IPFamily.V4,), kernels=lambda f: RefusingNft(f, attempts))
    loop = SyncLoop(StaticSource(ClusterState(NODE)), proxier, min_sync_period=0.01, sync_period=0.05)
    busy = threading.Event()

    def churn() -> None:
        while not busy.wait(0.005):
            loop.notify()

    with caplog.at_level(logging.WARNING, logger="nfproxy.proxier"):
        loop.start()
        notifier = threading.Thread(target=churn, daemon=True)
        notifier.start()
        time.sleep(1.6)
        busy.set()
        loop.stop()
        notifier.join()
    # 0, 100, 300, 700, 1500 ms (+ the time each failed sync takes): 5 in 1.6 s.
    assert 4 <= len(attempts) <= 6, [round(t - attempts[0], 3) for t in attempts]
    announced = [
        getattr(r, logs.KEYS_ATTR)["retryIn"].seconds
        for r in caplog.records if logs.message(r) == "Sync failed, retrying"
    ]
    assert announced[:4] == pytest.approx([0.1, 0.2, 0.4, 0.8])
    for earlier, later, retry_in in zip(attempts, attempts[1:], announced):
        assert later - earlier >= retry_in * 0.95  # never earlier than the log said

"""The periodic sync checks, it does not rewrite (issue P.1), on the in-memory kernels.

Each --sync-period the loop's sync compares every kernel's generation with the one read after
nfproxy's own last write: unchanged, the sync writes nothing; moved (someone else wrote), the
sync is full and repairs what was deleted. A full rewrite is forced only every
FULL_SYNC_PERIOD (an hour, kube-proxy's). The same on real kernels: test_periodic_check_kernel.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from nfproxy.core.model import ClusterState, IPFamily
from nfproxy.daemon.proxier import FULL_SYNC_PERIOD, Proxier, SyncLoop, SyncResult
from nfproxy.kernel import memory
from nfproxy.kernel.base import Kernel
from nfproxy.kernel.memory.iptables import MemoryIptablesKernel
from nfproxy.kernel.memory.nft import MemoryNft
from nfproxy.nftables import Chain, Transaction
from nfproxy.testing import uniform_cluster
from tests.test_proxier_memory import _StaticSource

V4 = IPFamily.V4
BACKENDS = ["nft", "iptables"]


def memory_proxier(backend: str) -> tuple[Proxier, dict[IPFamily, Kernel]]:
    kernels: dict[IPFamily, Kernel] = {}
    make = memory.kernels(backend)
    return Proxier(backend, kernels=lambda f: kernels.setdefault(f, make(f))), kernels


def fresh_dump(backend: str, state: ClusterState) -> str:
    proxier, kernels = memory_proxier(backend)
    proxier.sync(state)
    return kernels[V4].dump()


def delete_externally(kernel: Kernel) -> None:
    """What an admin's `nft flush chain` or `iptables -F` does to one service's chain."""
    if isinstance(kernel, MemoryNft):
        assert kernel.table is not None
        name = sorted(n for n in kernel.table.chains if n.startswith("service-"))[0]
        tx = Transaction("ip", "nfproxy")
        tx.flush(Chain(name))
        kernel.apply(tx)
        return
    assert isinstance(kernel, MemoryIptablesKernel)
    name = sorted(n for n in kernel.tables["nat"].chains if n.startswith("KUBE-SVC-"))[0]
    kernel.restore(f"*nat\n-F {name}\nCOMMIT\n")


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_periodic_sync_of_an_untouched_kernel_writes_nothing(backend: str) -> None:
    state = uniform_cluster(5, 3)
    proxier, kernels = memory_proxier(backend)
    assert proxier.sync(state).kind == "full"
    generation = kernels[V4].generation()
    result = proxier.sync(state, check=True)
    assert (result.kind, result.operations) == ("noop", 0)
    assert kernels[V4].generation() == generation  # nothing was sent


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_external_deletion_makes_the_next_periodic_sync_full_and_it_repairs(backend: str) -> None:
    """A change's sync after the deletion stays partial (it only notes the moved generation,
    and writing must not make it look like ours); the periodic sync then repairs."""
    state = uniform_cluster(6, 3)
    proxier, kernels = memory_proxier(backend)
    proxier.sync(state)
    delete_externally(kernels[V4])
    broken = kernels[V4].dump()
    assert broken != fresh_dump(backend, state)
    changed = uniform_cluster(7, 3)
    partial = proxier.sync(changed)
    assert partial.kind == "partial"
    result = proxier.sync(changed, check=True)
    assert (result.kind, result.reason) == ("full", "rules changed outside nfproxy")
    assert kernels[V4].dump() == fresh_dump(backend, changed)
    assert proxier.sync(changed, check=True).kind == "noop"  # trusted again


def test_an_unreadable_generation_is_never_trusted() -> None:
    """A kernel that cannot say its generation is checked the old way: every periodic sync full."""

    class Blind(MemoryNft):
        def generation(self) -> int:
            raise OSError("netlink: Permission denied")

    state = uniform_cluster(3, 2)
    proxier = Proxier("nft", families=(V4,), kernels=lambda f: Blind(f))
    proxier.sync(state)
    assert proxier.sync(state).kind == "noop"
    assert proxier.sync(state, check=True).kind == "full"


class Recorder:
    """Every sync the loop runs, with a way to wait for the n-th."""

    def __init__(self) -> None:
        self.results: list[SyncResult] = []
        self._cond = threading.Condition()

    def __call__(self, _previous: object, _state: object, result: SyncResult) -> None:
        with self._cond:
            self.results.append(result)
            self._cond.notify_all()

    def wait(self, until: Callable[[list[SyncResult]], bool], timeout: float = 30.0) -> list[SyncResult]:
        with self._cond:
            assert self._cond.wait_for(lambda: until(self.results), timeout), self.results
            return list(self.results)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_loops_periodic_syncs_check_and_repair_within_one_period(backend: str) -> None:
    """kube-proxy's default loop, scaled down: --sync-period 20 ms, the forced full sync an
    hour away. The periodic syncs of an idle node write nothing (the old loop rewrote all at
    each); an external deletion is repaired by the next one."""
    state = uniform_cluster(6, 3)
    proxier, kernels = memory_proxier(backend)
    seen = Recorder()
    proxier.hooks.on_synced.append(seen)
    loop = SyncLoop(_StaticSource(state), proxier, min_sync_period=0.001, sync_period=0.02)
    assert loop.full_period == FULL_SYNC_PERIOD == 3600.0
    loop.start()
    try:
        idle = seen.wait(lambda r: len(r) >= 6)
        assert [r.kind for r in idle[:6]] == ["full"] + ["noop"] * 5
        generation = kernels[V4].generation()
        with proxier._lock:  # between two of the loop's syncs
            delete_externally(kernels[V4])
        done = seen.wait(lambda r: any(x.reason == "rules changed outside nfproxy" for x in r))
        repair = next(x for x in done if x.reason)
        assert repair.kind == "full"
    finally:
        loop.stop()
    assert kernels[V4].generation() != generation
    assert kernels[V4].dump() == fresh_dump(backend, state)

"""split_map and beside: the same answer as without the fork, whatever happens to the child."""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import pytest

from nfproxy.analysis import check as check_mod
from nfproxy.analysis import dump, iptables_save
from nfproxy.backends.iptables import render as iptables_backend
from nfproxy.backends.nft import render as nft_backend
from nfproxy.core import forked
from nfproxy.core.model import IPFamily
from nfproxy.testing import random_cluster



@pytest.fixture(autouse=True)
def two_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """split_map forks only with two CPUs to use: these tests fork whatever the machine has."""
    monkeypatch.setattr(forked, "cpus", lambda: 2)


def test_a_small_input_or_one_cpu_stays_in_the_process(monkeypatch: pytest.MonkeyPatch) -> None:
    parent = os.getpid()
    assert forked.split_map(lambda x: (x, os.getpid()), range(10)) == [(x, parent) for x in range(10)]
    monkeypatch.setattr(forked, "cpus", lambda: 1)
    assert forked.split_map(lambda x: (x, os.getpid()), range(10), min_items=0) == [(x, parent) for x in range(10)]


def test_half_is_done_by_a_child_and_the_order_is_kept() -> None:
    parent = os.getpid()
    out = forked.split_map(lambda x: (x * x, os.getpid() == parent), list(range(101)), min_items=0)
    assert [v for v, _ in out] == [x * x for x in range(101)]
    assert [here for _, here in out] == [i % 2 == 0 for i in range(101)]


def test_a_failing_child_leaves_its_half_to_the_parent() -> None:
    parent = os.getpid()

    def only_here(x: int) -> int:
        if os.getpid() != parent:
            raise RuntimeError("the child fails")
        return x + 1

    assert forked.split_map(only_here, list(range(50)), min_items=0) == [x + 1 for x in range(50)]


def test_results_that_do_not_pickle_are_redone_in_the_parent() -> None:
    out = forked.split_map(lambda x: (lambda: x), list(range(9)), min_items=0)
    assert [f() for f in out] == list(range(9))


def _rulesets(seed: int) -> list[object]:
    state = random_cluster(random.Random(seed), 60)
    nft = dump.read_nft_script(nft_backend.render(state, IPFamily.V4).script()).ruleset
    iptables = iptables_save.parse(iptables_backend.render(state, IPFamily.V4).restore_text(with_jumps=True), 4)
    return [nft, iptables]


@pytest.mark.parametrize("seed", [1, 2])
def test_check_reports_the_same_with_the_walks_split(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    for ruleset in _rulesets(seed):
        serial = check_mod.check(ruleset)  # type: ignore[arg-type]
        assert serial.services, "the cluster has services to check"
        with monkeypatch.context() as m:
            m.setattr(forked, "MIN_ITEMS", 0)
            assert check_mod.check(ruleset) == serial  # type: ignore[arg-type]


def test_beside_computes_in_a_child() -> None:
    parent = os.getpid()
    child = forked.beside(lambda: (os.getpid() != parent, list(range(5))))
    assert child is not None
    assert child.result(60) == (True, [0, 1, 2, 3, 4])


def test_beside_without_two_cpus_is_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(forked, "cpus", lambda: 1)
    assert forked.beside(lambda: 1) is None


def test_a_failing_or_silent_child_gives_none_and_is_gone() -> None:
    def fails() -> int:
        raise RuntimeError("the child fails")

    child = forked.beside(fails)
    assert child is not None and child.result(60) is None
    silent = forked.beside(lambda: time.sleep(600))
    assert silent is not None
    pid = silent._pid
    assert silent.result(0.2) is None  # killed at the deadline, and reaped
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def test_a_child_forked_from_a_thread_takes_the_default_signal_actions() -> None:
    """The daemon forks from its sync thread while its main thread holds the signal handlers
    and the wakeup pipe: a SIGTERM to the child ends the child, and wakes nobody in the parent."""
    read, write = os.pipe()
    os.set_blocking(write, False)
    old = signal.set_wakeup_fd(write)
    seen: list[object] = []
    previous = signal.signal(signal.SIGTERM, lambda *_: seen.append("handled"))
    try:
        out: list[object] = []

        def run() -> None:
            child = forked.beside(lambda: time.sleep(600))
            assert child is not None
            os.kill(child._pid, signal.SIGTERM)
            out.append(child.result(60))

        thread = threading.Thread(target=run)
        thread.start()
        thread.join(120)
        assert out == [None]  # the child died of the signal: no value
        os.set_blocking(read, False)
        with pytest.raises(BlockingIOError):
            os.read(read, 16)  # nothing written into the parent's wakeup pipe
        assert seen == []
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.set_wakeup_fd(old)
        os.close(read)
        os.close(write)

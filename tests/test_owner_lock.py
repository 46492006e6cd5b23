"""The owner lock after kill -9 (issue J.4): the file may stay in /run/nfproxy (as
/run/xtables.lock does), the flock does not, so the next daemon starts at once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from nfproxy.kernel import lock

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def _wait(predicate: Callable[[], bool], timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


class Daemon:
    """`nfproxy` on `netns`, its stderr collected line by line."""

    def __init__(self, netns: str, backend: str) -> None:
        argv = [sys.executable, "-m", "nfproxy.cli.main", "--backend", backend, "--netns", netns,
                "--manifests", str(EXAMPLES), "--healthz-bind-address", "", "--metrics-bind-address", "",
                "--min-sync-period", "100ms", "--v=2"]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        self.log: list[str] = []
        assert self.proc.stderr is not None
        stream = self.proc.stderr
        self._reader = threading.Thread(target=lambda: self.log.extend(iter(stream.readline, "")), daemon=True)
        self._reader.start()

    def synced(self) -> bool:
        """Its first full sync is done (it holds the lock: it is taken before anything)."""
        return _wait(lambda: any('kind="full"' in line for line in self.log) or self.proc.poll() is not None) and (
            self.proc.poll() is None
        )

    def stop(self, sig: signal.Signals) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        code = self.proc.wait(timeout=30)
        self._reader.join(30)
        return code


@pytest.mark.kernel
@pytest.mark.parametrize("backend", ["nft", "iptables"])
def test_a_daemon_starts_on_a_namespace_whose_owner_was_killed_9(netns: str, backend: str) -> None:
    path = Path(lock.LOCK_DIR) / f"{backend}-{lock.namespace_key(netns)}.lock"
    first = Daemon(netns, backend)
    second: Daemon | None = None
    try:
        assert first.synced(), "".join(first.log)
        assert path.read_text() == f"{first.proc.pid}\n"
        assert first.stop(signal.SIGKILL) == -signal.SIGKILL
        # Nobody unlinked it: the file stays, holding a dead pid, but no lock.
        assert path.read_text() == f"{first.proc.pid}\n"
        second = Daemon(netns, backend)
        assert second.synced(), "".join(second.log)
        assert path.read_text() == f"{second.proc.pid}\n"
        assert not any("already programs" in line for line in second.log)
        with pytest.raises(lock.NamespaceTaken, match=f"pid {second.proc.pid}"):
            lock.acquire(backend, netns)  # and the new owner's lock is a real one
        assert second.stop(signal.SIGTERM) == 0, "".join(second.log)
    finally:
        for daemon in (first, second):
            if daemon is not None and daemon.proc.poll() is None:
                daemon.proc.kill()
                daemon.proc.wait()


@pytest.mark.kernel
def test_a_clean_stop_removes_the_lock_file(netns: str) -> None:
    path = Path(lock.LOCK_DIR) / f"nft-{lock.namespace_key(netns)}.lock"
    daemon = Daemon(netns, "nft")
    try:
        assert daemon.synced(), "".join(daemon.log)
        assert path.exists()
    finally:
        code = daemon.stop(signal.SIGTERM)
    assert code == 0, "".join(daemon.log)
    assert not path.exists()
    assert os.path.isdir(lock.LOCK_DIR)

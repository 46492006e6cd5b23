"""Work beside a forked child: CPU-bound pure work over a large read-only structure.

`check` walks 10 000 selection chains of a parsed ruleset (~5 s of its 12 at 10 000 × 10 in
iptables), one independent walk each, in an interpreter that holds the GIL. A thread would not
help and a process pool would have to pickle the ruleset; a forked child shares it copy-on-write
for free and sends back only its results. Every other item goes to the child, so both halves
cost about the same. Anything wrong on the child's side (it died, its results would not pickle,
it did not answer in time) and the parent does that half itself: the answer never depends on
the fork. A full nft sync encodes its 200 000 set elements in a child the same way
(kernel/nft_bulk.py) while the parent compiles the rules.

The daemon forks from its sync thread while its servers run on others. The child only runs
pure Python over objects the parent built (no imports, no logging, no locks another thread could
hold), takes the default action for SIGTERM and SIGINT (the daemon's handlers and wakeup pipe
are the parent's), and leaves with `os._exit`; a child that never answers is killed at the
parent's deadline and its work done by the parent. (CPython 3.12 and later warn about any fork
of a threaded process, with a DeprecationWarning hidden by default: the child's narrow work
above is why this one is safe.)
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import time
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")

# Below this many items the fork costs more than it saves (a fork of a 300 MiB process is ~10 ms).
MIN_ITEMS = 2000


def cpus() -> int:
    """The CPUs this process may run on (its affinity, not the machine's count)."""
    return len(os.sched_getaffinity(0))


class Beside(Generic[R]):
    """A value a forked child is computing; `result` waits for it."""

    def __init__(self, pid: int, fd: int) -> None:
        self._pid, self._fd = pid, fd

    def result(self, timeout: float) -> R | None:
        """The child's value, or None: it failed, or sent nothing whole within `timeout` s
        (then it is killed)."""
        data = bytearray()  # one buffer, not chunks and their join: the result is held beside it
        deadline = time.monotonic() + timeout
        finished = False
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([self._fd], [], [], left)[0]:
                    break
                chunk = os.read(self._fd, 1 << 20)
                if not chunk:
                    finished = True
                    break
                data += chunk
        finally:
            os.close(self._fd)
            if not finished:
                _kill(self._pid)
            _, status = os.waitpid(self._pid, 0)
        if not finished or os.waitstatus_to_exitcode(status) != 0:
            return None
        try:
            return pickle.loads(data)  # type: ignore[no-any-return]
        except Exception:  # noqa: BLE001 - a cut pipe: the caller does the work instead
            return None


def beside(fn: Callable[[], R]) -> Beside[R] | None:
    """fn() in a forked child while the caller goes on; None with one CPU or no fork."""
    if cpus() < 2:
        return None
    read, write = os.pipe()
    # Blocked across the fork: a signal between the fork and the child's own actions would
    # run the parent's handler in the child (and write to the parent's wakeup pipe).
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, _CHILD_DEFAULTS)
    try:
        pid = os.fork()
    except OSError:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        os.close(read)
        os.close(write)
        return None
    if pid != 0:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    if pid == 0:  # the child: the value, pickled down the pipe, and out without cleanup
        code = 0
        try:
            os.close(read)
            _child_signals(mask)
            data = pickle.dumps(fn(), pickle.HIGHEST_PROTOCOL)
            with os.fdopen(write, "wb") as out:
                out.write(data)
        except BaseException:  # noqa: BLE001 - the parent does the work; nothing to report here
            code = 1
        finally:
            os._exit(code)
    os.close(write)
    return Beside(pid, read)


def split_map(fn: Callable[[T], R], items: Sequence[T], *, min_items: int | None = None) -> list[R]:
    """[fn(x) for x in items], half of it in a forked child when there are two CPUs to use."""
    if len(items) < (MIN_ITEMS if min_items is None else min_items):
        return [fn(x) for x in items]
    child = beside(lambda: [fn(x) for x in items[1::2]])
    started = time.monotonic()
    mine = [fn(x) for x in items[0::2]]
    theirs = child.result(max(30.0, 4 * (time.monotonic() - started))) if child is not None else None
    if theirs is None or len(theirs) != len(items[1::2]):
        theirs = [fn(x) for x in items[1::2]]
    out: list[R] = []
    for i in range(len(items)):
        out.append(mine[i // 2] if i % 2 == 0 else theirs[i // 2])
    return out


_CHILD_DEFAULTS = (signal.SIGTERM, signal.SIGINT)


def _child_signals(mask: set[signal.Signals]) -> None:
    signal.set_wakeup_fd(-1)
    for sig in _CHILD_DEFAULTS:
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass

"""Network namespaces: the sandboxes every kernel test and the lab program.

nfproxy never touches the root namespace's firewall in tests; it creates a throwaway namespace,
works inside it and removes it even when the work fails or is interrupted.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import secrets
import signal
import threading
from collections.abc import Iterator

from pyroute2 import IPRoute, netns

from nfproxy.kernel.process import KernelError

NETNS_DIR = "/run/netns"
_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def _setns(fd: int) -> None:
    if _libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise KernelError(f"setns failed: {os.strerror(err)}")


# What stops a command from a terminal, from `timeout`/systemd, and when its terminal goes away.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(KeyboardInterrupt):
    """A stop signal arrived inside `interruptible()`; raised so that cleanup blocks run.

    A KeyboardInterrupt, so code that already cleans up after Ctrl-C handles all three alike.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def exists(name: str) -> bool:
    return name in netns.listnetns()


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """Turn SIGINT, SIGTERM and SIGHUP into `Interrupted` for the block.

    Their default action kills the process at once, so no `finally` runs and a throwaway
    namespace (with its rules) outlives the command. A signal the process was started with
    ignored (nohup, a background shell's SIGINT) stays ignored. Only the main thread can set
    handlers; elsewhere this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, _frame: object) -> None:
        raise Interrupted(signum)

    # None: a handler set outside Python, left alone.
    previous = {sig: h for sig in STOP_SIGNALS if (h := signal.getsignal(sig)) is not None}
    for sig, handler in previous.items():
        if handler is not signal.SIG_IGN:
            signal.signal(sig, interrupt)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Hold SIGINT, SIGTERM and SIGHUP for the block, then deliver them.

    pyroute2 creates and removes a namespace from a forked helper: an interrupt landing while
    we wait for it lets the helper finish after our cleanup looked, and the namespace leaks.
    Only the main thread can set handlers; elsewhere this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = {sig: h for sig in STOP_SIGNALS if (h := signal.getsignal(sig)) is not None}
    for sig, handler in previous.items():
        if handler is not signal.SIG_IGN:
            signal.signal(sig, lambda signum, _f: caught.append(signum))
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if caught:
            signal.raise_signal(caught[0])


def create(name: str) -> None:
    """Create a namespace with its loopback up (conntrack and local routes need it)."""
    if exists(name):
        raise KernelError(f"network namespace {name} already exists")
    with signals_held():
        netns.create(name)
    with entered(name), IPRoute() as ipr:
        lo = ipr.link_lookup(ifname="lo")
        if lo:
            ipr.link("set", index=lo[0], state="up")


def remove(name: str) -> None:
    with signals_held():
        if exists(name):
            netns.remove(name)


@contextlib.contextmanager
def inside(name: str | None) -> Iterator[None]:
    """`entered(name)`, or this thread's own namespace when `name` is None (a daemon that
    programs the node itself)."""
    if name is None:
        yield
    else:
        with entered(name):
            yield


@contextlib.contextmanager
def entered(name: str) -> Iterator[None]:
    """Switch this thread (only) into `name` for the block, and back even on error.

    setns(2) moves the calling thread, so the saved namespace is this thread's own
    (/proc/thread-self), not the process's: other threads are unaffected and blocks nest.
    Sockets and libnftables contexts created inside stay bound to `name` afterwards.
    """
    path = os.path.join(NETNS_DIR, name)
    try:
        target = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise KernelError(f"network namespace {name} does not exist") from None
    saved = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        _setns(target)
        try:
            yield
        finally:
            _setns(saved)
    finally:
        os.close(target)
        os.close(saved)


@contextlib.contextmanager
def throwaway(prefix: str = "nfp") -> Iterator[str]:
    """A fresh namespace with a unique name, removed when the block ends, however it ends: a
    stop signal inside the block raises `Interrupted` after the namespace is gone."""
    name = f"{prefix}-{os.getpid()}-{secrets.token_hex(3)}"
    with interruptible():
        try:
            create(name)
            yield name
        finally:
            remove(name)

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


def exists(name: str) -> bool:
    return name in netns.listnetns()


def create(name: str) -> None:
    """Create a namespace with its loopback up (conntrack and local routes need it)."""
    if exists(name):
        raise KernelError(f"network namespace {name} already exists")
    netns.create(name)
    with entered(name), IPRoute() as ipr:
        lo = ipr.link_lookup(ifname="lo")
        if lo:
            ipr.link("set", index=lo[0], state="up")


def remove(name: str) -> None:
    if exists(name):
        netns.remove(name)


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
    """A fresh namespace with a unique name, removed when the block ends, however it ends."""
    name = f"{prefix}-{os.getpid()}-{secrets.token_hex(3)}"
    create(name)
    try:
        yield name
    finally:
        remove(name)

"""Read and write sysctls (`/proc/sys`) inside one network namespace.

The `net.*` sysctls a proxy cares about (conntrack timeouts, `nf_conntrack_tcp_be_liberal`) are
per network namespace: /proc/sys/net shows the namespace of the thread that opens the file, so
entering the namespace for the open is enough and the root namespace is never touched.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator

from nfproxy.kernel import netns as netns_mod
from nfproxy.kernel.process import KernelError

PROC_SYS = "/proc/sys"


class ReadOnlySysctl(KernelError):
    """/proc/sys is mounted read-only: an unprivileged container (kube-proxy's errReadOnlySysFS)."""


def path_of(name: str) -> str:
    """`net.netfilter.nf_conntrack_max` -> /proc/sys/net/netfilter/nf_conntrack_max."""
    if not name or "/" in name or ".." in name.split("."):
        raise ValueError(f"not a sysctl name: {name!r}")
    return os.path.join(PROC_SYS, *name.split("."))


@contextlib.contextmanager
def _inside(netns: str | None) -> Iterator[None]:
    if netns is None:
        yield
    else:
        with netns_mod.entered(netns):
            yield


def read(name: str, netns: str | None = None) -> str | None:
    """The value, stripped; None when the sysctl does not exist (its module is not loaded)."""
    with _inside(netns):
        try:
            with open(path_of(name), encoding="ascii") as f:
                return f.read().strip()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise KernelError(f"sysctl {name}: cannot read: {exc.strerror}") from None


def writable(name: str, netns: str | None = None) -> bool:
    """False for a sysctl this namespace may only read (e.g. `nf_conntrack_max` outside the
    root namespace, where it is the root namespace's global limit)."""
    with _inside(netns):
        return os.access(path_of(name), os.W_OK) and bool(os.stat(path_of(name)).st_mode & 0o222)


def write(name: str, value: int | str, netns: str | None = None) -> None:
    with _inside(netns):
        try:
            with open(path_of(name), "w", encoding="ascii") as f:
                f.write(f"{value}\n")
        except FileNotFoundError:
            raise KernelError(f"sysctl {name} does not exist (is its kernel module loaded?)") from None
        except OSError as exc:
            if exc.errno == errno.EROFS:
                raise ReadOnlySysctl(f"sysctl {name}={value}: /proc/sys is read-only here") from None
            raise KernelError(f"sysctl {name}={value}: cannot write: {exc.strerror}") from None


def ensure(name: str, value: int, netns: str | None = None) -> bool:
    """Set `name` to `value` unless it already is (kube-proxy's EnsureSysctl); True when written."""
    if read(name, netns) == str(value):
        return False
    write(name, value, netns)
    return True

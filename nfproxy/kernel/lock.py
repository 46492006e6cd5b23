"""One owner per network namespace and backend: an flock, as the xtables lock serialises iptables.

Two daemons programming one namespace fight: each sync undoes the other's, and iptables' jump
insertion (check, then insert) duplicates rules when both race. The lock makes the second one
stop before it touches anything.

The key is the namespace's nsfs inode, not its name: `--netns web` and a daemon started with
`ip netns exec web` program the same namespace and must collide. The lock is released by the
kernel when the process dies, however it dies (kill -9 included), so a stale file never blocks.
"""

from __future__ import annotations

import fcntl
import os
from dataclasses import dataclass

from nfproxy.kernel.netns import NETNS_DIR
from nfproxy.kernel.process import KernelError

LOCK_DIR = "/run/nfproxy"


class NamespaceTaken(KernelError):
    """Another live process holds the lock for this namespace and backend."""


def namespace_key(netns: str | None) -> str:
    """`netns-<inode>` of the named namespace, or of this thread's own when `netns` is None."""
    path = os.path.join(NETNS_DIR, netns) if netns else "/proc/thread-self/ns/net"
    try:
        return f"netns-{os.stat(path).st_ino}"
    except OSError as exc:
        raise KernelError(f"cannot identify network namespace {netns or '(current)'}: {exc.strerror}") from None


@dataclass(slots=True)
class OwnerLock:
    """A held lock; `release` (or process exit) frees it."""

    path: str
    fd: int

    def release(self) -> None:
        if self.fd < 0:
            return
        # Unlink while still holding it: a waiter that opened the old file re-checks the inode.
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self.fd)
        self.fd = -1


def acquire(backend: str, netns: str | None, directory: str = LOCK_DIR) -> OwnerLock:
    """Take the lock for `backend` on `netns` without waiting; NamespaceTaken if it is held,
    KernelError naming the path if it cannot be taken at all (e.g. /run not writable)."""
    where = f"network namespace {netns!r}" if netns else "this network namespace"
    path = os.path.join(directory, f"{backend}-{namespace_key(netns)}.lock")
    while True:
        try:
            os.makedirs(directory, mode=0o755, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise KernelError(
                f"cannot take the owner lock {path}: {exc.strerror} (the directory must be "
                "writable: in a container, mount the host's /run/nfproxy there)"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").split("\n", 1)[0].strip()
            os.close(fd)
            raise NamespaceTaken(
                f"another nfproxy (pid {holder or 'unknown'}) already programs {where} with the "
                f"{backend} backend (lock {path}); stop it first, or use another --netns"
            ) from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # the file we locked was released and unlinked meanwhile: try again
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return OwnerLock(path, fd)

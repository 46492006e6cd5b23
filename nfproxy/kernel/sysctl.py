"""sysctls of one network namespace: what kube-proxy sets (and reads) on the node at start.

/proc/sys/net resolves against the opening thread's namespace, so entering it is enough; None
means the caller's own namespace (the node itself, in production).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from nfproxy.kernel import netns as netns_mod


def _path(key: str) -> str:
    return "/proc/sys/" + (key.replace(".", "/") if "/" not in key else key)


@contextlib.contextmanager
def _inside(netns: str | None) -> Iterator[None]:
    if netns is None:
        yield
    else:
        with netns_mod.entered(netns):
            yield


def read(key: str, netns: str | None = None) -> str:
    with _inside(netns), open(_path(key)) as f:
        return f.read().strip()


def ensure(key: str, value: int, netns: str | None = None) -> bool:
    """Set `key` to `value` unless it already is (kube-proxy's EnsureSysctl); True when written."""
    with _inside(netns):
        with open(_path(key)) as f:
            if f.read().strip() == str(value):
                return False
        with open(_path(key), "w") as f:
            f.write(f"{value}\n")
    return True

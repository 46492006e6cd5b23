"""Which capabilities this process holds, for commands that program the kernel.

A node image runs nfproxy as an unprivileged user with exactly CAP_NET_ADMIN and CAP_NET_RAW
(ambient), so "am I root" is the wrong question: the kernel checks capabilities, and so do we.
"""

from __future__ import annotations

from pathlib import Path

CAP_NET_ADMIN = 12
CAP_NET_RAW = 13
CAP_SYS_ADMIN = 21
"""setns(2) into a named network namespace (`--netns`) needs it."""


def effective(status: str | None = None) -> int:
    """The effective capability mask, from /proc/self/status (or the text given)."""
    text = status if status is not None else Path("/proc/self/status").read_text()
    for line in text.splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return 0


def missing(*caps: int, status: str | None = None) -> list[str]:
    """The names of the capabilities asked for that this process lacks."""
    mask = effective(status)
    names = {CAP_NET_ADMIN: "CAP_NET_ADMIN", CAP_NET_RAW: "CAP_NET_RAW", CAP_SYS_ADMIN: "CAP_SYS_ADMIN"}
    return [names.get(c, str(c)) for c in caps if not mask >> c & 1]

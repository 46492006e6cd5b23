"""Running the kernel tools (iptables-restore, nft, ...) in the right network namespace.

Every external command nfproxy runs goes through `run`, so there is one place that decides how
a namespace is entered and how a tool's failure becomes a `KernelError` with its stderr.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence

# Debian puts the netfilter tools in /usr/sbin, which a non-login root shell may not have.
_SBIN = ("/usr/sbin", "/sbin")


class KernelError(RuntimeError):
    """A kernel update or read-back failed; the message carries the tool's own error text."""


def find_tool(name: str) -> str:
    path = shutil.which(name) or shutil.which(
        name, path=os.pathsep.join([os.environ.get("PATH", ""), *_SBIN])
    )
    if path is None:
        raise KernelError(f"{name} not found: install the Debian package that provides it")
    return path


def netns_argv(netns: str | None) -> list[str]:
    return [] if netns is None else [find_tool("ip"), "netns", "exec", netns]


def run(
    argv: Sequence[str],
    *,
    netns: str | None = None,
    stdin: str | None = None,
    timeout: float = 600.0,
) -> str:
    """Run a tool (inside `netns` when given) and return its stdout, or raise KernelError."""
    full = [*netns_argv(netns), find_tool(argv[0]), *argv[1:]]
    try:
        proc = subprocess.run(
            full, input=stdin, capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise KernelError(f"{argv[0]} timed out after {timeout:.0f}s") from exc
    if proc.returncode != 0:
        where = f" in netns {netns}" if netns else ""
        detail = (proc.stderr or proc.stdout).strip()
        raise KernelError(f"{argv[0]}{where} failed (exit {proc.returncode}): {detail}")
    return proc.stdout

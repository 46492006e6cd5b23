"""Running the kernel tools (iptables-restore, nft, ...) in the right network namespace.

Every external command nfproxy runs goes through `run` (or `lines`, for output read as it is
written), so there is one place that decides how a namespace is entered and how a tool's
failure becomes a `KernelError` with its stderr.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterable, Iterator, Sequence

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


def feed(argv: Sequence[str], pieces: Iterable[str], *, netns: str | None = None, timeout: float = 600.0) -> None:
    """Run a tool with `pieces` written to its stdin as they come, or raise KernelError.

    `run(stdin=text)` encodes the whole text first: for a 32 MB iptables-restore payload that is
    a second 32 MB copy beside the text, held while the restore builds its own few hundred MiB.
    Here each piece is encoded and written on its own (callers hand ~1 MiB slices). The tool's
    output goes to a temporary file, so that it cannot block on a pipe nobody reads."""
    full = [*netns_argv(netns), find_tool(argv[0]), *argv[1:]]
    with tempfile.TemporaryFile() as out, subprocess.Popen(full, stdin=subprocess.PIPE, stdout=out, stderr=out) as proc:
        assert proc.stdin is not None
        try:
            for piece in pieces:
                proc.stdin.write(piece.encode())
        except BrokenPipeError:
            pass  # the tool stopped reading: its exit status and output say why
        finally:
            try:
                proc.stdin.close()
            except BrokenPipeError:
                pass
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise KernelError(f"{argv[0]} timed out after {timeout:.0f}s") from None
        if code != 0:
            out.seek(0)
            where = f" in netns {netns}" if netns else ""
            detail = out.read().decode(errors="replace").strip()
            raise KernelError(f"{argv[0]}{where} failed (exit {code}): {detail}")


def slices(text: str, start: int = 0, stop: int | None = None, size: int = 1 << 20) -> Iterator[str]:
    """text[start:stop] in pieces of `size` characters, without a copy of the whole."""
    end = len(text) if stop is None else stop
    for at in range(start, end, size):
        yield text[at: min(at + size, end)]


def lines(argv: Sequence[str], *, netns: str | None = None, timeout: float = 600.0) -> Iterator[str]:
    """A tool's stdout line by line, as it writes it (`iptables-save` of 10 000 services writes
    for half a second, which the reader can spend parsing). After the last line, a KernelError
    if the tool failed; killed after `timeout` seconds, as `run` would. Its stderr goes to a
    temporary file, so that a chatty tool cannot block on a pipe nobody reads."""
    full = [*netns_argv(netns), find_tool(argv[0]), *argv[1:]]
    timed_out = threading.Event()
    with tempfile.TemporaryFile() as err, subprocess.Popen(full, stdout=subprocess.PIPE, stderr=err, text=True) as proc:
        assert proc.stdout is not None

        def kill() -> None:
            timed_out.set()
            proc.kill()

        watchdog = threading.Timer(timeout, kill)
        watchdog.daemon = True
        watchdog.start()
        try:
            yield from proc.stdout
            code = proc.wait()
        finally:
            watchdog.cancel()
        err.seek(0)
        detail = err.read().decode(errors="replace").strip()
    if timed_out.is_set():
        raise KernelError(f"{argv[0]} timed out after {timeout:.0f}s")
    if code != 0:
        where = f" in netns {netns}" if netns else ""
        raise KernelError(f"{argv[0]}{where} failed (exit {code}): {detail}")

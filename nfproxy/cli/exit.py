"""Ending a command that holds a large heap, without freeing it object by object.

`nfproxy check` at 10 000 services x 10 ends holding the parsed ruleset and its walks, about
450 MiB of small objects; CPython frees them one at a time when the last frame lets go (0.5 s
of a 10 s command, measured in docs/benchmarks.md). A command that is done with such objects
hands them to `hold`; the process's entry point (`entry`) then flushes the output and leaves
with `os._exit`, as mypy does for the same reason. Called in-process (`main`, as the tests
do), nothing exits: `hold` keeps only the last command's objects, and `entry` is not used.

Only commands that register no atexit work of their own hold objects (check, compare, trace);
the lab's sandbox registers namespace removal at exit and must go the ordinary way.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

_held: list[object] = []


def hold(*objects: object) -> None:
    """Keep `objects` alive until the process ends, so that `entry` can skip freeing them."""
    _held[:] = objects


def entry() -> None:
    """The `nfproxy` console script and `python -m nfproxy`."""
    from nfproxy.cli.main import main

    status = main()
    if not _held:
        sys.exit(status)
    logging.shutdown()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BrokenPipeError:  # the reader went away after the last write: as main() says it
        status = 128 + signal.SIGPIPE
    os._exit(status)

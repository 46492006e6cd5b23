"""The daemon's open-file limit, raised as Go programs raise theirs.

Go (since 1.19) lifts the soft RLIMIT_NOFILE to the hard limit when a program starts, so
kube-proxy under systemd's soft 1 024 can still hold thousands of probe connections, watch
streams and netlink sockets. A Python daemon keeps the soft limit it inherited: a thousand idle
connections to the healthz port were enough to make every listing and namespace open fail with
EMFILE. The daemon does what kube-proxy's runtime does; commands keep the limit they are given.
"""

from __future__ import annotations

import logging
import resource

log = logging.getLogger(__name__)


def raise_open_file_limit() -> int:
    """Set the soft open-file limit to the hard one; returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft >= hard:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as exc:  # a sandbox may refuse it: keep going as we are
        log.debug("open-file limit stays %d: %s", soft, exc)
        return soft
    log.debug("open-file limit raised from %d to %d", soft, hard)
    return hard

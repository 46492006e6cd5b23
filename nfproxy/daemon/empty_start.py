"""A first empty state, held while the kernel still serves services from before.

A restarted daemon believes nothing: its first sync makes the kernel what the source says. A
source that says "no Service at all" then (an API server listing none, not even
default/kubernetes: a restored-empty etcd, the wrong server) would remove every rule the node
serves from, silently. Sources hold an empty state that follows a non-empty one
(`--empty-source-grace`); at start there is none before it but the kernel's. So the sync loop
holds the first sync of an empty state for the same grace while the kernel holds service
chains, says so at WARNING, and counts a source error; a state with services ends the hold, and
the end of the grace applies the empty state as asked. kube-proxy has no such hold.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from nfproxy.core.model import ClusterState

log = logging.getLogger("nfproxy.daemon")


@dataclass(slots=True)
class EmptyStartHold:
    """Armed until the first successful sync (`done`); `held` is asked before each attempt."""

    grace: float
    since: float | None = None
    done: bool = False

    def held(self, state: ClusterState, now: float, service_chains: Callable[[], int]) -> bool:
        """True while the first sync of `state` must wait. `service_chains` (read once, when
        an empty state first shows) counts the per-service chains the kernel holds."""
        if self.done or state.services or self.grace <= 0:
            return False
        if self.since is None:
            held = service_chains()
            if not held:
                self.done = True  # nothing to lose: a fresh node
                return False
            self.since = now
            log.warning(
                "The source lists no service at all, while the kernel holds %d service chains from "
                "before this start: keeping them for %gs (--empty-source-grace) in case it is wrong",
                held, self.grace,
            )
            return True
        if now - self.since < self.grace:
            return True
        log.warning("The source has listed no service for %.0fs since start: removing every service", now - self.since)
        self.done = True
        return False

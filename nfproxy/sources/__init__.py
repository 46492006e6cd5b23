"""Sources produce model state; they never touch the kernel.

Every source (manifest files, the Kubernetes API) offers the same small interface, so the
proxier's sync loop does not care where services come from: it is told *that* something changed
and later asks for the state as it is *now*. Coalescing many changes into one sync is the
loop's job (bounded frequency), not the source's.

A source may also carry `on_error: list[Callable[[str], None]]`: hooks it calls with its name
("manifests", "api") each time it holds back input it does not trust (a bad file, an empty
state) instead of applying it; the daemon counts them in `nfproxy_source_errors_total`.

A source may also offer `snapshot_changes() -> (LoadResult, core.changes.Touched)`: the snapshot
with the service-port keys that may differ from the snapshot the previous call returned (only
the sync loop calls it; `snapshot()` leaves the count alone). The proxier then checks just those
keys instead of diffing the whole state (kube-proxy's change trackers).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from nfproxy.sources.manifests import LoadResult


class Source(Protocol):
    def start(self, notify: Callable[[], None]) -> None:
        """Begin watching in the background; call `notify()` (from any thread) after a change.

        `notify` must be cheap and non-blocking; it may be called many times per sync.
        """

    def snapshot(self) -> LoadResult:
        """The whole current state, plus the objects that were rejected (with reasons)."""

    def ready(self) -> bool:
        """True once the first complete state is known (before that, syncing would wipe rules)."""

    def stop(self) -> None:
        """Stop watching; idempotent."""

"""A Source over manifest files: re-read when any file under the path changes.

Polling a signature (path, size, mtime of every manifest file) is what works everywhere —
bind-mounted ConfigMaps replace files through symlink swaps that inotify watchers miss — and
costs microseconds per poll for the handful of files a node is given.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

from nfproxy.core.model import ClusterState, NodeConfig
from nfproxy.sources.manifests import LoadResult, ManifestError, load, manifest_files

log = logging.getLogger("nfproxy.sources.files")

Signature = tuple[tuple[str, int, int], ...]


def _signature(root: Path) -> Signature:
    """(path, size, mtime) of the files `manifests.load` would read (stat follows the symlinks
    a ConfigMap volume swaps on update)."""
    out = []
    for path in [root] if root.is_file() else manifest_files(root):
        try:
            st = path.stat()
        except FileNotFoundError:
            continue
        out.append((str(path), st.st_size, st.st_mtime_ns))
    return tuple(out)


class ManifestSource:
    """Watches a file or directory of manifests; every change re-reads the whole tree.

    A tree that cannot be read at all (missing path, unreadable file) keeps the last good state
    and logs why: a half-written file must not wipe a node's rules. Objects that fail
    validation are reported through `snapshot().errors` and skipped, as everywhere else.
    """

    def __init__(self, path: str | os.PathLike[str], node: NodeConfig | None = None, *, poll: float = 1.0) -> None:
        self.path = Path(path)
        self.node = node
        self.poll = poll
        self._lock = threading.Lock()
        self._result: LoadResult | None = None
        self._signature: Signature | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._reload()

    def _reload(self) -> bool:
        try:
            sig = _signature(self.path)
        except OSError as exc:
            log.error("cannot read manifests at %s: %s (keeping the last good state)", self.path, exc)
            return False
        if sig == self._signature:
            return False
        try:
            result = load(self.path, node=self.node)
        except ManifestError as exc:
            log.error("%s (keeping the last good state)", exc)
            self._signature = sig
            return False
        for err in result.errors:
            log.warning("skipped: %s", err)
        with self._lock:
            self._result = result
            self._signature = sig
        return True

    def start(self, notify: Callable[[], None]) -> None:
        def watch() -> None:
            while not self._stop.wait(self.poll):
                if self._reload():
                    notify()

        self._thread = threading.Thread(target=watch, name="nfproxy-manifests", daemon=True)
        self._thread.start()

    def snapshot(self) -> LoadResult:
        with self._lock:
            if self._result is None:
                return LoadResult(ClusterState(node=self.node or NodeConfig()), ())
            return self._result

    def ready(self) -> bool:
        with self._lock:
            return self._result is not None

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

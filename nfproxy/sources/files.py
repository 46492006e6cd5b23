"""A Source over manifest files: re-read a file when its (device, inode, size, mtime) changes.

Polling a signature per file is what works everywhere — bind-mounted ConfigMaps replace files
through symlink swaps that inotify watchers miss — and costs microseconds per poll for the
handful of files a node is given. The watcher also listens to inotify (inotify_simple) on the
directories it reads, because polling alone cannot keep up with a file that keeps changing: a
file rewritten every 0.2 s never holds still for a 1 s poll (issue R.4: gaps of 11-24 s between
syncs, and none at all for a faster writer).

A node proxy must never drop live services because a file was half-written, truncated by a
config-management tool or replaced by garbage, so the source distrusts every *loss*:

- a file is read when it is known whole: at once when inotify says a writer closed it
  (IN_CLOSE_WRITE) or it was moved into place (IN_MOVED_TO, also a ConfigMap's `..data`
  swap), unless a write came after that; otherwise once its signature has held still for one
  poll and inotify does not say a writer is at it (written, not closed since), so a file
  written in place is not taken for its first part; and a file that keeps changing for
  MAX_WAIT seconds is read at a moment it held still for SETTLE seconds. Every read is
  dropped when the file changed while it was read (signature, or any inotify event);

- per file: a file that is empty (no object at all), unreadable, unparsable, not a regular file,
  a symlink loop or over the size cap keeps the objects it last held, with a WARNING naming it
  and a count in `on_error` (the daemon's `nfproxy_source_errors_total{source="manifests"}`).
  A file that is *deleted* (and still gone one poll later, its directory still there) is a
  deliberate removal: its objects go. A directory that cannot be listed (no permission, no file
  descriptor left) says nothing about its files: each keeps its objects.
- per file, again: a file that reads with a new problem in its objects (a line cut off inside
  an object, an edit that broke one, something else written over it) and loses or changes
  objects it held keeps its last good objects too; a valid file that holds fewer objects (cut
  between two of them) cannot be told from an edit and is used, with an INFO line naming what
  it no longer holds.
- for the whole source: a state with no service at all, after one with services, is applied only
  once it has stayed so for `empty_grace` seconds; a path that vanished (the directory removed,
  the one file deleted) is never taken to mean "no services": the last state stays until it
  returns.

Objects that fail validation inside a readable file are reported through `snapshot().errors` and
skipped, as everywhere else.

Change tracking (`snapshot_changes`): the state is rebuilt from every good file, but only the
Services whose objects differ (per file, then per object: a Service by its name, an
EndpointSlice by the Service it is labelled for, and any other slice of the same name, which
the duplicate check couples to it) are reported as touched, so the proxier checks their keys
and no others.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from nfproxy.core.changes import Touched
from nfproxy.core.model import ClusterState, NodeConfig, ServicePortKey
from nfproxy.sources.manifests import (
    DEFAULT_MAX_BYTES,
    FileProblem,
    LoadResult,
    ManifestFile,
    ObjectError,
    build,
    list_manifests,
    read_manifest,
)

log = logging.getLogger("nfproxy.sources.files")

SOURCE_NAME = "manifests"

# A file still changing after this long is read at a moment it holds still for SETTLE (a full
# look happens every poll, so the wait is MAX_WAIT plus at most one poll).
MAX_WAIT = 2.0
SETTLE = 0.05
SETTLE_TRIES = 10

# (st_dev, st_ino, st_size, st_mtime_ns, st_mode) through symlinks; None when stat fails.
FileSignature = tuple[int, int, int, int, int] | None


def _file_signature(path: Path) -> FileSignature:
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_mode)


# (kind, namespace, name) of a Service or EndpointSlice; a Service's (namespace, name).
ObjectIdentity = tuple[str, str, str]
ServiceName = tuple[str, str]


def _problem_key(err: ObjectError) -> tuple[str, str, str, str, str]:
    """An object problem without its line: the same problem after lines moved is not new."""
    return (err.kind, err.namespace, err.name, err.field, err.message)


def _listed(identities: set[ObjectIdentity], limit: int = 5) -> str:
    """`Service ns/a, EndpointSlice ns/a-1 and 3 more`, for a log line."""
    names = [f"{kind} {namespace}/{name}" for kind, namespace, name in sorted(identities)]
    more = len(names) - limit
    return ", ".join(names[:limit]) + (f" and {more} more" if more > 0 else "")


def _identities(contents: ManifestFile | None) -> dict[ObjectIdentity, list[Any]]:
    """What each Service and EndpointSlice of the file parsed to, by identity (as manifests
    reads them: a null namespace is `default`). Invalid objects and objects left to another
    proxy add no state, so they are absent here: an object turning invalid is a change. Where
    an object sits in the file is left out: moving it changes nothing."""
    out: dict[ObjectIdentity, list[Any]] = {}
    for parsed in contents.parsed if contents is not None else ():
        if isinstance(parsed, ObjectError) or parsed.kind not in ("Service", "EndpointSlice"):
            continue
        namespace, name = parsed.identity
        out.setdefault((parsed.kind, namespace, name), []).append(parsed.value)
    return out


def _service_of(identity: ObjectIdentity, value: Any) -> ServiceName:
    """The Service an object's state belongs to: its own name, or a slice's service label."""
    kind, namespace, name = identity
    return (namespace, name) if kind == "Service" else (namespace, value.service)


def _keys_by_service(state: ClusterState) -> dict[ServiceName, list[ServicePortKey]]:
    out: dict[ServiceName, list[ServicePortKey]] = {}
    for key in state.services:
        out.setdefault((key[0].namespace, key[0].name), []).append(key)
    return out


class _Events:
    """inotify on the directories the source reads: which files a writer closed or moved into
    place (whole, unless written again since), and a count of events per file, so a read that
    a write overlapped is known even when the signature cannot tell (same size, same tick).

    Used by the watcher thread only; `wake` (from `stop`) is the one call from another thread.
    """

    def __init__(self, inotify: Any, flags: Any) -> None:
        self._inotify = inotify
        self._flags = flags
        self._mask = (flags.CLOSE_WRITE | flags.MOVED_TO | flags.MODIFY | flags.CREATE
                      | flags.DELETE | flags.MOVED_FROM)
        self._dirs: dict[int, Path] = {}
        self._watched: set[Path] = set()
        self._generation: dict[Path, int] = {}
        self._closed: set[Path] = set()
        self._moved: set[Path] = set()
        self._writing: set[Path] = set()  # written, and not closed (nor moved, nor gone) since
        self._wake_r, self._wake_w = os.pipe()
        self._failed = False

    @classmethod
    def open(cls, path: Path) -> _Events | None:
        """None where inotify cannot be had (the watcher then polls only, as before)."""
        try:
            from inotify_simple import INotify, flags

            return cls(INotify(), flags)
        except (ImportError, OSError) as exc:
            log.warning("%s: inotify unavailable (%s): changes are found by polling only", path, exc)
            return None

    def watch(self, directories: set[Path]) -> None:
        for directory in directories - self._watched:
            try:
                wd = self._inotify.add_watch(directory, self._mask)
            except OSError as exc:  # gone meanwhile, or out of watches: the poll still sees it
                if not self._failed:
                    self._failed = True
                    log.warning("%s: cannot watch with inotify (%s): changes below it are found by polling", directory, exc)
                continue
            self._dirs[wd] = directory
            self._watched.add(directory)

    def wait(self, timeout: float) -> Callable[[Path], bool] | None:
        """Block until a file is known whole (its predicate), or for `timeout` (None)."""
        deadline = time.monotonic() + timeout
        poller = select.poll()  # not select(): the daemon may hold more than 1 024 descriptors
        poller.register(self._inotify.fileno(), select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        while not self._closed and not self._moved:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready = {fd for fd, _ in poller.poll(left * 1000)}
            if self._wake_r in ready:
                os.read(self._wake_r, 64)
                return None
            self._drain()
        return self.take()

    def take(self) -> Callable[[Path], bool] | None:
        """The files known whole since the last take, as a predicate (None: none)."""
        self._drain()
        closed, moved, self._closed, self._moved = self._closed, self._moved, set(), set()
        # Counts matter only within one read (see `generation`): forgetting them here keeps
        # the editors' and tools' temporary names from piling up over the daemon's life.
        self._generation.clear()
        if not closed and not moved:
            return None
        swapped = [Path(os.path.realpath(m)) for m in moved]

        def whole(path: Path) -> bool:
            if path in closed or path in moved:
                return True
            real = Path(os.path.realpath(path))
            return any(real.is_relative_to(m) for m in swapped)

        return whole

    def generation(self, path: Path) -> int:
        """How many events `path` has had since the last `take` (read now): equal before and
        after a read, nothing wrote to it meanwhile."""
        self._drain()
        return self._generation.get(path, 0)

    def writing(self, path: Path) -> bool:
        """Whether a writer is at `path` now: written to, and not closed since."""
        self._drain()
        return path in self._writing

    def _drain(self) -> None:
        for event in self._inotify.read(timeout=0):
            directory = self._dirs.get(event.wd)
            if event.mask & self._flags.IGNORED and directory is not None:
                del self._dirs[event.wd]
                self._watched.discard(directory)
                continue
            if directory is None:
                continue  # overflow (the poll still looks) or an old watch
            path = directory / event.name if event.name else directory
            self._generation[path] = self._generation.get(path, 0) + 1
            if event.mask & (self._flags.CLOSE_WRITE | self._flags.MOVED_TO):
                self._closed.add(path)
            else:
                self._closed.discard(path)
            if event.mask & self._flags.MODIFY:  # not CREATE: a symlink or FIFO is never closed
                self._writing.add(path)
            else:
                self._writing.discard(path)
            if event.mask & self._flags.MOVED_TO:
                self._moved.add(path)

    def wake(self) -> None:
        with contextlib.suppress(OSError):  # closed meanwhile: nothing left to wake
            os.write(self._wake_w, b"x")

    def close(self) -> None:
        for close in (self._inotify.close, lambda: os.close(self._wake_r), lambda: os.close(self._wake_w)):
            with contextlib.suppress(OSError):
                close()


@dataclass(frozen=True, slots=True)
class _Seen:
    """What the last read of one file gave: its contents, or why they could not be used."""

    signature: FileSignature
    contents: ManifestFile | None
    problem: ObjectError | None = None
    # No object at all in a readable file: a problem only when it had objects before.
    empty: bool = False


class ManifestSource:
    """Watches a file or directory of manifests (see the module docstring for what is trusted)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        node: NodeConfig | None = None,
        *,
        poll: float = 1.0,
        empty_grace: float = 30.0,
        max_bytes: int = DEFAULT_MAX_BYTES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = Path(path)
        self.node = node
        self.poll = poll
        self.empty_grace = empty_grace
        self.max_bytes = max_bytes
        self._clock = clock
        # Called with SOURCE_NAME once per newly seen problem (the daemon counts them).
        self.on_error: list[Callable[[str], None]] = []
        self._lock = threading.Lock()
        self._polled = threading.Condition()
        self._polls = 0
        self._result: LoadResult | None = None
        self._seen: dict[Path, _Seen] = {}
        self._good: dict[Path, ManifestFile] = {}  # last good contents per file
        self._settling: dict[Path, FileSignature] = {}  # changed files waiting to hold still
        self._changing_since: dict[Path, float] = {}  # when a file not read yet first changed
        self._events: _Events | None = None  # inotify, once the watcher runs
        self._missing: set[Path] = set()  # good files gone since the last poll
        self._problem_view: dict[str, str] = {}
        self._object_errors: tuple[ObjectError, ...] = ()
        self._vanished = False
        self._unlisted: dict[Path, str] = {}  # directories that cannot be listed now, and why
        self._empty_since: float | None = None
        # Change tracking: identities per good file; Services touched since the state last
        # applied (None: unknown); keys touched since the last `snapshot_changes` (None:
        # unknown) and the state it returned.
        self._identities: dict[Path, dict[ObjectIdentity, list[Any]]] = {}
        self._touched_services: set[ServiceName] | None = None
        self._keys: dict[ServiceName, list[ServicePortKey]] = {}
        self._pending: set[ServicePortKey] | None = None
        self._taken: ClusterState | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.rescan()

    # ---- reading

    def _error(self, message: str, *args: object) -> None:
        log.warning(message, *args)
        for hook in self.on_error:
            hook(SOURCE_NAME)

    def _listing(self) -> list[Path] | None:
        """The files to read, or None when the path itself is gone (or cannot be looked at)."""
        try:
            is_dir = self.path.is_dir()
            os.stat(self.path)
        except OSError as exc:
            if not self._vanished:
                self._vanished = True
                self._empty_since = None
                self._error(
                    "%s: %s: keeping the last good state until it returns",
                    self.path,
                    "vanished" if isinstance(exc, FileNotFoundError) else exc.strerror,
                )
            return None
        listing = list_manifests(self.path) if is_dir else None
        if is_dir and not self.path.is_dir():
            return self._listing()  # removed while walking: judge it on the next look
        if self._vanished:
            self._vanished = False
            log.info("%s is back", self.path)
        if listing is None:
            return [self.path]
        return self._with_unlisted(list(listing.files), dict(listing.unlisted))

    def _with_unlisted(self, files: list[Path], unlisted: dict[Path, str]) -> list[Path]:
        """`files`, plus the files seen before below a directory that could not be listed now
        (no permission, no file descriptor left): they are looked at one by one as before, so
        they keep their objects (or say why they cannot be read) instead of being taken for
        deleted."""
        for where, why in unlisted.items():
            if where not in self._unlisted:
                self._error("%s: %s; keeping the last good objects of the files below it", where, why)
        for where in self._unlisted.keys() - unlisted.keys():
            log.info("%s can be listed again", where)
        self._unlisted = unlisted
        if not unlisted:
            return files
        listed = set(files)
        for path in self._seen:
            if path not in listed and any(path.is_relative_to(where) for where in unlisted):
                files.append(path)
        return sorted(files)

    def _read(self, path: Path, signature: FileSignature) -> _Seen:
        try:
            contents = read_manifest(path, self.max_bytes)
        except FileProblem as exc:
            return _Seen(signature, None, exc.error())
        if contents.objects == 0:
            return _Seen(signature, None, ObjectError("", "", "", "", "holds no Kubernetes object", str(path)), True)
        return _Seen(signature, contents)

    def _refresh(self, files: list[Path], whole: Callable[[Path], bool] | None = None) -> bool:
        """Read the files whose signature changed; True when the set of good contents changed.

        `whole` (an inotify look): only the files it says a writer closed or moved into place
        are read, at once; deletions and the files still settling wait for the next full look,
        so looks made more often by events never shorten a poll."""
        if whole is not None:
            return any([self._consider(path, True) for path in files if whole(path)])
        changed = self._forget_gone(files)
        return any([self._consider(path, False) for path in files]) or changed

    def _forget_gone(self, files: list[Path]) -> bool:
        changed = False
        listed = set(files)
        for path in [p for p in self._settling if p not in listed]:
            del self._settling[path]
            self._changing_since.pop(path, None)
        for path in [p for p in self._seen if p not in listed]:
            if path in self._good and path not in self._missing:
                # Gone since the last poll: `rm -rf` unlinks the files before the directory,
                # so wait one poll to tell a removed file from a directory being removed.
                self._missing.add(path)
                continue
            self._missing.discard(path)
            del self._seen[path]
            if self._good.pop(path, None) is not None:
                log.info("%s was removed: its objects go", path)
                self._note(path, None)
                changed = True
        self._missing -= listed  # back again
        return changed

    def _consider(self, path: Path, whole: bool) -> bool:
        """Read `path` if it changed and is known whole (see the module docstring)."""
        signature = _file_signature(path)
        previous = self._seen.get(path)
        if previous is not None and previous.signature == signature:
            self._changing_since.pop(path, None)
            return False
        forced = False
        if not whole and self._result is not None and self._settling.get(path) != signature:
            forced, signature = self._held_still_after_wait(path, signature)
            if not forced:
                return False
        self._settling.pop(path, None)
        return self._take(path, signature, previous, forced)

    def _held_still_after_wait(self, path: Path, signature: FileSignature) -> tuple[bool, FileSignature]:
        """Changed since the last poll: wait for it to hold still one poll (False), unless it
        has been changing for MAX_WAIT: then True and its signature once it holds still for
        SETTLE (looked for during up to SETTLE_TRIES x SETTLE, then again at the next poll)."""
        now = self._clock()
        since = self._changing_since.setdefault(path, now)
        self._settling[path] = signature
        if now - since < MAX_WAIT:
            return False, signature
        for _ in range(SETTLE_TRIES):
            time.sleep(SETTLE)
            current = _file_signature(path)
            if current == signature:
                log.info("%s has been changing for %.1fs: read while it held still", path, now - since)
                return True, signature
            signature = current
        return False, signature

    def _take(self, path: Path, signature: FileSignature, previous: _Seen | None, forced: bool = False) -> bool:
        """Read and use (or keep out) `path`; a read the file changed under is dropped, and so
        is one of a file inotify says a writer is at (written, not closed since), unless it
        has been changing for MAX_WAIT (`forced`)."""
        if self._events is not None and not forced and self._events.writing(path):
            return False  # its close brings it, or MAX_WAIT does
        generation = self._events.generation(path) if self._events is not None else 0
        seen = self._read(path, signature)
        if _file_signature(path) != signature:
            return False  # written while we read: look again at the next poll
        if self._events is not None and self._events.generation(path) != generation:
            return False  # written while we read, within the signature's resolution
        self._changing_since.pop(path, None)
        seen = self._distrusted(path, seen)
        self._seen[path] = seen
        if seen.contents is not None:
            if previous is not None and previous.problem is not None:
                log.info("%s can be used again", path)
            if self._good.get(path) != seen.contents:
                self._good[path] = seen.contents
                self._note(path, seen.contents)
                return True
            return False
        assert seen.problem is not None
        kept = self._good.get(path)
        if kept is not None:
            self._error("%s; keeping its last good %d objects", seen.problem, kept.objects)
        elif seen.empty:
            log.info("%s", seen.problem)
        else:
            self._error("%s", seen.problem)
        return False

    def _distrusted(self, path: Path, seen: _Seen) -> _Seen:
        """`seen` as a problem when the file has new invalid objects and loses or changes some
        it held: a file cut off inside an object, overwritten by something else, or an edit
        that broke an object (a Service whose only port turned invalid would otherwise go).
        Which of its objects the invalid ones were meant to be cannot be known, so the file
        keeps its last good objects until it reads without new problems. Problems it already
        had when it was last used do not hold up edits of its other objects."""
        kept, contents = self._good.get(path), seen.contents
        if kept is None or contents is None:
            return seen
        known = {_problem_key(p) for p in kept.parsed if isinstance(p, ObjectError)}
        new = [p for p in contents.parsed if isinstance(p, ObjectError) and _problem_key(p) not in known]
        if not new:
            return seen
        before, after = self._identities.get(path, {}), _identities(contents)
        hit = {i for i, values in before.items() if after.get(i) != values}
        if not hit:
            return seen
        for err in new:
            log.warning("skipped: %s", err)
        n, lost = len(new), hit - after.keys()
        what = f"{_listed(lost)} it held {'are' if len(lost) > 1 else 'is'} gone" if lost else (
            f"{_listed(hit)} it held {'are' if len(hit) > 1 else 'is'} changed"
        )
        problem = ObjectError("", "", "", "", f"{n} new problem{'s' if n > 1 else ''} in its objects, and {what}", str(path))
        return _Seen(seen.signature, None, problem)

    def _note(self, path: Path, contents: ManifestFile | None) -> None:
        """Record the Services whose objects differ between the file's last good contents and
        `contents` (None: the file is gone)."""
        before = self._identities.pop(path, {})
        after = _identities(contents)
        if contents is not None:
            self._identities[path] = after
            if gone := before.keys() - after.keys():
                log.info("%s no longer holds %s", path, _listed(gone))
        touched = self._touched_services
        if touched is None:
            return
        for identity in before.keys() | after.keys():
            old, new = before.get(identity, []), after.get(identity, [])
            if old == new:
                continue
            coupled = [old, new]
            if identity[0] == "EndpointSlice":
                # A duplicate slice name in another file: which one wins may change too.
                coupled += [ids[identity] for ids in self._identities.values() if identity in ids]
            for value in (v for values in coupled for v in values):
                touched.add(_service_of(identity, value))

    def _applied(self, state: ClusterState) -> None:
        """`state` replaces the last applied one: turn the touched Services into keys."""
        keys = _keys_by_service(state)
        touched, self._touched_services = self._touched_services, set()
        if touched is None or self._pending is None:
            self._pending = None
        else:
            for service in touched:
                self._pending.update(self._keys.get(service, ()))
                self._pending.update(keys.get(service, ()))
        self._keys = keys

    def _problems(self) -> tuple[ObjectError, ...]:
        """File-level problems that matter (an empty file that never held anything does not)."""
        out = [
            ObjectError("", "", "", "", f"{why}; the last good objects of its files are kept", str(where))
            for where, why in sorted(self._unlisted.items())
        ]
        for path, seen in sorted(self._seen.items()):
            if seen.problem is None or (seen.empty and path not in self._good):
                continue
            kept = "; its last good objects are kept" if path in self._good else ""
            out.append(replace(seen.problem, message=seen.problem.message + kept))
        return tuple(out)

    def rescan(self) -> bool:
        """Look at the files once (the watcher does every `poll` seconds); True when the state
        to sync changed."""
        return self._rescan(None)

    def _rescan(self, whole: Callable[[Path], bool] | None) -> bool:
        """A look; with `whole`, at once and only at the files inotify saw closed or moved into
        place (see `_refresh`)."""
        files = self._listing()
        if files is None:
            with self._lock:
                self._problem_view = {str(self.path): "vanished: the last good state is kept"}
            return False
        if self._events is not None:
            self._events.watch(self._directories(files))
        changed = self._refresh(files, whole)
        problems = self._problems()
        with self._lock:
            self._problem_view = {e.source: e.message for e in problems}
            if self._result is not None:
                # Same state (no sync needed), today's file problems.
                self._result = LoadResult(self._result.state, problems + self._object_errors)
        if not changed and self._empty_since is None:
            return False
        result = build(sorted(self._good.values(), key=lambda f: f.path), self.node)
        if changed:  # not again on every poll of an empty spell
            for err in result.errors:
                log.warning("skipped: %s", err)
        object_errors = result.errors
        result = LoadResult(result.state, problems + object_errors)
        if self._held_empty(result):
            return False
        with self._lock:
            if self._result is None and not self._good:
                return False  # nothing good read yet: not ready, so the kernel is left alone
            self._applied(result.state)
            self._result = result
            self._object_errors = object_errors
        return True

    def _held_empty(self, result: LoadResult) -> bool:
        """True while a state without services waits out `empty_grace` after one with services."""
        with self._lock:
            before = self._result
        if result.state.services or before is None or not before.state.services:
            if self._empty_since is not None:
                log.info("%s has services again: the empty state was never applied", self.path)
            self._empty_since = None
            return False
        now = self._clock()
        if self._empty_since is None:
            self._empty_since = now
            self._error(
                "%s now holds no service at all: applying that only if it stays so for %gs",
                self.path,
                self.empty_grace,
            )
        if now - self._empty_since < self.empty_grace:
            return True
        log.warning("%s has held no service for %gs: removing every service", self.path, self.empty_grace)
        self._empty_since = None
        return False

    def _directories(self, files: list[Path]) -> set[Path]:
        """Where inotify must listen: the path's directory (or the file's), and every
        directory holding a file read."""
        root = self.path if self.path.is_dir() else self.path.parent
        return {root, *(f.parent for f in files)}

    # ---- the Source interface

    def start(self, notify: Callable[[], None]) -> None:
        self._events = _Events.open(self.path)
        if self._events is not None:
            self._events.watch(self._directories(list(self._seen)))
        self._thread = threading.Thread(target=self._watch, args=(notify,), name="nfproxy-manifests", daemon=True)
        self._thread.start()

    def _watch(self, notify: Callable[[], None]) -> None:
        """A full look every `poll` seconds; between them, a look at once at the files inotify
        saw closed or moved into place."""
        failed: list[str | None] = [None]
        due = time.monotonic() + self.poll
        while not self._stop.is_set():
            left = due - time.monotonic()
            if left > 0:
                whole = self._wait_events(left)
                if whole is not None and not self._stop.is_set() and self._look(whole, failed):
                    notify()
                continue
            due = time.monotonic() + self.poll
            whole = self._wait_events(0)
            changed = whole is not None and self._look(whole, failed)
            if self._look(None, failed) or changed:
                notify()
            with self._polled:
                self._polls += 1
                self._polled.notify_all()

    def _wait_events(self, timeout: float) -> Callable[[Path], bool] | None:
        """The files inotify saw made whole, waiting up to `timeout`; without inotify (or once
        it failed: the polling goes on without it) a plain wait."""
        if self._events is not None:
            try:
                return self._events.wait(timeout) if timeout > 0 else self._events.take()
            except Exception as exc:  # noqa: BLE001 - the watcher must outlive inotify
                self._error("%s: inotify failed (%s: %s): changes are found by polling only",
                            self.path, type(exc).__name__, exc)
                events, self._events = self._events, None
                events.close()
        self._stop.wait(timeout)
        return None

    def _look(self, whole: Callable[[Path], bool] | None, failed: list[str | None]) -> bool:
        """`rescan`, outliving any failure: a bug reading some input must not end the watcher;
        the last state stays (nothing is applied from this look) and the next one tries again."""
        try:
            changed = self.rescan() if whole is None else self._rescan(whole)
        except Exception as exc:  # noqa: BLE001 - the watcher must outlive any one file
            if repr(exc) != failed[0]:
                failed[0] = repr(exc)
                self._error("%s: reading the manifests failed (%s: %s); keeping the last good state",
                            self.path, type(exc).__name__, exc)
                log.debug("the failure", exc_info=True)
            return False
        if failed[0] is not None:
            log.info("%s can be read again", self.path)
        failed[0] = None
        return changed

    def wait_polled(self, timeout: float) -> bool:
        """Wait until every change made before this call has been judged: two polls started
        after it have finished (the first sees a change, the second reads it once it held
        still). For tests and tools that change files and must know the watcher has looked."""
        with self._polled:
            target = self._polls + 3
            return self._polled.wait_for(lambda: self._polls >= target, timeout)

    def problems(self) -> dict[str, str]:
        """Files whose contents are not used as they are now (path: reason)."""
        with self._lock:
            return dict(self._problem_view)

    def snapshot(self) -> LoadResult:
        with self._lock:
            if self._result is None:
                return LoadResult(ClusterState(node=self.node or NodeConfig()), ())
            return self._result

    def snapshot_changes(self) -> tuple[LoadResult, Touched | None]:
        """The snapshot, and the keys of the Services touched since the previous call (None
        when unknown: before the first state, the proxier then diffs the whole state)."""
        with self._lock:
            result = self._result or LoadResult(ClusterState(node=self.node or NodeConfig()), ())
            pending, self._pending = self._pending, set()
            touched = None if pending is None else Touched(self._taken, frozenset(pending))
            self._taken = result.state
            return result, touched

    def ready(self) -> bool:
        with self._lock:
            return self._result is not None

    def stop(self) -> None:
        self._stop.set()
        if self._events is not None:
            self._events.wake()
        if self._thread is not None:
            self._thread.join(5)
        if self._events is not None and (self._thread is None or not self._thread.is_alive()):
            self._events.close()

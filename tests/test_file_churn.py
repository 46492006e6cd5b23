"""A manifest file that keeps changing is still applied within a bounded time (issue R.4).

The file source used to read a changed file only once it had held still for a whole poll, so a
file rewritten every 0.2 s waited unboundedly (syncs 11, 17 and 24 s apart in the issue). Here
the daemon's own loop (SyncLoop: the manifest source, the proxier, --min-sync-period) runs over
the in-memory nft kernel while a writer rewrites a file in place every 0.2 s for 30 s, in two
writes per version (the Service, then its EndpointSlice) so that a reader that looks between
them would see a Service without endpoints.

What is asserted: no gap between syncs (nor from the start of the churn to the first one, nor
from the last one to its end) longer than 2 s + --min-sync-period, a generous bound: the real
figure is printed by bench/file_churn.py (docs/benchmarks.md). And no sync ever applied a
half-written version: every state synced holds the Service with one of the endpoint counts
written.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from nfproxy.core.model import ClusterState, IPFamily, NodeConfig
from nfproxy.daemon.proxier import Proxier, SyncLoop, SyncResult
from nfproxy.kernel.memory.nft import MemoryNft
from nfproxy.sources.files import ManifestSource
from tests.test_source_faults import B, service_yaml

CHURN = 30.0
INTERVAL = 0.2
MIN_SYNC_PERIOD = 1.0
BOUND = 2.0 + MIN_SYNC_PERIOD
COUNTS = range(1, 7)


def version(i: int) -> tuple[str, str]:
    """The i-th version of a.yaml, as its two halves: the Service, then the EndpointSlice."""
    n = COUNTS[i % len(COUNTS)]
    text = service_yaml("a", "10.96.0.10", [f"10.244.1.{k + 1}" for k in range(n)])
    cut = text.index("---")
    return text[:cut], text[cut:]


def rewrite(path: Path, i: int) -> None:
    """In place, as an editor or a config tool without a rename would: truncate, write twice."""
    first, rest = version(i)
    with path.open("w") as f:
        f.write(first)
        f.flush()
        f.write(rest)


def endpoints_of_a(state: ClusterState) -> int:
    return sum(len(eps) for key, eps in state.endpoints.items() if key[0].name == "a")


def has_a(state: ClusterState) -> bool:
    return any(key[0].name == "a" for key in state.services)


def test_a_file_rewritten_every_fifth_of_a_second_is_synced_without_long_gaps(tmp_path: Path) -> None:
    tree = tmp_path / "manifests"
    tree.mkdir()
    rewrite(tree / "a.yaml", 0)
    (tree / "b.yaml").write_text(B)
    synced: list[tuple[float, bool, int]] = []

    def on_synced(_: ClusterState | None, state: ClusterState, result: SyncResult) -> None:
        if result.kind != "noop":
            synced.append((time.monotonic(), has_a(state), endpoints_of_a(state)))

    kernels: dict[IPFamily, MemoryNft] = {}
    proxier = Proxier("nft", kernels=lambda f: kernels.setdefault(f, MemoryNft(f)))
    proxier.hooks.on_synced.append(on_synced)
    source = ManifestSource(tree, NodeConfig(), empty_grace=3600.0)
    loop = SyncLoop(source, proxier, min_sync_period=MIN_SYNC_PERIOD)
    loop.start()
    try:
        assert loop.wait_synced(60)
        start = time.monotonic()
        i = 1
        while time.monotonic() < start + CHURN:
            rewrite(tree / "a.yaml", i)
            i += 1
            time.sleep(INTERVAL)
        end = time.monotonic()
    finally:
        loop.stop()
    times = [start] + [t for t, _, _ in synced if start < t <= end] + [end]
    gaps = [round(b - a, 2) for a, b in zip(times, times[1:])]
    assert max(gaps) <= BOUND, f"gaps between syncs: {gaps}"
    half_written = [(present, n) for _, present, n in synced if not present or n not in COUNTS]
    assert not half_written, f"a synced state held a half-written a.yaml: {half_written}"


def test_the_watcher_reads_a_file_closed_after_writing_without_waiting_for_a_poll(tmp_path: Path) -> None:
    """A file closed after writing is read at once: with a poll of an hour, only inotify can
    have read it. Moved into place likewise (a rename, as config tools and ConfigMaps do)."""
    tree = tmp_path / "manifests"
    tree.mkdir()
    rewrite(tree / "a.yaml", 0)
    source = ManifestSource(tree, NodeConfig(), poll=3600.0)
    changed = threading.Event()
    source.start(changed.set)
    try:
        rewrite(tree / "a.yaml", 2)  # 3 endpoints
        assert changed.wait(60), "a closed file was not read before the next poll"
        assert endpoints_of_a(source.snapshot().state) == 3
        changed.clear()
        staging = tmp_path / "staging.yaml"
        staging.write_text("".join(version(4)))  # 5 endpoints
        staging.rename(tree / "a.yaml")
        assert changed.wait(60), "a file moved into place was not read before the next poll"
        assert endpoints_of_a(source.snapshot().state) == 5
    finally:
        source.stop()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_file_that_never_holds_still_for_a_poll_is_read_after_the_maximum_wait(tmp_path: Path) -> None:
    """Without inotify (here: no watcher, the looks are made by hand, one a poll apart on a
    clock of the test's), a file rewritten between every two looks never held still for a
    poll: it is read once it has been changing for MAX_WAIT, at a moment it held still."""
    from nfproxy.sources.files import MAX_WAIT

    tree = tmp_path / "manifests"
    tree.mkdir()
    rewrite(tree / "a.yaml", 0)
    clock = Clock()
    source = ManifestSource(tree, NodeConfig(), clock=clock)
    assert endpoints_of_a(source.snapshot().state) == 1
    read_at = None
    for i in range(1, 10):
        rewrite(tree / "a.yaml", i)
        if source.rescan():
            read_at = i
            break
        clock.now += 1.0  # one poll
    assert read_at is not None, "never read"
    assert clock.now >= MAX_WAIT  # not before the maximum wait...
    assert clock.now <= MAX_WAIT + 1.0  # ...and at the first look after it
    assert endpoints_of_a(source.snapshot().state) == COUNTS[read_at % len(COUNTS)]  # that version, whole

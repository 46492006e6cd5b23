#!/usr/bin/env python3
"""Syncs of a manifest file that keeps changing: the figure issue R.4 asks for (the test,
tests/test_file_churn.py, only holds a generous bound).

The daemon's own loop (SyncLoop over nfproxy.sources.files.ManifestSource and a Proxier of the
nft backend on the in-memory kernel: the source and the loop are measured, not the kernel)
runs while a writer rewrites one file in place every `--interval` seconds for `--seconds`,
each version in two writes (a Service, then its EndpointSlice). Reported: the syncs during the
churn, the gaps between them (and from the churn's start to the first one, and from the last
one to its end): largest, median; the age of the version each sync applied, since its writer
closed it (largest, median); and how many synced states held a half-written file (must be 0).

Usage: .venv/bin/python bench/file_churn.py [--seconds 30] [--interval 0.2] [--min-sync-period 1] [--poll 1]
       [--no-inotify]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nfproxy.core.model import ClusterState, IPFamily, NodeConfig  # noqa: E402
from nfproxy.daemon.proxier import Proxier, SyncLoop, SyncResult  # noqa: E402
from nfproxy.kernel.memory.nft import MemoryNft  # noqa: E402
from nfproxy.sources import files  # noqa: E402
from nfproxy.sources.files import ManifestSource  # noqa: E402

SERVICE = """apiVersion: v1
kind: Service
metadata: {name: a, namespace: default}
spec:
  clusterIP: 10.96.0.10
  ports: [{name: http, port: 80, protocol: TCP}]
"""
SLICE = """---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: a-1, namespace: default, labels: {kubernetes.io/service-name: a}}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints:
"""
VERSIONS = 50  # distinct endpoint counts, so that every version is a change and is told apart


def rewrite(path: Path, i: int) -> None:
    n = i % VERSIONS + 1
    with path.open("w") as f:
        f.write(SERVICE)
        f.flush()
        f.write(SLICE + "".join(f"  - addresses: [10.244.{k // 250}.{k % 250 + 1}]\n" for k in range(n)))


def endpoints_of_a(state: ClusterState) -> int | None:
    if not any(key[0].name == "a" for key in state.services):
        return None
    return sum(len(eps) for key, eps in state.endpoints.items() if key[0].name == "a")


def run(args: argparse.Namespace, tree: Path) -> None:
    path = tree / "a.yaml"
    rewrite(path, 0)
    synced: list[tuple[float, int | None]] = []

    def on_synced(_: ClusterState | None, state: ClusterState, result: SyncResult) -> None:
        if result.kind != "noop":
            synced.append((time.monotonic(), endpoints_of_a(state)))

    proxier = Proxier("nft", kernels=lambda f: MemoryNft(f), families=(IPFamily.V4,))
    proxier.hooks.on_synced.append(on_synced)
    source = ManifestSource(tree, NodeConfig(), poll=args.poll, empty_grace=3600.0)
    loop = SyncLoop(source, proxier, min_sync_period=args.min_sync_period)
    loop.start()
    closed: list[tuple[float, int]] = []
    try:
        loop.wait_synced(60)
        start = time.monotonic()
        i = 1
        while time.monotonic() < start + args.seconds:
            rewrite(path, i)
            closed.append((time.monotonic(), i % VERSIONS + 1))
            i += 1
            time.sleep(args.interval)
        end = time.monotonic()
    finally:
        loop.stop()
    report(args, start, end, synced, closed)


def report(args: argparse.Namespace, start: float, end: float, synced: list[tuple[float, int | None]],
           closed: list[tuple[float, int]]) -> None:
    during = [(t, n) for t, n in synced if start < t <= end]
    times = [start] + [t for t, _ in during] + [end]
    gaps = [b - a for a, b in zip(times, times[1:])]
    half = sum(1 for _, n in synced if n is None or not 1 <= n <= VERSIONS)
    ages = []  # per sync: how long before it the version it applied was closed
    for t, n in during:
        before = [t_close for t_close, m in closed if t_close <= t and m == n]
        if before:
            ages.append(t - before[-1])
    print(f"file rewritten every {args.interval:g} s for {args.seconds:g} s ({len(closed)} versions); "
          f"poll {args.poll:g} s, --min-sync-period {args.min_sync_period:g} s"
          f"{', polling only (no inotify)' if args.no_inotify else ''}")
    print(f"  syncs during the churn: {len(during)}")
    print(f"  gap between syncs: largest {max(gaps):.2f} s, median {statistics.median(gaps):.2f} s "
          f"(bound asked: {2 + args.min_sync_period:g} s)")
    if ages:
        print(f"  age of the version each sync applied (since its writer closed it): largest "
              f"{max(ages):.2f} s, median {statistics.median(ages):.2f} s")
    print(f"  synced states holding a half-written file: {half}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--interval", type=float, default=0.2)
    parser.add_argument("--min-sync-period", type=float, default=1.0)
    parser.add_argument("--poll", type=float, default=1.0)
    parser.add_argument("--no-inotify", action="store_true",
                        help="polling alone, as where inotify cannot be had (the maximum wait then bounds it)")
    args = parser.parse_args()
    if args.no_inotify:
        files._Events.open = classmethod(lambda cls, path: None)  # type: ignore[method-assign,assignment]
    with tempfile.TemporaryDirectory(prefix="nfp-churn-") as tmp:
        run(args, Path(tmp))


if __name__ == "__main__":
    main()

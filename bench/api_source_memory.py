#!/usr/bin/env python3
"""The API source alone: its memory once its lists are read and a snapshot taken (issue P).

Brings up (or reuses) the real kube-apiserver holding S services x N endpoints, as
`bench/idle.py --source api` does, then in this process starts `KubeSource` against it, waits
for its lists, takes one snapshot, gives the heap back (`daemon.heap.release`) and prints: RSS
after importing and after the lists, the peak (VmHWM), and CPython's small-object arenas (how
many, how many bytes in live and in free blocks: a heap left fragmented by a large decoded
response shows as free blocks). `--root` runs another checkout's source.

Usage: sudo .venv/bin/python bench/api_source_memory.py [--services 10000] [--endpoints 10]
       [--kube-dir /tmp/nfproxy-kube-idle] [--root CHECKOUT]
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

ROOT = Path(__file__).resolve().parent.parent


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _arenas() -> dict[str, int]:
    """CPython's arena statistics (`sys._debugmallocstats` writes them to fd 2)."""
    read, write = os.pipe()
    saved = os.dup(2)
    os.dup2(write, 2)
    try:
        sys._debugmallocstats()
    finally:
        os.dup2(saved, 2)
        os.close(write)
        os.close(saved)
    chunks = []
    while chunk := os.read(read, 1 << 16):
        chunks.append(chunk)
    os.close(read)
    text = b"".join(chunks).decode()
    found = {}
    for key, pattern in (("arenas", r"# arenas allocated current\s*=\s*([\d,]+)"),
                         ("live_bytes", r"# bytes in allocated blocks\s*=\s*([\d,]+)"),
                         ("free_bytes", r"# bytes in available blocks\s*=\s*([\d,]+)")):
        match = re.search(pattern, text)
        found[key] = int(match.group(1).replace(",", "")) if match else -1
    return found


def _cluster_beside(directory: Path, services: int, endpoints: int) -> Path:
    """`idle.api_cluster` in a forked child: checking and writing the cluster builds every
    object, which must not be in this process's heap when the source is measured."""
    pid = os.fork()
    if pid == 0:
        from idle import api_cluster  # bench/ is on sys.path

        try:
            api_cluster(directory, services, endpoints)
        except BaseException as exc:  # noqa: BLE001 - reported by the exit status
            print(f"the cluster: {exc}", file=sys.stderr)
            os._exit(1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    if status:
        sys.exit("the API server or the cluster could not be made ready")
    return directory / "admin.kubeconfig"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--services", type=int, default=10000)
    parser.add_argument("--endpoints", type=int, default=10)
    parser.add_argument("--kube-dir", type=Path, default=Path("/tmp/nfproxy-kube-idle"))
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout whose source runs")
    args = parser.parse_args()
    kubeconfig = _cluster_beside(args.kube_dir, args.services, args.endpoints)
    sys.path.insert(0, str(args.root.resolve()))
    from nfproxy.core.model import NodeConfig
    from nfproxy.daemon import heap
    from nfproxy.sources.kube import KubeSource, api_client
    from nfproxy.testing import NODE

    imported = _rss_mib()
    started = time.monotonic()
    source = KubeSource(api_client(kubeconfig=str(kubeconfig)), NodeConfig(name=NODE.name))
    source.start(lambda: None)
    if not source.wait_ready(1200):
        sys.exit("the source did not finish its lists")
    listed = time.monotonic() - started
    result = source.snapshot()
    snapshot = time.monotonic() - started
    heap.release()
    with open("/proc/self/status") as f:
        peak = int(re.search(r"VmHWM:\s*(\d+)", f.read()).group(1)) / 1024  # type: ignore[union-attr]
    arenas = _arenas()
    print(f"{args.root}: {len(result.state.services)} service ports, {len(result.errors)} errors; "
          f"lists {listed:.1f} s, snapshot at {snapshot:.1f} s; RSS imported {imported:.0f} MiB, "
          f"after {_rss_mib():.0f} MiB, peak {peak:.0f} MiB; {arenas['arenas']} arenas, "
          f"{arenas['live_bytes'] / 2**20:.1f} MiB live, {arenas['free_bytes'] / 2**20:.1f} MiB free blocks")
    source.stop()
    os._exit(0)  # the reflector threads are daemons; nothing to tidy


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Render time and peak memory for 100, 1 000 and 10 000 services x 10 endpoints, both backends.

Each measurement runs in its own child process so that peak RSS belongs to that render alone.
Prints one table; the ratio columns are what to compare across machines (this one is noisy:
2 shared cores), e.g. time against the 1 s target and nft against iptables in the same run.

    .venv/bin/python bench/render.py [--sizes 100,1000,10000] [--endpoints 10] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET_SECONDS = 1.0


def measure(backend: str, services: int, endpoints: int) -> dict[str, float]:
    """Runs in the child: build the model, then time render + text for both families."""
    sys.path.insert(0, ROOT)
    from nfproxy.core.model import IPFamily
    from nfproxy.testing import uniform_cluster

    state = uniform_cluster(services, endpoints)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    if backend == "iptables":
        from nfproxy.backends.iptables import render as iptables

        text = "".join(iptables.render(state, f).restore_text() for f in IPFamily)
    else:
        from nfproxy.backends.nft import render as nft

        text = "".join(nft.render(state, f).script() for f in IPFamily)
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"seconds": seconds, "rss_mib": (after - before) / 1024, "bytes": len(text)}


def run_child(backend: str, services: int, endpoints: int) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, __file__, "--child", backend, str(services), str(endpoints)],
        capture_output=True, text=True, check=True,
    )
    return json.loads(out.stdout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="100,1000,10000")
    ap.add_argument("--endpoints", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=3, help="best of N runs per cell")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        backend, services, endpoints = args.child
        print(json.dumps(measure(backend, int(services), int(endpoints))))
        return 0

    sizes = [int(s) for s in args.sizes.split(",")]
    rows = []
    for n in sizes:
        cell = {}
        for backend in ("iptables", "nft"):
            runs = [run_child(backend, n, args.endpoints) for _ in range(args.repeat)]
            best = min(runs, key=lambda r: r["seconds"])
            best["rss_mib"] = max(r["rss_mib"] for r in runs)
            cell[backend] = best
        rows.append((n, cell))

    print(f"render: services x {args.endpoints} endpoints, both families, best of {args.repeat}")
    print(f"{'services':>9} {'backend':>8} {'seconds':>8} {'/target':>8} {'peak MiB':>9} "
          f"{'MiB text':>9} {'nft/ipt':>8} {'x per 10x':>9}")
    prev: dict[str, float] = {}
    for n, cell in rows:
        for backend in ("iptables", "nft"):
            r = cell[backend]
            ratio = cell["nft"]["seconds"] / cell["iptables"]["seconds"]
            growth = r["seconds"] / prev[backend] if backend in prev else float("nan")
            print(f"{n:>9} {backend:>8} {r['seconds']:>8.3f} {r['seconds'] / TARGET_SECONDS:>8.2f} "
                  f"{r['rss_mib']:>9.1f} {r['bytes'] / 2**20:>9.1f} "
                  f"{(ratio if backend == 'nft' else 1.0):>8.2f} {growth:>9.2f}")
        prev = {b: cell[b]["seconds"] for b in cell}
    worst = max(cell[b]["seconds"] for _, cell in rows for b in cell)
    print(f"slowest cell: {worst:.3f} s = {worst / TARGET_SECONDS:.2f} x the 1 s target")
    return 0


if __name__ == "__main__":
    sys.exit(main())

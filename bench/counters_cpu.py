#!/usr/bin/env python3
"""CPU time (user + system, this process) of nft full syncs and one-service changes with the
per-endpoint counters on and off: on a loaded shared machine wall time swings by 2-3x between
identical runs, CPU time far less. libnftables and nfnetlink run in-process and the kernel
handles a netlink batch in the sending thread, so the kernel's side is in the system time.

Usage: sudo .venv/bin/python bench/counters_cpu.py [--services 10000] [--endpoints 10] [--repeat 2]
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from counters import _proxier, _with_endpoint  # noqa: E402  (bench/ is sys.path[0])
from nfproxy.kernel import netns  # noqa: E402
from nfproxy.testing import uniform_cluster  # noqa: E402


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--services", type=int, default=10_000)
    ap.add_argument("--endpoints", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--changes", type=int, default=5)
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench/counters_cpu.py: needs root", file=sys.stderr)
        return 1
    state = uniform_cluster(args.services, args.endpoints)
    full: dict[bool, list[float]] = {True: [], False: []}
    change: dict[bool, list[float]] = {True: [], False: []}
    for r in range(args.repeat):
        for on in (True, False) if r % 2 == 0 else (False, True):
            with netns.throwaway("nfp-bench") as ns:
                proxier = _proxier("nft", ns, on)
                gc.collect()
                t0 = cpu()
                assert proxier.sync(state).kind == "full"
                full[on].append(cpu() - t0)
                current = state
                for i in range(args.changes):
                    current = _with_endpoint(current, i)
                    gc.collect()
                    t0 = cpu()
                    assert proxier.sync(current).kind == "partial"
                    change[on].append(cpu() - t0)
            print(f"  counters {'on ' if on else 'off'}: full {full[on][-1]:.2f} s CPU, "
                  f"change {statistics.median(change[on][-args.changes:]) * 1e3:.1f} ms CPU", flush=True)
    med = statistics.median
    print(f"| full sync {args.services} x {args.endpoints} (CPU s) | {med(full[True]):.2f} | {med(full[False]):.2f} | {med(full[True]) / med(full[False]):.3f} |")
    print(f"| one-service change (CPU ms) | {med(change[True]) * 1e3:.1f} | {med(change[False]) * 1e3:.1f} | {med(change[True]) / med(change[False]):.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

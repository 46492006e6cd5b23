#!/usr/bin/env python3
"""Analysis of one service of many endpoints: `check`, `trace --json` and `compare` as whole
processes, on one Service whose EndpointSlice holds N ready endpoints (kube-proxy's cascade of
N rules; shares of up to 31·N bits).

Before session 12 these raised (Python's 4 300-digit limit on int-to-str) from ~490 endpoints
and summed Fractions pairwise (compare at 2 000 endpoints: 22 s). With `--before REV` every
command also runs on that revision's tree (a git worktree, same interpreter), the two taking
turns, so the ratio is measured in one run on the same machine load. Times are the median of
`--repeat` wall-clock runs of the whole process; `fail` is a non-zero exit (a traceback, for the
old tree), `>T` a run killed at the timeout.

Usage: .venv/bin/python bench/large_services.py [--sizes 250,500,1000,2000] [--repeat 3]
       [--before af22d10] [--timeout 60]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def manifest(n: int) -> str:
    addrs = [f"10.{244 + i // 65024}.{(i // 254) % 256}.{i % 254 + 1}" for i in range(n)]
    head = (
        "apiVersion: v1\nkind: Service\nmetadata: {name: big, namespace: default}\n"
        "spec:\n  type: ClusterIP\n  clusterIP: 10.96.10.20\n  ports: [{name: http, port: 80, protocol: TCP}]\n"
        "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\n"
        "metadata: {name: big-1, namespace: default, labels: {kubernetes.io/service-name: big}}\n"
        "addressType: IPv4\nports: [{name: http, port: 80, protocol: TCP}]\nendpoints:\n"
    )
    return head + "".join(f"  - addresses: [{a}]\n" for a in addrs)


def run(tree: Path, argv: list[str], timeout: float) -> float | str:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-m", "nfproxy", *argv], cwd=tree, env=env,
                              capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f">{timeout:g}"
    seconds = time.perf_counter() - start
    return seconds if done.returncode in (0, 1) and b"Traceback" not in done.stderr else "fail"


def median(values: list[float | str]) -> float | str:
    numbers = [v for v in values if isinstance(v, float)]
    return statistics.median(numbers) if len(numbers) == len(values) else values[-1]


def show(value: float | str) -> str:
    return f"{value:.2f}" if isinstance(value, float) else value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="250,500,1000,2000")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--before", metavar="REV", help="also run this revision's tree, in turns")
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    work = Path(tempfile.mkdtemp(prefix="nfproxy-large-"))
    trees = {"now": ROOT}
    if args.before:
        before = work / "before"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(before), args.before],
                       check=True, capture_output=True)
        trees["before"] = before
    rows = []
    try:
        for n in sizes:
            path = work / f"big{n}.yaml"
            path.write_text(manifest(n))
            save = work / f"big{n}.ipt"
            with save.open("wb") as out:
                subprocess.run([sys.executable, "-m", "nfproxy", "render", "--backend", "iptables", str(path)],
                               cwd=ROOT, stdout=out, check=True)
            commands = {
                "check": ["check", "--from-file", str(save)],
                "trace --json": ["trace", "--json", "--from-file", str(save), "203.0.113.5", "10.96.10.20:80/tcp"],
                "compare": ["compare", str(path)],
            }
            for name, argv in commands.items():
                times: dict[str, list[float | str]] = {t: [] for t in trees}
                for _ in range(args.repeat):
                    for label, tree in trees.items():  # in turns
                        times[label].append(run(tree, argv, args.timeout))
                rows.append({"endpoints": n, "command": name, **{t: median(v) for t, v in times.items()}})
                print(json.dumps(rows[-1]), file=sys.stderr)
    finally:
        if args.before:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(trees["before"])],
                           capture_output=True)
    print(f"| endpoints | command | now s | x per 2x endpoints{' | before s | now / before' if args.before else ''} |")
    print(f"|---|---|---|---{'|---|---' if args.before else ''}|")
    previous: dict[str, float | str] = {}
    for row in rows:
        now = row["now"]
        last = previous.get(row["command"])
        growth = f"{now / last:.2f}" if isinstance(now, float) and isinstance(last, float) else ""
        previous[row["command"]] = now
        line = f"| {row['endpoints']} | {row['command']} | {show(now)} | {growth}"
        if args.before:
            old = row["before"]
            ratio = f"{now / old:.3f}" if isinstance(now, float) and isinstance(old, float) else ""
            line += f" | {show(old)} | {ratio}"
        print(line + " |")


if __name__ == "__main__":
    main()

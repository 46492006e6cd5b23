#!/usr/bin/env python3
"""Daemon memory benchmark: the real `nfproxy` daemon on a generated cluster, RSS over its life.

For each backend it writes the benchmark shape of nfproxy/testing.py (S services x N endpoints)
as manifest files, starts `python -m nfproxy --manifests DIR --netns NS` in a throwaway network
namespace, and samples from /proc every 20 ms:

- peak: the largest sum of the daemon's RSS and the private pages of all its descendants (the
  iptables backend's `iptables-restore` child, the nft backend's forked element encoder; a
  forked child's RSS would count again every page it shares with the daemon), and the daemon's
  own high-water mark (VmHWM, exact);
- steady: the daemon's RSS once the cold start is over: the median over the last `--settle`
  seconds of a `--window` after its first full sync is logged. The resync period defaults to an
  hour so that no periodic full sync runs in the window (on a loaded machine one lasts minutes,
  and its own peak is not "steady"); give `--sync-period 20s` to include resyncs in the peak.

Sampling can miss a short child's peak between two samples; VmHWM cannot miss the daemon's.
`--root` runs another checkout's code (e.g. /work/main) for before/after figures.

Usage: sudo .venv/bin/python bench/memory.py [--services 10000] [--endpoints 10]
       [--backends nft,iptables] [--root PATH] [--window 20] [--sync-period 1h]
       [--iptables-flavour legacy]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nfproxy.kernel import netns  # noqa: E402
from nfproxy.testing import NODE, manifest_objects, uniform_cluster  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
STEADY_TARGET_MIB = 250
PEAK_TARGET_MIB = 400
PAGE = os.sysconf("SC_PAGE_SIZE")
# kube-proxy's mode names, as `--proxy-mode` takes them.
MODES = {"nft": "nftables", "iptables": "iptables"}


def write_manifests(services: int, endpoints: int, into: Path, per_file: int = 500) -> None:
    """The cluster as JSON List files of `per_file` objects (under the 16 MiB file cap)."""
    objects = manifest_objects(uniform_cluster(services, endpoints))
    for i in range(0, len(objects), per_file):
        doc = {"apiVersion": "v1", "kind": "List", "items": objects[i : i + per_file]}
        (into / f"cluster-{i // per_file:04d}.json").write_text(json.dumps(doc))


def _rss(pid: int) -> int:
    """Resident bytes of `pid` (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * PAGE
    except (OSError, IndexError, ValueError):
        return 0


def _children(pid: int) -> list[int]:
    """Children of every thread of `pid`: the daemon forks from its sync thread, whose children
    /proc lists under that thread only."""
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                found.extend(int(c) for c in f.read().split())
        except OSError:
            continue
    return found


def _private(pid: int) -> int:
    """Pages `pid` alone maps (0 when it is gone). A forked helper's RSS also counts every page
    it still shares with the daemon, which the daemon's RSS already holds."""
    total = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith(("Private_Clean:", "Private_Dirty:")):
                    total += int(line.split()[1]) * 1024
    except (OSError, IndexError, ValueError):
        return 0
    return total


def _tree_rss(pid: int) -> tuple[int, int]:
    """(the daemon's RSS, that plus every descendant's private pages)."""
    own = _rss(pid)
    total, todo = own, _children(pid)
    while todo:
        child = todo.pop()
        total += _private(child)
        todo.extend(_children(child))
    return own, total


def _hwm(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@dataclass(slots=True)
class Samples:
    """(seconds since start, daemon RSS, tree RSS) every interval, and when the first sync ended."""

    points: list[tuple[float, int, int]] = field(default_factory=list)
    first_sync: float | None = None
    hwm: int = 0


def _watch_log(stream: object, samples: Samples, start: float, lines: list[str]) -> None:
    for line in stream:  # type: ignore[attr-defined]
        lines.append(line)
        if samples.first_sync is None and "Syncing" in line and 'kind="full"' in line:
            samples.first_sync = time.monotonic() - start


def run_daemon(
    backend: str, manifests: Path, root: Path, window: float, settle: float, sync_period: str,
    flavour: str = "legacy",
) -> dict[str, float]:
    with netns.throwaway("nfp-mem") as ns:
        cmd = [
            sys.executable, "-m", "nfproxy", "--proxy-mode", MODES[backend], "--manifests", str(manifests),
            "--netns", ns, "--node-name", NODE.name, "--healthz-bind-address", "", "--metrics-bind-address", "",
            "--sync-period", sync_period, "--conntrack-max-per-core", "0",
            "--conntrack-tcp-timeout-established", "0", "--conntrack-tcp-timeout-close-wait", "0",
            "--max-manifest-bytes", "64Mi", "--v=2",
        ]
        if backend == "iptables":
            cmd += ["--iptables-flavour", flavour]
        start = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": str(root)})
        samples, lines = Samples(), []
        reader = threading.Thread(target=_watch_log, args=(proc.stderr, samples, start, lines), daemon=True)
        reader.start()
        try:
            deadline = None
            while proc.poll() is None:
                now = time.monotonic() - start
                own, total = _tree_rss(proc.pid)
                samples.points.append((now, own, total))
                samples.hwm = max(samples.hwm, _hwm(proc.pid))
                if samples.first_sync is not None and deadline is None:
                    deadline = samples.first_sync + window
                if deadline is not None and now >= deadline:
                    break
                if now > 900:
                    raise RuntimeError(f"{backend}: no full sync after 900 s")
                time.sleep(0.02)
            if proc.poll() is not None:
                raise RuntimeError(f"{backend}: the daemon exited {proc.returncode}:\n{''.join(lines[-20:])}")
        finally:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            subprocess.run([sys.executable, "-m", "nfproxy", "cleanup", "--netns", ns], cwd=root,
                           capture_output=True, env={**os.environ, "PYTHONPATH": str(root)})
    assert samples.first_sync is not None
    end = samples.points[-1][0]
    steady = [own for t, own, _ in samples.points if t >= end - settle]
    mib = 2**20
    return {
        "first_sync_s": samples.first_sync,
        "peak_tree_mib": max(total for _, _, total in samples.points) / mib,
        "peak_daemon_mib": samples.hwm / mib,
        "steady_mib": statistics.median(steady) / mib,
        "syncs": sum("Syncing" in line and 'kind="full"' in line for line in lines),
    }


def table(results: dict[str, dict[str, float]], label: str, services: int, endpoints: int) -> str:
    head = (
        f"Daemon RSS at {services} x {endpoints} ({label}); targets: steady < {STEADY_TARGET_MIB} MiB,"
        f" peak < {PEAK_TARGET_MIB} MiB\n\n"
        "| backend | cold start s | peak MiB (with children's private pages) | daemon VmHWM MiB | steady MiB | full syncs seen |\n"
        "|---|---|---|---|---|---|\n"
    )
    rows = []
    for backend, r in results.items():
        peak_ok = "ok" if r["peak_tree_mib"] < PEAK_TARGET_MIB else "OVER"
        steady_ok = "ok" if r["steady_mib"] < STEADY_TARGET_MIB else "OVER"
        rows.append(
            f"| {backend} | {r['first_sync_s']:.1f} | {r['peak_tree_mib']:.0f} ({peak_ok}) |"
            f" {r['peak_daemon_mib']:.0f} | {r['steady_mib']:.0f} ({steady_ok}) | {r['syncs']:.0f} |"
        )
    return head + "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--services", type=int, default=10000)
    parser.add_argument("--endpoints", type=int, default=10)
    parser.add_argument("--backends", default="nft,iptables")
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout whose daemon runs")
    parser.add_argument("--window", type=float, default=20.0, help="seconds sampled after the first sync")
    parser.add_argument("--settle", type=float, default=5.0, help="the steady median's last seconds")
    parser.add_argument("--sync-period", default="1h", help="the daemon's full resync interval")
    parser.add_argument("--iptables-flavour", default="legacy", help="as the daemon's flag (kube-proxy: legacy)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench/memory.py needs root (network namespaces)")
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="nfp-mem-") as tmp:
        write_manifests(args.services, args.endpoints, Path(tmp))
        for backend in args.backends.split(","):
            results[backend] = run_daemon(backend, Path(tmp), args.root.resolve(), args.window,
                                          args.settle, args.sync_period, args.iptables_flavour)
            print(f"{backend}: {results[backend]}", file=sys.stderr, flush=True)
    label = str(args.root.resolve())
    print(json.dumps(results) if args.json else table(results, label, args.services, args.endpoints))


if __name__ == "__main__":
    main()

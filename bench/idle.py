#!/usr/bin/env python3
"""The idle node: what the real daemon costs while nothing changes (issue P).

For each backend it writes the benchmark shape of nfproxy/testing.py (S services x N endpoints)
as manifest files (bench/memory.py's), starts `python -m nfproxy --manifests DIR --netns NS`
in a throwaway namespace with kube-proxy's default `--sync-period 30s`, waits for the first
full sync (and the cleanup sync after it), then over `--window` seconds with nothing changing
measures the points below. `--source api` serves the same cluster from the real kube-apiserver
instead (`scripts/kube up` into `--kube-dir`, reused when it is up and already holds the
cluster, which takes minutes to write at 10 000 x 10: bench/kube_proxy.py's shape, a Node
object for node-a, server-side applied) and the daemon reads it with `--kubeconfig`, as on a
node:

- CPU: the daemon's user + system seconds, its reaped children's included (an
  `iptables-restore` of a periodic full sync counts), from /proc/PID/stat, as a share of one core;
- RSS: sampled every second; the median (steady) and the largest;
- full syncs logged in the window (kube-proxy's sync line at --v=2): none is the target, the
  periodic sync only checks the kernel's generation.

Then it flushes one service chain by hand (`nft flush chain` / `iptables -F`) and reports how
long the daemon took to log the repairing full sync (`reason="rules changed outside nfproxy"`):
at most one --sync-period.

Usage: sudo .venv/bin/python bench/idle.py [--services 10000] [--endpoints 10]
       [--backends nft,iptables] [--window 300] [--sync-period 30s] [--iptables-flavour legacy]
       [--source manifests|api] [--kube-dir /tmp/nfproxy-kube-idle]
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
sys.path.insert(0, str(Path(__file__).resolve().parent))

from memory import MODES, _rss, write_manifests  # noqa: E402  (bench/ is sys.path[0])

from nfproxy.kernel import netns  # noqa: E402
from nfproxy.testing import NODE  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CPU_TARGET = 0.005  # of one core
STEADY_TARGET_MIB = 150  # nft
TICK = os.sysconf("SC_CLK_TCK")
REPAIR = "rules changed outside nfproxy"


def cpu_seconds(pid: int) -> float:
    """utime + stime + cutime + cstime of `pid`: its threads' and its reaped children's."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return sum(int(v) for v in fields[11:15]) / TICK


@dataclass(slots=True)
class Log:
    """The daemon's stderr, with the moments that matter."""

    lines: list[tuple[float, str]] = field(default_factory=list)
    full_syncs: int = 0
    quiet_since: float | None = None  # the first moment nothing was pending after the first sync
    lock: threading.Lock = field(default_factory=threading.Lock)

    def fulls_after(self, t: float, reason: str | None = None) -> list[float]:
        with self.lock:
            return [at for at, line in self.lines if at >= t and _full(line) and (reason is None or reason in line)]


def _full(line: str) -> bool:
    return "Syncing" in line and 'kind="full"' in line


def _read(stream: object, log: Log) -> None:
    for line in stream:  # type: ignore[attr-defined]
        with log.lock:
            log.lines.append((time.monotonic(), line))


def _delete_by_hand(backend: str, ns: str, flavour: str) -> None:
    """Flush the first service chain, as an admin would."""
    if backend == "nft":
        listing = subprocess.run(["ip", "netns", "exec", ns, "nft", "list", "chains", "ip"],
                                 capture_output=True, text=True, check=True).stdout
        name = next(w for line in listing.splitlines() for w in line.split()[1:2] if w.startswith("service-"))
        cmd = ["nft", "flush", "chain", "ip", "nfproxy", name]
    else:
        tool = f"iptables-{flavour}"
        listing = subprocess.run(["ip", "netns", "exec", ns, f"{tool}-save", "-t", "nat"],
                                 capture_output=True, text=True, check=True).stdout
        name = next(line[1:].split()[0] for line in listing.splitlines() if line.startswith(":KUBE-SVC-"))
        cmd = [tool, "-w", "5", "-t", "nat", "-F", name]
    subprocess.run(["ip", "netns", "exec", ns, *cmd], check=True)


def api_cluster(directory: Path, services: int, endpoints: int) -> Path:
    """A kube-apiserver in `directory` holding the cluster (brought up and written if need be);
    returns its admin kubeconfig."""
    from kube_proxy import KUBE, cluster_objects, sh

    kubeconfig = directory / "admin.kubeconfig"
    if not _api_up(directory):
        sh(str(KUBE), "up", "--dir", str(directory), "--service-cidr", "172.16.0.0/12")
    kubectl = sh(str(KUBE), "path", "kubectl").strip()
    objects = cluster_objects(services, endpoints)
    wanted = {(o["metadata"].get("namespace"), o["metadata"]["name"]) for o in objects if o["kind"] == "Service"}
    listed = sh(kubectl, "--kubeconfig", str(kubeconfig), "get", "services", "-A", "--no-headers")
    held = {tuple(line.split()[:2]) for line in listed.splitlines() if line.strip()}
    if not wanted <= held:
        started = time.monotonic()
        for i in range(0, len(objects), 2000):
            doc = {"apiVersion": "v1", "kind": "List", "items": objects[i:i + 2000]}
            sh(kubectl, "--kubeconfig", str(kubeconfig), "apply", "--server-side", "--force-conflicts",
               "-f", "-", stdin=json.dumps(doc))
        print(f"cluster {services} x {endpoints} written in {time.monotonic() - started:.0f}s",
              file=sys.stderr, flush=True)
    return kubeconfig


def _api_up(directory: Path) -> bool:
    port = directory / "kube-apiserver.port"
    if not port.exists():
        return False
    probe = subprocess.run(["curl", "-sk", "--max-time", "5",
                            f"https://127.0.0.1:{port.read_text().strip()}/readyz"],
                           capture_output=True, text=True)
    return probe.returncode == 0 and probe.stdout.strip() == "ok"


def run_daemon(backend: str, source: list[str], root: Path, window: float, sync_period: str,
               flavour: str, settle: float) -> dict[str, float]:
    with netns.throwaway("nfp-idle") as ns:
        cmd = [
            sys.executable, "-m", "nfproxy", "--proxy-mode", MODES[backend], *source,
            "--netns", ns, "--node-name", NODE.name, "--healthz-bind-address", "", "--metrics-bind-address", "",
            "--sync-period", sync_period, "--conntrack-max-per-core", "0",
            "--conntrack-tcp-timeout-established", "0", "--conntrack-tcp-timeout-close-wait", "0",
            "--v=2",
        ]
        if backend == "iptables":
            cmd += ["--iptables-flavour", flavour]
        env = {**os.environ, "PYTHONPATH": str(root)}
        proc = subprocess.Popen(cmd, cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        log = Log()
        threading.Thread(target=_read, args=(proc.stderr, log), daemon=True).start()
        started = time.monotonic()
        try:
            while not log.fulls_after(started):
                if proc.poll() is not None or time.monotonic() - started > 1200:
                    raise RuntimeError(f"{backend}: no first sync ({proc.returncode}):\n"
                                       + "".join(line for _, line in log.lines[-20:]))
                time.sleep(0.2)
            first_sync = log.fulls_after(started)[0] - started
            time.sleep(settle)  # the cleanup sync after the first, and the heap given back
            t0, cpu0 = time.monotonic(), cpu_seconds(proc.pid)
            rss: list[int] = []
            while time.monotonic() - t0 < window:
                rss.append(_rss(proc.pid))
                time.sleep(1.0)
            t1, cpu1 = time.monotonic(), cpu_seconds(proc.pid)
            fulls = len(log.fulls_after(t0)) - len(log.fulls_after(t1))
            _delete_by_hand(backend, ns, flavour)
            deleted = time.monotonic()
            while not log.fulls_after(deleted, REPAIR):
                if time.monotonic() - deleted > 600 or proc.poll() is not None:
                    raise RuntimeError(f"{backend}: the deletion was not repaired")
                time.sleep(0.1)
            repaired = log.fulls_after(deleted, REPAIR)[0] - deleted
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            subprocess.run([sys.executable, "-m", "nfproxy", "cleanup", "--netns", ns], cwd=root,
                           capture_output=True, env=env)
    mib = 2**20
    return {
        "first_sync_s": first_sync,
        "window_s": t1 - t0,
        "cpu_s": cpu1 - cpu0,
        "core_share": (cpu1 - cpu0) / (t1 - t0),
        "steady_mib": statistics.median(rss) / mib,
        "max_mib": max(rss) / mib,
        "full_syncs_in_window": fulls,
        "repaired_after_s": repaired,
    }


def table(results: dict[str, dict[str, float]], services: int, endpoints: int, sync_period: str,
          source: str) -> str:
    head = (
        f"Idle daemon at {services} x {endpoints}, {source} source, --sync-period {sync_period}; targets: CPU <= "
        f"{CPU_TARGET:.1%} of a core, steady RSS <= {STEADY_TARGET_MIB} MiB (nft), no full sync in the window\n\n"
        "| backend | cold start s | window s | CPU s | share of a core | steady RSS MiB | max RSS MiB "
        "| full syncs in window | external flush repaired after s |\n"
        "|---|---|---|---|---|---|---|---|---|\n"
    )
    rows = [
        f"| {b} | {r['first_sync_s']:.1f} | {r['window_s']:.0f} | {r['cpu_s']:.2f} | {r['core_share']:.2%} "
        f"| {r['steady_mib']:.0f} | {r['max_mib']:.0f} | {r['full_syncs_in_window']:.0f} | {r['repaired_after_s']:.1f} |"
        for b, r in results.items()
    ]
    return head + "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--services", type=int, default=10000)
    parser.add_argument("--endpoints", type=int, default=10)
    parser.add_argument("--backends", default="nft,iptables")
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout whose daemon runs")
    parser.add_argument("--window", type=float, default=300.0, help="idle seconds measured")
    parser.add_argument("--settle", type=float, default=10.0, help="seconds after the first sync before the window")
    parser.add_argument("--sync-period", default="30s", help="the daemon's periodic sync (kube-proxy: 30s)")
    parser.add_argument("--iptables-flavour", default="legacy", help="as the daemon's flag (kube-proxy: legacy)")
    parser.add_argument("--source", choices=("manifests", "api"), default="manifests",
                        help="where the daemon reads the cluster: manifest files, or the real kube-apiserver")
    parser.add_argument("--kube-dir", type=Path, default=Path("/tmp/nfproxy-kube-idle"),
                        help="--source api: the scripts/kube directory (reused when up and holding the cluster)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench/idle.py needs root (network namespaces)")
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="nfp-idle-") as tmp:
        if args.source == "api":
            source = ["--kubeconfig", str(api_cluster(args.kube_dir, args.services, args.endpoints))]
        else:
            write_manifests(args.services, args.endpoints, Path(tmp))
            source = ["--manifests", tmp, "--max-manifest-bytes", "64Mi"]
        for backend in args.backends.split(","):
            results[backend] = run_daemon(backend, source, args.root.resolve(), args.window,
                                          args.sync_period, args.iptables_flavour, args.settle)
            print(f"{backend}: {results[backend]}", file=sys.stderr, flush=True)
    print(json.dumps(results) if args.json else
          table(results, args.services, args.endpoints, args.sync_period, args.source))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""nfproxy against the real kube-proxy, both modes, one run, in turns (issue O).

The real control plane and kube-proxy v1.37.2 come from `scripts/kube` (built from
k8s.io/kubernetes). The cluster (nfproxy/testing.py's uniform shape: S IPv4 ClusterIP services x
N endpoints on another node) is written once to kube-apiserver; then, for each mode and each
round, kube-proxy and nfproxy take turns on a fresh network namespace, each measured alone:

- cold start: from the process's start to its first complete sync (its
  kubeproxy_sync_proxy_rules_last_timestamp_seconds set; the rules are all in the kernel then);
- one Service added, one endpoint changed: 2 s after the sync before (past both proxies'
  --min-sync-period of 1 s), from just before the API write to the end of the first sync after
  it (the same metric, polled every 20 ms);
- idle: CPU seconds (user + system, children included) over `--idle` seconds with nothing
  changing, as a share of one core, and RSS at the end of the window and its peak (VmHWM).

Ratios nfproxy / kube-proxy are printed per mode, from medians over the rounds. The machine has
2 shared cores: absolute times drift; the ratios are taken in one run, in turns.

Both proxies run the same iptables flavour: `--iptables legacy` puts a directory first in both
processes' PATH whose `iptables*`/`ip6tables*` are the legacy commands (kube-proxy runs whatever
`iptables` its PATH gives, nfproxy asks `iptables --version` in a fresh namespace, as
kube-proxy's iptables-wrapper does); `nft` (the default) leaves the machine's alternatives.
A kube-proxy turn that has not synced within `--kube-proxy-limit` seconds is stopped and shown
as not finished; `--proxies nfproxy` measures nfproxy alone (sizes kube-proxy cannot reach).

Usage: sudo .venv/bin/python bench/kube_proxy.py [--services 1000] [--endpoints 10]
       [--modes iptables,nftables] [--rounds 2] [--idle 60] [--iptables nft|legacy]
       [--proxies kube-proxy,nfproxy] [--kube-proxy-limit 1800]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from nfproxy.kernel import netns as netns_mod  # noqa: E402
from nfproxy.testing import uniform_cluster  # noqa: E402

KUBE = ROOT / "scripts" / "kube"
NODE = "node-a"
SYNCED = "kubeproxy_sync_proxy_rules_last_timestamp_seconds"
# Both proxies' --min-sync-period is 1 s: a change waits this long after the sync before it, so
# the figure is the reaction to the change, not the rate limit.
QUIET = 2.0
_LEGACY_COMMANDS = ("iptables", "iptables-save", "iptables-restore", "ip6tables", "ip6tables-save", "ip6tables-restore")


class NotSynced(Exception):
    """A proxy made no first sync within its limit."""


def legacy_path() -> str:
    """A PATH whose iptables commands are the legacy ones (the machine's alternatives untouched)."""
    d = Path(tempfile.mkdtemp(prefix="nfproxy-kpbench-legacy-"))
    for name in _LEGACY_COMMANDS:  # the multi-call binary acts as the name it is run under
        (d / name).symlink_to("/usr/sbin/xtables-legacy-multi")
    return f"{d}:{os.environ.get('PATH', '')}"


def sh(*args: str, stdin: str | None = None, timeout: float = 1800) -> str:
    done = subprocess.run(args, input=stdin, capture_output=True, text=True, timeout=timeout)
    if done.returncode:
        raise SystemExit(f"{' '.join(args[:4])}...: {done.stderr.strip()[-2000:]}")
    return done.stdout


class Plane:
    def __init__(self, directory: str) -> None:
        self.dir = directory
        sh(str(KUBE), "up", "--dir", directory, "--service-cidr", "172.16.0.0/12", "--etcd-no-fsync")
        self.kubeconfig = f"{directory}/admin.kubeconfig"
        self.kubectl_path = sh(str(KUBE), "path", "kubectl").strip()

    def kubectl(self, *args: str, stdin: str | None = None) -> str:
        return sh(self.kubectl_path, "--kubeconfig", self.kubeconfig, *args, stdin=stdin)

    def apply(self, objects: list[dict[str, Any]]) -> None:
        """In chunks, each retried: a loaded machine's etcd times requests out now and then, and
        a server-side apply of the same objects again is harmless."""
        for i in range(0, len(objects), 500):
            doc = json.dumps({"apiVersion": "v1", "kind": "List", "items": objects[i:i + 500]})
            for attempt in range(5):
                done = subprocess.run([self.kubectl_path, "--kubeconfig", self.kubeconfig, "apply", "--server-side",
                                       "--force-conflicts", "-f", "-"], input=doc, capture_output=True, text=True,
                                      timeout=1800)
                if not done.returncode:
                    break
                print(f"  apply of objects {i}..: {done.stderr.strip()[-200:]} (attempt {attempt + 1})", flush=True)
                time.sleep(5)
            else:
                raise SystemExit("the cluster could not be written")

    def create(self, obj: dict[str, Any]) -> None:
        """One object through the API client: a write timed from just before the request."""
        from kubernetes import config, utils

        if not hasattr(self, "_api"):
            self._api = config.new_client_from_config(self.kubeconfig)
        utils.create_from_dict(self._api, obj)


def cluster_objects(services: int, endpoints: int) -> list[dict[str, Any]]:
    from nfproxy.testing import manifest_objects

    objects = manifest_objects(uniform_cluster(services, endpoints))
    namespaces = sorted({o["metadata"]["namespace"] for o in objects})
    for obj in objects:
        if obj["kind"] == "Service":  # cluster IPs allocated by the server
            obj["spec"]["ports"][0]["targetPort"] = 8080
            del obj["spec"]["clusterIP"], obj["spec"]["clusterIPs"]
    node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE},
            "status": {"addresses": [{"type": "InternalIP", "address": "192.168.0.2"}]}}
    return [node] + [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": n}} for n in namespaces] + objects


def metric(url: str, ns: str | None) -> float:
    """The newest sync timestamp of either family (0: none yet)."""
    def read() -> str:
        with urllib.request.urlopen(url, timeout=5) as answer:  # noqa: S310 - loopback
            return answer.read().decode()
    try:
        if ns:
            with netns_mod.entered(ns):
                text = read()
        else:
            text = read()
    except OSError:
        return 0.0
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(SYNCED)]
    return max(values, default=0.0)


class Proxy:
    """One proxy process on a fresh namespace: kube-proxy (through scripts/kube) or nfproxy."""

    def __init__(self, who: str, mode: str, plane: Plane, env: dict[str, str], limit: float) -> None:
        self.who, self.mode, self.plane, self.limit = who, mode, plane, limit
        self.ns = f"nfp-kpb-{os.getpid()}-{who[:2]}"
        # The xtables lock is one file for every namespace of the machine: another program's
        # iptables elsewhere would make kube-proxy give up its first sync after 5 s (it exits).
        # The lock serialises writers of one namespace's tables; here the proxy is the only one.
        self.env = {**env, "XTABLES_LOCKFILE": f"{plane.dir}/xtables-{self.ns}.lock"}
        sh("ip", "netns", "add", self.ns)
        sh("ip", "-n", self.ns, "link", "set", "lo", "up")
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> float:
        """Seconds from the start to the first complete sync."""
        began = time.time()
        if self.who == "kube-proxy":
            env = {**self.env, "NFPROXY_KUBE_PROXY_WAIT": str(int(self.limit))}
            done = subprocess.run(
                [str(KUBE), "proxy", "--dir", self.plane.dir, self.ns, "--proxy-mode", self.mode,
                 "--hostname-override", NODE, "--cluster-cidr", "10.0.0.0/8"],
                capture_output=True, text=True, env=env, timeout=self.limit + 120)
            if done.returncode:
                raise NotSynced(done.stderr.strip()[-300:])
            self.url, self.url_ns = "http://127.0.0.1:10249/metrics", self.ns
            self.pid = int(Path(self.plane.dir, f"proxy-{self.ns}", "kube-proxy.pid").read_text())
            self.pid = _child(self.pid, "kube-proxy")
        else:
            port = _free_port()
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "nfproxy", "--proxy-mode", self.mode, "--kubeconfig", self.plane.kubeconfig,
                 "--netns", self.ns, "--hostname-override", NODE, "--cluster-cidr", "10.0.0.0/8",
                 "--metrics-bind-address", f"127.0.0.1:{port}", "--healthz-bind-address", ""],
                cwd=ROOT, env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
            self.url, self.url_ns, self.pid = f"http://127.0.0.1:{port}/metrics", None, self.proc.pid
        synced = _wait(lambda: metric(self.url, self.url_ns), 3600)
        if self.mode == "iptables":
            self.flavour = flavour_used(self.ns)
        return synced - began

    def change(self, write: Callable[[], None]) -> float:
        """Seconds from the API write (just before the request) to the end of the first sync
        after it."""
        time.sleep(QUIET)
        before = metric(self.url, self.url_ns)
        written = time.time()
        write()
        done = _wait(lambda: (v := metric(self.url, self.url_ns)) > max(before, written) and v, 600)
        return done - written

    def idle(self, seconds: float) -> tuple[float, float, float]:
        """(CPU share of one core, RSS MiB at the end, peak RSS MiB) over `seconds`."""
        cpu0 = _cpu(self.pid)
        time.sleep(seconds)
        cpu = (_cpu(self.pid) - cpu0) / seconds
        status = Path(f"/proc/{self.pid}/status").read_text()
        field = {ln.split(":")[0]: ln.split()[1] for ln in status.splitlines() if ln.startswith(("VmRSS", "VmHWM"))}
        return cpu, int(field["VmRSS"]) / 1024, int(field["VmHWM"]) / 1024

    def stop(self) -> None:
        if self.who == "kube-proxy":
            subprocess.run([str(KUBE), "proxy-stop", "--dir", self.plane.dir, self.ns], check=False)
        elif self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(60)
        subprocess.run(["ip", "netns", "del", self.ns], check=False)


def flavour_used(ns: str) -> str:
    """Which iptables flavour holds the proxy's KUBE-SERVICES chain: the bench checks, not trusts."""
    held = [f for f in ("legacy", "nft")
            if ":KUBE-SERVICES" in sh("ip", "netns", "exec", ns, f"iptables-{f}-save", "-t", "nat")]
    return ",".join(held) or "none"


def _child(pid: int, name: str) -> int:
    """`ip netns exec` execs the program: the recorded pid is kube-proxy's own (checked)."""
    comm = Path(f"/proc/{pid}/comm").read_text().strip()
    if comm != name:
        raise SystemExit(f"pid {pid} is {comm}, not {name}")
    return pid


def _cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = sum(int(fields[i]) for i in (11, 12, 13, 14))  # utime stime cutime cstime
    return ticks / os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(probe: Callable[[], float], timeout: float) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(0.02)
    raise SystemExit(f"no sync within {timeout}s")


def one_turn(who: str, mode: str, plane: Plane, round_: int, args: argparse.Namespace,
             env: dict[str, str]) -> dict[str, float]:
    proxy = Proxy(who, mode, plane, env, args.kube_proxy_limit)
    idle = args.idle
    try:
        try:
            out = {"cold start": proxy.start()}
        except NotSynced as e:
            print(f"  {mode} round {round_} {who}: no first sync within {args.kube_proxy_limit:.0f}s ({e})", flush=True)
            return {}
        name = f"bench-{who[:2]}-{mode[:2]}-{round_}"
        svc = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": "default"},
               "spec": {"ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}]}}
        out["one service added"] = proxy.change(lambda: plane.create(svc))
        sl = {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
              "metadata": {"name": f"{name}-a", "namespace": "default",
                           "labels": {"kubernetes.io/service-name": name,
                                      "endpointslice.kubernetes.io/managed-by": "bench"}},
              "addressType": "IPv4", "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
              "endpoints": [{"addresses": [f"10.255.{round_}.{len(who)}"], "conditions": {"ready": True}}]}
        out["one endpoint changed"] = proxy.change(lambda: plane.create(sl))
        share, out["idle RSS MiB"], out["peak RSS MiB"] = proxy.idle(idle)
        out["idle CPU % of a core"] = 100 * share
        if mode == "iptables":
            print(f"  {mode} round {round_} {who}: rules in iptables-{proxy.flavour}", flush=True)
        return out
    finally:
        proxy.stop()


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally blocks stop what was started
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--services", type=int, default=1000)
    p.add_argument("--endpoints", type=int, default=10)
    p.add_argument("--modes", default="iptables,nftables")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--idle", type=float, default=60.0)
    p.add_argument("--iptables", choices=("nft", "legacy"), default="nft")
    p.add_argument("--proxies", default="kube-proxy,nfproxy")
    p.add_argument("--kube-proxy-limit", type=float, default=1800.0)
    args = p.parse_args()
    env = dict(os.environ)
    if args.iptables == "legacy":
        env["PATH"] = legacy_path()
    proxies = tuple(args.proxies.split(","))
    directory = tempfile.mkdtemp(prefix="nfproxy-kpbench-")
    try:
        plane = Plane(directory)
        t = time.monotonic()
        plane.apply(cluster_objects(args.services, args.endpoints))
        print(f"cluster: {args.services} x {args.endpoints} written in {time.monotonic() - t:.1f}s", flush=True)
        for mode in args.modes.split(","):
            runs: dict[str, list[dict[str, float]]] = {who: [] for who in proxies}
            for r in range(args.rounds):
                for who in (proxies if r % 2 == 0 else proxies[::-1]):
                    runs[who].append(one_turn(who, mode, plane, r, args, env))
                    print(f"  {mode} round {r} {who}: {json.dumps({k: round(v, 3) for k, v in runs[who][-1].items()})}",
                          flush=True)
            report(mode, args, runs)
    finally:
        sh(str(KUBE), "down", "--dir", directory)  # also when stopped while coming up


def report(mode: str, args: argparse.Namespace, runs: dict[str, list[dict[str, float]]]) -> None:
    print(f"{mode} (iptables {args.iptables}), {args.services} x {args.endpoints}, medians of {args.rounds} rounds:")
    keys = next((list(x) for xs in runs.values() for x in xs if x), [])
    for key in keys:
        med = {who: statistics.median(vs) if (vs := [x[key] for x in xs if key in x]) else None
               for who, xs in runs.items()}
        shown = "   ".join(f"{who} {v:10.3f}" if v is not None else f"{who} {'not done':>10}" for who, v in med.items())
        ours, theirs = med.get("nfproxy"), med.get("kube-proxy")
        ratio = f"   nfproxy/kube-proxy {ours / theirs:.2f}x" if ours is not None and theirs else ""
        print(f"  {key:<28} {shown}{ratio}")


if __name__ == "__main__":
    main()

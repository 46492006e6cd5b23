"""The daemon as a node runs it: manifests change, rules follow; SIGTERM leaves the rules."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from nfproxy.daemon.node import Daemon, DaemonConfig
from nfproxy.kernel import netns
from nfproxy.kernel.nft import NftSession
from nfproxy.kernel.process import run
from nfproxy.sources.files import ManifestSource

pytestmark = pytest.mark.kernel

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

EXTRA = """\
apiVersion: v1
kind: Service
metadata: {name: extra, namespace: default}
spec:
  clusterIP: 10.96.77.7
  ports: [{name: http, port: 80, protocol: TCP}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: extra-1
  namespace: default
  labels: {kubernetes.io/service-name: extra}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints:
  - addresses: [10.244.7.7]
    conditions: {ready: true}
"""


def service_ips(ns: str) -> set[str]:
    doc = NftSession(ns).list_table("ip", "nfproxy") or {"nftables": []}
    for obj in doc["nftables"]:
        m = obj.get("map")
        if m and m["name"] == "service-ips":
            return {json.dumps(e) for e in m.get("elem", [])}
    return set()


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def wait_for(predicate, timeout: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_daemon_follows_manifest_changes_and_serves_health_and_metrics(tmp_path: Path) -> None:
    tree = tmp_path / "cluster"
    shutil.copytree(EXAMPLES, tree)
    with netns.throwaway("nfp-daemon") as ns:
        source = ManifestSource(tree, poll=0.05)
        config = DaemonConfig(
            "nft", netns=ns, min_sync_period=0.1, healthz_bind_address="127.0.0.1:0",
            metrics_bind_address="127.0.0.1:0",
        )
        daemon = Daemon(source, config)
        daemon.start()
        try:
            assert daemon.loop.wait_synced(10)
            before = service_ips(ns)
            assert before and not any("10.96.77.7" in e for e in before)
            hz = daemon.servers.healthz
            status, body = get(f"http://127.0.0.1:{hz.port}/healthz")
            assert status == 200 and json.loads(body)["nodeEligible"] is True

            (tree / "extra.yaml").write_text(EXTRA)
            assert wait_for(lambda: any("10.96.77.7" in e for e in service_ips(ns)))
            result = daemon.proxier.last_result
            assert result is not None and result.kind == "partial" and result.services_changed == 1

            (tree / "extra.yaml").unlink()
            assert wait_for(lambda: service_ips(ns) == before)

            mt = daemon.servers.metrics
            status, text = get(f"http://127.0.0.1:{mt.port}/metrics")
            assert status == 200
            for name in (
                "kubeproxy_sync_proxy_rules_duration_seconds_bucket",
                "kubeproxy_sync_partial_proxy_rules_duration_seconds_count",
                "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
                "kubeproxy_sync_proxy_rules_service_changes_total",
            ):
                assert name in text, name
            objects = {
                l.split("{", 1)[1].split("}", 1)[0]: float(l.rsplit(" ", 1)[1])
                for l in text.splitlines()
                if l.startswith("nfproxy_nftables_objects{")
            }
            # The example cluster's IPv4 table, as the kernel was told: 16 + 10 service chains.
            assert objects['ip_family="IPv4",object="chains"'] > 20, objects
            assert objects['ip_family="IPv4",object="elements"'] > 10, objects
            partial = [l for l in text.splitlines() if l.startswith("kubeproxy_sync_partial_proxy_rules_duration_seconds_count")]
            assert any(float(l.rsplit(" ", 1)[1]) >= 2 for l in partial), partial
        finally:
            daemon.stop()


def test_bad_manifest_edit_keeps_the_rest(tmp_path: Path) -> None:
    tree = tmp_path / "cluster"
    shutil.copytree(EXAMPLES, tree)
    with netns.throwaway("nfp-daemon") as ns:
        source = ManifestSource(tree, poll=0.05)
        daemon = Daemon(source, DaemonConfig("nft", netns=ns, min_sync_period=0.05,
                                             healthz_bind_address="", metrics_bind_address=""))
        daemon.start()
        try:
            assert daemon.loop.wait_synced(10)
            before = service_ips(ns)
            (tree / "broken.yaml").write_text(EXTRA.replace("10.96.77.7", "10.96.777.7"))
            time.sleep(0.5)
            assert daemon.loop.wait_synced(5)
            assert service_ips(ns) == before
            assert any("clusterIP" in str(e) for e in source.snapshot().errors)
        finally:
            daemon.stop()


@pytest.mark.parametrize("backend", ["nft", "iptables"])
def test_sigterm_exits_cleanly_and_leaves_the_rules(tmp_path: Path, backend: str) -> None:
    with netns.throwaway("nfp-daemon") as ns:
        proc = subprocess.Popen(
            [sys.executable, "-m", "nfproxy.cli.main", "--backend", backend, "--manifests", str(EXAMPLES),
             "--netns", ns, "--healthz-bind-address", "127.0.0.1:0", "--metrics-bind-address", "",
             "--min-sync-period", "100ms"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        try:
            def synced() -> bool:
                if backend == "nft":
                    return bool(service_ips(ns))
                return "KUBE-SVC-" in run(["iptables-save", "-t", "nat"], netns=ns)

            assert wait_for(synced, 30), proc.stderr.read() if proc.poll() is not None else "no sync"
            proc.send_signal(signal.SIGTERM)
            out, err = proc.communicate(timeout=15)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 0, err
        # kube-proxy's sync line (V(2); with --v, once the flag is wired, it needs --v=2).
        mode = "nftables" if backend == "nft" else backend
        assert f"Syncing {mode} rules" in err and 'kind="full"' in err and "SIGTERM" in err
        assert synced(), "rules must stay after SIGTERM"
        subprocess.run([sys.executable, "-m", "nfproxy.cli.main", "cleanup", "--netns", ns], check=True,
                       capture_output=True)
        assert not synced()


def test_daemon_flag_errors() -> None:
    def nfproxy(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "nfproxy.cli.main", *argv], capture_output=True, text=True)

    p = nfproxy("--backend", "nft", "--manifests", str(EXAMPLES), "--min-sync-period", "fast", "--once")
    assert p.returncode == 2 and "--min-sync-period: not a duration: 'fast'" in p.stderr
    p = nfproxy("--backend", "nft", "--manifests", "/no/such/dir", "--once")
    assert p.returncode == 2 and "--manifests: no such file or directory" in p.stderr
    p = nfproxy("--backend", "nft", "--manifests", str(EXAMPLES), "--netns", "nfp-missing-ns", "--once")
    assert p.returncode == 2 and "--netns: no network namespace named 'nfp-missing-ns'" in p.stderr
    p = nfproxy("--backend", "pf", "--manifests", str(EXAMPLES))
    assert p.returncode == 2 and "invalid choice: 'pf'" in p.stderr


def test_per_sync_bookkeeping_from_changes_equals_a_full_walk() -> None:
    """The daemon counts no-local-endpoint ports and finds stale UDP flows from a sync's changes
    only; that must give what walking every service gives."""
    import dataclasses
    import random

    from nfproxy.core.changes import diff
    from nfproxy.daemon.conntrack import stale_flows
    from nfproxy.daemon.node import NoLocalEndpoints
    from nfproxy.core.model import IPFamily
    from nfproxy.testing import random_cluster

    rng = random.Random(3)
    state = random_cluster(random.Random(11), 60)
    tracked = NoLocalEndpoints()
    tracked.update(state, state.services)
    for _ in range(30):
        keys = sorted(state.services, key=str)
        key = rng.choice(keys)
        endpoints = dict(state.endpoints)
        eps = list(endpoints.get(key, ()))
        if eps and rng.random() < 0.5:
            eps.pop(rng.randrange(len(eps)))
        elif eps:
            eps[0] = dataclasses.replace(eps[0], node_name=rng.choice(["node-a", "node-b"]))
        endpoints[key] = tuple(eps)
        services = dict(state.services)
        if rng.random() < 0.2:
            del services[rng.choice(keys)]
        new = dataclasses.replace(state, services=services, endpoints=endpoints)
        changes = diff(state, new)
        assert stale_flows(state, new, changes.keys) == stale_flows(state, new)
        tracked.update(new, changes.keys)
        fresh = NoLocalEndpoints()
        fresh.update(new, new.services)
        for family in IPFamily:
            assert tracked.counts(family) == fresh.counts(family)
        state = new

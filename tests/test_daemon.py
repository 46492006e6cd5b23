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
from nfproxy.kernel import netns, sysctl
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
            assert wait_for(lambda: any("10.96.77.7" in e for e in service_ips(ns)), 30)
            # The kernel has it; the sync's bookkeeping (last_result, metrics) follows its apply.
            assert daemon.loop.wait_synced(10)
            result = daemon.proxier.last_result
            assert result is not None and result.kind == "partial" and result.services_changed == 1

            (tree / "extra.yaml").unlink()
            assert wait_for(lambda: service_ips(ns) == before, 30)
            assert daemon.loop.wait_synced(10)

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
            # Registered per backend, as kube-proxy's RegisterMetrics(mode): no iptables families.
            assert "kubeproxy_sync_proxy_rules_iptables" not in text and "_created" not in text
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
             "--min-sync-period", "100ms", "--v=2"],
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
    p = nfproxy("--backend", "nft", "--manifests", str(EXAMPLES), "--netns", "nfp-missing-ns", "--once")
    assert p.returncode == 2 and "--netns: no network namespace named 'nfp-missing-ns'" in p.stderr
    p = nfproxy("--backend", "pf", "--manifests", str(EXAMPLES))
    assert p.returncode == 2 and "invalid choice: 'pf'" in p.stderr


@pytest.mark.kernel
def test_a_missing_manifests_path_stops_the_start_before_any_sysctl_is_set() -> None:
    """The source is built before the conntrack sysctls are written: a bad --manifests changes
    nothing (it used to set them first, and without --netns that was the root namespace)."""
    established = "net.netfilter.nf_conntrack_tcp_timeout_established"
    with netns.throwaway("nfp-flags") as ns:
        before = sysctl.read(established, ns)
        p = subprocess.run([sys.executable, "-m", "nfproxy.cli.main", "--backend", "nft", "--manifests",
                            "/no/such/dir", "--once", "--netns", ns], capture_output=True, text=True)
        assert p.returncode == 2 and "--manifests: no such file or directory" in p.stderr
        assert sysctl.read(established, ns) == before


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


DUAL = """\
apiVersion: v1
kind: Service
metadata: {name: dual, namespace: default}
spec:
  ipFamilyPolicy: RequireDualStack
  ipFamilies: [IPv4, IPv6]
  clusterIP: 10.96.90.1
  clusterIPs: [10.96.90.1, "fd00:96::1"]
  ports: [{name: http, port: 80, protocol: TCP}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: dual-v4
  namespace: default
  labels: {kubernetes.io/service-name: dual}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints:
  - addresses: [10.244.9.9]
    conditions: {ready: true}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: dual-v6
  namespace: default
  labels: {kubernetes.io/service-name: dual}
addressType: IPv6
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints:
  - addresses: ["fd00:244::9"]
    conditions: {ready: true}
"""


def ten_ipv4_services() -> str:
    docs = []
    for i in range(10):
        docs.append(
            EXTRA.replace("extra-1", f"ten-{i}-1").replace("name: extra", f"name: ten-{i}")
            .replace("service-name: extra", f"service-name: ten-{i}")
            .replace("10.96.77.7", f"10.96.78.{i + 1}").replace("10.244.7.7", f"10.244.8.{i + 1}")
        )
    return "---\n".join(docs)


def scrape(port: int) -> dict[str, float]:
    """`name{labels}` -> value, from the daemon's /metrics."""
    status, text = get(f"http://127.0.0.1:{port}/metrics")
    assert status == 200
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


@pytest.mark.parametrize("backend", ["nft", "iptables"])
def test_dual_stack_metrics_are_each_familys_own_and_changes_count_once(tmp_path: Path, backend: str) -> None:
    tree = tmp_path / "cluster"
    shutil.copytree(EXAMPLES, tree)
    (tree / "dual.yaml").write_text(DUAL)
    with netns.throwaway("nfp-daemon") as ns:
        source = ManifestSource(tree, poll=0.05)
        config = DaemonConfig(backend, netns=ns, min_sync_period=0.1, healthz_bind_address="",
                              metrics_bind_address="127.0.0.1:0")
        daemon = Daemon(source, config)
        daemon.start()
        try:
            assert daemon.loop.wait_synced(30)
            port = daemon.servers.metrics.port
            before = scrape(port)
            v4, v6 = 'ip_family="IPv4"', 'ip_family="IPv6"'
            # The first sync: each family timed and counted on its own; the IPv6 table holds one
            # service, the IPv4 one a dozen, so their kernel operations differ.
            full_ops = "nfproxy_sync_kernel_operations_sum{%s,kind=\"full\"}"
            assert before[full_ops % v4] > before[full_ops % v6] > 0, before
            for fam in (v4, v6):
                assert before["kubeproxy_sync_full_proxy_rules_duration_seconds_count{%s}" % fam] == 1

            tmp = tree / ".ten.tmp"
            tmp.write_text(ten_ipv4_services())
            tmp.rename(tree / "ten.yaml")  # at once: no half-written file

            changes = "kubeproxy_sync_proxy_rules_service_changes_total"
            assert wait_for(lambda: scrape(port)[changes] >= before[changes] + 10, 30)
            assert daemon.loop.wait_synced(10)
            after = scrape(port)
            # 10 created services are 10 service changes and 10 endpoint changes, not 20.
            assert after[changes] - before[changes] == 10
            eps = "kubeproxy_sync_proxy_rules_endpoint_changes_total"
            assert after[eps] - before[eps] == 10
            # Only IPv4 had work: its partial syncs are counted, IPv6's are not.
            partial = "kubeproxy_sync_partial_proxy_rules_duration_seconds_count{%s}"
            assert after[partial % v4] - before.get(partial % v4, 0) >= 1
            assert after.get(partial % v6, 0) == before.get(partial % v6, 0)
            last_ops = "nfproxy_sync_kernel_operations_last{%s}"
            assert after[last_ops % v6] == before[last_ops % v6]
            assert after[last_ops % v4] != before[last_ops % v4]
            # Both families are up to date: each has its own last-synced time.
            stamp = "kubeproxy_sync_proxy_rules_last_timestamp_seconds{%s}"
            assert after[stamp % v4] >= before[stamp % v4] and after[stamp % v6] > 0
        finally:
            daemon.stop()


class StillSource:
    """A source the test drives by hand (the daemon's loop is never started)."""

    def start(self, notify) -> None:  # type: ignore[no-untyped-def]
        pass

    def stop(self) -> None:
        pass

    def ready(self) -> bool:
        return True


def test_nft_cleanup_failures_are_counted_and_the_sync_goes_through() -> None:
    import dataclasses

    from nfproxy.core.model import IPFamily
    from nfproxy.testing import uniform_cluster

    state = uniform_cluster(3, 2)
    keys = sorted(state.services, key=str)
    with netns.throwaway("nfp-daemon") as ns:
        daemon = Daemon(StillSource(), DaemonConfig("nft", netns=ns, conntrack=False))  # type: ignore[arg-type]
        session = NftSession(ns)
        try:
            daemon.proxier.sync(state)
            gone = dataclasses.replace(
                state,
                services={k: v for k, v in state.services.items() if k != keys[0]},
                endpoints={k: v for k, v in state.endpoints.items() if k != keys[0]},
            )
            daemon.proxier.sync(gone)  # keys[0]'s chains are emptied now, deleted next time
            tag = f"{keys[0][0].namespace}/{keys[0][0].name}/"
            stale = sorted(c for c in session.object_names("ip", "nfproxy")[0] if tag in c)
            assert stale
            # Someone else's rule jumps to a stale chain: nft refuses to delete it (EBUSY).
            session.apply(f"add chain ip nfproxy foreign\nadd rule ip nfproxy foreign jump {stale[0]}\n")
            fewer = dataclasses.replace(
                gone,
                endpoints={**gone.endpoints, keys[1]: gone.endpoints[keys[1]][:1]},
            )
            result = daemon.proxier.sync(fewer)
            assert result.kind == "partial" and result.families[IPFamily.V4].cleanup_failed
            failures = "kubeproxy_sync_proxy_rules_nftables_cleanup_failures_total"
            reg = daemon.metrics.registry
            assert reg.get_sample_value(failures, {"ip_family": "IPv4"}) == 1
            assert reg.get_sample_value(failures, {"ip_family": "IPv6"}) in (None, 0)
            assert reg.get_sample_value("kubeproxy_sync_proxy_rules_nftables_sync_failures_total",
                                        {"ip_family": "IPv4"}) in (None, 0)
            # The change itself went through: keys[1] has one endpoint chain left.
            assert daemon.proxier.state is fewer
            assert stale[0] in session.object_names("ip", "nfproxy")[0]
            # Once the foreign jump is gone, the next sync deletes the stale chain.
            session.apply("delete chain ip nfproxy foreign\n")
            result = daemon.proxier.sync(gone)
            assert not result.families[IPFamily.V4].cleanup_failed
            assert stale[0] not in session.object_names("ip", "nfproxy")[0]
            assert reg.get_sample_value(failures, {"ip_family": "IPv4"}) == 1
        finally:
            daemon.stop()


def test_taken_ports_are_retried_or_with_hard_fail_stop_the_daemon(tmp_path: Path) -> None:
    import socket

    from nfproxy.daemon.server import BindError

    squatter = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    squatter.bind(("127.0.0.1", 0))
    squatter.listen(1)
    taken = f"127.0.0.1:{squatter.getsockname()[1]}"
    try:
        with netns.throwaway("nfp-daemon") as ns:
            hard = DaemonConfig("nft", netns=ns, healthz_bind_address=taken, metrics_bind_address="",
                                bind_address_hard_fail=True)
            daemon = Daemon(ManifestSource(EXAMPLES, poll=0.05), hard)
            with pytest.raises(BindError, match="--healthz-bind-address"):
                daemon.start()
            daemon.stop()
            assert service_ips(ns) == set()  # it never synced
            # Without hard fail (kube-proxy's default) the daemon runs and the port waits.
            soft = DaemonConfig("nft", netns=ns, min_sync_period=0.1, healthz_bind_address=taken,
                                metrics_bind_address="")
            daemon = Daemon(ManifestSource(EXAMPLES, poll=0.05), soft)
            daemon.start()
            try:
                assert daemon.loop.wait_synced(30) and service_ips(ns)
                assert daemon.servers.healthz is None
            finally:
                daemon.stop()
    finally:
        squatter.close()


def test_network_programming_latency_from_the_api_sources_trigger_times() -> None:
    import datetime

    from nfproxy.core.model import NodeConfig
    from nfproxy.sources.kube import TRIGGER_TIME, KubeSource, WatchSettings, api_client
    from tests.apiserver import FakeApiServer, endpoint_slice, service

    def triggered(slice_: dict, seconds_ago: float) -> dict:
        when = datetime.datetime.now(datetime.UTC) - datetime.timedelta(seconds=seconds_ago)
        slice_["metadata"]["annotations"] = {TRIGGER_TIME: when.isoformat().replace("+00:00", "Z")}
        return slice_

    name = "kubeproxy_network_programming_duration_seconds"
    with FakeApiServer(bookmark_interval=0.2) as api, netns.throwaway("nfp-daemon") as ns:
        api.apply(service("web", "10.96.0.10"))
        api.apply(triggered(endpoint_slice("web-1", "web", ["10.244.0.5"]), 30))
        settings = WatchSettings(watch_timeout=5, connect_timeout=1.0, watch_read_margin=3.0,
                                 list_timeout=3.0, backoff_initial=0.05, backoff_max=0.4)
        source = KubeSource(api_client(master=api.url), NodeConfig(name="node-a"), settings)
        daemon = Daemon(source, DaemonConfig("nft", netns=ns, min_sync_period=0.1,
                                             healthz_bind_address="", metrics_bind_address=""))
        reg = daemon.metrics.registry
        daemon.start()
        try:
            assert wait_for(lambda: reg.get_sample_value(f"{name}_count", {"ip_family": "IPv4"}) == 1, 30)
            # Triggered 30 s before the sync: that is what the SLO histogram says.
            assert 30 <= reg.get_sample_value(f"{name}_sum", {"ip_family": "IPv4"}) < 300
            assert reg.get_sample_value(f"{name}_bucket", {"ip_family": "IPv4", "le": "29.0"}) == 0
            api.apply(triggered(endpoint_slice("web-1", "web", ["10.244.0.5", "10.244.0.6"]), 2))
            assert wait_for(lambda: reg.get_sample_value(f"{name}_count", {"ip_family": "IPv4"}) == 2, 30)
            # A Service change with no endpoint change programs no new trigger time.
            api.apply(service("web", "10.96.0.10", [("http", 81, "TCP")]))
            assert wait_for(lambda: (daemon.proxier.state is not None and any(
                s.port == 81 for s in daemon.proxier.state.services.values())), 30)
            assert daemon.loop.wait_synced(10)
            assert reg.get_sample_value(f"{name}_count", {"ip_family": "IPv4"}) == 2
            assert reg.get_sample_value(f"{name}_count", {"ip_family": "IPv6"}) in (None, 0)
        finally:
            daemon.stop()

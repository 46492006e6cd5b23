"""Exposition parity with kube-proxy: what a scrape of the daemon's registry shows.

Each test reads the text exposition, as Prometheus does, and checks series names, buckets and
labels against kube-proxy's (pkg/proxy/metrics, component-base/metrics).
"""

from __future__ import annotations

import re

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from nfproxy import __version__
from nfproxy.core.model import IPFamily
from nfproxy.daemon.metrics import ProxyMetrics

V4, V6 = IPFamily.V4, IPFamily.V6

IPTABLES_ONLY = (
    "kubeproxy_sync_proxy_rules_iptables_restore_failures_total",
    "kubeproxy_sync_proxy_rules_iptables_partial_restore_failures_total",
    "kubeproxy_sync_proxy_rules_iptables_total",
    "kubeproxy_sync_proxy_rules_iptables_last",
)
NFT_ONLY = (
    "kubeproxy_sync_proxy_rules_nftables_sync_failures_total",
    "kubeproxy_sync_proxy_rules_nftables_cleanup_failures_total",
    "nfproxy_nftables_objects",
)
# component-base/metrics/prometheus/version: kubernetes_build_info's label names.
BUILD_INFO_LABELS = {
    "major", "minor", "gitVersion", "gitCommit", "gitTreeState", "buildDate", "goVersion", "compiler", "platform",
}
EVERY_MODE = (
    "kubeproxy_sync_proxy_rules_duration_seconds",
    "kubeproxy_network_programming_duration_seconds",
    "kubeproxy_sync_proxy_rules_no_local_endpoints_total",
    "kubeproxy_proxy_healthz_total",
    "kubeproxy_conntrack_reconciler_deleted_entries_total",
    "kubeproxy_conntrack_reconciler_sync_duration_seconds",
    "kubernetes_build_info",
)


def scrape(m: ProxyMetrics) -> str:
    return generate_latest(m.registry).decode()


def declared(text: str) -> set[str]:
    """Names the exposition declares a TYPE for (what kube-proxy registers, samples or not)."""
    return set(re.findall(r"^# TYPE (\S+) ", text, re.M))


def daemon_metrics(**kwargs: object) -> ProxyMetrics:
    """The daemon's registry: the one ProxyMetrics makes itself."""
    return ProxyMetrics(process_metrics=False, **kwargs)  # type: ignore[arg-type]


def test_network_programming_has_kube_proxys_zero_bucket() -> None:
    m = daemon_metrics()
    m.network_programmed(0.0, family=V4)
    m.network_programmed(0.1, family=V4)
    text = scrape(m)
    name = "kubeproxy_network_programming_duration_seconds_bucket"
    assert f'{name}{{ip_family="IPv4",le="0.0"}} 1.0' in text
    assert f'{name}{{ip_family="IPv4",le="0.25"}} 2.0' in text
    buckets = re.findall(rf'^{name}{{ip_family="IPv4",le="([^"]+)"}}', text, re.M)
    assert len(buckets) == 82  # 81 finite bounds, as kube-proxy's, and +Inf
    assert buckets[0] == "0.0" and buckets[-2] == "300.0" and buckets[-1] == "+Inf"


def test_conntrack_deletions_are_counted_under_kube_proxys_name_too() -> None:
    m = daemon_metrics()
    m.conntrack_cleaned(5, family=V4)
    m.conntrack_cleaned(2, family=V6)
    m.conntrack_cleaned(0, family=V4)
    text = scrape(m)
    assert "# TYPE kubeproxy_conntrack_reconciler_deleted_entries_total counter" in text
    assert ("# HELP kubeproxy_conntrack_reconciler_deleted_entries_total "
            "Cumulative conntrack flows deleted by conntrack reconciler") in text
    assert 'kubeproxy_conntrack_reconciler_deleted_entries_total{ip_family="IPv4"} 5.0' in text
    assert 'kubeproxy_conntrack_reconciler_deleted_entries_total{ip_family="IPv6"} 2.0' in text
    # nfproxy's own name stays, with the same counts.
    assert 'nfproxy_conntrack_deleted_entries_total{ip_family="IPv4"} 5.0' in text


def test_a_reconciliation_is_timed_under_kube_proxys_name() -> None:
    m = daemon_metrics()
    m.conntrack_reconciled(0.003, family=V4)
    text = scrape(m)
    name = "kubeproxy_conntrack_reconciler_sync_duration_seconds"
    assert f"# TYPE {name} histogram" in text
    assert f"# HELP {name} ReconcileConntrackFlowsLatency latency in seconds" in text
    assert f'{name}_bucket{{ip_family="IPv4",le="0.002"}} 0.0' in text
    assert f'{name}_bucket{{ip_family="IPv4",le="0.004"}} 1.0' in text
    buckets = re.findall(rf'^{name}_bucket{{ip_family="IPv4",le="([^"]+)"}}', text, re.M)
    assert buckets[0] == "0.001" and buckets[-2] == "16.384" and len(buckets) == 16  # ExponentialBuckets(0.001, 2, 15)
    assert f'{name}_count{{ip_family="IPv6"}}' not in text


def test_daemon_registry_exports_no_created_series() -> None:
    m = daemon_metrics()
    m.observe_sync("full", 0.01, family=V4)
    m.apply_failed("nft", family=V4)
    m.probe_answered("healthz", 200)
    m.conntrack_cleaned(1, family=V4)
    text = scrape(m)
    assert "_created" not in text
    # The rest of each family is all there.
    assert 'kubeproxy_proxy_healthz_total{code="200"} 1.0' in text
    assert 'kubeproxy_sync_proxy_rules_duration_seconds_count{ip_family="IPv4"} 1.0' in text
    assert 'kubeproxy_sync_proxy_rules_duration_seconds_bucket{ip_family="IPv4",le="+Inf"} 1.0' in text
    assert m.registry.get_sample_value("kubeproxy_proxy_healthz_total", {"code": "200"}) == 1


def test_a_registry_given_is_left_as_it_is() -> None:
    m = ProxyMetrics(CollectorRegistry(), process_metrics=False)
    m.probe_answered("livez", 200)
    assert "kubeproxy_proxy_livez_created" in scrape(m)


def test_build_info_has_kube_proxys_labels_and_nfproxys_version() -> None:
    text = scrape(daemon_metrics())
    assert "# TYPE kubernetes_build_info gauge" in text
    (line,) = [ln for ln in text.splitlines() if ln.startswith("kubernetes_build_info{")]
    labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
    assert set(labels) == BUILD_INFO_LABELS
    assert line.endswith(" 1.0")
    major, minor = __version__.split(".")[:2]
    assert labels["gitVersion"] == f"v{__version__}"
    assert (labels["major"], labels["minor"]) == (major, minor)
    assert labels["goVersion"].startswith("python3.")
    assert re.fullmatch(r"[a-z0-9]+/[a-z0-9_]+", labels["platform"])


@pytest.mark.parametrize(("backend", "present", "absent"), [
    ("iptables", IPTABLES_ONLY, NFT_ONLY),
    ("nft", NFT_ONLY, IPTABLES_ONLY),
])
def test_backend_registers_only_its_own_families(backend: str, present: tuple[str, ...],
                                                 absent: tuple[str, ...]) -> None:
    names = declared(scrape(daemon_metrics(backend=backend)))
    for name in present + EVERY_MODE:
        assert name in names, name
    for name in absent:
        assert name not in names, name


def test_no_backend_registers_both() -> None:
    names = declared(scrape(daemon_metrics()))
    for name in IPTABLES_ONLY + NFT_ONLY + EVERY_MODE:
        assert name in names, name


def test_events_of_the_other_backend_are_refused() -> None:
    m = daemon_metrics(backend="nft")
    m.apply_failed("nft", family=V4)
    m.cleanup_failed(family=V4)
    m.set_rule_counts("nft", {"chains": 3}, family=V4)
    with pytest.raises(ValueError, match="iptables metrics are not registered"):
        m.apply_failed("iptables", family=V4)
    with pytest.raises(ValueError, match="iptables metrics are not registered"):
        m.set_rule_counts("iptables", {"nat": 1}, family=V4)
    ipt = daemon_metrics(backend="iptables")
    with pytest.raises(ValueError, match="nft metrics are not registered"):
        ipt.cleanup_failed(family=V4)
    with pytest.raises(ValueError, match="unknown backend 'ipvs'"):
        daemon_metrics(backend="ipvs")

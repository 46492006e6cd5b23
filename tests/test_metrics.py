"""Metrics: kube-proxy's names, types, labels and buckets, in a registry of their own."""

from __future__ import annotations

import datetime

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from nfproxy.daemon.metrics import NETWORK_PROGRAMMING_BUCKETS, SYNC_BUCKETS, ProxyMetrics
from nfproxy.core.model import IPFamily

V4, V6 = IPFamily.V4, IPFamily.V6


class Clock:
    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def fresh(clock: Clock | None = None) -> ProxyMetrics:
    return ProxyMetrics(CollectorRegistry(), clock=clock or Clock(), process_metrics=False)


def value(m: ProxyMetrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, labels)


def types(m: ProxyMetrics) -> dict[str, str]:
    return {fam.name: fam.type for fam in m.registry.collect()}


# kube-proxy v1.33 (pkg/proxy/metrics/metrics.go): name -> (type, label names).
UPSTREAM = {
    "kubeproxy_sync_proxy_rules_duration_seconds": ("histogram", {"ip_family"}),
    "kubeproxy_sync_full_proxy_rules_duration_seconds": ("histogram", {"ip_family"}),
    "kubeproxy_sync_partial_proxy_rules_duration_seconds": ("histogram", {"ip_family"}),
    "kubeproxy_sync_proxy_rules_last_timestamp_seconds": ("gauge", {"ip_family"}),
    "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds": ("gauge", {"ip_family"}),
    "kubeproxy_sync_proxy_rules_endpoint_changes_pending": ("gauge", set()),
    "kubeproxy_sync_proxy_rules_endpoint_changes": ("counter", set()),
    "kubeproxy_sync_proxy_rules_service_changes_pending": ("gauge", set()),
    "kubeproxy_sync_proxy_rules_service_changes": ("counter", set()),
    "kubeproxy_sync_proxy_rules_iptables_restore_failures": ("counter", {"ip_family"}),
    "kubeproxy_sync_proxy_rules_iptables_partial_restore_failures": ("counter", {"ip_family"}),
    "kubeproxy_sync_proxy_rules_iptables_total": ("gauge", {"ip_family", "table"}),
    "kubeproxy_sync_proxy_rules_iptables_last": ("gauge", {"ip_family", "table"}),
    "kubeproxy_sync_proxy_rules_nftables_sync_failures": ("counter", {"ip_family"}),
    "kubeproxy_sync_proxy_rules_nftables_cleanup_failures": ("counter", {"ip_family"}),
    "kubeproxy_sync_proxy_rules_no_local_endpoints_total": ("gauge", {"ip_family", "traffic_policy"}),
    "kubeproxy_proxy_healthz": ("counter", {"code"}),
    "kubeproxy_proxy_livez": ("counter", {"code"}),
    "kubeproxy_network_programming_duration_seconds": ("histogram", {"ip_family"}),
}


def test_upstream_names_types_and_label_sets() -> None:
    m = fresh()
    # Touch every labelled metric once so its samples (and label names) show.
    m.queued(pending_services=1, pending_endpoints=1)
    m.network_programmed(1.0, family=V4)
    m.observe_sync("full", 0.1, family=V4)
    m.observe_sync("partial", 0.1, family=V4)
    m.apply_failed("iptables", family=V4)
    m.apply_failed("iptables", family=V4, partial=True)
    m.apply_failed("nft", family=V4)
    m.cleanup_failed(family=V4)
    m.set_rule_counts("iptables", {"nat": 1}, family=V4, written={"nat": 1})
    m.set_no_local_endpoints(0, 0, family=V4)
    m.probe_answered("healthz", 200)
    m.probe_answered("livez", 200)
    got = {fam.name: fam for fam in m.registry.collect()}
    for name, (kind, labels) in UPSTREAM.items():
        assert name in got, name
        assert got[name].type == kind, name
        sample_labels = {k for s in got[name].samples for k in s.labels} - {"le"}
        assert sample_labels == labels, name
    text = generate_latest(m.registry).decode()
    # Counters are exposed with _total, exactly as kube-proxy's.
    for exposed in (
        "kubeproxy_sync_proxy_rules_endpoint_changes_total ",
        "kubeproxy_sync_proxy_rules_iptables_restore_failures_total{",
        "kubeproxy_sync_proxy_rules_nftables_sync_failures_total{",
        'kubeproxy_proxy_healthz_total{code="200"} 1.0',
        "# TYPE kubeproxy_sync_proxy_rules_no_local_endpoints_total gauge",
    ):
        assert exposed in text, exposed


def test_sync_histogram_buckets_are_kube_proxys() -> None:
    assert SYNC_BUCKETS[0] == pytest.approx(0.001)
    assert SYNC_BUCKETS[-1] == pytest.approx(16.384)
    assert len(SYNC_BUCKETS) == 15
    m = fresh()
    m.observe_sync("full", 0.003, family=V4)
    name = "kubeproxy_sync_proxy_rules_duration_seconds_bucket"
    assert value(m, name, ip_family="IPv4", le="0.002") == 0
    assert value(m, name, ip_family="IPv4", le="0.004") == 1
    assert value(m, name, ip_family="IPv4", le="16.384") == 1


def test_observe_sync_splits_full_and_partial_per_family() -> None:
    clock = Clock(1000.0)
    m = fresh(clock)
    m.observe_sync("full", 2.0, family=V4, services_changed=3, endpoints_changed=5, operations=40)
    clock.now = 1010.0
    m.observe_sync("partial", 0.5, family=V6, services_changed=1, operations=0)
    assert value(m, "kubeproxy_sync_full_proxy_rules_duration_seconds_sum", ip_family="IPv4") == 2.0
    assert value(m, "kubeproxy_sync_full_proxy_rules_duration_seconds_count", ip_family="IPv6") is None
    assert value(m, "kubeproxy_sync_partial_proxy_rules_duration_seconds_count", ip_family="IPv6") == 1
    assert value(m, "kubeproxy_sync_proxy_rules_duration_seconds_count", ip_family="IPv4") == 1
    assert value(m, "kubeproxy_sync_proxy_rules_last_timestamp_seconds", ip_family="IPv4") == 1000.0
    assert value(m, "kubeproxy_sync_proxy_rules_last_timestamp_seconds", ip_family="IPv6") == 1010.0
    assert value(m, "kubeproxy_sync_proxy_rules_service_changes_total") == 4
    assert value(m, "kubeproxy_sync_proxy_rules_endpoint_changes_total") == 5
    assert value(m, "nfproxy_syncs_total", ip_family="IPv4", kind="full") == 1
    assert value(m, "nfproxy_syncs_total", ip_family="IPv6", kind="partial") == 1
    assert value(m, "nfproxy_sync_kernel_operations_last", ip_family="IPv4") == 40
    assert value(m, "nfproxy_sync_kernel_operations_last", ip_family="IPv6") == 0
    # The unchanged sync lands in the 0 bucket: "zero operations" is observable.
    assert value(m, "nfproxy_sync_kernel_operations_bucket", ip_family="IPv6", kind="partial", le="0.0") == 1
    with pytest.raises(ValueError, match="full.*partial"):
        m.observe_sync("noop", 0.1, family=V4)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="negative"):
        m.observe_sync("full", -1.0, family=V4)


def test_queued_sets_timestamps_and_pending_until_the_sync() -> None:
    clock = Clock(500.0)
    m = fresh(clock)
    m.queued(pending_services=2, pending_endpoints=7)
    for fam in ("IPv4", "IPv6"):
        assert value(m, "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds", ip_family=fam) == 500.0
    assert value(m, "kubeproxy_sync_proxy_rules_service_changes_pending") == 2
    assert value(m, "kubeproxy_sync_proxy_rules_endpoint_changes_pending") == 7
    clock.now = 501.0
    m.queued([V6])
    assert value(m, "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds", ip_family="IPv4") == 500.0
    assert value(m, "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds", ip_family="IPv6") == 501.0
    m.observe_sync("partial", 0.01, family=V4)
    assert value(m, "kubeproxy_sync_proxy_rules_service_changes_pending") == 0
    assert value(m, "kubeproxy_sync_proxy_rules_endpoint_changes_pending") == 0


def test_failures_counted_by_backend_and_family() -> None:
    m = fresh()
    m.apply_failed("iptables", family=V4)
    m.apply_failed("iptables", family=V4)
    m.apply_failed("iptables", family=V6, partial=True)
    m.apply_failed("nft", family=V6)
    assert value(m, "kubeproxy_sync_proxy_rules_iptables_restore_failures_total", ip_family="IPv4") == 2
    assert value(m, "kubeproxy_sync_proxy_rules_iptables_partial_restore_failures_total", ip_family="IPv6") == 1
    assert value(m, "kubeproxy_sync_proxy_rules_iptables_restore_failures_total", ip_family="IPv6") is None
    assert value(m, "kubeproxy_sync_proxy_rules_nftables_sync_failures_total", ip_family="IPv6") == 1
    with pytest.raises(ValueError, match="unknown backend"):
        m.apply_failed("ipvs", family=V4)  # type: ignore[arg-type]


def test_rule_counts_and_no_local_endpoints() -> None:
    m = fresh()
    m.set_rule_counts("iptables", {"filter": 12, "nat": 340}, family=V4, written={"nat": 9})
    m.set_rule_counts("nft", {"chains": 30, "rules": 90, "elements": 44}, family=V6)
    m.set_no_local_endpoints(2, 1, family=V4)
    assert value(m, "kubeproxy_sync_proxy_rules_iptables_total", ip_family="IPv4", table="nat") == 340
    assert value(m, "kubeproxy_sync_proxy_rules_iptables_total", ip_family="IPv4", table="filter") == 12
    assert value(m, "kubeproxy_sync_proxy_rules_iptables_last", ip_family="IPv4", table="nat") == 9
    assert value(m, "nfproxy_nftables_objects", ip_family="IPv6", object="elements") == 44
    assert value(m, "kubeproxy_sync_proxy_rules_no_local_endpoints_total", ip_family="IPv4", traffic_policy="internal") == 2
    assert value(m, "kubeproxy_sync_proxy_rules_no_local_endpoints_total", ip_family="IPv4", traffic_policy="external") == 1
    with pytest.raises(ValueError, match="iptables table 'mangle'"):
        m.set_rule_counts("iptables", {"mangle": 1}, family=V4)
    with pytest.raises(ValueError, match="nft object kind 'flowtables'"):
        m.set_rule_counts("nft", {"flowtables": 1}, family=V4)


def test_registries_are_independent() -> None:
    a, b = fresh(), fresh()
    a.apply_failed("nft", family=V4)
    assert value(a, "kubeproxy_sync_proxy_rules_nftables_sync_failures_total", ip_family="IPv4") == 1
    assert value(b, "kubeproxy_sync_proxy_rules_nftables_sync_failures_total", ip_family="IPv4") is None


def test_process_metrics_are_exported_by_default() -> None:
    m = ProxyMetrics(CollectorRegistry())
    names = types(m)
    assert "process_cpu_seconds" in names or "process_cpu_seconds_total" in names
    assert "python_info" in names


def test_network_programming_buckets_are_kube_proxys() -> None:
    def linear(start: float, width: float, count: int) -> list[float]:
        return [start + i * width for i in range(count)]

    # metrics.MergeBuckets(LinearBuckets(0.25, 0.25, 2), (1, 1, 59), (60, 5, 12), (120, 30, 7)):
    # MergeBuckets starts with a 0 bucket (`result := make([]float64, 1)`), so 81 buckets.
    want = [0.0] + linear(0.25, 0.25, 2) + linear(1, 1, 59) + linear(60, 5, 12) + linear(120, 30, 7)
    assert list(NETWORK_PROGRAMMING_BUCKETS) == want and want[-1] == 300 and len(want) == 81
    m = fresh()
    m.network_programmed(1.2, family=V6)
    name = "kubeproxy_network_programming_duration_seconds"
    assert value(m, f"{name}_bucket", ip_family="IPv6", le="1.0") == 0
    assert value(m, f"{name}_bucket", ip_family="IPv6", le="2.0") == 1
    assert value(m, f"{name}_count", ip_family="IPv4") is None


def test_changes_are_counted_once_per_sync_whatever_the_families() -> None:
    m = fresh()
    m.queued(pending_services=10, pending_endpoints=4)
    for family in (V4, V6):
        m.observe_sync("partial", 0.1, family=family, operations=5)
    m.changes_synced(10, 4)
    assert value(m, "kubeproxy_sync_proxy_rules_service_changes_total") == 10
    assert value(m, "kubeproxy_sync_proxy_rules_endpoint_changes_total") == 4
    assert value(m, "kubeproxy_sync_proxy_rules_service_changes_pending") == 0
    with pytest.raises(ValueError):
        m.changes_synced(-1, 0)


def test_changed_services_counts_services_not_ports_or_families() -> None:
    from nfproxy.core.model import Protocol, ServicePortName
    from nfproxy.daemon.node import changed_services

    def key(name: str, port: str, family: IPFamily) -> tuple[ServicePortName, IPFamily]:
        return (ServicePortName("shop", name, port, Protocol.TCP), family)

    keys = [key("web", "http", V4), key("web", "https", V4), key("web", "http", V6), key("api", "", V4)]
    assert changed_services(keys) == 2
    assert changed_services([]) == 0


class TriggerSource:
    def __init__(self) -> None:
        self.times: dict[tuple[str, str], dict[str, float]] = {}

    def trigger_times(self, namespace: str, name: str) -> dict[str, float]:
        return dict(self.times.get((namespace, name), {}))


def test_programming_latency_observes_each_trigger_time_once_in_its_family() -> None:
    from nfproxy.core.changes import Changes
    from nfproxy.core.model import Protocol, ServicePortName
    from nfproxy.daemon.node import ProgrammingLatency

    clock = Clock(1000.0)
    m = fresh(clock)
    source = TriggerSource()
    latency = ProgrammingLatency(source, m, clock)
    web4 = (ServicePortName("shop", "web", "http", Protocol.TCP), V4)
    web6 = (ServicePortName("shop", "web", "http", Protocol.TCP), V6)
    name = "kubeproxy_network_programming_duration_seconds"
    source.times[("shop", "web")] = {"IPv4": 997.0, "IPv6": 999.5}
    latency.observe(Changes(frozenset(), frozenset({web4, web6}), False), [V4, V6])
    assert value(m, f"{name}_sum", ip_family="IPv4") == 3.0
    assert value(m, f"{name}_sum", ip_family="IPv6") == 0.5
    # The same trigger time again (a later sync of other changes): not observed twice.
    latency.observe(Changes(frozenset(), frozenset({web4}), False), [V4])
    assert value(m, f"{name}_count", ip_family="IPv4") == 1
    # A new change; only IPv4's endpoints changed, so only IPv4 observes.
    clock.now = 1010.0
    source.times[("shop", "web")] = {"IPv4": 1009.0, "IPv6": 1008.0}
    latency.observe(Changes(frozenset(), frozenset({web4}), False), [V4, V6])
    assert value(m, f"{name}_count", ip_family="IPv4") == 2
    assert value(m, f"{name}_count", ip_family="IPv6") == 1
    # A source without trigger times (the manifests): nothing, and no error.
    ProgrammingLatency(object(), m, clock).observe(Changes(frozenset(), frozenset({web4}), False), [V4])


def test_api_cache_carries_trigger_times_per_address_type() -> None:
    from nfproxy.core.model import NodeConfig
    from nfproxy.sources.kube import ENDPOINT_SLICES, TRIGGER_TIME, ObjectCache

    def eps(name: str, family: str, when: str | None) -> dict:
        meta: dict = {"name": name, "namespace": "shop", "labels": {"kubernetes.io/service-name": "web"}}
        if when is not None:
            meta["annotations"] = {TRIGGER_TIME: when}
        return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "metadata": meta,
                "addressType": family, "endpoints": [], "ports": []}

    cache = ObjectCache(NodeConfig(name="node-a"))
    cache.apply(ENDPOINT_SLICES, "ADDED", eps("web-1", "IPv4", "2026-12-01T10:00:00Z"))
    cache.apply(ENDPOINT_SLICES, "ADDED", eps("web-2", "IPv4", "2026-12-01T10:00:02.5Z"))
    cache.apply(ENDPOINT_SLICES, "ADDED", eps("web-3", "IPv6", "not a time"))
    cache.apply(ENDPOINT_SLICES, "ADDED", eps("web-4", "IPv6", None))
    assert cache.trigger_times("shop", "web") == {}  # only what a snapshot has seen
    cache.snapshot()
    when = datetime.datetime(2026, 12, 1, 10, 0, 2, 500000, tzinfo=datetime.UTC).timestamp()
    assert cache.trigger_times("shop", "web") == {"IPv4": when}
    assert cache.trigger_times("shop", "other") == {}

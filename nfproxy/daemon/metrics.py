"""Prometheus metrics of the sync loop, under kube-proxy's names so existing dashboards work.

Names, types, label sets and buckets follow kube-proxy's pkg/proxy/metrics (v1.33: the per-proxier
metrics carry `ip_family` = "IPv4" / "IPv6", since each family is synced on its own). What
kube-proxy has no metric for (kernel operations per sync, nft object counts, sync kinds) is
exported under the `nfproxy_` prefix. Everything lives in a registry of its own, so a test (or a
second proxier in one process) never collides with another's counters.

Given a backend, only that backend's families are registered, as kube-proxy's
RegisterMetrics(mode) does; the daemon's own registry (none given) leaves out prometheus_client's
`*_created` series, which kube-proxy (Go client) does not export.
"""

from __future__ import annotations

import copy
import platform
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client import PlatformCollector, ProcessCollector
from prometheus_client.metrics_core import Metric

from nfproxy import __version__
from nfproxy.core.model import IPFamily

SyncKind = Literal["full", "partial"]
Backend = Literal["iptables", "nft"]

SUBSYSTEM = "kubeproxy"
# kube-proxy's ExponentialBuckets(0.001, 2, 15): 1 ms .. 16.384 s.
SYNC_BUCKETS = tuple(0.001 * 2**i for i in range(15))
# Kernel operations per sync: 0 (the unchanged sync) is a bucket of its own.
OPERATION_BUCKETS = (0, 1, 10, 100, 1_000, 10_000, 100_000, 1_000_000)
# kube-proxy's network programming buckets: metrics.MergeBuckets(LinearBuckets(0.25, 0.25, 2),
# (1, 1, 59), (60, 5, 12), (120, 30, 7)). MergeBuckets starts its result with a 0 bucket
# (`result := make([]float64, 1)`), so: 0, 0.25 s, 0.5 s, 1..59 s, 60..115 s by 5, 2..5 min by 30 s.
NETWORK_PROGRAMMING_BUCKETS = (
    (0.0, 0.25, 0.5)
    + tuple(float(s) for s in range(1, 60))
    + tuple(float(s) for s in range(60, 120, 5))
    + tuple(float(s) for s in range(120, 330, 30))
)
FAMILY = ("ip_family",)
IPTABLES_TABLES = ("filter", "nat")
NFT_OBJECTS = ("chains", "rules", "sets", "maps", "elements")


BACKENDS: tuple[Backend, ...] = ("iptables", "nft")
# component-base/metrics/prometheus/version: kubernetes_build_info's labels, in its order.
BUILD_INFO_LABELS = (
    "major", "minor", "gitVersion", "gitCommit", "gitTreeState", "buildDate", "goVersion", "compiler", "platform",
)
# Go's GOARCH names for what platform.machine() says, so `platform` reads as kube-proxy's does.
_GOARCH = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64", "i386": "386",
           "i686": "386", "armv7l": "arm", "armv6l": "arm", "ppc64le": "ppc64le", "s390x": "s390x",
           "riscv64": "riscv64"}


def family_label(family: IPFamily) -> str:
    """kube-proxy's label value: the core/v1 IPFamily string."""
    return "IPv4" if family is IPFamily.V4 else "IPv6"


def build_info(version: str = __version__) -> dict[str, str]:
    """kubernetes_build_info's labels, filled with what nfproxy knows of itself.

    The version is nfproxy's (not a Kubernetes version); nfproxy records no commit, tree state
    or build date, so those are empty; `goVersion` and `compiler` name the Python runtime that
    stands where Go's would.
    """
    parts = version.split(".")
    machine = platform.machine().lower()
    return {
        "major": parts[0] if parts and parts[0].isdigit() else "",
        "minor": parts[1] if len(parts) > 1 and parts[1].isdigit() else "",
        "gitVersion": f"v{version}",
        "gitCommit": "",
        "gitTreeState": "",
        "buildDate": "",
        "goVersion": f"python{platform.python_version()}",
        "compiler": platform.python_implementation().lower(),
        "platform": f"{sys.platform}/{_GOARCH.get(machine, machine)}",
    }


class NoCreatedRegistry(CollectorRegistry):
    """A registry whose counters and histograms expose no `*_created` sample.

    prometheus_client adds one per counter, histogram and summary child; kube-proxy's Go client
    does not, and scrape budgets and dashboards written for kube-proxy do not expect them. This
    drops them for this registry only (`prometheus_client.disable_created_metrics()` would do it
    for every registry in the process).
    """

    def collect(self) -> Iterator[Metric]:
        for metric in super().collect():
            if metric.type not in ("counter", "histogram", "summary", "gaugehistogram"):
                yield metric
                continue
            created = f"{metric.name}_created"
            kept = copy.copy(metric)
            kept.samples = [s for s in metric.samples if s.name != created]
            yield kept


class ProxyMetrics:
    """The metrics the proxier and the health server update, in one registry.

    Methods name events of the sync loop, so the proxier never touches a metric object directly
    and the mapping to kube-proxy's names lives in one place.
    """

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        clock: Callable[[], float] = time.time,
        process_metrics: bool = True,
        backend: Backend | None = None,
        localhost_nodeports: bool = False,
    ) -> None:
        """`backend` ("iptables" or "nft") registers only that backend's metric families, as
        kube-proxy's RegisterMetrics(mode); None registers both (a caller that does not know).
        `localhost_nodeports`: the KubeProxyNFTablesLocalhostNodePorts gate is on, which adds
        its proxy's metrics in nftables mode (and the rejected-packets collector, which the
        daemon registers with its kernel reader: LocalhostRejectedCollector)."""
        if backend is not None and backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r} (expected one of {', '.join(BACKENDS)})")
        self.registry = registry if registry is not None else NoCreatedRegistry()
        self.backend = backend
        self._clock = clock
        if process_metrics:
            # kube-proxy exports process_* too; scrape configs expect them next to kubeproxy_*.
            ProcessCollector(registry=self.registry)
            PlatformCollector(registry=self.registry)
        self._sync_durations()
        self._sync_timestamps()
        self._changes()
        self._kernel_failures()
        self._rule_counts()
        self._probes()
        self._conntrack()
        self._build_info()
        self._nfproxy_own()
        self.localhost_listeners: Gauge | None = None
        self.localhost_listener_failures: Counter | None = None
        if localhost_nodeports and self._has("nft"):
            self._localhost_nodeports()

    def _has(self, backend: Backend) -> bool:
        return self.backend is None or self.backend == backend

    # ---- the metrics, by kind (kube-proxy's names; nfproxy's own last)

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...] = SYNC_BUCKETS) -> Histogram:
        return Histogram(name, doc, FAMILY, subsystem=SUBSYSTEM, registry=self.registry, buckets=buckets)

    def _gauge(self, name: str, doc: str, labels: tuple[str, ...] = FAMILY) -> Gauge:
        return Gauge(name, doc, labels, subsystem=SUBSYSTEM, registry=self.registry)

    def _counter(self, name: str, doc: str, labels: tuple[str, ...] = FAMILY) -> Counter:
        return Counter(name, doc, labels, subsystem=SUBSYSTEM, registry=self.registry)

    def _sync_durations(self) -> None:
        self.sync_duration = self._histogram("sync_proxy_rules_duration_seconds", "SyncProxyRules latency in seconds")
        self.sync_full_duration = self._histogram(
            "sync_full_proxy_rules_duration_seconds", "SyncProxyRules latency in seconds for full resyncs"
        )
        self.sync_partial_duration = self._histogram(
            "sync_partial_proxy_rules_duration_seconds", "SyncProxyRules latency in seconds for partial resyncs"
        )
        # The SLO: from the EndpointSlice's last-change-trigger-time to rules in the kernel.
        self.network_programming = self._histogram(
            "network_programming_duration_seconds",
            "In Cluster Network Programming Latency in seconds",
            NETWORK_PROGRAMMING_BUCKETS,
        )

    def _sync_timestamps(self) -> None:
        self.last_timestamp = self._gauge(
            "sync_proxy_rules_last_timestamp_seconds", "The last time proxy rules were successfully synced"
        )
        self.last_queued_timestamp = self._gauge(
            "sync_proxy_rules_last_queued_timestamp_seconds", "The last time a sync of proxy rules was queued"
        )

    def _changes(self) -> None:
        self.endpoint_changes_pending = self._gauge(
            "sync_proxy_rules_endpoint_changes_pending", "Pending proxy rules Endpoint changes", ()
        )
        self.endpoint_changes_total = self._counter(
            "sync_proxy_rules_endpoint_changes", "Cumulative proxy rules Endpoint changes", ()
        )
        self.service_changes_pending = self._gauge(
            "sync_proxy_rules_service_changes_pending", "Pending proxy rules Service changes", ()
        )
        self.service_changes_total = self._counter(
            "sync_proxy_rules_service_changes", "Cumulative proxy rules Service changes", ()
        )

    def _kernel_failures(self) -> None:
        self.iptables_restore_failures: Counter | None = None
        self.iptables_partial_restore_failures: Counter | None = None
        self.nftables_sync_failures: Counter | None = None
        self.nftables_cleanup_failures: Counter | None = None
        if self._has("iptables"):
            self.iptables_restore_failures = self._counter(
                "sync_proxy_rules_iptables_restore_failures", "Cumulative proxy iptables restore failures"
            )
            self.iptables_partial_restore_failures = self._counter(
                "sync_proxy_rules_iptables_partial_restore_failures",
                "Cumulative proxy iptables partial restore failures",
            )
        if self._has("nft"):
            self.nftables_sync_failures = self._counter(
                "sync_proxy_rules_nftables_sync_failures", "Cumulative proxy nftables sync failures"
            )
            self.nftables_cleanup_failures = self._counter(
                "sync_proxy_rules_nftables_cleanup_failures", "Cumulative proxy nftables cleanup failures"
            )

    def _rule_counts(self) -> None:
        self.iptables_rules: Gauge | None = None
        self.iptables_rules_last: Gauge | None = None
        if self._has("iptables"):
            self.iptables_rules = self._gauge(
                "sync_proxy_rules_iptables_total", "Total number of iptables rules owned by kube-proxy",
                ("ip_family", "table"),
            )
            self.iptables_rules_last = self._gauge(
                "sync_proxy_rules_iptables_last", "Number of iptables rules written by kube-proxy in last sync",
                ("ip_family", "table"),
            )
        self.no_local_endpoints = self._gauge(
            "sync_proxy_rules_no_local_endpoints_total",
            "Number of services with a Local traffic policy and no endpoints",
            ("ip_family", "traffic_policy"),
        )

    def _probes(self) -> None:
        self.healthz_total = self._counter("proxy_healthz", "Cumulative proxy healthz HTTP status", ("code",))
        self.livez_total = self._counter("proxy_livez", "Cumulative proxy livez HTTP status", ("code",))

    def _conntrack(self) -> None:
        # kube-proxy v1.33 (kubernetes#130204, #130200); registered in every mode. The duration
        # is observed per walk of a family's UDP table, which only syncs that changed a UDP
        # service port make (docs/conntrack.md), so most syncs add nothing to it.
        self.conntrack_reconciler_deleted = self._counter(
            "conntrack_reconciler_deleted_entries", "Cumulative conntrack flows deleted by conntrack reconciler"
        )
        self.conntrack_reconciler_duration = self._histogram(
            "conntrack_reconciler_sync_duration_seconds", "ReconcileConntrackFlowsLatency latency in seconds"
        )

    def _build_info(self) -> None:
        """component-base's kubernetes_build_info: a constant 1 labelled with the build."""
        self.build_info = Gauge(
            "kubernetes_build_info",
            "A metric with a constant '1' value labeled by major, minor, git version, git commit, git tree "
            "state, build date, Go version, and compiler from which Kubernetes was built, and platform on "
            "which it is running.",
            BUILD_INFO_LABELS, registry=self.registry,
        )
        info = build_info()
        self.build_info.labels(*(info[k] for k in BUILD_INFO_LABELS)).set(1)

    def _nfproxy_own(self) -> None:
        """What kube-proxy does not measure, under the nfproxy_ prefix."""
        r = self.registry
        self.syncs_total = Counter(
            "nfproxy_syncs", "Successful syncs, by kind (full or partial)", ("ip_family", "kind"), registry=r,
        )
        self.sync_operations = Histogram(
            "nfproxy_sync_kernel_operations",
            "Kernel operations (nft commands, iptables-restore lines) sent per sync",
            ("ip_family", "kind"), registry=r, buckets=OPERATION_BUCKETS,
        )
        self.sync_operations_last = Gauge(
            "nfproxy_sync_kernel_operations_last", "Kernel operations sent by the last successful sync",
            FAMILY, registry=r,
        )
        self.nft_objects: Gauge | None = None
        if self._has("nft"):
            self.nft_objects = Gauge(
                "nfproxy_nftables_objects", "nftables objects owned by nfproxy after the last sync",
                ("ip_family", "object"), registry=r,
            )
        self.conntrack_deleted = Counter(
            "nfproxy_conntrack_deleted_entries",
            "Stale UDP conntrack entries deleted after endpoint or service changes", FAMILY, registry=r,
        )
        self.conntrack_failures = Counter(
            "nfproxy_conntrack_cleanup_failures",
            "Conntrack cleanups that failed (entries may still pin traffic to gone endpoints)",
            FAMILY, registry=r,
        )
        self.source_errors = Counter(
            "nfproxy_source_errors",
            "Source problems held back instead of applied (a bad manifest file, an empty state)",
            ("source",), registry=r,
        )

    def _localhost_nodeports(self) -> None:
        """kube-proxy 1.37's localhost node-port proxy metrics (nftables mode, gate on)."""
        self.localhost_listeners = self._gauge(
            "nftables_localhost_nodeport_listeners", "Number of active localhost NodePort userspace proxy listeners."
        )
        self.localhost_listener_failures = self._counter(
            "nftables_localhost_nodeport_listener_creation_failures",
            "Number of localhost NodePort userspace proxy listener creation failures.",
        )

    # ---- events of the sync loop

    def localhost_listening(self, listeners: int, *, family: IPFamily) -> None:
        """The localhost node-port proxy listens on this many node ports of `family`."""
        if self.localhost_listeners is not None:
            self.localhost_listeners.labels(family_label(family)).set(listeners)

    def localhost_listener_failed(self, *, family: IPFamily) -> None:
        if self.localhost_listener_failures is not None:
            self.localhost_listener_failures.labels(family_label(family)).inc()

    def queued(
        self,
        families: Iterable[IPFamily] = tuple(IPFamily),
        *,
        pending_services: int | None = None,
        pending_endpoints: int | None = None,
    ) -> None:
        """A change arrived and a sync is queued; pending counts when the loop knows them."""
        now = self._clock()
        for family in families:
            self.last_queued_timestamp.labels(family_label(family)).set(now)
        if pending_services is not None:
            self.service_changes_pending.set(pending_services)
        if pending_endpoints is not None:
            self.endpoint_changes_pending.set(pending_endpoints)

    def observe_sync(
        self,
        kind: SyncKind,
        seconds: float,
        *,
        family: IPFamily,
        services_changed: int = 0,
        endpoints_changed: int = 0,
        operations: int = 0,
    ) -> None:
        """A sync of one family's rules succeeded: durations, kernel operations, and (for a
        caller that syncs one family) change counts. A daemon syncing several families counts
        changes once per sync with `changes_synced` instead, so no change is counted twice."""
        if kind not in ("full", "partial"):
            raise ValueError(f"sync kind must be 'full' or 'partial', not {kind!r}")
        if min(seconds, services_changed, endpoints_changed, operations) < 0:
            raise ValueError("sync durations and counts cannot be negative")
        f = family_label(family)
        self.sync_duration.labels(f).observe(seconds)
        (self.sync_full_duration if kind == "full" else self.sync_partial_duration).labels(
            f
        ).observe(seconds)
        self.last_timestamp.labels(f).set(self._clock())
        self.service_changes_total.inc(services_changed)
        self.endpoint_changes_total.inc(endpoints_changed)
        self.service_changes_pending.set(0)
        self.endpoint_changes_pending.set(0)
        self.syncs_total.labels(f, kind).inc()
        self.sync_operations.labels(f, kind).observe(operations)
        self.sync_operations_last.labels(f).set(operations)

    def changes_synced(self, services: int, endpoints: int) -> None:
        """Service and endpoint changes a sync wrote, counted once whatever the families."""
        if min(services, endpoints) < 0:
            raise ValueError("change counts cannot be negative")
        self.service_changes_total.inc(services)
        self.endpoint_changes_total.inc(endpoints)
        self.service_changes_pending.set(0)
        self.endpoint_changes_pending.set(0)

    def synced_at(self, *, family: IPFamily) -> None:
        """A family's rules are up to date now (also when it had nothing to write)."""
        self.last_timestamp.labels(family_label(family)).set(self._clock())

    def network_programmed(self, seconds: float, *, family: IPFamily) -> None:
        """A change whose EndpointSlice says it was triggered `seconds` ago is in the rules."""
        self.network_programming.labels(family_label(family)).observe(max(seconds, 0.0))

    def apply_failed(self, backend: Backend, *, family: IPFamily, partial: bool = False) -> None:
        """The kernel refused a sync (iptables-restore or the nft transaction failed)."""
        f = family_label(family)
        self._check_backend(backend)
        if backend == "iptables":
            counter = self.iptables_partial_restore_failures if partial else self.iptables_restore_failures
        else:
            counter = self.nftables_sync_failures
        assert counter is not None
        counter.labels(f).inc()

    def cleanup_failed(self, *, family: IPFamily) -> None:
        """Deleting stale nft chains or sets failed (the sync went through; retried next time)."""
        self._check_backend("nft")
        assert self.nftables_cleanup_failures is not None
        self.nftables_cleanup_failures.labels(family_label(family)).inc()

    def _check_backend(self, backend: str) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}")
        if not self._has(backend):  # type: ignore[arg-type]
            raise ValueError(f"{backend} metrics are not registered: these metrics are for the {self.backend} backend")

    def set_no_local_endpoints(self, internal: int, external: int, *, family: IPFamily) -> None:
        """Services whose Local policy finds no local endpoint (their traffic is dropped)."""
        f = family_label(family)
        self.no_local_endpoints.labels(f, "internal").set(internal)
        self.no_local_endpoints.labels(f, "external").set(external)

    def set_rule_counts(
        self,
        backend: Backend,
        counts: Mapping[str, int],
        *,
        family: IPFamily,
        written: Mapping[str, int] | None = None,
    ) -> None:
        """What the kernel holds after a sync: rules per iptables table, or nft objects by kind.

        `written` (iptables only) is the number of rules the last sync sent per table.
        """
        f = family_label(family)
        self._check_backend(backend)
        if backend == "iptables":
            assert self.iptables_rules is not None and self.iptables_rules_last is not None
            for table, n in counts.items():
                _check_key(table, IPTABLES_TABLES, "iptables table")
                self.iptables_rules.labels(f, table).set(n)
            for table, n in (written or {}).items():
                _check_key(table, IPTABLES_TABLES, "iptables table")
                self.iptables_rules_last.labels(f, table).set(n)
        else:
            if written:
                raise ValueError("`written` counts are an iptables metric")
            assert self.nft_objects is not None
            for kind, n in counts.items():
                _check_key(kind, NFT_OBJECTS, "nft object kind")
                self.nft_objects.labels(f, kind).set(n)

    def conntrack_cleaned(self, deleted: int, *, family: IPFamily) -> None:
        """Stale UDP conntrack entries deleted after a sync: nfproxy's counter and kube-proxy's."""
        f = family_label(family)
        self.conntrack_deleted.labels(f).inc(deleted)
        self.conntrack_reconciler_deleted.labels(f).inc(deleted)

    def conntrack_reconciled(self, seconds: float, *, family: IPFamily) -> None:
        """One reconciliation of a family's whole UDP conntrack table, as kube-proxy times it."""
        self.conntrack_reconciler_duration.labels(family_label(family)).observe(seconds)

    def conntrack_failed(self, *, family: IPFamily) -> None:
        self.conntrack_failures.labels(family_label(family)).inc()

    def source_error(self, source: str) -> None:
        """A source kept its last good state instead of applying what it read."""
        self.source_errors.labels(source).inc()

    def probe_answered(self, probe: Literal["healthz", "livez"], status: int) -> None:
        """The health server answered /healthz or /livez with `status`."""
        counter = self.healthz_total if probe == "healthz" else self.livez_total
        counter.labels(str(status)).inc()


def _check_key(key: str, allowed: tuple[str, ...], what: str) -> None:
    if key not in allowed:
        raise ValueError(f"unknown {what} {key!r} (expected one of {', '.join(allowed)})")


LOCALHOST_REJECTED = "kubeproxy_nftables_localhost_nodeport_rejected_packets_total"


class LocalhostRejectedCollector:
    """kube-proxy 1.37's kubeproxy_nftables_localhost_nodeport_rejected_packets_total: the
    packets the nft rules rejected on localhost node ports, per family and protocol, read from
    the kernel's named counters when scraped (as upstream's nftCounterMetricCollector: one
    sample per counter that exists, none while the table has none)."""

    def __init__(self, read: Callable[[], Mapping[tuple[IPFamily, str], int]]) -> None:
        self._read = read

    def describe(self) -> list[Metric]:
        return [self._family()]

    @staticmethod
    def _family() -> Metric:
        from prometheus_client.core import CounterMetricFamily

        return CounterMetricFamily(
            LOCALHOST_REJECTED.removesuffix("_total"),
            "Number of packets rejected on localhost NodePorts. UDP and SCTP are always rejected; "
            "TCP is rejected when the localhost NodePort proxy is not running",
            labels=("ip_family", "protocol"),
        )

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        try:
            counts = self._read()
        except OSError:  # no sample while the kernel cannot be read, as upstream
            counts = {}
        for (ip_family, proto), packets in sorted(counts.items(), key=lambda kv: (kv[0][0].value, kv[0][1])):
            family.add_metric([family_label(ip_family), proto.upper()], packets)
        yield family

"""The node daemon: a source, a proxier, the sync loop and the servers, wired together.

Kept apart from the command line so tests can run a daemon in-process against a throwaway
namespace, and from the proxier so the proxier stays usable without any server.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from nfproxy.core.categorize import categorize
from nfproxy.core.changes import Changes
from nfproxy.daemon import logs
from nfproxy.daemon.healthcheck import ServiceHealthServer, service_health
from nfproxy.daemon.localhost_proxy import LocalhostProxy, localhost_node_ports
from nfproxy.daemon.metrics import ProxyMetrics
from nfproxy.core.model import ClusterState, IPFamily, Protocol, ServicePortKey
from nfproxy.daemon.proxier import FailedSync, Proxier, SyncLoop, SyncResult
from nfproxy.daemon.server import ProxierHealth, Servers, node_eligible, serve
from nfproxy.sources import Source

log = logging.getLogger("nfproxy.daemon")


@dataclass(frozen=True, slots=True)
class DaemonConfig:
    backend: str
    netns: str | None = None
    min_sync_period: float = 1.0
    # kube-proxy's default: every 30 s the kernel is checked (a full sync only when someone else
    # wrote to it; otherwise hourly: proxier.FULL_SYNC_PERIOD), so /healthz reports a stuck
    # proxy after 60 s.
    sync_period: float = 30.0
    healthz_bind_address: str = "0.0.0.0:10256"
    metrics_bind_address: str = "127.0.0.1:10249"
    conntrack: bool = True
    # --dry-run: health-check node ports are a real kernel's sockets, so a canary serves none.
    health_check_node_ports: bool = True
    # --bind-address-hard-fail: a taken healthz/metrics port is fatal instead of retried.
    bind_address_hard_fail: bool = False
    # --metrics-endpoint-connections: nfproxy_endpoint_new_connections_total, read when scraped.
    endpoint_connections_metric: bool = False
    # The effective KubeProxyConfiguration, for /configz (None: not served).
    configz: Mapping[str, Any] | None = None
    # --empty-source-grace: how long the first sync of an empty state waits while the kernel
    # still serves services from before this start (daemon/empty_start.py).
    empty_grace: float = 0.0
    # KubeProxyNFTablesLocalhostNodePorts (nft backend): node ports on loopback served by a
    # userspace proxy (daemon/localhost_proxy.py), not on a dry run's in-memory kernels.
    localhost_nodeports: bool = False


def _source_label(source: object) -> str:
    """The `source` label of nfproxy_source_errors_total: `manifests` or `api`."""
    from nfproxy.sources.files import ManifestSource

    return "manifests" if isinstance(source, ManifestSource) else "api"


class NoLocalEndpoints:
    """Service ports whose Local traffic policy finds no local endpoint, kept per port.

    kube-proxy's sync_proxy_rules_no_local_endpoints_total; updated from each sync's changes
    (categorising only the changed ports), so a sync at 10 000 services does not categorise
    every port a second time after the renderer did.
    """

    def __init__(self) -> None:
        self._flags: dict[ServicePortKey, tuple[bool, bool]] = {}

    def update(self, state: ClusterState, keys: Iterable[ServicePortKey]) -> None:
        for key in keys:
            svc = state.services.get(key)
            eps = state.endpoints.get(key, ())
            if svc is None or not eps:
                self._flags.pop(key, None)
                continue
            local = bool(categorize(svc, eps, state.node).local)
            internal = svc.internal_policy_local and not local
            external = svc.externally_accessible and svc.external_policy_local and not local
            if internal or external:
                self._flags[key] = (internal, external)
            else:
                self._flags.pop(key, None)

    def counts(self, family: IPFamily) -> tuple[int, int]:
        """(internal, external) for one family."""
        flags = [f for key, f in self._flags.items() if key[1] is family]
        return sum(f[0] for f in flags), sum(f[1] for f in flags)


def changed_services(keys: Iterable[ServicePortKey]) -> int:
    """Distinct Services among changed service ports: kube-proxy counts a Service (or its
    endpoints) once per change, not once per port or per family."""
    return len({(key[0].namespace, key[0].name) for key in keys})


class ProgrammingLatency:
    """kubeproxy_network_programming_duration_seconds, from the sources' trigger times.

    The API source knows, per Service and family, the newest
    `endpoints.kubernetes.io/last-change-trigger-time` of the EndpointSlices in the snapshot
    just synced; each such time is observed once, after the sync that wrote it (kube-proxy
    observes the trigger times of the endpoint changes each sync applied).
    """

    def __init__(self, source: object, metrics: ProxyMetrics, clock: Callable[[], float] = time.time) -> None:
        self._times = getattr(source, "trigger_times", None)
        self._metrics = metrics
        self._clock = clock
        self._seen: dict[tuple[str, str, IPFamily], float] = {}

    def observe(self, changes: Changes, families: Iterable[IPFamily]) -> None:
        if self._times is None:
            return
        now = self._clock()
        wanted = set(families)
        changed = {(key[0].namespace, key[0].name, key[1]) for key in changes.endpoints if key[1] in wanted}
        for namespace, name in sorted({(ns, n) for ns, n, _ in changed}):
            for label, when in self._times(namespace, name).items():
                family = IPFamily.V4 if label == "IPv4" else IPFamily.V6
                seen = (namespace, name, family)
                if seen not in changed or self._seen.get(seen) == when:
                    continue
                self._seen[seen] = when
                self._metrics.network_programmed(now - when, family=family)
                logs.info(log, "Network programming", level=4, endpoint=f"{namespace}/{name}",
                          ipFamily=label, elapsed=logs.Duration(now - when))


def _touches_health_checks(previous: ClusterState | None, state: ClusterState, result: SyncResult) -> bool:
    if previous is None or result.changes.node:
        return True
    for key in result.changes.keys:
        for s in (previous, state):
            svc = s.services.get(key)
            if svc is not None and svc.health_check_node_port:
                return True
    return False


class Daemon:
    def __init__(self, source: Source, config: DaemonConfig, proxier: Proxier | None = None) -> None:
        self.config = config
        self.source = source
        self.proxier = proxier or Proxier(config.backend, netns=config.netns)
        self.metrics = ProxyMetrics(backend=config.backend, localhost_nodeports=config.localhost_nodeports)
        self.localhost_proxy: LocalhostProxy | None = None
        if config.netns is None and config.health_check_node_ports:
            # kube-proxy's INVALID-drop counter: the node's own kernel object, read when scraped.
            from nfproxy.daemon.invalid_drops import InvalidDropCollector, reader

            self.metrics.registry.register(InvalidDropCollector(reader(config.backend)))
        if config.endpoint_connections_metric:
            from nfproxy.daemon.endpoint_connections import EndpointConnectionsCollector, reader as counts

            self.metrics.registry.register(EndpointConnectionsCollector(counts(config.backend, config.netns)))
        # kube-proxy: healthz fails when a queued update waits longer than 2 x sync period.
        self.health = ProxierHealth(max(2 * config.sync_period, 1.0))
        self.health_checks = ServiceHealthServer(config.netns, health=self.health)
        self.loop = SyncLoop(
            source,
            self.proxier,
            min_sync_period=config.min_sync_period,
            sync_period=config.sync_period,
            empty_grace=config.empty_grace,
        )
        self.loop.on_queued.append(self._queued)
        self.loop.on_empty_held.append(lambda: self.metrics.source_error(_source_label(source)))
        self.proxier.hooks.on_synced.append(self._synced)
        self.proxier.hooks.on_failed.append(self._failed)
        getattr(source, "on_error", []).append(self.metrics.source_error)
        self.servers: Servers | None = None
        self._stopped = threading.Event()
        self._no_local = NoLocalEndpoints()
        self._latency = ProgrammingLatency(source, self.metrics)
        self._health_ports: dict[object, int] = {}
        # A cleanup that failed leaves entries no later change names: the next sync walks every
        # family's UDP table, whatever it changed (the first sync does anyway).
        self._conntrack_unreconciled = True

    # ---- hooks

    def _queued(self) -> None:
        self.health.queued_update()
        self.metrics.queued()

    def _synced(self, previous: ClusterState | None, state: ClusterState, result: SyncResult) -> None:
        self.health.updated()
        node_object = getattr(self.source, "node_object", None)
        if node_object is not None:
            # kube-proxy: a node being deleted (or tainted for deletion) fails /healthz, so
            # load balancers drain it; /livez ignores this.
            self.health.set_node_eligible(node_eligible(node_object()))
        # Every family is up to date now, also one that had nothing to write.
        for family in result.families or getattr(self.proxier.backend, "families", tuple(IPFamily)):
            self.metrics.synced_at(family=family)
        if self.localhost_proxy is not None and result.kind == "noop" and self.localhost_proxy.owed:
            self.localhost_proxy.sync(localhost_node_ports(state))  # a node port not bound yet
        if result.kind == "noop":
            if self.config.conntrack and self._conntrack_unreconciled:
                self._clean_conntrack(previous, state, ())  # a failed cleanup to make good
            return
        changes = result.changes
        self._no_local.update(state, state.services if changes.node else changes.keys)
        self._observe(result)
        for family, counts in self.proxier.backend.counts().items():
            self.metrics.set_rule_counts(self.config.backend, counts, family=family)  # type: ignore[arg-type]
        # Walking every service for health-check ports only when one can have changed, or when a
        # port could not be bound last time (it is retried).
        if self.config.health_check_node_ports and (
            _touches_health_checks(previous, state, result) or dict(self.health_checks.ports) != self._health_ports
        ):
            sh = service_health(state)
            self._health_ports = dict(sh.ports)
            self.health_checks.sync_services(sh.ports)
            self.health_checks.sync_endpoints(sh.local_endpoints)
        if self.localhost_proxy is not None:
            self.localhost_proxy.sync(localhost_node_ports(state))
        if self.config.conntrack:
            self._clean_conntrack(previous, state, changes.keys)

    def _observe(self, result: SyncResult) -> None:
        """Each family's metrics from that family's own part of the sync; changes once."""
        worked = [f for f, part in sorted(result.families.items()) if part.kind != "noop"]
        for family in worked:
            part = result.families[family]
            self.metrics.observe_sync(part.kind, part.seconds, family=family, operations=part.operations)  # type: ignore[arg-type]
            if part.cleanup_failed:
                self.metrics.cleanup_failed(family=family)
        for family in result.families:
            internal, external = self._no_local.counts(family)
            self.metrics.set_no_local_endpoints(internal, external, family=family)
        self.metrics.changes_synced(
            changed_services(result.changes.services), changed_services(result.changes.endpoints)
        )
        self._latency.observe(result.changes, worked)

    def _clean_conntrack(
        self, previous: ClusterState | None, state: ClusterState, changed: Iterable[ServicePortKey]
    ) -> None:
        """Walk the UDP table of each family whose UDP service ports the sync changed (every
        family when owed), as kube-proxy's CleanStaleEntries, and delete the stale entries.
        A failed walk is logged and counted, never fails the sync, and is owed to the next."""
        from nfproxy.daemon.conntrack import sweeps
        from nfproxy.kernel import conntrack as kernel_conntrack

        owed, self._conntrack_unreconciled = self._conntrack_unreconciled, False
        for sweep in sweeps(previous, state, changed, owed=owed):
            family = sweep.family
            started = time.perf_counter()
            try:
                n = kernel_conntrack.delete_judged(self.config.netns, family, Protocol.UDP, sweep.stale)
            except Exception as exc:  # noqa: BLE001 - a failed cleanup must not fail the sync
                self.metrics.conntrack_failed(family=family)
                logs.warning(log, "Failed to reconcile conntrack entries", err=exc, ipFamily=f"IPv{family.value}")
                self._conntrack_unreconciled = True
                continue
            took = time.perf_counter() - started
            self.metrics.conntrack_cleaned(n, family=family)
            self.metrics.conntrack_reconciled(took, family=family)
            logs.info(log, "Finished reconciling conntrack entries", level=4, ipFamily=f"IPv{family.value}",
                      entriesDeleted=n, took=logs.Duration(took))

    def _failed(self, exc: BaseException) -> None:
        """Counted for the family whose kernel refused (every family if that is unknown)."""
        failed: FailedSync | None = getattr(exc, "failed_sync", None)
        families = [failed.family] if failed is not None else list(IPFamily)
        partial = failed.partial if failed is not None else False
        for family in families:
            self.metrics.apply_failed(self.config.backend, family=family, partial=partial)  # type: ignore[arg-type]

    # ---- life cycle

    def start(self) -> None:
        self.servers = serve(
            self.health,
            self.metrics,
            self.config.healthz_bind_address,
            self.config.metrics_bind_address,
            proxy_mode=self.config.backend,
            hard_fail=self.config.bind_address_hard_fail,
            configz=self.config.configz,
        )
        self._start_localhost_proxy()
        self.loop.start()

    def _start_localhost_proxy(self) -> None:
        """kube-proxy 1.37's nftables mode with KubeProxyNFTablesLocalhostNodePorts: its
        listeners and the counter of what the rules reject on loopback."""
        c = self.config
        if not (c.localhost_nodeports and c.backend == "nft" and c.health_check_node_ports):
            return
        from nfproxy.daemon.localhost_proxy import LocalhostProxy, rejected_reader
        from nfproxy.daemon.metrics import LocalhostRejectedCollector

        self.metrics.registry.register(LocalhostRejectedCollector(rejected_reader(c.netns)))  # type: ignore[arg-type]
        self.localhost_proxy = LocalhostProxy(
            c.netns,
            on_listeners=lambda family, n: self.metrics.localhost_listening(n, family=family),
            on_failure=lambda family: self.metrics.localhost_listener_failed(family=family),
        )

    def once(self) -> SyncResult:
        """Sync once, fully, and return (`--once`): no servers, no loop."""
        try:
            return self.loop.run_once()
        finally:
            self.health_checks.close()
            self.proxier.close()

    def run_until_signalled(self) -> None:
        """Serve until SIGTERM or SIGINT; the rules stay in place, as kube-proxy leaves them."""

        def stop(signum: int, _frame: object) -> None:
            logs.info(log, "Received signal: stopping, rules stay in place", signal=signal.Signals(signum).name)
            self._stopped.set()

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        with _SignalWakeup() as wakeup:
            self.start()
            try:
                while not self._stopped.is_set() and not wakeup.wait() & _STOP_SIGNALS:
                    pass
            finally:
                self.stop()

    def stop(self) -> None:
        self.loop.stop()
        self.health_checks.close()
        if self.localhost_proxy is not None:
            self.localhost_proxy.close()
        if self.servers is not None:
            self.servers.close()
        self.proxier.close()  # after the loop: no sync runs any more


_STOP_SIGNALS = {signal.SIGTERM.value, signal.SIGINT.value}


class _SignalWakeup:
    """Wakes the main thread for every signal, whichever thread the kernel delivered it to.

    A signal's C-level handler may run on any thread (the sync thread, say). Python runs the
    Python handler on the main thread only, and a main thread blocked in a lock (an
    `Event.wait()`) is not woken by a signal another thread took: the daemon would then miss
    SIGTERM now and then under load. `signal.set_wakeup_fd` writes each signal's number to
    a pipe from whichever thread took it; the main thread waits in select() on that pipe.
    """

    def __enter__(self) -> _SignalWakeup:
        self._read, self._write = os.pipe()
        for fd in (self._read, self._write):
            os.set_blocking(fd, False)
        self._previous = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        return self

    def wait(self) -> set[int]:
        """The signals that arrived, once one has (their Python handlers may not have run yet)."""
        select.select([self._read], [], [])
        try:
            return set(os.read(self._read, 512))
        except BlockingIOError:
            return set()

    def __exit__(self, *exc: object) -> None:
        signal.set_wakeup_fd(self._previous)
        os.close(self._read)
        os.close(self._write)

"""The node daemon: a source, a proxier, the sync loop and the servers, wired together.

Kept apart from the command line so tests can run a daemon in-process against a throwaway
namespace, and from the proxier so the proxier stays usable without any server.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterable
from dataclasses import dataclass

from nfproxy.core.categorize import categorize
from nfproxy.daemon.healthcheck import ServiceHealthServer, service_health
from nfproxy.daemon.metrics import ProxyMetrics
from nfproxy.core.model import ClusterState, IPFamily, ServicePortKey
from nfproxy.daemon.proxier import Proxier, SyncLoop, SyncResult
from nfproxy.daemon.server import ProxierHealth, Servers, node_eligible, serve
from nfproxy.sources import Source

log = logging.getLogger("nfproxy.daemon")


@dataclass(frozen=True, slots=True)
class DaemonConfig:
    backend: str
    netns: str | None = None
    min_sync_period: float = 1.0
    sync_period: float = 3600.0
    healthz_bind_address: str = "0.0.0.0:10256"
    metrics_bind_address: str = "127.0.0.1:10249"
    conntrack: bool = True


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
        self.metrics = ProxyMetrics()
        # kube-proxy: healthz fails when a queued update waits longer than 2 x sync period.
        self.health = ProxierHealth(max(2 * config.sync_period, 1.0))
        self.health_checks = ServiceHealthServer(config.netns, health=self.health)
        self.loop = SyncLoop(
            source,
            self.proxier,
            min_sync_period=config.min_sync_period,
            sync_period=config.sync_period,
        )
        self.loop.on_queued.append(self._queued)
        self.proxier.hooks.on_synced.append(self._synced)
        self.proxier.hooks.on_failed.append(self._failed)
        self.servers: Servers | None = None
        self._stopped = threading.Event()
        self._no_local = NoLocalEndpoints()
        self._health_ports: dict[object, int] = {}

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
        if result.kind == "noop":
            return
        changes = result.changes
        self._no_local.update(state, state.services if changes.node else changes.keys)
        for family in IPFamily:
            self.metrics.observe_sync(
                result.kind,
                result.seconds,
                family=family,
                services_changed=result.services_changed,
                endpoints_changed=result.endpoints_changed,
                operations=result.operations,
            )
            internal, external = self._no_local.counts(family)
            self.metrics.set_no_local_endpoints(internal, external, family=family)
        for family, counts in self.proxier.backend.counts().items():
            self.metrics.set_rule_counts(self.config.backend, counts, family=family)  # type: ignore[arg-type]
        # Walking every service for health-check ports only when one can have changed, or when a
        # port could not be bound last time (it is retried).
        if _touches_health_checks(previous, state, result) or dict(self.health_checks.ports) != self._health_ports:
            sh = service_health(state)
            self._health_ports = dict(sh.ports)
            self.health_checks.sync_services(sh.ports)
            self.health_checks.sync_endpoints(sh.local_endpoints)
        if self.config.conntrack and previous is not None:
            self._clear_conntrack(previous, state, changes.keys)

    def _clear_conntrack(
        self, previous: ClusterState, state: ClusterState, changed: Iterable[ServicePortKey]
    ) -> None:
        from nfproxy.daemon.conntrack import stale_flows
        from nfproxy.kernel import conntrack as kernel_conntrack

        flows = stale_flows(previous, state, changed)
        if not flows:
            return
        try:
            deleted = kernel_conntrack.delete_per_family(flows, self.config.netns)
        except Exception as exc:  # noqa: BLE001 - a failed cleanup must not fail the sync
            for family in IPFamily:
                self.metrics.conntrack_failed(family=family)
            log.warning("conntrack cleanup failed: %s", exc)
            return
        for family, n in deleted.items():
            self.metrics.conntrack_cleaned(n, family=family)
        log.info("conntrack: deleted %d stale UDP entries (%d filters)", sum(deleted.values()), len(flows))

    def _failed(self, exc: BaseException) -> None:
        for family in IPFamily:
            self.metrics.apply_failed(self.config.backend, family=family)  # type: ignore[arg-type]

    # ---- life cycle

    def start(self) -> None:
        self.servers = serve(
            self.health,
            self.metrics,
            self.config.healthz_bind_address,
            self.config.metrics_bind_address,
            proxy_mode=self.config.backend,
        )
        self.loop.start()

    def once(self) -> SyncResult:
        """Sync once, fully, and return (`--once`): no servers, no loop."""
        try:
            return self.loop.run_once()
        finally:
            self.health_checks.close()

    def run_until_signalled(self) -> None:
        """Serve until SIGTERM or SIGINT; the rules stay in place, as kube-proxy leaves them."""

        def stop(signum: int, _frame: object) -> None:
            log.info("received %s: stopping, rules stay in place", signal.Signals(signum).name)
            self._stopped.set()

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        self.start()
        try:
            self._stopped.wait()
        finally:
            self.stop()

    def stop(self) -> None:
        self.loop.stop()
        self.health_checks.close()
        if self.servers is not None:
            self.servers.close()

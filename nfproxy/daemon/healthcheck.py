"""Health-check node ports: how a cloud load balancer learns which nodes have local endpoints.

A LoadBalancer service with `externalTrafficPolicy: Local` gets a `healthCheckNodePort`. The
load balancer probes that port on every node; kube-proxy answers 200 where the service has ready
local endpoints (and the proxier keeps up), 503 elsewhere, so external traffic only goes to nodes
that can serve it without a second hop, and the client's source address survives.

The answer follows kube-proxy's pkg/proxy/healthcheck/service_health.go byte for byte: a
tab-indented JSON body, `X-Content-Type-Options: nosniff`, and
`X-Load-Balancing-Endpoint-Weight: <local endpoints>` (weighted load balancers read it).

Listening sockets are created in the namespace nfproxy programs (`--netns`), since that is where
node ports live. One event loop serves all of them, so a thousand such services cost a thousand
sockets, not a thousand threads, and connections held open by a slow client never delay a probe.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import socket
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from nfproxy.core.model import ClusterState, IPFamily, ServicePortName
from nfproxy.daemon import logs
from nfproxy.daemon.server import BACKLOG, HttpLoop, ProxierHealth, listen_socket, text_response
from nfproxy.kernel import netns as netns_mod

if TYPE_CHECKING:
    from aiohttp import web

log = logging.getLogger(__name__)

# A probe connection that sends no complete request in this long is closed.
REQUEST_TIMEOUT = 5.0


class ServiceName(NamedTuple):
    """A service's namespace and name: what a health check node port belongs to."""

    namespace: str
    name: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


ServiceKey = ServiceName | tuple[str, str] | ServicePortName


def service_name(key: ServiceKey) -> ServiceName:
    if isinstance(key, ServicePortName):
        return ServiceName(key.namespace, key.name)
    namespace, name = key
    return ServiceName(namespace, name)


# --------------------------------------------------------------------------------------------
# The pure part: what to serve, from a ClusterState


@dataclass(frozen=True, slots=True)
class ServiceHealth:
    """What the health-check server needs after a sync: ports to open, local endpoint counts."""

    ports: Mapping[ServiceName, int]
    local_endpoints: Mapping[ServiceName, int]


def service_health(state: ClusterState) -> ServiceHealth:
    """Health-check node ports and ready local endpoint counts, as kube-proxy derives them.

    kube-proxy counts ready endpoints on this node over every port of the service (a pod behind
    two ports counts twice). Terminating endpoints are not ready, so a node whose last local pod
    is shutting down answers 503 and the load balancer drains it. Each family's proxier counts
    its own endpoints in kube-proxy; here the count comes from the first family (IPv4 before IPv6)
    in which the service has a health check node port, so a dual-stack pod is not counted twice.
    """
    ports: dict[ServiceName, int] = {}
    family_of: dict[ServiceName, IPFamily] = {}
    for key in sorted(state.services):
        svc = state.services[key]
        if not svc.health_check_node_port:
            continue
        name = service_name(svc.name)
        if name not in ports:
            ports[name] = svc.health_check_node_port
            family_of[name] = svc.family
    counts = dict.fromkeys(ports, 0)
    node = state.node.name
    if node:
        for key, svc in state.services.items():
            name = service_name(svc.name)
            if family_of.get(name) is not svc.family:
                continue
            counts[name] += sum(
                1 for ep in state.endpoints.get(key, ()) if ep.ready and ep.node_name == node
            )
    return ServiceHealth(ports, counts)


def health_check_ports(state: ClusterState) -> dict[ServiceName, int]:
    return dict(service_health(state).ports)


def local_endpoint_counts(state: ClusterState) -> dict[ServiceName, int]:
    return dict(service_health(state).local_endpoints)


def response_body(name: ServiceName, local_endpoints: int, proxy_healthy: bool) -> bytes:
    """kube-proxy's body, tabs and all: some checkers compare it, not just the status."""
    return (
        "{\n"
        '\t"service": {\n'
        f'\t\t"namespace": {json.dumps(name.namespace)},\n'
        f'\t\t"name": {json.dumps(name.name)}\n'
        "\t},\n"
        f'\t"localEndpoints": {local_endpoints},\n'
        f'\t"serviceProxyHealthy": {"true" if proxy_healthy else "false"}\n'
        "}"
    ).encode()


# --------------------------------------------------------------------------------------------
# The server


@dataclass(frozen=True, slots=True)
class _Listener:
    name: ServiceName
    port: int
    sock: socket.socket


class ServiceHealthServer:
    """Opens and closes health-check listeners as services come and go; answers the probes.

    `bind_addresses` are the node addresses to listen on (kube-proxy: the node IPs matching
    --nodeport-addresses); empty means every address, IPv4 and IPv6 alike. Every listener is
    served by one event loop (server.HttpLoop), so connections that send nothing cost a socket
    each, never a worker: a load balancer's probe is answered while they are held, and they are
    closed after `idle_timeout`.
    """

    def __init__(
        self,
        netns: str | None = None,
        bind_addresses: Sequence[str] = (),
        *,
        health: ProxierHealth | None = None,
        idle_timeout: float = REQUEST_TIMEOUT,
    ) -> None:
        addrs = []
        for a in bind_addresses:
            try:
                addrs.append(str(ipaddress.ip_address(a)))
            except ValueError:
                raise ValueError(f"health check bind address {a!r} is not an IP address") from None
        self.netns = netns
        self.bind_addresses = tuple(dict.fromkeys(addrs))
        self.health = health
        self._lock = threading.Lock()
        self._listeners: dict[ServiceName, list[_Listener]] = {}
        self._by_port: dict[int, ServiceName] = {}
        self._counts: dict[ServiceName, int] = {}
        self._http = HttpLoop("hc", self._handle, idle_timeout=idle_timeout)
        self._closed = False

    # ---- what the proxier calls

    def sync_services(self, services: Mapping[ServiceKey, int]) -> None:
        """Serve exactly these services on these ports; keep the ones already right.

        A port that cannot be bound (in use, say) is logged and tried again at the next call.
        """
        if self._closed:
            raise RuntimeError("the health check server is closed")
        want: dict[ServiceName, int] = {}
        for key, port in services.items():
            if not 0 < int(port) < 65536:
                raise ValueError(f"health check node port of {service_name(key)} out of range: {port}")
            want[service_name(key)] = int(port)
        with self._lock:
            stale = [name for name, ls in self._listeners.items() if want.get(name) != ls[0].port]
            gone = [l for name in stale for l in self._listeners.pop(name)]
            for l in gone:
                self._by_port.pop(l.port, None)
        self._unregister(gone)
        for name in sorted(want):
            with self._lock:
                if name in self._listeners:
                    continue
            try:
                listeners = self._open(name, want[name])
            except OSError as exc:
                logs.error(
                    log, "Failed to open health check node port; retrying at the next sync", exc,
                    service=str(name), port=want[name],
                )
                continue
            for l in listeners:
                self._http.add(l.sock)
            logs.info(log, "Serving health checks", service=str(name), port=want[name])
            with self._lock:
                self._listeners[name] = listeners
                self._by_port[want[name]] = name

    def sync_endpoints(self, counts: Mapping[ServiceKey, int]) -> None:
        """Local endpoint counts; a service left out has none."""
        new = {service_name(k): int(v) for k, v in counts.items()}
        with self._lock:
            self._counts = new

    def sync(self, state: ClusterState) -> None:
        """Both at once, straight from a state."""
        h = service_health(state)
        self.sync_services(h.ports)
        self.sync_endpoints(h.local_endpoints)

    @property
    def ports(self) -> dict[ServiceName, int]:
        """Services being served now, with their port (those that failed to bind are absent)."""
        with self._lock:
            return {name: ls[0].port for name, ls in self._listeners.items()}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._lock:
            everything = [l for ls in self._listeners.values() for l in ls]
            self._listeners.clear()
            self._by_port.clear()
        self._unregister(everything)
        self._http.close()

    def __enter__(self) -> ServiceHealthServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- answers

    def local_endpoints(self, name: ServiceName) -> int:
        with self._lock:
            return self._counts.get(name, 0)

    def answer(self, name: ServiceName) -> tuple[int, bytes, int]:
        """Status, body and local endpoint count for a probe of `name`'s health check port."""
        with self._lock:
            open_now = name in self._listeners
            count = self._counts.get(name, 0)
        if not open_now:
            return 503, b"", 0  # closed between accept and answer
        healthy = self.health.healthy() if self.health is not None else True
        status = 200 if count and healthy else 503
        return status, response_body(name, count, healthy), count

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        # Any path, any method, as kube-proxy's handler: the port says which service it is.
        sockname = request.transport.get_extra_info("sockname") if request.transport else None
        with self._lock:
            name = self._by_port.get(int(sockname[1])) if sockname else None
        status, body, count = self.answer(name) if name is not None else (503, b"", 0)
        return text_response(
            status,
            body,
            "application/json",
            {
                "X-Content-Type-Options": "nosniff",
                "X-Load-Balancing-Endpoint-Weight": str(count),
            },
        )

    # ---- sockets

    def _open(self, name: ServiceName, port: int) -> list[_Listener]:
        opened: list[_Listener] = []
        try:
            with netns_mod.inside(self.netns):
                for addr in self.bind_addresses or ("",):
                    opened.append(_Listener(name, port, listen_socket(addr, port, BACKLOG)))
        except OSError:
            for l in opened:
                l.sock.close()
            raise
        return opened

    def _unregister(self, listeners: list[_Listener]) -> None:
        for l in listeners:
            self._http.remove(l.sock)
            logs.info(log, "Closed health check node port", service=str(l.name), port=l.port)

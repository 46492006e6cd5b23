"""The proxy's own HTTP endpoints: /healthz and /livez for probes, /metrics for Prometheus.

Semantics are kube-proxy's (pkg/proxy/healthcheck/proxy_health.go), so the DaemonSet probes and
cloud load-balancer checks written for kube-proxy work unchanged:

- Each IP family's proxier is healthy while no update is queued, or while the oldest queued
  update is younger than the timeout (kube-proxy: 2 x the sync period). A family is judged only
  once it has synced at least once (kube-proxy's map of last updates starts empty), so a long
  first sync does not get the daemon killed by its liveness probe.
- /livez is that health alone. /healthz also requires the node to be eligible (not being
  deleted, not tainted ToBeDeletedByClusterAutoscaler), so load balancers drain a node that is
  about to go away.
- Both answer 200 or 503 with a JSON body; on 200 `lastUpdated` is the current time, as kube-proxy
  does for compatibility with releases where it was the time of the last loop.

The servers bind in the namespace they are started in: the daemon's, never the one it programs.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client.exposition import choose_encoder

from nfproxy.cli.config import FlagError
from nfproxy.kernel import netns as netns_mod
from nfproxy.daemon.metrics import ProxyMetrics, family_label
from nfproxy.core.model import IPFamily

log = logging.getLogger(__name__)

TO_BE_DELETED_TAINT = "ToBeDeletedByClusterAutoscaler"
DEFAULT_HEALTHZ_ADDRESS = "0.0.0.0:10256"
DEFAULT_METRICS_ADDRESS = "127.0.0.1:10249"

Body = dict[str, Any]


def go_time(epoch: float | None) -> str:
    """A timestamp as Go's encoding/json writes time.Time (RFC 3339, trailing zeros trimmed).

    None is Go's zero time, what kube-proxy reports before anything happened.
    """
    if epoch is None:
        return "0001-01-01T00:00:00Z"
    t = datetime.datetime.fromtimestamp(epoch, tz=datetime.UTC)
    text = t.strftime("%Y-%m-%dT%H:%M:%S")
    if t.microsecond:
        text += f".{t.microsecond:06d}".rstrip("0")
    return text + "Z"


class ProxierHealth:
    """Whether the sync loop keeps up: kube-proxy's ProxyHealthServer without the HTTP part.

    Thread-safe: the sync loop calls `queued_update` / `updated`, the HTTP threads read.
    """

    def __init__(
        self,
        timeout: float,
        clock: Callable[[], float] = time.time,
        families: Iterable[IPFamily] = tuple(IPFamily),
    ) -> None:
        if timeout <= 0:
            raise ValueError(f"health timeout must be positive, not {timeout}")
        self.timeout = timeout
        self._clock = clock
        self._families = tuple(families)
        self._lock = threading.Lock()
        self._last_updated: dict[IPFamily, float] = {}
        self._oldest_queued: dict[IPFamily, float] = {}
        # Eligible while starting up, until a Node object says otherwise (as kube-proxy).
        self._node_eligible = True

    def _which(self, family: IPFamily | None) -> tuple[IPFamily, ...]:
        return self._families if family is None else (family,)

    def queued_update(self, family: IPFamily | None = None) -> None:
        """A change arrived that the rules do not reflect yet (None: every family)."""
        now = self._clock()
        with self._lock:
            for f in self._which(family):
                self._oldest_queued.setdefault(f, now)

    def updated(self, family: IPFamily | None = None) -> None:
        """The rules of `family` (None: every family) now reflect everything queued so far."""
        now = self._clock()
        with self._lock:
            for f in self._which(family):
                self._oldest_queued.pop(f, None)
                self._last_updated[f] = now

    def set_node_eligible(self, eligible: bool) -> None:
        with self._lock:
            self._node_eligible = eligible

    @property
    def node_eligible(self) -> bool:
        with self._lock:
            return self._node_eligible

    def _health(self) -> tuple[bool, Body]:
        with self._lock:
            now = self._clock()
            healthy = True
            status: dict[str, Body] = {}
            for family in sorted(self._last_updated):
                queued = self._oldest_queued.get(family)
                ok = queued is None or now - queued < self.timeout
                healthy = healthy and ok
                status[family_label(family)] = {
                    "lastUpdated": go_time(self._last_updated[family]),
                    "healthy": ok,
                }
            last = max(self._last_updated.values(), default=None)
        body: Body = {"lastUpdated": go_time(last), "currentTime": go_time(now)}
        body["healthy"] = healthy
        if status:  # omitempty, as kube-proxy's JSON
            body["status"] = status
        return healthy, body

    def healthy(self) -> bool:
        """The proxier's own health, ignoring the node (what service health checks report)."""
        return self._health()[0]

    def livez(self) -> tuple[int, Body]:
        healthy, body = self._health()
        if healthy:
            body["lastUpdated"] = body["currentTime"]
        return (200 if healthy else 503), body

    def healthz(self) -> tuple[int, Body]:
        healthy, body = self._health()
        eligible = self.node_eligible
        ok = healthy and eligible
        if ok:
            body["lastUpdated"] = body["currentTime"]
        # Go's field order: lastUpdated, currentTime, nodeEligible, healthy, status.
        ordered: Body = {
            "lastUpdated": body["lastUpdated"],
            "currentTime": body["currentTime"],
            "nodeEligible": eligible,
        }
        ordered.update((k, v) for k, v in body.items() if k not in ordered)
        return (200 if ok else 503), ordered


def node_eligible(node: Mapping[str, Any] | None) -> bool:
    """kube-proxy's rule for a Node object: not being deleted and not tainted for deletion."""
    if not node:
        return False
    if (node.get("metadata") or {}).get("deletionTimestamp"):
        return False
    taints = (node.get("spec") or {}).get("taints") or []
    return not any(isinstance(t, Mapping) and t.get("key") == TO_BE_DELETED_TAINT for t in taints)


# --------------------------------------------------------------------------------------------
# Bind addresses


@dataclass(frozen=True, slots=True)
class BindAddress:
    host: str
    port: int

    @property
    def family(self) -> socket.AddressFamily:
        return socket.AF_INET6 if ":" in self.host else socket.AF_INET

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_bind_address(value: str, flag: str) -> BindAddress | None:
    """`ip:port` or `[ipv6]:port` as kube-proxy takes it; "" disables the server (None).

    Port 0 asks the kernel for a free port (tests). Errors name the flag and the value.
    """
    if value == "":
        return None
    host, sep, port_text = value.rpartition(":")
    if not sep or not host:
        raise FlagError(f"{flag}: {value!r} is not ip:port (use [ip]:port for IPv6, '' to disable)")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        if ":" not in host:
            raise FlagError(f"{flag}: {value!r}: brackets are only for IPv6 addresses")
    elif ":" in host:
        raise FlagError(f"{flag}: {value!r}: write an IPv6 address in brackets, [ip]:port")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise FlagError(f"{flag}: {value!r}: {host!r} is not an IP address") from None
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise FlagError(f"{flag}: {value!r}: port must be a number from 0 to 65535")
    return BindAddress(str(ip), int(port_text))


# --------------------------------------------------------------------------------------------
# HTTP


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # Ours to answer, even when a dying daemon still holds the port in TIME_WAIT.
    allow_reuse_address = True

    def __init__(self, bind: BindAddress, handler: type[BaseHTTPRequestHandler], app: Any) -> None:
        self.address_family = bind.family
        self.app = app
        super().__init__((bind.host, bind.port), handler, bind_and_activate=False)
        try:
            if bind.family == socket.AF_INET6 and bind.host == "::":
                # Go listens dual-stack on "[::]:port"; so do we.
                self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            self.server_bind()
            self.server_activate()
        except BaseException:
            self.server_close()
            raise


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        log.debug("%s %s", self.address_string(), format % args)

    def send(
        self, status: int, body: bytes, content_type: str, headers: Mapping[str, str] | None = None
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_HEAD(self) -> None:
        self.do_GET()


class _HealthHandler(_Handler):
    def do_GET(self) -> None:
        app: _HealthApp = self.server.app
        path = self.path.split("?", 1)[0]
        if path not in ("/healthz", "/livez"):
            self.send(404, b"404 page not found\n", "text/plain; charset=utf-8")
            return
        probe = "healthz" if path == "/healthz" else "livez"
        status, body = app.health.healthz() if probe == "healthz" else app.health.livez()
        if app.metrics is not None:
            app.metrics.probe_answered(probe, status)
        self.send(
            status,
            json.dumps(body, separators=(",", ":")).encode(),
            "application/json",
            {"X-Content-Type-Options": "nosniff"},
        )


class _MetricsHandler(_Handler):
    def do_GET(self) -> None:
        app: _MetricsApp = self.server.app
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
            self.send(200, encoder(app.metrics.registry), content_type)
        elif path == "/proxyMode" and app.proxy_mode:
            self.send(200, app.proxy_mode.encode(), "text/plain; charset=utf-8")
        elif path == "/healthz":
            # kube-proxy's metrics mux has the plain apiserver-style healthz too.
            self.send(200, b"ok", "text/plain; charset=utf-8")
        else:
            self.send(404, b"404 page not found\n", "text/plain; charset=utf-8")


@dataclass(frozen=True, slots=True)
class _HealthApp:
    health: ProxierHealth
    metrics: ProxyMetrics | None


@dataclass(frozen=True, slots=True)
class _MetricsApp:
    metrics: ProxyMetrics
    proxy_mode: str


class Servers:
    """The running health and metrics servers; `close()` stops both and frees the ports."""

    def __init__(self) -> None:
        self._servers: dict[str, _Server] = {}
        self._threads: list[threading.Thread] = []
        self._running: set[str] = set()

    def _start(self, name: str, server: _Server) -> None:
        t = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.2},
            name=f"nfproxy-{name}", daemon=True,
        )
        t.start()
        self._running.add(name)
        self._threads.append(t)

    def address(self, name: str) -> BindAddress | None:
        """Where `healthz` or `metrics` listens (the real port when asked for port 0)."""
        server = self._servers.get(name)
        if server is None:
            return None
        host, port = server.server_address[:2]
        return BindAddress(str(host), int(port))

    @property
    def healthz(self) -> BindAddress | None:
        return self.address("healthz")

    @property
    def metrics(self) -> BindAddress | None:
        return self.address("metrics")

    def close(self) -> None:
        for name, server in self._servers.items():
            if name in self._running:
                server.shutdown()  # blocks until serve_forever returns: never call it unstarted
            server.server_close()
        for t in self._threads:
            t.join(timeout=5)
        self._servers.clear()
        self._threads.clear()
        self._running.clear()

    def __enter__(self) -> Servers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def _maybe_entered(netns: str | None) -> Iterator[None]:
    if netns is None:
        yield
    else:
        with netns_mod.entered(netns):
            yield


def serve(
    health: ProxierHealth,
    metrics: ProxyMetrics,
    healthz_address: str = DEFAULT_HEALTHZ_ADDRESS,
    metrics_address: str = DEFAULT_METRICS_ADDRESS,
    netns: str | None = None,
    *,
    proxy_mode: str = "",
) -> Servers:
    """Start /healthz + /livez on `healthz_address` and /metrics on `metrics_address`.

    Addresses are validated first (FlagError naming --healthz-bind-address or
    --metrics-bind-address); "" leaves that server off. `netns` is where the sockets are bound:
    None (the daemon) means the current namespace; tests pass a throwaway one. A port that
    cannot be bound raises OSError, after closing whatever was already started.
    """
    hz = parse_bind_address(healthz_address, "--healthz-bind-address")
    mt = parse_bind_address(metrics_address, "--metrics-bind-address")
    servers = Servers()
    try:
        with _maybe_entered(netns):
            # Bound here, inside the namespace; served from threads started outside it.
            if hz is not None:
                servers._servers["healthz"] = _Server(
                    hz, _HealthHandler, _HealthApp(health, metrics)
                )
            if mt is not None:
                servers._servers["metrics"] = _Server(
                    mt, _MetricsHandler, _MetricsApp(metrics, proxy_mode)
                )
        for name, server in servers._servers.items():
            servers._start(name, server)
            log.info("serving %s on %s", name, servers.address(name))
    except BaseException:
        servers.close()
        raise
    return servers

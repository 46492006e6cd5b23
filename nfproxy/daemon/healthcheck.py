"""Health-check node ports: how a cloud load balancer learns which nodes have local endpoints.

A LoadBalancer service with `externalTrafficPolicy: Local` gets a `healthCheckNodePort`. The
load balancer probes that port on every node; kube-proxy answers 200 where the service has ready
local endpoints (and the proxier keeps up), 503 elsewhere, so external traffic only goes to nodes
that can serve it without a second hop, and the client's source address survives.

The answer follows kube-proxy's pkg/proxy/healthcheck/service_health.go byte for byte: a
tab-indented JSON body, `X-Content-Type-Options: nosniff`, and
`X-Load-Balancing-Endpoint-Weight: <local endpoints>` (weighted load balancers read it).

Listening sockets are created in the namespace nfproxy programs (`--netns`), since that is where
node ports live. One thread accepts on all of them and a small pool answers, so a thousand such
services cost a thousand sockets, not a thousand threads.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import ipaddress
import json
import logging
import selectors
import socket
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from typing import Any, NamedTuple

from nfproxy.kernel import netns as netns_mod
from nfproxy.core.model import ClusterState, IPFamily, ServicePortName
from nfproxy.daemon.server import ProxierHealth

log = logging.getLogger(__name__)

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


class _Context:
    """What a request handler sees as its `server`."""

    def __init__(self, owner: ServiceHealthServer, name: ServiceName) -> None:
        self.owner = owner
        self.name = name


class _Handler(BaseHTTPRequestHandler):
    server: _Context  # type: ignore[assignment]
    protocol_version = "HTTP/1.1"
    timeout = REQUEST_TIMEOUT

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        log.debug("health check %s from %s: %s", self.server.name, self.address_string(), format % args)

    def do_GET(self) -> None:
        status, body, count = self.server.owner.answer(self.server.name)
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("X-Load-Balancing-Endpoint-Weight", str(count))
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_HEAD(self) -> None:
        self.do_GET()


class ServiceHealthServer:
    """Opens and closes health-check listeners as services come and go; answers the probes.

    `bind_addresses` are the node addresses to listen on (kube-proxy: the node IPs matching
    --nodeport-addresses); empty means every address, IPv4 and IPv6 alike.
    """

    def __init__(
        self,
        netns: str | None = None,
        bind_addresses: Sequence[str] = (),
        *,
        health: ProxierHealth | None = None,
        workers: int = 4,
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
        self._counts: dict[ServiceName, int] = {}
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._commands: list[tuple[Callable[[], None], threading.Event]] = []
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix="nfproxy-hc"
        )
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="nfproxy-hc-accept", daemon=True)
        self._thread.start()

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
            stale = [
                name
                for name, ls in self._listeners.items()
                if want.get(name) != ls[0].port
            ]
            gone = [l for name in stale for l in self._listeners.pop(name)]
        if gone:
            self._run_in_loop(lambda: self._unregister(gone))
        for name in sorted(want):
            with self._lock:
                if name in self._listeners:
                    continue
            try:
                listeners = self._open(name, want[name])
            except OSError as exc:
                log.error(
                    "cannot open health check node port %d for %s: %s (retrying at next sync)",
                    want[name], name, exc,
                )
                continue
            log.info("serving health checks of %s on port %d", name, want[name])
            with self._lock:
                self._listeners[name] = listeners
            self._run_in_loop(lambda ls=listeners: self._register(ls))

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
        with self._lock:
            everything = [l for ls in self._listeners.values() for l in ls]
            self._listeners.clear()
        self._run_in_loop(lambda: self._unregister(everything))
        self._closed = True
        self._wake()
        self._thread.join(timeout=5)
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._sel.close()
        self._wake_r.close()
        self._wake_w.close()

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

    # ---- sockets

    @contextlib.contextmanager
    def _in_netns(self) -> Iterator[None]:
        if self.netns is None:
            yield
        else:
            with netns_mod.entered(self.netns):
                yield

    def _open(self, name: ServiceName, port: int) -> list[_Listener]:
        opened: list[_Listener] = []
        try:
            with self._in_netns():
                for addr in self.bind_addresses or ("",):
                    opened.append(_Listener(name, port, _listen(addr, port)))
        except OSError:
            for l in opened:
                l.sock.close()
            raise
        return opened

    # ---- the accept loop (all selector changes happen on its thread)

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def _run_in_loop(self, fn: Callable[[], None]) -> None:
        done = threading.Event()
        with self._lock:
            self._commands.append((fn, done))
        self._wake()
        if not done.wait(timeout=10):
            raise RuntimeError("health check server loop did not respond")

    def _register(self, listeners: list[_Listener]) -> None:
        for l in listeners:
            self._sel.register(l.sock, selectors.EVENT_READ, l)

    def _unregister(self, listeners: list[_Listener]) -> None:
        for l in listeners:
            with contextlib.suppress(KeyError, ValueError):
                self._sel.unregister(l.sock)
            l.sock.close()
            log.info("closed health check node port %d of %s", l.port, l.name)

    def _loop(self) -> None:
        while True:
            for key, _ in self._sel.select():
                if key.data is None:
                    with contextlib.suppress(OSError):
                        while self._wake_r.recv(512):
                            pass
                    continue
                listener: _Listener = key.data
                try:
                    conn, peer = listener.sock.accept()
                except OSError:
                    continue
                try:
                    self._pool.submit(self._serve, conn, peer, listener.name)
                except RuntimeError:  # pool shut down
                    conn.close()
            with self._lock:
                commands, self._commands = self._commands, []
            for fn, done in commands:
                try:
                    fn()
                except Exception:  # noqa: BLE001 - never let the loop die; logged
                    log.exception("health check server: command failed")
                finally:
                    done.set()
            if self._closed:
                return

    def _serve(self, conn: socket.socket, peer: Any, name: ServiceName) -> None:
        try:
            conn.settimeout(REQUEST_TIMEOUT)
            _Handler(conn, peer, _Context(self, name))  # type: ignore[arg-type]
        except OSError as exc:
            log.debug("health check %s: %s", name, exc)
        finally:
            with contextlib.suppress(OSError):
                conn.close()


def _listen(addr: str, port: int) -> socket.socket:
    """A listening TCP socket; "" means every address, dual-stack when IPv6 is there (as Go)."""
    if addr == "":
        try:
            sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            host = "::"
        except OSError as exc:
            if exc.errno not in (errno.EAFNOSUPPORT, errno.EPROTONOSUPPORT):
                raise
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            host = "0.0.0.0"
    else:
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        host = addr
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock

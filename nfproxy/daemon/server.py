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
They hold load as kube-proxy's Go servers do (see "HTTP" below): a listen backlog of 1 024, one
event loop instead of a thread per connection, idle and header timeouts, and a port that is
taken is logged and retried (or fatal with `--bind-address-hard-fail`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import datetime
import errno
import functools
import ipaddress
import json
import logging
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from prometheus_client.exposition import choose_encoder

from nfproxy.core.flags import FlagError
from nfproxy.daemon import logs
from nfproxy.kernel import netns as netns_mod
from nfproxy.daemon.metrics import ProxyMetrics, family_label
from nfproxy.core.model import IPFamily

if TYPE_CHECKING:
    from aiohttp import web

log = logging.getLogger(__name__)
T = TypeVar("T")

TO_BE_DELETED_TAINT = "ToBeDeletedByClusterAutoscaler"
DEFAULT_HEALTHZ_ADDRESS = "0.0.0.0:10256"
DEFAULT_METRICS_ADDRESS = "127.0.0.1:10249"
CONFIGZ_GROUP = "kubeproxy.config.k8s.io"

Body = dict[str, Any]


@functools.lru_cache(maxsize=64)
def go_time(epoch: float | None) -> str:
    """A timestamp as Go's encoding/json writes time.Time (RFC 3339, trailing zeros trimmed).

    None is Go's zero time, what kube-proxy reports before anything happened. Cached and built
    with isoformat, not strftime: every probe formats the same last-update times again, and
    formatting was a third of a probe's own cost.
    """
    if epoch is None:
        return "0001-01-01T00:00:00Z"
    text = datetime.datetime.fromtimestamp(epoch, tz=datetime.UTC).isoformat().removesuffix("+00:00")
    if "." in text:
        text = text.rstrip("0")
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
    if not (port_text.isascii() and port_text.isdigit()) or not 0 <= int(port_text) <= 65535:
        raise FlagError(f"{flag}: {value!r}: port must be a number from 0 to 65535")
    return BindAddress(str(ip), int(port_text))


# --------------------------------------------------------------------------------------------
# HTTP: one asyncio loop per server set (aiohttp), so load costs sockets, not threads
#
# kube-proxy's Go servers hold thousands of connections; a thread per connection does not
# (issue J: 1 000 concurrent requests, 587 timed out; 8 idle connections starved a probe). An
# event loop holds every connection in one thread, parses requests with aiohttp's parser, and
# closes a connection that has not sent a complete request within `idle_timeout` (aiohttp's
# keep-alive timer runs from the moment a connection is accepted, so it is the header timeout
# too). The only work that is not a few microseconds, encoding /metrics, runs on a small,
# bounded pool so probes are answered while a scrape is being encoded.

BACKLOG = 1024  # the kernel caps it at net.core.somaxconn
IDLE_TIMEOUT = 10.0
RETRY_INTERVAL = 5.0  # kube-proxy retries a server that failed to start every 5 s
METRICS_WORKERS = 2
SHUTDOWN_TIMEOUT = 1.0
PROXY_MODES = {"nft": "nftables", "nftables": "nftables", "iptables": "iptables"}


class BindError(OSError):
    """A server's port cannot be bound and `--bind-address-hard-fail` makes that fatal."""


def listen_socket(host: str, port: int, backlog: int = BACKLOG) -> socket.socket:
    """A listening, non-blocking TCP socket; "" or "::" listen dual-stack, as Go does.

    Created in the caller's network namespace, which is the one it stays in.
    """
    if host == "":
        try:
            sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
            host = "::"
        except OSError as exc:
            if exc.errno not in (errno.EAFNOSUPPORT, errno.EPROTONOSUPPORT):
                raise
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            host = "0.0.0.0"
    else:
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        # Ours to answer, even when a dying daemon still holds the port in TIME_WAIT.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if sock.family == socket.AF_INET6 and host == "::":
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind((host, port))
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


Handler = Callable[["web.BaseRequest"], Awaitable["web.StreamResponse"]]

# aiohttp's per-connection log (see _ClientErrors).
_HTTP_LOG = logging.getLogger("nfproxy.daemon.server.http")
_ACCEPT_FAILED = "socket.accept() out of system resource"
ACCEPT_LOG_INTERVAL = 10.0  # seconds between two "cannot accept" errors while it lasts


class _ClientErrors(logging.Filter):
    """A malformed request is the client's problem: Go's net/http answers 400 and logs nothing,
    so aiohttp's ERROR with the client's bytes becomes a debug line (--v=4), and a flood of
    bad requests cannot fill the disk. An exception of our own handlers stays an error."""

    def filter(self, record: logging.LogRecord) -> bool:
        from aiohttp.http_exceptions import HttpProcessingError

        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, (HttpProcessingError, ConnectionError)):
            return True
        if not _HTTP_LOG.isEnabledFor(logging.DEBUG):
            return False
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return True


if not any(isinstance(f, _ClientErrors) for f in _HTTP_LOG.filters):
    _HTTP_LOG.addFilter(_ClientErrors())


class _AcceptFailures:
    """The loop's exception handler, rate-limiting one error: out of file descriptors,
    asyncio's accept logs once per connection waiting in the backlog (1 024 a turn, ~10 000
    lines a second) where Go's server logs once per back-off. Here: one ERROR per
    ACCEPT_LOG_INTERVAL, saying how many were held back."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._last: float | None = None
        self._held = 0

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if not str(context.get("message", "")).startswith(_ACCEPT_FAILED):
            loop.default_exception_handler(context)
            return
        now = self._clock()
        if self._last is not None and now - self._last < ACCEPT_LOG_INTERVAL:
            self._held += 1
            return
        exc = context.get("exception")
        held = f" ({self._held} more since the last report)" if self._held else ""
        log.error("Cannot accept connections: %s%s; retrying", exc or context["message"], held)
        self._last, self._held = now, 0


@functools.cache
def _half_close_server() -> type:
    """aiohttp's `web.Server`, made to answer a client that half-closes after its request.

    aiohttp's protocol ignores the end of the client's stream, so asyncio closes the whole
    connection and cancels the request being handled: an empty reply (issue R.5). Go's
    net/http, and so kube-proxy, answers every request read before that end, then closes. Here
    the connection stays open for writing while anything read is unanswered; the last answer
    carries `Connection: close`. Built on first use: only the daemon pays aiohttp's import.
    Leans on aiohttp's private `_waiter`, `_messages` and `_close` (pinned in constraints.txt;
    tests/test_half_close.py fails if they change meaning).
    """
    from aiohttp import web
    from aiohttp.web_protocol import RequestHandler

    class HalfClosing(RequestHandler):  # type: ignore[misc]
        __slots__ = ("peer_done",)

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.peer_done = False

        def eof_received(self) -> bool | None:
            if self._waiter is not None and not self._waiter.done():
                return None  # idle, nothing read is unanswered: close as before
            self.peer_done = True
            if not self._messages:
                self._close = True  # the request in hand is the last one
            return True  # keep the write side open for the answers

        def last_request(self) -> bool:
            return self.peer_done and not self._messages

    class Server(web.Server):  # type: ignore[misc]
        def __call__(self) -> RequestHandler:
            return HalfClosing(self, loop=self._loop, **self._kwargs)

    return Server


def _closing_after_last(handler: Handler) -> Handler:
    """`handler`, whose answer to a half-closed client's last request says the connection ends."""

    async def answer(request: web.BaseRequest) -> web.StreamResponse:
        response = await handler(request)
        last = getattr(request.protocol, "last_request", None)
        if last is not None and last():
            response.force_close()
        return response

    return answer


class HttpLoop:
    """An asyncio loop on a thread of its own, serving the listeners given to `add`.

    Everything that touches aiohttp runs on the loop's thread; other threads call `run`.
    """

    def __init__(self, name: str, handler: Handler, *, idle_timeout: float = IDLE_TIMEOUT) -> None:
        from aiohttp import web  # the daemon's only user: other commands do not pay the import

        self._web = web
        self.loop = asyncio.new_event_loop()
        self.loop.set_exception_handler(_AcceptFailures())
        self._thread = threading.Thread(target=self._main, name=f"nfproxy-{name}", daemon=True)
        self._thread.start()
        server = _half_close_server()(
            _closing_after_last(handler), access_log=None, keepalive_timeout=idle_timeout, loop=self.loop, logger=_HTTP_LOG,
        )
        self._runner = web.ServerRunner(server, handle_signals=False, shutdown_timeout=SHUTDOWN_TIMEOUT)
        self.run(self._runner.setup())
        self._sites: dict[int, web.SockSite] = {}
        self._closed = False

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 10.0) -> T:
        """Run `coro` on the loop and wait for its result (from any other thread)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def add(self, sock: socket.socket) -> None:
        """Serve a listening socket (made by `listen_socket`, in whatever namespace)."""
        site = self._web.SockSite(self._runner, sock, backlog=BACKLOG)
        self.run(site.start())
        self._sites[sock.fileno()] = site

    def remove(self, sock: socket.socket) -> None:
        """Stop listening on `sock` and close it; connections already accepted finish."""
        site = self._sites.pop(sock.fileno(), None)
        if site is not None:
            self.run(site.stop())
        sock.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            self.run(self._runner.cleanup(), timeout=SHUTDOWN_TIMEOUT + 5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self.loop.close()


def text_response(status: int, body: bytes, content_type: str, headers: Mapping[str, str] | None = None) -> web.Response:
    from aiohttp import web

    all_headers = {"Content-Type": content_type, **(headers or {})}
    return web.Response(status=status, body=body, headers=all_headers)


NOT_FOUND = b"404 page not found\n"
PLAIN = "text/plain; charset=utf-8"


class SharedEncoding:
    """Scrapes that arrive while /metrics is being encoded share that encoding.

    Encoding the registry costs about 10 ms of CPU; a thousand concurrent scrapes would queue
    ten seconds of it. Sharing the one in flight (per content type) answers them all with
    figures at most one encoding old, which no scrape interval can tell apart. Runs on the
    loop's thread only; the encoding itself on the bounded pool.
    """

    def __init__(self, metrics: ProxyMetrics, pool: concurrent.futures.ThreadPoolExecutor) -> None:
        self._metrics = metrics
        self._pool = pool
        self._inflight: dict[str, asyncio.Future[bytes]] = {}

    async def encode(self, accept: str) -> tuple[bytes, str]:
        encoder, content_type = choose_encoder(accept)
        shared = self._inflight.get(content_type)
        if shared is None:
            shared = asyncio.get_running_loop().run_in_executor(self._pool, encoder, self._metrics.registry)
            self._inflight[content_type] = shared
            shared.add_done_callback(lambda _: self._inflight.pop(content_type, None))
        # shield: a client that hangs up cancels its own wait, not everyone's encoding.
        return await asyncio.shield(shared), content_type


@dataclass(frozen=True, slots=True)
class _Apps:
    """What the two servers answer from."""

    health: ProxierHealth
    metrics: ProxyMetrics
    proxy_mode: str
    encoding: SharedEncoding
    configz: bytes = b""  # the /configz body, made once at start; empty: no /configz

    async def healthz(self, request: web.BaseRequest) -> web.StreamResponse:
        if request.path not in ("/healthz", "/livez"):
            return text_response(404, NOT_FOUND, PLAIN)
        probe: Literal["healthz", "livez"] = "healthz" if request.path == "/healthz" else "livez"
        status, body = self.health.healthz() if probe == "healthz" else self.health.livez()
        self.metrics.probe_answered(probe, status)
        return text_response(
            status,
            json.dumps(body, separators=(",", ":")).encode(),
            "application/json",
            {"X-Content-Type-Options": "nosniff"},
        )

    async def serve_metrics(self, request: web.BaseRequest) -> web.StreamResponse:
        if request.path == "/metrics":
            body, content_type = await self.encoding.encode(request.headers.get("Accept", ""))
            return text_response(200, body, content_type)
        if request.path == "/proxyMode" and self.proxy_mode:
            return text_response(200, self.proxy_mode.encode(), PLAIN)
        if request.path in ("/healthz", "/healthz/ping"):
            # kube-proxy's metrics mux has the plain apiserver-style healthz too (its one
            # check, ping, has a path of its own).
            return text_response(200, b"ok", PLAIN)
        if request.path == "/configz" and self.configz:
            return text_response(200, self.configz, "application/json")
        return text_response(404, NOT_FOUND, PLAIN)


_FLAGS = {"healthz": "--healthz-bind-address", "metrics": "--metrics-bind-address"}
_FAILED = {"healthz": "Healthz server failed", "metrics": "Metrics server failed"}


class Servers:
    """The running health and metrics servers; `close()` stops both and frees the ports.

    A port that cannot be bound is logged and tried again every `retry_interval` (kube-proxy
    does the same, so a node where the old proxy still holds 10256 recovers on its own), or,
    with `hard_fail`, is a `BindError` (`--bind-address-hard-fail`).
    """

    def __init__(self, netns: str | None, *, hard_fail: bool, retry_interval: float) -> None:
        self.netns = netns
        self.hard_fail = hard_fail
        self.retry_interval = retry_interval
        self._lock = threading.Lock()
        self._loops: dict[str, HttpLoop] = {}
        self._wanted: dict[str, BindAddress] = {}
        self._bound: dict[str, tuple[socket.socket, BindAddress]] = {}
        self._retries: dict[str, threading.Timer] = {}
        self._closed = False
        self.pool: concurrent.futures.ThreadPoolExecutor | None = None

    def _add(self, name: str, bind: BindAddress, loop: HttpLoop) -> None:
        self._loops[name] = loop
        self._wanted[name] = bind
        try:
            self._bind(name)
        except OSError as exc:
            if self.hard_fail:
                raise BindError(
                    exc.errno, f"{_FLAGS[name]} {bind}: {exc.strerror or exc} (--bind-address-hard-fail)"
                ) from None
            logs.error(log, _FAILED[name], exc, address=str(bind), retryIn=logs.Duration(self.retry_interval))
            self._schedule_retry(name)

    def _bind(self, name: str) -> None:
        bind = self._wanted[name]
        with _maybe_entered(self.netns):
            sock = listen_socket(bind.host, bind.port)
        try:
            self._loops[name].add(sock)
        except BaseException:
            sock.close()
            raise
        host, port = sock.getsockname()[:2]
        with self._lock:
            self._bound[name] = (sock, BindAddress(str(host), int(port)))
        logs.info(log, "Serving", server=name, address=str(self._bound[name][1]))

    def _schedule_retry(self, name: str) -> None:
        timer = threading.Timer(self.retry_interval, self._retry, (name,))
        timer.name = f"nfproxy-{name}-retry"
        timer.daemon = True
        with self._lock:
            if self._closed:
                return
            self._retries[name] = timer
        timer.start()

    def _retry(self, name: str) -> None:
        if self._closed:
            return
        try:
            self._bind(name)
        except OSError as exc:
            logs.error(log, _FAILED[name], exc, address=str(self._wanted[name]),
                       retryIn=logs.Duration(self.retry_interval))
            if not self._closed:
                self._schedule_retry(name)
        except RuntimeError:  # closed while retrying: the loop is gone
            return

    def address(self, name: str) -> BindAddress | None:
        """Where `healthz` or `metrics` listens (the real port when asked for port 0); None
        while the port is not bound (yet)."""
        with self._lock:
            bound = self._bound.get(name)
        return bound[1] if bound else None

    @property
    def healthz(self) -> BindAddress | None:
        return self.address("healthz")

    @property
    def metrics(self) -> BindAddress | None:
        return self.address("metrics")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            retries, self._retries = list(self._retries.values()), {}
        for timer in retries:
            timer.cancel()
            if timer is not threading.current_thread():
                timer.join(timeout=5)
        for loop in self._loops.values():
            loop.close()
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            for sock, _ in self._bound.values():
                sock.close()
            self._bound.clear()
        self._loops.clear()

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
    hard_fail: bool = False,
    retry_interval: float = RETRY_INTERVAL,
    idle_timeout: float = IDLE_TIMEOUT,
    configz: Mapping[str, Any] | None = None,
) -> Servers:
    """Start /healthz + /livez on `healthz_address` and /metrics on `metrics_address`.

    Addresses are validated first (FlagError naming --healthz-bind-address or
    --metrics-bind-address); "" leaves that server off. `netns` is where the sockets are bound:
    None (the daemon) means the current namespace; tests pass a throwaway one. A port that
    cannot be bound is retried in the background, or with `hard_fail` raises `BindError` after
    closing whatever was already started. `proxy_mode` is the backend ("nft" answers
    `nftables` on /proxyMode, as kube-proxy names the mode). `configz`, the effective
    KubeProxyConfiguration, is served on /configz under its group name, as kube-proxy does
    (kube-proxy serves its internal type there, kubernetes#137426; this is the versioned one).
    """
    hz = parse_bind_address(healthz_address, "--healthz-bind-address")
    mt = parse_bind_address(metrics_address, "--metrics-bind-address")
    if proxy_mode and proxy_mode not in PROXY_MODES:
        raise ValueError(f"proxy mode {proxy_mode!r}: choose one of {', '.join(sorted(PROXY_MODES))}")
    if retry_interval <= 0 or idle_timeout <= 0:
        raise ValueError("retry interval and idle timeout must be positive")
    pool = concurrent.futures.ThreadPoolExecutor(METRICS_WORKERS, thread_name_prefix="nfproxy-metrics")
    body = json.dumps({CONFIGZ_GROUP: dict(configz)}, separators=(",", ":")).encode() if configz else b""
    apps = _Apps(health, metrics, PROXY_MODES.get(proxy_mode, ""), SharedEncoding(metrics, pool), body)
    servers = Servers(netns, hard_fail=hard_fail, retry_interval=retry_interval)
    servers.pool = pool
    try:
        if hz is not None:
            servers._add("healthz", hz, HttpLoop("healthz", apps.healthz, idle_timeout=idle_timeout))
        if mt is not None:
            servers._add("metrics", mt, HttpLoop("metrics", apps.serve_metrics, idle_timeout=idle_timeout))
    except BaseException:
        servers.close()
        raise
    return servers

"""Real packets through real rules: a throwaway node, its clients and its endpoints.

Every real-traffic test, the cross-backend compat corpus and `nfproxy lab` need the same thing:
a node whose rules are under test, clients outside and inside the pod network, and endpoints
that say who they are and whom they saw. Building that once, here, keeps all of them honest
about the same topology and makes sure none of them ever touches the root namespace.

Topology (all of it in namespaces this module creates; the root namespace is never changed):

    client ns <base>-c<i>        node ns <base>-n                         endpoint ns <base>-e<j>
    eth0  client IPs /32 /128 == cl<i>  169.254.1.1 fe80::1   ep<j> == eth0  endpoint IP /32 /128
    default via the node           cl0 also holds the node IPs            default via the node
                                   routes: client IP dev cl<i>, endpoint IP dev ep<j>
                                   (src: first IPv4 node IP); default via sink0,
                                   a veth whose twin sink1 drops everything

The node's default route plays the part of a real node's uplink: any service, load-balancer or
external IP is routable from the node itself (nat OUTPUT DNAT happens after the routing
decision), and whatever no rule rewrites is dropped silently instead of answered.

Servers live in this process: sockets are created while the thread is inside the endpoint's
namespace, stay bound to it, and one event-loop thread serves them all. The wire protocol is a
line: on accept (TCP) and on every request line or datagram the server answers
"<ip:port> <peer ip> <peer port>\\n", so one-shot probes read one line and close, while held
connections send a line and read the answer as often as they like.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import enum
import errno
import functools
import ipaddress
import os
import re
import secrets
import selectors
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from pyroute2 import IPRoute
from pyroute2 import netns as pyroute2_netns

from nfproxy.kernel import netns as netns_mod
from nfproxy.kernel.process import KernelError

Proto = Literal["tcp", "udp"]
ProtoLike = str | enum.Enum
""""tcp"/"udp" in any case, or the model's Protocol enum."""
Kind = Literal["ok", "refused", "timeout", "unreachable", "reset", "denied", "error"]
"""`denied`: the node's own output path dropped what the node itself sent (EPERM at once)."""

NODE = "node"
"""Client name for connections opened from the node namespace itself."""

PREFIX = "nfsb"

# The node's side of every veth: the one gateway address clients and endpoints need, and never a
# source the node picks for a global destination (scope link), so node IPs show up as sources.
GATEWAY_V4 = "169.254.1.1"
GATEWAY_V6 = "fe80::1"
# The sink's invisible next hop, resolved by a permanent neighbour entry so dropped traffic
# disappears at once instead of waiting on ARP.
_SINK_V4 = "169.254.255.1"
_SINK_V6 = "fe80::ff"
_SINK_MAC = "02:00:00:00:00:01"
_RESERVED = {ipaddress.ip_address(a) for a in (GATEWAY_V4, GATEWAY_V6, _SINK_V4, _SINK_V6)}

_RT_SCOPE_LINK = 253
_IFA_F_NODAD = 0x02
_RTNH_F_ONLINK = 0x04
_NUD_PERMANENT = 0x80

_UDP_PORTS = (32768, 60999)


class SandboxError(KernelError):
    """The sandbox could not be built or was used wrongly; the namespaces are already gone."""


class ConnectFailed(SandboxError):
    """A held connection could not be opened; `outcome` says how it failed."""

    def __init__(self, outcome: Outcome) -> None:
        super().__init__(f"connection failed: {outcome.kind} {outcome.detail}".rstrip())
        self.outcome = outcome


def _proto(p: ProtoLike) -> Proto:
    """Accept "tcp"/"udp" and the model's Protocol enum alike, so callers need not convert."""
    text = str(p.value if isinstance(p, enum.Enum) else p).lower()
    if text == "tcp":
        return "tcp"
    if text == "udp":
        return "udp"
    raise SandboxError(f"unsupported protocol {p!r}: the sandbox speaks tcp and udp")


def endpoint_label(ip: str, port: int) -> str:
    """`ip:port`, bracketed for IPv6, the same spelling servers report and summaries count."""
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def _canon(ip: str) -> str:
    try:
        return str(ipaddress.ip_address(ip))
    except ValueError as exc:
        raise SandboxError(f"not an IP address: {ip!r}") from exc


def _family(ip: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in ip else socket.AF_INET


# --------------------------------------------------------------------------------------------
# Spec and outcome values


@dataclass(frozen=True)
class ClientSpec:
    """A namespace that opens connections; dual-stack when given one address of each family."""

    name: str
    addresses: tuple[str, ...]

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,32}", self.name) or self.name == NODE:
            raise SandboxError(f"bad client name {self.name!r} ({NODE!r} is the node itself)")
        if not self.addresses:
            raise SandboxError(f"client {self.name} has no address")
        object.__setattr__(self, "addresses", tuple(_canon(a) for a in self.addresses))


@dataclass(frozen=True)
class EndpointSpec:
    """One endpoint IP: its own namespace (or the node's, when it is a node IP: host network)."""

    ip: str
    ports: tuple[tuple[int, Proto], ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "ip", _canon(self.ip))
        ports = tuple(dict.fromkeys((int(port), _proto(p)) for port, p in self.ports))
        for port, _ in ports:
            if not 0 < port < 65536:
                raise SandboxError(f"endpoint {self.ip}: bad port {port}")
        object.__setattr__(self, "ports", ports)


@dataclass(frozen=True)
class SandboxSpec:
    """What to build. `SandboxSpec.of(...)` takes plain dicts; the fields hold tuples."""

    node_ips: tuple[str, ...] = ()
    clients: tuple[ClientSpec, ...] = ()
    endpoints: tuple[EndpointSpec, ...] = ()
    service_cidrs: tuple[str, ...] = ()
    """Optional: the node's default route already covers every service address; listing the
    CIDRs only adds explicit routes (to the same sink) that show up in `ip route`."""

    @classmethod
    def of(
        cls,
        *,
        node_ips: Iterable[str] = (),
        service_cidrs: Iterable[str] = (),
        clients: Mapping[str, str | Sequence[str]] | None = None,
        endpoints: Mapping[str, Iterable[tuple[int, ProtoLike]]] | None = None,
    ) -> SandboxSpec:
        return cls(
            node_ips=tuple(node_ips),
            service_cidrs=tuple(service_cidrs),
            clients=tuple(
                ClientSpec(name, (addrs,) if isinstance(addrs, str) else tuple(addrs))
                for name, addrs in (clients or {}).items()
            ),
            endpoints=tuple(
                EndpointSpec(ip, tuple((port, _proto(p)) for port, p in ports))
                for ip, ports in (endpoints or {}).items()
            ),
        )

    def __post_init__(self) -> None:
        object.__setattr__(self, "node_ips", tuple(dict.fromkeys(_canon(a) for a in self.node_ips)))
        try:
            cidrs = tuple(str(ipaddress.ip_network(c, strict=False)) for c in self.service_cidrs)
        except ValueError as exc:
            raise SandboxError(f"bad service CIDR: {exc}") from exc
        object.__setattr__(self, "service_cidrs", cidrs)
        seen: dict[str, str] = {}

        def claim(ip: str, owner: str) -> None:
            if ipaddress.ip_address(ip) in _RESERVED:
                raise SandboxError(f"{owner}: {ip} is reserved for the sandbox's own links")
            if ip in seen:
                raise SandboxError(f"{owner}: {ip} is already used by {seen[ip]}")
            seen[ip] = owner

        for ip in self.node_ips:
            claim(ip, "node")
        names = [c.name for c in self.clients]
        if len(set(names)) != len(names):
            raise SandboxError(f"duplicate client names in {names}")
        for c in self.clients:
            for ip in c.addresses:
                claim(ip, f"client {c.name}")
        for e in self.endpoints:
            if e.ip not in self.node_ips:  # a node IP endpoint is a host-network server
                claim(e.ip, f"endpoint {e.ip}")
            elif seen.get(e.ip) != "node":
                raise SandboxError(f"endpoint {e.ip} listed twice")
            else:
                seen[e.ip] = "node endpoint"

    @property
    def families(self) -> frozenset[socket.AddressFamily]:
        ips = [*self.node_ips, *(a for c in self.clients for a in c.addresses)]
        ips += [e.ip for e in self.endpoints]
        return frozenset(_family(ip) for ip in ips)


@dataclass(frozen=True)
class Outcome:
    """What one connection found: who answered and whom it saw, or how it failed."""

    kind: Kind
    endpoint: str | None = None
    """`ip:port` of the server that answered (`[ip]:port` for IPv6)."""
    source: str | None = None
    """The source address the server saw: the client's own unless something masqueraded it."""
    source_port: int | None = None
    seconds: float = 0.0
    detail: str = ""
    client_port: int | None = None
    """The port the client sent from. With `source`, what tells masquerade apart even when
    the client is the node itself: SNAT to the node's own address still changes the port
    (kube-proxy masquerades with --random-fully)."""

    @property
    def ok(self) -> bool:
        return self.kind == "ok"

    @property
    def label(self) -> str:
        """The endpoint for answers, the failure kind otherwise: what summaries count."""
        return self.endpoint if self.endpoint is not None else self.kind


def summarize(
    outcomes: Iterable[Outcome], by: Literal["endpoint", "source"] = "endpoint"
) -> collections.Counter[str]:
    """Count outcomes per endpoint (failures by kind) or per seen source."""
    counts: collections.Counter[str] = collections.Counter()
    for o in outcomes:
        counts[o.label if not o.ok or by == "endpoint" else o.source or "?"] += 1
    return counts


# --------------------------------------------------------------------------------------------
# Outcomes from socket errors and server lines


def _failure(err: int, started: float) -> Outcome:
    kind: Kind
    if err == errno.ECONNREFUSED:
        kind = "refused"
    elif err in (errno.EHOSTUNREACH, errno.ENETUNREACH):
        kind = "unreachable"
    elif err in (errno.ECONNRESET, errno.EPIPE, errno.ECONNABORTED):
        kind = "reset"
    elif err == errno.ETIMEDOUT:
        kind = "timeout"
    elif err == errno.EPERM:
        kind = "denied"
    else:
        kind = "error"
    name = errno.errorcode.get(err, str(err))
    return Outcome(kind, seconds=time.monotonic() - started, detail=name)


def _send_error(sock: socket.socket, exc: OSError) -> int:
    """The errno a failed datagram send stands for.

    A packet the node's own output path drops fails the send with EPERM, whether a rule
    dropped or rejected it; a reject also queues the ICMP error it generated on the socket.
    Reading that pending error tells the node's UDP "rejected" (refused) from "dropped"
    (denied), as a remote client would see them.
    """
    err = exc.errno or 0
    if err == errno.EPERM:
        with contextlib.suppress(OSError):
            pending = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if pending:
                return pending
    return err


def _answer(line: bytes, started: float) -> Outcome:
    parts = line.decode("ascii", "replace").split()
    if len(parts) != 3 or not parts[2].isdigit():
        return Outcome("error", seconds=time.monotonic() - started, detail=f"bad reply {line!r}")
    return Outcome("ok", parts[0], parts[1], int(parts[2]), time.monotonic() - started)


# --------------------------------------------------------------------------------------------
# Servers: one event loop for every endpoint socket of the sandbox


class _Servers:
    """Answers every endpoint socket from one thread.

    One thread and no per-connection threads: the GIL makes more threads slower, not faster,
    and an epoll loop keeps up with thousands of short connections per second on two cores.
    """

    def __init__(self) -> None:
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._thread: threading.Thread | None = None
        self._stop = False
        self.errors: list[BaseException] = []

    def listen(self, ip: str, port: int, proto: Proto) -> None:
        """Open a server socket in the current thread's namespace (call inside `entered`)."""
        family = _family(ip)
        kind = socket.SOCK_STREAM if proto == "tcp" else socket.SOCK_DGRAM
        sock = socket.socket(family, kind)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if proto == "udp":
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
            sock.bind((ip, port))
            if proto == "tcp":
                sock.listen(4096)
            sock.setblocking(False)
        except OSError as exc:
            sock.close()
            raise SandboxError(f"cannot serve {proto} {endpoint_label(ip, port)}: {exc}") from exc
        ident = endpoint_label(ip, port).encode()
        self._sel.register(sock, selectors.EVENT_READ, (proto, ident))

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._run, name="nfproxy-sandbox-servers", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if self._thread is not None:
            self._thread.join(timeout=10)
        for key in list(self._sel.get_map().values()):
            with contextlib.suppress(OSError):
                key.fileobj.close()  # type: ignore[union-attr]
        self._sel.close()
        self._wake_w.close()

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # noqa: BLE001 - surfaced by Sandbox.close
            self.errors.append(exc)

    def _loop(self) -> None:
        sel = self._sel
        while not self._stop:
            for key, _ in sel.select():
                data = key.data
                if data is None:
                    return
                sock: socket.socket = key.fileobj  # type: ignore[assignment]
                kind, ident = data[0], data[1]
                if kind == "tcp":
                    self._accept(sock, ident)
                elif kind == "conn":
                    self._serve_conn(sock, ident, data[2])
                else:
                    self._serve_udp(sock, ident)

    def _accept(self, listener: socket.socket, ident: bytes) -> None:
        while True:
            try:
                conn, peer = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            conn.setblocking(False)
            reply = b"%s %s %d\n" % (ident, peer[0].encode(), peer[1])
            try:
                conn.send(reply)
            except OSError:
                conn.close()
                continue
            self._sel.register(conn, selectors.EVENT_READ, ("conn", ident, reply))

    def _serve_conn(self, conn: socket.socket, ident: bytes, reply: bytes) -> None:
        try:
            data = conn.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if data:
            n = data.count(b"\n")
            if n:
                try:
                    conn.send(reply * n)
                    return
                except OSError:
                    pass
            else:
                return
        self._sel.unregister(conn)
        conn.close()

    def _serve_udp(self, sock: socket.socket, ident: bytes) -> None:
        for _ in range(256):
            try:
                _, peer = sock.recvfrom(2048)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                continue  # an ICMP error queued on the socket: the next datagram is still there
            with contextlib.suppress(OSError):
                sock.sendto(b"%s %s %d\n" % (ident, peer[0].encode(), peer[1]), peer)


# --------------------------------------------------------------------------------------------
# Clients


@dataclass
class _Flow:
    index: int
    sock: socket.socket
    started: float
    deadline: float
    connecting: bool
    buf: bytes = b""
    local_port: int | None = None


class _Flows:
    """`count` connections, up to `parallel` in flight, on one selector; outcomes in order.

    Flows are kept in start order, which is deadline order (one timeout for all), so the oldest
    is always the next to time out.
    """

    def __init__(self, family: socket.AddressFamily, proto: Proto, addr: tuple[str, int],
                 timeout: float, udp_socket: Callable[[], socket.socket]) -> None:
        self.family = family
        self.tcp = proto == "tcp"
        self.addr = addr
        self.timeout = timeout
        self.udp_socket = udp_socket
        self.active: dict[int, _Flow] = {}
        self.results: list[Outcome | None] = []
        self.sel = selectors.DefaultSelector()

    def run(self, count: int, parallel: int) -> list[Outcome]:
        self.results = [None] * count
        nxt = 0
        try:
            while nxt < count or self.active:
                while nxt < count and len(self.active) < parallel:
                    self._start(nxt)
                    nxt += 1
                if self.active:
                    self._poll()
                    self._expire()
        finally:
            for flow in list(self.active.values()):
                flow.sock.close()
            self.sel.close()
        return [r for r in self.results if r is not None]

    def _finish(self, flow: _Flow, outcome: Outcome) -> None:
        del self.active[flow.index]
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(flow.sock)
        flow.sock.close()
        if flow.local_port is not None:
            outcome = dataclasses.replace(outcome, client_port=flow.local_port)
        self.results[flow.index] = outcome

    def _start(self, i: int) -> None:
        now = time.monotonic()
        if self.tcp:
            sock = socket.socket(self.family, socket.SOCK_STREAM)
            sock.setblocking(False)
            err = sock.connect_ex(self.addr)
            flow = self.active[i] = _Flow(i, sock, now, now + self.timeout, True)
            if err in (errno.EINPROGRESS, 0):
                self.sel.register(sock, selectors.EVENT_WRITE, flow)
            else:
                self._finish(flow, _failure(err, now))
            return
        sock = self.udp_socket()
        sock.setblocking(False)
        flow = self.active[i] = _Flow(i, sock, now, now + self.timeout, False)
        flow.local_port = sock.getsockname()[1]
        try:
            sock.connect(self.addr)
            sock.send(b"?\n")
        except OSError as exc:
            self._finish(flow, _failure(_send_error(sock, exc), now))
            return
        self.sel.register(sock, selectors.EVENT_READ, flow)

    def _poll(self) -> None:
        oldest = next(iter(self.active.values()))
        wait = max(0.0, oldest.deadline - time.monotonic())
        for key, _ in self.sel.select(wait):
            flow = key.data
            if flow.index in self.active:
                self._ready(flow)

    def _ready(self, flow: _Flow) -> None:
        if flow.connecting:
            err = flow.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                self._finish(flow, _failure(err, flow.started))
                return
            flow.connecting = False
            flow.local_port = flow.sock.getsockname()[1]
            self.sel.modify(flow.sock, selectors.EVENT_READ, flow)
            return
        try:
            chunk = flow.sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._finish(flow, _failure(exc.errno or 0, flow.started))
            return
        if not chunk and self.tcp:
            took = time.monotonic() - flow.started
            self._finish(flow, Outcome("reset", seconds=took, detail="EOF"))
            return
        flow.buf += chunk
        if b"\n" in flow.buf or not self.tcp:
            self._finish(flow, _answer(flow.buf.split(b"\n", 1)[0], flow.started))

    def _expire(self) -> None:
        now = time.monotonic()
        while self.active:
            oldest = next(iter(self.active.values()))
            if oldest.deadline > now:
                break
            self._finish(oldest, Outcome("timeout", seconds=now - oldest.started))


class Connection:
    """One held TCP connection (or connected UDP socket): every exchange goes down the same flow.

    For "all packets of a connection reach one endpoint" and "an established connection
    survives a sync": `greeting` is what the server said on connect (TCP), and each `exchange()`
    asks again on the same flow.
    """

    def __init__(self, sock: socket.socket, proto: Proto, timeout: float, owner: Sandbox) -> None:
        self._sock = sock
        self.proto = proto
        self.timeout = timeout
        self._buf = b""
        self._owner = weakref.ref(owner)
        self.local_port: int = sock.getsockname()[1]
        self.greeting: Outcome | None = None

    def _read_line(self, started: float, timeout: float) -> Outcome:
        deadline = started + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return Outcome("timeout", seconds=time.monotonic() - started)
            self._sock.settimeout(left)
            try:
                chunk = self._sock.recv(4096)
            except TimeoutError:
                return Outcome("timeout", seconds=time.monotonic() - started)
            except OSError as exc:
                return _failure(exc.errno or 0, started)
            if not chunk:
                return Outcome("reset", seconds=time.monotonic() - started, detail="EOF")
            if self.proto == "udp":
                self._buf = b""  # one datagram, one answer: never glue datagrams together
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return _answer(line, started)

    def exchange(self, timeout: float | None = None) -> Outcome:
        """Ask the far end who it is, on this flow."""
        started = time.monotonic()
        try:
            self._sock.settimeout(timeout or self.timeout)
            self._sock.send(b"?\n")
        except OSError as exc:
            return _failure(_send_error(self._sock, exc), started)
        return self._read_line(started, timeout or self.timeout)

    def close(self) -> None:
        self._sock.close()
        owner = self._owner()
        if owner is not None:
            owner._held.discard(self)

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------------------------
# The sandbox


# pyroute2 creates a namespace in a forked helper and talks to it over a pipe; helpers forked
# by several threads at once lose each other's answers ("no response from the child"). Sandboxes
# built in parallel (the compat corpus) take turns for that one step.
_CREATE_LOCK = threading.Lock()

# Strong references: a sandbox dropped without close() must still be cleaned up at exit.
_live: set[Sandbox] = set()


@atexit.register
def _close_live() -> None:
    for sb in list(_live):
        with contextlib.suppress(Exception):
            sb.close()


def reap_stale(prefix: str = PREFIX) -> list[str]:
    """Remove namespaces left by sandboxes whose process died without cleaning up (SIGKILL).

    Names carry the creating pid, so only namespaces of dead processes are touched.
    """
    removed = []
    for name in pyroute2_netns.listnetns():
        m = re.fullmatch(rf"{re.escape(prefix)}-(\d+)-[0-9a-f]+-\w+", name)
        if m is None:
            continue
        pid = int(m.group(1))
        try:
            os.kill(pid, 0)
            continue
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        with contextlib.suppress(OSError):
            netns_mod.remove(name)
            removed.append(name)
    return removed


def write_sysctl(ns: str, key: str, value: str | int) -> None:
    """Set a sysctl inside `ns` (dotted or slashed key), without touching the root namespace.

    /proc/sys/net resolves against the opening thread's namespace, so entering is enough.
    """
    path = "/proc/sys/" + (key.replace(".", "/") if "/" not in key else key)
    with netns_mod.entered(ns), open(path, "w") as f:
        f.write(f"{value}\n")


class Sandbox:
    """A node namespace with clients and endpoints around it; everything goes when it closes.

    Use as a context manager. Namespace names are unique per run (`<prefix>-<pid>-<hex>-...`)
    so parallel runs and leftovers from killed runs never collide.
    """

    def __init__(self, spec: SandboxSpec, *, prefix: str = PREFIX) -> None:
        if os.geteuid() != 0:
            raise SandboxError("the sandbox needs root: it creates network namespaces")
        if socket.AF_INET6 in spec.families and not os.path.exists("/proc/sys/net/ipv6"):
            raise SandboxError("IPv6 addresses requested but this kernel has IPv6 disabled")
        self.spec = spec
        self.base = f"{prefix}-{os.getpid()}-{secrets.token_hex(3)}"
        self.node_ns = f"{self.base}-n"
        self._client_ns = {c.name: f"{self.base}-c{i}" for i, c in enumerate(spec.clients)}
        self._client_ns[NODE] = self.node_ns
        self._client_addrs = {c.name: c.addresses for c in spec.clients}
        self._client_addrs[NODE] = spec.node_ips
        self._endpoint_ns: dict[str, str] = {}
        j = 0
        for e in spec.endpoints:
            if e.ip in spec.node_ips:
                self._endpoint_ns[e.ip] = self.node_ns
            else:
                self._endpoint_ns[e.ip] = f"{self.base}-e{j}"
                j += 1
        self._created: list[str] = []
        self._servers: _Servers | None = None
        self._held: set[Connection] = set()
        self._udp_cursor: dict[tuple[str, int], int] = {}
        self._closed = True

    # ---- lifecycle

    def __enter__(self) -> Sandbox:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        reap_stale(self.base.split("-", 1)[0])
        self._closed = False
        _live.add(self)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop servers, drop held connections, remove every namespace; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        errors: list[str] = []
        for conn in list(self._held):
            with contextlib.suppress(OSError):
                conn.close()
        if self._servers is not None:
            self._servers.stop()
            errors += [repr(e) for e in self._servers.errors]
            self._servers = None
        for name in reversed(self._created):
            try:
                netns_mod.remove(name)
            except OSError as exc:
                errors.append(f"{name}: {exc}")
        self._created.clear()
        _live.discard(self)
        if errors:
            raise SandboxError("sandbox cleanup: " + "; ".join(errors))

    @property
    def namespaces(self) -> tuple[str, ...]:
        """Every namespace this sandbox made, node first."""
        return tuple(self._created)

    def client_ns(self, client: str) -> str:
        """Namespace of a client name, of "node", or of an endpoint IP (pods reaching their own
        service: the hairpin case)."""
        if client in self._client_ns:
            return self._client_ns[client]
        with contextlib.suppress(ValueError, SandboxError, KeyError):
            return self._endpoint_ns[_canon(client)]
        raise SandboxError(f"no client {client!r} (have {sorted(self._client_ns)} and endpoints)")

    def address(self, client: str, family: int = 4) -> str:
        """The client's own address of `family` (4 or 6): the source it should be seen with."""
        want = socket.AF_INET6 if family == 6 else socket.AF_INET
        addrs = self._client_addrs.get(client)
        if addrs is None:
            self.client_ns(client)  # raises for unknown names
            addrs = (_canon(client),)
        for ip in addrs:
            if _family(ip) == want:
                return ip
        raise SandboxError(f"{client!r} has no IPv{family} address")

    def endpoint_ns(self, ip: str) -> str:
        return self._endpoint_ns[_canon(ip)]

    # ---- building

    def _create_ns(self, name: str) -> None:
        self._created.append(name)  # first: a half-made namespace must be removed too
        with _CREATE_LOCK:
            netns_mod.create(name)
        # Before any link exists, so every interface made here inherits them. ICMP errors are
        # not rate limited: past a burst of six per peer a `reject` would turn into a timeout.
        # A client may reuse a port its own TIME_WAIT holds (tcp_tw_reuse, IPv4 and IPv6):
        # otherwise, some 10 000 connections into a run, connect() walks the port range past
        # them (perf: __inet_hash_connect, tcp_twsk_unique; docs/benchmarks.md), the client's
        # cost and not the rules'. The node's conntrack entry for a
        # reused tuple is in TIME_WAIT, and the SYN reopens it as a new flow: a new DNAT choice.
        settings: dict[str, str | int] = {
            "net/ipv4/conf/all/rp_filter": 0,
            "net/ipv4/conf/default/rp_filter": 0,
            "net/ipv4/icmp_ratemask": 0,
            "net/ipv4/tcp_tw_reuse": 1,
        }
        if os.path.exists("/proc/sys/net/ipv6"):
            settings |= {
                "net/ipv6/conf/all/accept_dad": 0,
                "net/ipv6/conf/default/accept_dad": 0,
                "net/ipv6/conf/default/accept_ra": 0,
                "net/ipv6/icmp/ratemask": "",
            }
        with netns_mod.entered(name):
            for key, value in settings.items():
                with open(f"/proc/sys/{key}", "w") as f:
                    f.write(f"{value}\n")

    def _build(self) -> None:
        v6 = os.path.exists("/proc/sys/net/ipv6")
        self._create_namespaces(v6)
        with netns_mod.entered(self.node_ns), IPRoute() as node:
            sink = self._add_sink(node, v6)
            links = self._add_links(node, v6)
            uplink = links[0][0] if self.spec.clients else sink
            for ip in self.spec.node_ips:
                _add_addr(node, uplink, ip)
            self._route_links(node, links)
        self._start_servers()

    def _create_namespaces(self, v6: bool) -> None:
        self._create_ns(self.node_ns)
        write_sysctl(self.node_ns, "net/ipv4/ip_forward", 1)
        if v6:
            write_sysctl(self.node_ns, "net/ipv6/conf/all/forwarding", 1)
        for c in self.spec.clients:
            self._create_ns(self._client_ns[c.name])
        for ns in self._endpoint_ns.values():
            if ns != self.node_ns:
                self._create_ns(ns)

    def _add_sink(self, node: IPRoute, v6: bool) -> int:
        """The uplink stand-in: default (and service CIDR) routes into a veth whose twin drops
        everything."""
        node.link("add", ifname="sink0", kind="veth", peer={"ifname": "sink1"})
        sink = node.link_lookup(ifname="sink0")[0]
        for name in ("sink1", "sink0"):
            node.link("set", index=node.link_lookup(ifname=name)[0], state="up")
        node.neigh("add", dst=_SINK_V4, lladdr=_SINK_MAC, ifindex=sink, state=_NUD_PERMANENT)
        node.route("add", dst="0.0.0.0/0", gateway=_SINK_V4, oif=sink, flags=_RTNH_F_ONLINK)
        if v6:
            node.neigh(
                "add", dst=_SINK_V6, lladdr=_SINK_MAC, ifindex=sink, state=_NUD_PERMANENT,
                family=socket.AF_INET6,
            )
            node.route(
                "add", dst="::/0", gateway=_SINK_V6, oif=sink, flags=_RTNH_F_ONLINK,
                family=socket.AF_INET6,
            )
        for cidr in self.spec.service_cidrs:
            v4 = ":" not in cidr
            if v4 or v6:
                node.route(
                    "add", dst=cidr, gateway=_SINK_V4 if v4 else _SINK_V6, oif=sink,
                    flags=_RTNH_F_ONLINK, family=socket.AF_INET if v4 else socket.AF_INET6,
                )
        return sink

    def _add_links(self, node: IPRoute, v6: bool) -> list[tuple[int, tuple[str, ...]]]:
        """A veth per client and per endpoint namespace: (node-side index, far addresses)."""
        links: list[tuple[int, tuple[str, ...]]] = []
        for i, c in enumerate(self.spec.clients):
            idx = self._veth(node, f"cl{i}", self._client_ns[c.name], c.addresses, v6)
            links.append((idx, c.addresses))
        j = 0
        for e in self.spec.endpoints:
            ns = self._endpoint_ns[e.ip]
            if ns != self.node_ns:
                links.append((self._veth(node, f"ep{j}", ns, (e.ip,), v6), (e.ip,)))
                j += 1
        return links

    def _route_links(self, node: IPRoute, links: list[tuple[int, tuple[str, ...]]]) -> None:
        # The gateway address is scope link, but a scope-link route would still pick it as
        # the source; the first node IP is what a real node's own traffic comes from.
        prefsrc = next((ip for ip in self.spec.node_ips if _family(ip) == socket.AF_INET), None)
        for idx, addrs in links:
            for ip in addrs:
                if _family(ip) == socket.AF_INET6:
                    node.route("add", dst=f"{ip}/128", oif=idx, family=socket.AF_INET6)
                elif prefsrc is None:
                    node.route("add", dst=f"{ip}/32", oif=idx, scope=_RT_SCOPE_LINK)
                else:
                    node.route(
                        "add", dst=f"{ip}/32", oif=idx, scope=_RT_SCOPE_LINK, prefsrc=prefsrc
                    )

    def _start_servers(self) -> None:
        servers = _Servers()
        self._servers = servers
        for e in self.spec.endpoints:
            with netns_mod.entered(self._endpoint_ns[e.ip]):
                for port, proto in e.ports:
                    servers.listen(e.ip, port, proto)
        servers.start()

    def _veth(self, node: IPRoute, ifname: str, ns: str, addrs: Sequence[str], v6: bool) -> int:
        """A veth from the node into `ns`: the far side holds `addrs` and routes via the node.

        The node's routes to `addrs` come later, once the node IPs they take as source exist.
        """
        node.link("add", ifname=ifname, kind="veth", peer={"ifname": "eth0", "net_ns_fd": ns})
        idx = node.link_lookup(ifname=ifname)[0]
        node.addr("add", index=idx, address=GATEWAY_V4, prefixlen=32, scope=_RT_SCOPE_LINK)
        if v6:
            node.addr("add", index=idx, address=GATEWAY_V6, prefixlen=64, flags=_IFA_F_NODAD)
        node.link("set", index=idx, state="up")
        with netns_mod.entered(ns), IPRoute() as far:
            eth = far.link_lookup(ifname="eth0")[0]
            for ip in addrs:
                _add_addr(far, eth, ip)
            far.link("set", index=eth, state="up")
            families = {_family(ip) for ip in addrs}
            if socket.AF_INET in families:
                far.route("add", dst=f"{GATEWAY_V4}/32", oif=eth, scope=_RT_SCOPE_LINK)
                far.route("add", dst="0.0.0.0/0", gateway=GATEWAY_V4, oif=eth)
            if socket.AF_INET6 in families:
                far.route(
                    "add", dst="::/0", gateway=GATEWAY_V6, oif=eth, family=socket.AF_INET6
                )
        return idx

    # ---- traffic

    def _ns_for(self, client: str) -> str:
        if self._closed:
            raise SandboxError("the sandbox is closed")
        return self.client_ns(client)

    def connect(
        self,
        client: str,
        dst: str,
        port: int,
        proto: ProtoLike = "tcp",
        count: int = 1,
        *,
        timeout: float = 1.0,
        parallel: int = 64,
    ) -> list[Outcome]:
        """Open `count` fresh connections from `client` and report each one's outcome, in order.

        Up to `parallel` are in flight at once, so dropped flows cost about
        count / parallel * timeout rather than count * timeout. TCP: connect and read the
        server's line. UDP: one datagram from a source port not used before in this sandbox,
        one answer. An RST or ICMP port unreachable ends a flow at once as `refused`.
        """
        ns = self._ns_for(client)
        p = _proto(proto)
        dst = _canon(dst)
        family = _family(dst)
        if count <= 0:
            return []
        with netns_mod.entered(ns):
            udp_socket = functools.partial(self._fresh_udp_socket, client, family)
            flows = _Flows(family, p, (dst, port), timeout, udp_socket)
            return flows.run(count, max(1, parallel))

    def _fresh_udp_socket(self, client: str, family: socket.AddressFamily) -> socket.socket:
        """A UDP socket on a source port this sandbox has not used yet (until the range wraps).

        The kernel's random choice repeats ports within a few hundred probes, and a repeat
        rides on the old conntrack entry to the old endpoint, skewing every distribution test.
        """
        lo, hi = _UDP_PORTS
        key = (client, int(family))
        wildcard = "::" if family == socket.AF_INET6 else "0.0.0.0"
        for _ in range(hi - lo + 1):
            port = self._udp_cursor.get(key, lo)
            self._udp_cursor[key] = lo if port >= hi else port + 1
            sock = socket.socket(family, socket.SOCK_DGRAM)
            try:
                sock.bind((wildcard, port))
            except OSError:
                sock.close()
                continue
            return sock
        raise SandboxError("no free UDP source port left")

    def open(
        self, client: str, dst: str, port: int, proto: ProtoLike = "tcp", *, timeout: float = 2.0
    ) -> Connection:
        """Hold one connection open; raises ConnectFailed (carrying the Outcome) if it fails.

        TCP reads the server's greeting into `greeting`; UDP has none until the first exchange.
        """
        ns = self._ns_for(client)
        p = _proto(proto)
        dst = _canon(dst)
        family = _family(dst)
        started = time.monotonic()
        with netns_mod.entered(ns):
            if p == "udp":
                sock = self._fresh_udp_socket(client, family)
            else:
                sock = socket.socket(family, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect((dst, port))
        except TimeoutError:
            sock.close()
            raise ConnectFailed(Outcome("timeout", seconds=time.monotonic() - started)) from None
        except OSError as exc:
            sock.close()
            raise ConnectFailed(_failure(exc.errno or 0, started)) from None
        conn = Connection(sock, p, timeout, self)
        if p == "tcp":
            greeting = conn._read_line(started, timeout)
            if not greeting.ok:
                sock.close()
                raise ConnectFailed(greeting)
            conn.greeting = greeting
        self._held.add(conn)
        return conn


def _add_addr(ipr: IPRoute, index: int, ip: str) -> None:
    if _family(ip) == socket.AF_INET6:
        ipr.addr("add", index=index, address=ip, prefixlen=128, flags=_IFA_F_NODAD)
    else:
        ipr.addr("add", index=index, address=ip, prefixlen=32)

"""Localhost node ports in nftables mode: a userspace TCP proxy on 127.0.0.1 and ::1.

kube-proxy 1.37's pkg/proxy/localnodeportproxy, behind the alpha gate
KubeProxyNFTablesLocalhostNodePorts (off by default). nftables cannot DNAT a loopback-addressed
packet to a pod (route_localnet is an iptables-mode workaround with a CVE behind it), so when
the gate is on and `--nodeport-addresses` names loopback (`localhost`, 127.0.0.0/8, ::1/128),
kube-proxy listens on each TCP node port itself, on the family's loopback address, and copies
bytes to an endpoint it picks per connection; the rules reject and count what it cannot serve
(UDP and SCTP: backends/nft/render.py). Without that address, the rules reject all three.

As upstream: one listener per TCP node port with endpoints (eTP=Local: the local ones), a new
connection picks an endpoint at random (by weight here, as the rules do), ClientIP affinity pins
every loopback client to one endpoint for the affinity timeout (they all share one source
address), a backend not connected within 5 s closes the client, each direction half-closes
when its sender does, and a node port that cannot be bound is logged, counted and retried at
the next sync. `localhost_node_ports` is the pure part: what to serve, from a state.

All listeners and connections share one event loop on one thread, which lives in the
namespace nfproxy programs (`--netns`), so every socket it makes is there.
"""

from __future__ import annotations

import asyncio
import logging
import random
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from nfproxy.core.categorize import categorize, nodeport_loopback
from nfproxy.core.model import ClusterState, Endpoint, IPFamily, Protocol
from nfproxy.daemon import logs
from nfproxy.kernel import netns as netns_mod

log = logging.getLogger("nfproxy.daemon")

DIAL_TIMEOUT = 5.0  # upstream's dialTimeout
LOOPBACK = {IPFamily.V4: "127.0.0.1", IPFamily.V6: "::1"}
_BUFFER = 64 * 1024


@dataclass(frozen=True, slots=True)
class NodePortSpec:
    """One localhost node port to serve (upstream's NodePortSpec)."""

    family: IPFamily
    node_port: int
    service: str
    endpoints: tuple[Endpoint, ...]
    affinity_timeout: float = 0.0  # seconds; 0 without ClientIP affinity


def localhost_node_ports(state: ClusterState) -> tuple[NodePortSpec, ...]:
    """The TCP node ports the proxy serves: with the gate on, in each family whose node-port
    addresses name loopback, every TCP node port with endpoints for external traffic."""
    node = state.node
    if not node.nft_localhost_nodeports:
        return ()
    out: list[NodePortSpec] = []
    for family in IPFamily:
        if not nodeport_loopback(node, family, primary_by_default=True):
            continue
        for svc, eps in state.service_ports(family):
            if not svc.node_port or svc.protocol is not Protocol.TCP:
                continue
            chosen = categorize(svc, eps, node).external_endpoints
            if chosen:
                out.append(NodePortSpec(family, svc.node_port, str(svc.name), chosen, float(svc.affinity_timeout)))
    return tuple(out)


class _Listener:
    """One node port: its server, its endpoints and its affinity pin."""

    def __init__(self, spec: NodePortSpec, server: asyncio.base_events.Server, rng: random.Random,
                 clock: Callable[[], float]) -> None:
        self.spec = spec
        self.server = server
        self.connections: set[asyncio.Task[None]] = set()
        self._rng = rng
        self._clock = clock
        self._pinned: Endpoint | None = None
        self._pinned_at = 0.0

    def update(self, spec: NodePortSpec) -> None:
        if spec.affinity_timeout != self.spec.affinity_timeout:
            self._pinned = None  # affinity changed: drop the pin, as upstream
        self.spec = spec

    def pick(self) -> Endpoint:
        """Upstream's pickEndpoint: a sliding affinity window, else a random endpoint."""
        eps, now, timeout = self.spec.endpoints, self._clock(), self.spec.affinity_timeout
        if timeout > 0 and self._pinned in eps and now - self._pinned_at <= timeout:
            self._pinned_at = now
            return self._pinned  # type: ignore[return-value]
        weights = [ep.weight for ep in eps]
        ep = self._rng.choices(eps, weights)[0] if any(weights) else self._rng.choice(eps)
        if timeout > 0:
            self._pinned, self._pinned_at = ep, now
        return ep


class LocalhostProxy:
    """Listeners on loopback for the node ports `sync` is given; one event loop serves all."""

    def __init__(
        self,
        netns: str | None = None,
        *,
        on_listeners: Callable[[IPFamily, int], None] = lambda family, n: None,
        on_failure: Callable[[IPFamily], None] = lambda family: None,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.netns = netns
        self._on_listeners = on_listeners
        self._on_failure = on_failure
        self._rng = rng or random.Random()
        self._clock = clock
        self._active: dict[tuple[IPFamily, int], _Listener] = {}
        self._owed = False
        self._loop = asyncio.new_event_loop()
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(started,), name="localhost-nodeports", daemon=True)
        self._thread.start()
        started.wait()
        self._closed = False

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        with netns_mod.inside(self.netns):
            started.set()
            self._loop.run_forever()
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())
        self._loop.close()

    # ---- what the daemon calls

    def sync(self, specs: tuple[NodePortSpec, ...]) -> None:
        """Serve exactly these node ports (upstream's SyncNodePorts); waits until done."""
        if self._closed:
            raise RuntimeError("the localhost node-port proxy is closed")
        asyncio.run_coroutine_threadsafe(self._sync(specs), self._loop).result()

    @property
    def owed(self) -> bool:
        """A node port of the last sync could not be bound: sync again, also when the rules
        did not change (upstream retries at every sync)."""
        return self._owed

    @property
    def ports(self) -> dict[IPFamily, tuple[int, ...]]:
        """The node ports listened on now, per family."""
        out: dict[IPFamily, list[int]] = {}
        for family, port in sorted(self._active, key=lambda k: (k[0].value, k[1])):
            out.setdefault(family, []).append(port)
        return {f: tuple(p) for f, p in out.items()}

    def close(self) -> None:
        """Every listener and connection closed (upstream's Shutdown), the loop stopped."""
        if self._closed:
            return
        self._closed = True
        asyncio.run_coroutine_threadsafe(self._sync(()), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()

    # ---- on the loop

    async def _sync(self, specs: tuple[NodePortSpec, ...]) -> None:
        wanted = {(s.family, s.node_port): s for s in specs if s.endpoints}
        self._owed = False
        for key in [k for k in self._active if k not in wanted]:
            listener = self._active.pop(key)
            logs.info(log, "Removing localhost nodeport proxy", level=2, port=key[1], ipFamily=_label(key[0]))
            await self._shut(listener)
        for key, spec in wanted.items():
            held = self._active.get(key)
            if held is not None:
                held.update(spec)
                continue
            try:
                self._active[key] = await self._listen(spec)
            except OSError as exc:
                logs.error(log, "Failed to create localhost nodeport proxy", exc, protocol="TCP",
                           port=spec.node_port, ipFamily=_label(spec.family))
                self._on_failure(spec.family)
                self._owed = True
                continue
            logs.info(log, "Created localhost nodeport proxy", level=4, protocol="TCP", port=spec.node_port,
                      endpoints=len(spec.endpoints), ipFamily=_label(spec.family))
        for family in IPFamily:
            self._on_listeners(family, sum(1 for f, _ in self._active if f is family))

    async def _listen(self, spec: NodePortSpec) -> _Listener:
        family = socket.AF_INET6 if spec.family is IPFamily.V6 else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((LOOPBACK[spec.family], spec.node_port))
            holder: list[_Listener] = []
            server = await asyncio.start_server(lambda r, w: self._accepted(holder[0], r, w), sock=sock)
        except OSError:
            sock.close()
            raise
        listener = _Listener(spec, server, self._rng, self._clock)
        holder.append(listener)
        return listener

    async def _shut(self, listener: _Listener) -> None:
        listener.server.close()
        for task in list(listener.connections):
            task.cancel()
        await asyncio.gather(*listener.connections, return_exceptions=True)
        await listener.server.wait_closed()

    def _accepted(self, listener: _Listener, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.ensure_future(self._proxy(listener, reader, writer))
        listener.connections.add(task)
        task.add_done_callback(listener.connections.discard)

    async def _proxy(self, listener: _Listener, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One client connection; the client is closed however this ends (a listener shut
        down cancels it), so no connection outlives its listener."""
        ep = listener.pick()
        try:
            try:
                b_reader, b_writer = await asyncio.wait_for(self._dial(ep), DIAL_TIMEOUT)
            except (OSError, asyncio.TimeoutError) as exc:
                logs.info(log, "Failed to connect to backend", level=4, err=exc, port=listener.spec.node_port,
                          endpoint=ep.address)
                return
            try:
                await asyncio.gather(_pipe(reader, b_writer), _pipe(b_reader, writer))
            finally:
                b_writer.close()
        finally:
            writer.close()

    async def _dial(self, ep: Endpoint) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        # The socket is made on this thread, so in this namespace.
        family = socket.AF_INET6 if ":" in ep.ip else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await self._loop.sock_connect(sock, (ep.ip, ep.port))
        except BaseException:
            sock.close()
            raise
        return await asyncio.open_connection(sock=sock)


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    """Copy until the sender closes, then half-close towards the receiver (CloseWrite)."""
    try:
        while data := await src.read(_BUFFER):
            dst.write(data)
            await dst.drain()
        if dst.can_write_eof():
            dst.write_eof()
    except (ConnectionError, OSError) as exc:
        logs.info(log, "Error proxying localhost nodeport connection", level=4, err=exc)


def _label(family: IPFamily) -> str:
    return "IPv4" if family is IPFamily.V4 else "IPv6"


def rejected_reader(netns: str | None) -> Callable[[], Mapping[tuple[IPFamily, str], int]]:
    """Packets each localhost-reject counter counted, both tables of each family, read over
    netlink at scrape time (kubeproxy_nftables_localhost_nodeport_rejected_packets_total)."""
    from nfproxy.backends.nft.render import OFF_TABLE, TABLE, localhost_reject_counter
    from nfproxy.kernel.nft_netlink import NetlinkNft
    from nfproxy.kernel.process import KernelError

    kernel = NetlinkNft(netns)
    names = {localhost_reject_counter(p): p for p in ("tcp", "udp", "sctp")}

    def counters(nft_family: str, table: str) -> dict[str, int]:
        try:
            return kernel.counters(nft_family, table)
        except KernelError as exc:  # no sample for it, as upstream's collector
            log.debug("reading localhost node-port counters failed: %s", exc)
            return {}

    def read() -> dict[tuple[IPFamily, str], int]:
        out: dict[tuple[IPFamily, str], int] = {}
        for family, nft_family in ((IPFamily.V4, "ip"), (IPFamily.V6, "ip6")):
            for table in (TABLE, OFF_TABLE):
                for name, packets in counters(nft_family, table).items():
                    proto = names.get(name)
                    if proto is not None:
                        out[(family, proto)] = out.get((family, proto), 0) + packets
        return out

    return read

#!/usr/bin/env python3
"""HTTP server benchmark: the figures issue J asks for, measured (tests only assert answers).

In a throwaway network namespace, against the daemon's own servers (nfproxy.daemon.server and
nfproxy.daemon.healthcheck):

- N concurrent `/healthz` and `/metrics` requests, each on its own connection, all started at
  once from another process: how many were answered, the time until the last answer (target:
  all, within 2 s), and the server's CPU time for them (what the wall time comes to on an idle
  core; on a loaded machine the wall time is mostly waiting for a CPU);
- a load balancer's probe of a health-check node port while K idle connections (half of them
  with half a request, as a slow client sends) are held open (target: < 1 s);
- what K idle connections cost the process: threads and file descriptors (issue J: 500 idle
  connections made 506 threads and 1 010 fds).

Usage: sudo .venv/bin/python bench/servers.py [--requests 1000] [--idle 100] [--probes 20] [--rounds 3]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import resource
import selectors
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from prometheus_client import CollectorRegistry  # noqa: E402

from nfproxy.core.model import IPFamily  # noqa: E402
from nfproxy.daemon.healthcheck import ServiceHealthServer, ServiceName  # noqa: E402
from nfproxy.daemon.metrics import ProxyMetrics  # noqa: E402
from nfproxy.daemon.server import ProxierHealth, serve  # noqa: E402
from nfproxy.kernel import netns  # noqa: E402

WEB = ServiceName("bench", "web")
PORT = 32001


def _connections(host: str, port: int, n: int) -> list[socket.socket]:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    socks = []
    for _ in range(n):
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setblocking(False)
        sock.connect_ex((host, port))  # EINPROGRESS: the handshake completes in the kernel
        socks.append(sock)
    return socks


def _answers(socks: list[socket.socket], request: bytes, deadline: float) -> tuple[list[float], int, float]:
    """Drive every connection with one epoll: (seconds until each 200 answer, failures, seconds
    until the last request was sent), all measured from the call.

    A bare selector loop rather than asyncio streams: the load generator shares the CPUs with
    the server, and asyncio's streams cost it 1 ms of CPU per connection (5 times the server's
    own cost), so the first bench measured mostly itself (1.0 s of client CPU per 1 000).
    """
    start = time.perf_counter()
    sel = selectors.EpollSelector()
    pending: dict[socket.socket, list[bytes]] = {}
    for sock in socks:
        sel.register(sock, selectors.EVENT_WRITE)
        pending[sock] = []
    answered: list[float] = []
    failed, sent = 0, 0.0
    while pending and time.perf_counter() - start < deadline:
        for key, _ in sel.select(1.0):
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            if key.events == selectors.EVENT_WRITE:  # connected (or refused)
                if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                    sock.send(request)
                    sel.modify(sock, selectors.EVENT_READ)
                    sent = time.perf_counter() - start
                    continue
                chunk = None
            else:
                try:
                    chunk = sock.recv(65536)
                except OSError:
                    chunk = None
                if chunk:
                    pending[sock].append(chunk)
                    continue
            raw = b"".join(pending.pop(sock))
            sel.unregister(sock)
            sock.close()
            if chunk is None or not raw.startswith(b"HTTP/1.1 200 "):
                failed += 1
            else:
                answered.append(time.perf_counter() - start)
    for sock in pending:
        sock.close()
    return answered, failed + len(pending), sent


def _listen_overflows() -> int:
    """SYNs the namespace's listen queues dropped (TcpExt ListenOverflows + ListenDrops)."""
    lines = Path("/proc/net/netstat").read_text().splitlines()
    names, values = next(
        (a.split()[1:], b.split()[1:]) for a, b in zip(lines[::2], lines[1::2]) if a.startswith("TcpExt:")
    )
    counts = dict(zip(names, map(int, values)))
    return counts["ListenOverflows"] + counts["ListenDrops"]


def client(host: str, port: int, path: str, n: int) -> None:
    """The load, from a process of its own inside the namespace (as real clients are): n
    connections opened at once, one request each; prints a JSON summary."""
    request = f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode()
    overflows = _listen_overflows()
    cpu = time.process_time()  # the burst's own, without the interpreter's start and imports
    start = time.perf_counter()
    socks = _connections(host, port, n)
    opened = time.perf_counter() - start
    answered, failed, sent = _answers(socks, request, deadline=60.0)
    answered = [opened + t for t in answered]
    print(json.dumps({
        "ok": len(answered), "failed": failed, "wall": max(answered, default=None),
        "median": statistics.median(answered) if answered else None, "sent": opened + sent,
        "cpu": time.process_time() - cpu, "overflows": _listen_overflows() - overflows,
    }))


@dataclass(frozen=True, slots=True)
class Burst:
    """One burst of concurrent requests as the client saw it (seconds from its first connect)."""

    ok: int
    failed: int
    wall: float  # the last answer
    median: float
    sent: float  # the last request written
    client_cpu: float
    overflows: int  # SYNs dropped by a full listen queue


def burst(ns: str, host: str, port: int, path: str, n: int) -> Burst:
    out = subprocess.run(
        ["ip", "netns", "exec", ns, sys.executable, __file__, "--client", host, str(port), path, str(n)],
        check=True, capture_output=True, text=True,
    ).stdout
    r = json.loads(out)
    nan = float("nan")
    return Burst(r["ok"], r["failed"], r["wall"] or nan, r["median"] or nan, r["sent"], r["cpu"], r["overflows"])


def probe_seconds(ns: str, port: int) -> float:
    with netns.entered(ns):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.connect()
    start = time.perf_counter()
    conn.request("GET", "/")
    conn.getresponse().read()
    conn.close()
    return time.perf_counter() - start


def hold_idle(ns: str, port: int, k: int) -> list[socket.socket]:
    with netns.entered(ns):
        socks = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(k)]
    for s in socks[: k // 2]:
        s.sendall(b"GET / HTTP/1.1\r\n")  # half a request
    return socks


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--idle", type=int, default=100)
    parser.add_argument("--probes", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3, help="bursts per server")
    parser.add_argument("--client", nargs=4, metavar=("HOST", "PORT", "PATH", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        host, port, path, n = args.client
        client(host, int(port), path, int(n))
        return 0
    rows: list[tuple[str, str, str]] = []
    with netns.throwaway("nfp-bench") as ns:
        health = ProxierHealth(60)
        health.updated()
        metrics = ProxyMetrics(CollectorRegistry())
        for family in IPFamily:
            metrics.observe_sync("full", 0.01, family=family, operations=100)
        with serve(health, metrics, "127.0.0.1:0", "127.0.0.1:0", netns=ns) as servers:
            for addr, path in ((servers.healthz, "/healthz"), (servers.metrics, "/metrics")):
                assert addr is not None
                for _ in range(args.rounds):
                    before = resource.getrusage(resource.RUSAGE_SELF)
                    b = burst(ns, addr.host, addr.port, path, args.requests)
                    after = resource.getrusage(resource.RUSAGE_SELF)
                    user, system = after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime
                    rows.append((
                        f"{args.requests} concurrent {path}",
                        f"{b.ok}/{args.requests} answered, last after {b.wall:.2f} s",
                        f"median {b.median:.2f} s, all sent by {b.sent:.2f} s, {b.failed} failed, "
                        f"{b.overflows} SYNs dropped; CPU: server {user:.2f} s user + {system:.2f} s system, "
                        f"client {b.client_cpu:.2f} s; "
                        "target: all within 2 s",
                    ))
        with ServiceHealthServer(ns, health=health) as hc:
            hc.sync_services({WEB: PORT})
            hc.sync_endpoints({WEB: 1})
            threads0, fds0 = threading.active_count(), fds()
            held = hold_idle(ns, PORT, args.idle)
            try:
                times = [probe_seconds(ns, PORT) for _ in range(args.probes)]
                threads1, fds1 = threading.active_count(), fds()  # every idle one accepted by now
            finally:
                for s in held:
                    s.close()
            rows.append((f"probe with {args.idle} idle connections held",
                         f"median {statistics.median(times) * 1000:.1f} ms, max {max(times) * 1000:.1f} ms",
                         f"{args.probes} probes (target: < 1 s)"))
            rows.append((f"cost of {args.idle} idle connections",
                         f"+{threads1 - threads0} threads",
                         f"+{fds1 - fds0 - args.idle} server fds (+{args.idle} client fds in this process)"))
    width = max(len(r[0]) for r in rows)
    print(f"{'measurement':<{width}}  result")
    for what, result, note in rows:
        print(f"{what:<{width}}  {result}  [{note}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())

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

Usage: sudo .venv/bin/python bench/servers.py [--requests 1000] [--idle 100] [--probes 20]
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
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


async def _one(host: str, port: int, path: str) -> tuple[int, float]:
    start = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
    await writer.drain()
    raw = await reader.read()
    writer.close()
    return int(raw.split(b" ", 2)[1]), time.perf_counter() - start


def client(host: str, port: int, path: str, n: int) -> None:
    """The load, from a process of its own (as real clients are): prints a JSON summary."""

    async def run() -> tuple[list, float]:
        start = time.perf_counter()
        got = await asyncio.gather(*(_one(host, port, path) for _ in range(n)), return_exceptions=True)
        return got, time.perf_counter() - start

    got, wall = asyncio.run(run())
    ok = [lat for r in got if not isinstance(r, BaseException) for status, lat in [r] if status == 200]
    print(json.dumps({"ok": len(ok), "wall": wall, "median": statistics.median(ok) if ok else None,
                      "max": max(ok, default=None), "cpu": time.process_time()}))


def burst(ns: str, host: str, port: int, path: str, n: int) -> tuple[int, float, float, float, float]:
    """(answered with 200, wall seconds until the last answer, median and max latency, the
    client's own CPU seconds)."""
    out = subprocess.run(
        ["ip", "netns", "exec", ns, sys.executable, __file__, "--client", host, str(port), path, str(n)],
        check=True, capture_output=True, text=True,
    ).stdout
    r = json.loads(out)
    return r["ok"], r["wall"], r["median"] or float("nan"), r["max"] or float("nan"), r["cpu"]


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
            for name, addr, path in (("healthz", servers.healthz, "/healthz"), ("metrics", servers.metrics, "/metrics")):
                assert addr is not None
                cpu = time.process_time()
                ok, wall, median, worst, client_cpu = burst(ns, addr.host, addr.port, path, args.requests)
                cpu = time.process_time() - cpu
                rows.append((f"{args.requests} concurrent {path}", f"{ok}/{args.requests} answered in {wall:.2f} s",
                             f"median {median * 1000:.0f} ms, max {worst * 1000:.0f} ms; CPU: server {cpu:.2f} s,"
                             f" client {client_cpu:.2f} s; target: all within 2 s"))
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

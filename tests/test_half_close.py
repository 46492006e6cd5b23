"""A client that sends its request and then half-closes (shutdown(SHUT_WR)) gets its answer.

Some load-balancer health checkers and proxies do this; Go's net/http, and so kube-proxy,
answers every such request (issue R.5). All three of the daemon's servers (/healthz, /metrics,
a service's health-check node port) are held to it, 20 of 20, then to a pipelined pair sent
before the half-close. Each server listens on loopback inside a throwaway namespace, on a port
the kernel picked. The socket timeout is only there so a broken server fails the test instead
of hanging it; nothing here measures time.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry

from nfproxy.daemon.healthcheck import ServiceHealthServer
from nfproxy.daemon.metrics import ProxyMetrics
from nfproxy.daemon.server import ProxierHealth, Servers, serve
from nfproxy.kernel import netns as netns_mod

TRIES = 20
GIVE_UP = 60.0  # seconds: a hang fails the test, it is not a bound on anything


def half_closed(ns: str, port: int, requests: list[str]) -> bytes:
    """Everything the server sends to a client that wrote `requests` and then SHUT_WR."""
    with netns_mod.entered(ns):
        sock = socket.create_connection(("127.0.0.1", port), timeout=GIVE_UP)
    with sock:
        sock.sendall("".join(f"GET {path} HTTP/1.1\r\nHost: t\r\n\r\n" for path in requests).encode())
        sock.shutdown(socket.SHUT_WR)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    return reply


def answered(ns: str, port: int, path: str, status: bytes = b"200") -> int:
    """How many of TRIES half-closed requests got a whole answer with `status`."""
    ok = 0
    for _ in range(TRIES):
        reply = half_closed(ns, port, [path])
        ok += reply.startswith(b"HTTP/1.1 " + status) and b"\r\n\r\n" in reply
    return ok


@pytest.fixture
def served(netns: str) -> Iterator[tuple[str, Servers]]:
    metrics = ProxyMetrics(CollectorRegistry(), process_metrics=False)
    servers = serve(ProxierHealth(60), metrics, "127.0.0.1:0", "127.0.0.1:0", netns=netns)
    try:
        yield netns, servers
    finally:
        servers.close()


def _port(servers: Servers, name: str) -> int:
    address = servers.address(name)
    assert address is not None
    return address.port


@pytest.mark.kernel
def test_healthz_answers_every_half_closed_request(served: tuple[str, Servers]) -> None:
    ns, servers = served
    assert answered(ns, _port(servers, "healthz"), "/healthz") == TRIES


@pytest.mark.kernel
def test_metrics_answers_every_half_closed_request(served: tuple[str, Servers]) -> None:
    ns, servers = served
    assert answered(ns, _port(servers, "metrics"), "/metrics") == TRIES


@pytest.mark.kernel
def test_pipelined_requests_before_the_half_close_are_all_answered(served: tuple[str, Servers]) -> None:
    ns, servers = served
    reply = half_closed(ns, _port(servers, "healthz"), ["/livez", "/nothing", "/healthz"])
    assert re.findall(rb"HTTP/1\.1 (\d{3}) ", reply) == [b"200", b"404", b"200"]


def _free_port(ns: str) -> int:
    with netns_mod.entered(ns):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            return int(probe.getsockname()[1])


@pytest.mark.kernel
def test_health_check_node_port_answers_every_half_closed_request(netns: str) -> None:
    with ServiceHealthServer(netns, ("127.0.0.1",), health=ProxierHealth(60)) as server:
        port = _free_port(netns)
        server.sync_services({("shop", "web"): port})
        server.sync_endpoints({("shop", "web"): 1})
        assert server.ports == {("shop", "web"): port}
        assert answered(netns, port, "/") == TRIES

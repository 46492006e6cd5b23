"""Health-check node ports: what to serve (pure) and serving it (in a throwaway namespace)."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import logging
import socket
from collections.abc import Iterator

import pytest

from nfproxy.daemon.healthcheck import (
    ServiceHealthServer,
    ServiceName,
    response_body,
    service_health,
)
from nfproxy.kernel import netns as netns_mod
from nfproxy.core.model import (
    ClusterState,
    Endpoint,
    IPFamily,
    NodeConfig,
    Protocol,
    ServicePort,
    ServicePortName,
    ServiceType,
    sort_endpoints,
)
from nfproxy.daemon.server import ProxierHealth

NODE = NodeConfig(name="node-a", ips=("192.168.0.2", "fd00:1::2"), cluster_cidrs=("10.244.0.0/16",))
WEB = ServiceName("shop", "web")


def _lb(name: str, port_name: str, family: IPFamily, hc_port: int, port: int = 80) -> ServicePort:
    v4 = family is IPFamily.V4
    return ServicePort(
        name=ServicePortName("shop", name, port_name, Protocol.TCP),
        family=family,
        type=ServiceType.LOAD_BALANCER,
        cluster_ip="10.96.0.10" if v4 else "fd00:96::10",
        port=port,
        node_port=30080 + port,
        load_balancer_ips=("198.51.100.10",) if v4 else ("2001:db8:1::10",),
        external_policy_local=hc_port != 0,
        health_check_node_port=hc_port,
    )


def _state(node: NodeConfig = NODE) -> ClusterState:
    services = {}
    endpoints = {}
    for family in IPFamily:
        v4 = family is IPFamily.V4
        for port_name, port in (("http", 80), ("https", 443)):
            svc = _lb("web", port_name, family, 32001, port)
            services[svc.key] = svc
            ip = (lambda i: f"10.244.0.{i}") if v4 else (lambda i: f"fd01::{i}")
            endpoints[svc.key] = sort_endpoints([
                Endpoint(ip(1), 8080, node_name="node-a"),
                Endpoint(ip(2), 8080, node_name="node-a"),
                # Terminating (not ready, still serving): the LB must drain this node.
                Endpoint(ip(3), 8080, ready=False, serving=True, terminating=True, node_name="node-a"),
                Endpoint(ip(4), 8080, node_name="node-b"),
            ])
        other = _lb("api", "", family, 0)  # eTP=Cluster: no health check port
        services[other.key] = other
        endpoints[other.key] = (Endpoint("10.244.0.9" if v4 else "fd01::9", 8080, node_name="node-a"),)
    drained = _lb("old", "", IPFamily.V4, 32002)
    services[drained.key] = drained
    endpoints[drained.key] = (
        Endpoint("10.244.0.7", 8080, ready=False, serving=True, terminating=True, node_name="node-a"),
    )
    return ClusterState(node, services, endpoints)


# ---- pure


def test_service_health_counts_ready_local_endpoints_over_ports_once_per_family() -> None:
    h = service_health(_state())
    assert h.ports == {WEB: 32001, ServiceName("shop", "old"): 32002}
    # 2 ready local endpoints x 2 ports (kube-proxy counts per port); IPv6 twins not added.
    assert h.local_endpoints == {WEB: 4, ServiceName("shop", "old"): 0}


def test_no_node_name_means_no_local_endpoints() -> None:
    h = service_health(_state(NodeConfig()))
    assert h.local_endpoints == {WEB: 0, ServiceName("shop", "old"): 0}


def test_response_body_is_kube_proxys_text() -> None:
    want = (
        '{\n\t"service": {\n\t\t"namespace": "shop",\n\t\t"name": "web"\n\t},\n'
        '\t"localEndpoints": 2,\n\t"serviceProxyHealthy": true\n}'
    )
    assert response_body(WEB, 2, True).decode() == want
    doc = json.loads(response_body(WEB, 0, False))
    assert doc == {"service": {"namespace": "shop", "name": "web"}, "localEndpoints": 0,
                   "serviceProxyHealthy": False}


# ---- serving, inside a throwaway namespace



def probe(ns: str, host: str, port: int) -> tuple[int, dict[str, str], bytes]:
    with netns_mod.entered(ns):
        conn = http.client.HTTPConnection(host, port, timeout=5)
        conn.connect()
    try:
        conn.request("GET", "/")
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


@pytest.fixture
def hcs(netns: str) -> Iterator[tuple[str, ServiceHealthServer, ProxierHealth]]:
    health = ProxierHealth(60)
    server = ServiceHealthServer(netns, health=health)
    try:
        yield netns, server, health
    finally:
        server.close()


@pytest.mark.kernel
def test_probe_answers_follow_local_endpoints(hcs: tuple) -> None:
    ns, server, _ = hcs
    server.sync_services({("shop", "web"): 32001})
    assert server.ports == {WEB: 32001}
    status, headers, body = probe(ns, "127.0.0.1", 32001)
    assert status == 503
    assert json.loads(body)["localEndpoints"] == 0
    assert headers["x-load-balancing-endpoint-weight"] == "0"
    server.sync_endpoints({WEB: 2})
    status, headers, body = probe(ns, "127.0.0.1", 32001)
    assert status == 200
    assert body == response_body(WEB, 2, True)
    assert headers["content-type"] == "application/json"
    assert headers["x-content-type-options"] == "nosniff"
    assert headers["x-load-balancing-endpoint-weight"] == "2"
    assert "connection" not in headers  # kube-proxy sends none (it said close and kept it open)
    # Every address, IPv6 too (dual-stack listener, as Go's).
    assert probe(ns, "::1", 32001)[0] == 200
    server.sync_endpoints({})
    assert probe(ns, "127.0.0.1", 32001)[0] == 503


@pytest.mark.kernel
def test_unhealthy_proxier_fails_the_probe(netns: str) -> None:
    now = [1000.0]
    health = ProxierHealth(60, clock=lambda: now[0])
    with ServiceHealthServer(netns, health=health) as server:
        server.sync_services({WEB: 32001})
        server.sync_endpoints({WEB: 3})
        assert probe(netns, "127.0.0.1", 32001)[0] == 200
        health.updated()
        health.queued_update()
        now[0] += 61
        status, _, body = probe(netns, "127.0.0.1", 32001)
        assert status == 503
        assert json.loads(body)["serviceProxyHealthy"] is False
        assert json.loads(body)["localEndpoints"] == 3
        # Node eligibility does not matter here (it is /healthz's business).
        health.updated()
        health.set_node_eligible(False)
        assert probe(netns, "127.0.0.1", 32001)[0] == 200


@pytest.mark.kernel
def test_services_come_go_and_move(hcs: tuple) -> None:
    ns, server, _ = hcs
    api = ServiceName("shop", "api")
    server.sync_services({WEB: 32001, api: 32002})
    server.sync_endpoints({WEB: 1, api: 1})
    assert probe(ns, "127.0.0.1", 32002)[0] == 200
    # api moves to the port web had; web goes away: the port changes owner in one sync.
    server.sync_services({api: 32001})
    assert server.ports == {api: 32001}
    status, _, body = probe(ns, "127.0.0.1", 32001)
    assert status == 200 and json.loads(body)["service"]["name"] == "api"
    with pytest.raises(ConnectionRefusedError):
        probe(ns, "127.0.0.1", 32002)
    server.sync_services({})
    assert server.ports == {}
    with pytest.raises(ConnectionRefusedError):
        probe(ns, "127.0.0.1", 32001)


@pytest.mark.kernel
def test_port_in_use_is_logged_and_retried(hcs: tuple, caplog: pytest.LogCaptureFixture) -> None:
    ns, server, _ = hcs
    with netns_mod.entered(ns):
        squatter = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    squatter.bind(("::", 32003))
    squatter.listen(1)
    try:
        with caplog.at_level(logging.ERROR, logger="nfproxy.daemon.healthcheck"):
            server.sync_services({WEB: 32003})
        assert server.ports == {}
        assert "32003" in caplog.text and "shop/web" in caplog.text
    finally:
        squatter.close()
    server.sync_services({WEB: 32003})
    server.sync_endpoints({WEB: 1})
    assert server.ports == {WEB: 32003}
    assert probe(ns, "127.0.0.1", 32003)[0] == 200


@pytest.mark.kernel
def test_bind_addresses_limit_where_it_listens(netns: str) -> None:
    with ServiceHealthServer(netns, ["127.0.0.1"]) as server:
        server.sync(_state())
        assert server.ports == {WEB: 32001, ServiceName("shop", "old"): 32002}
        status, _, body = probe(netns, "127.0.0.1", 32001)
        assert status == 200 and json.loads(body)["localEndpoints"] == 4
        assert probe(netns, "127.0.0.1", 32002)[0] == 503  # only a terminating local endpoint
        with pytest.raises(ConnectionRefusedError):
            probe(netns, "::1", 32001)
    with pytest.raises(ValueError, match="not an IP address"):
        ServiceHealthServer(netns, ["node-a"])


@pytest.mark.kernel
def test_many_probes_at_once(hcs: tuple) -> None:
    ns, server, _ = hcs
    server.sync_services({WEB: 32001})
    server.sync_endpoints({WEB: 1})
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        codes = list(pool.map(lambda _: probe(ns, "127.0.0.1", 32001)[0], range(200)))
    assert codes == [200] * 200


def test_bad_ports_are_refused() -> None:
    server = ServiceHealthServer(None)
    try:
        with pytest.raises(ValueError, match="shop/web.*70000"):
            server.sync_services({WEB: 70000})
    finally:
        server.close()
    with pytest.raises(RuntimeError, match="closed"):
        server.sync_services({WEB: 32001})


@pytest.mark.kernel
def test_probe_answered_while_a_hundred_idle_connections_are_held(hcs: tuple) -> None:
    """Issue J: 8 idle connections delayed a load balancer's probe by 9 s (4 workers x 5 s)."""
    ns, server, _ = hcs
    server.sync_services({WEB: 32001})
    server.sync_endpoints({WEB: 1})
    with netns_mod.entered(ns):
        idle = [socket.create_connection(("127.0.0.1", 32001), timeout=30) for _ in range(100)]
    try:
        for sock in idle[:50]:
            sock.sendall(b"GET / HTTP/1.1\r\n")  # slow clients: half a request each
        with netns_mod.entered(ns):
            conn = http.client.HTTPConnection("127.0.0.1", 32001, timeout=10)
            conn.connect()
        try:
            conn.request("GET", "/")
            assert conn.getresponse().status == 200
        finally:
            conn.close()
    finally:
        for sock in idle:
            sock.close()


@pytest.mark.kernel
def test_idle_probe_connections_are_closed(netns: str) -> None:
    with ServiceHealthServer(netns, idle_timeout=0.3) as server:
        server.sync_services({WEB: 32001})
        with netns_mod.entered(netns):
            sock = socket.create_connection(("127.0.0.1", 32001), timeout=30)
        try:
            assert sock.recv(1024) == b""  # closed by the server, not by the 30 s timeout
        finally:
            sock.close()

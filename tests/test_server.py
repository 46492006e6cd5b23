"""Health (/healthz, /livez) and metrics servers: kube-proxy's semantics and JSON, real HTTP.

HTTP tests serve inside a throwaway namespace and connect from inside it: no traffic ever
touches the root namespace.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry

from nfproxy.cli.config import FlagError
from nfproxy.kernel import netns as netns_mod
from nfproxy.daemon.metrics import ProxyMetrics
from nfproxy.core.model import IPFamily
from nfproxy.daemon.server import (
    BindAddress,
    ProxierHealth,
    go_time,
    node_eligible,
    parse_bind_address,
    serve,
)

T0 = 1_700_000_000.0  # 2023-11-14T22:13:20Z


class Clock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


# ---- the health rule


def test_go_time_matches_go_json() -> None:
    assert go_time(None) == "0001-01-01T00:00:00Z"
    assert go_time(0) == "1970-01-01T00:00:00Z"
    assert go_time(T0) == "2023-11-14T22:13:20Z"
    assert go_time(T0 + 0.5) == "2023-11-14T22:13:20.5Z"
    assert go_time(T0 + 0.123456) == "2023-11-14T22:13:20.123456Z"


def test_healthy_at_start_with_go_zero_time() -> None:
    clock = Clock()
    h = ProxierHealth(60, clock)
    status, body = h.livez()
    assert status == 200
    # On 200 kube-proxy reports lastUpdated = now (compatibility with older releases).
    assert body == {"lastUpdated": go_time(T0), "currentTime": go_time(T0), "healthy": True}
    status, body = h.healthz()
    assert status == 200
    assert list(body) == ["lastUpdated", "currentTime", "nodeEligible", "healthy"]
    assert body["nodeEligible"] is True


def test_late_update_makes_the_family_unhealthy_until_it_syncs() -> None:
    clock = Clock()
    h = ProxierHealth(60, clock)
    h.updated()  # both families synced at T0
    clock.now = T0 + 10
    h.queued_update(IPFamily.V6)
    clock.now = T0 + 30
    h.queued_update(IPFamily.V6)  # the oldest queued update is what counts
    clock.now = T0 + 10 + 59.9
    assert h.livez()[0] == 200
    clock.now = T0 + 10 + 60
    status, body = h.livez()
    assert status == 503
    assert body["healthy"] is False
    assert body["lastUpdated"] == go_time(T0)  # the real last update on failure
    assert body["currentTime"] == go_time(T0 + 70)
    assert body["status"] == {
        "IPv4": {"lastUpdated": go_time(T0), "healthy": True},
        "IPv6": {"lastUpdated": go_time(T0), "healthy": False},
    }
    assert h.healthz()[0] == 503
    assert h.healthy() is False
    clock.now = T0 + 75
    h.updated(IPFamily.V6)
    status, body = h.livez()
    assert status == 200
    assert body["status"]["IPv6"] == {"lastUpdated": go_time(T0 + 75), "healthy": True}
    assert body["lastUpdated"] == go_time(T0 + 75)


def test_a_family_is_judged_only_after_its_first_sync() -> None:
    # kube-proxy keeps a map of last updates that starts empty: a slow first sync is not a
    # failed liveness probe (a restart would only start it over).
    clock = Clock()
    h = ProxierHealth(60, clock)
    h.queued_update()
    clock.now = T0 + 3600
    assert h.livez()[0] == 200
    h.updated(IPFamily.V4)
    h.queued_update(IPFamily.V4)
    clock.now += 61
    assert h.livez()[0] == 503
    assert set(h.livez()[1]["status"]) == {"IPv4"}


def test_node_eligibility_only_affects_healthz() -> None:
    h = ProxierHealth(60, Clock())
    h.set_node_eligible(False)
    status, body = h.healthz()
    assert status == 503
    assert body["nodeEligible"] is False
    assert body["healthy"] is True
    assert body["lastUpdated"] == go_time(None)  # nothing synced yet, reported as Go's zero
    assert h.livez()[0] == 200
    assert h.healthy() is True
    h.set_node_eligible(True)
    assert h.healthz()[0] == 200


def test_node_eligible_from_node_objects() -> None:
    assert node_eligible({"metadata": {"name": "n"}, "spec": {}}) is True
    assert node_eligible({"metadata": {"name": "n", "deletionTimestamp": "2024-01-01T00:00:00Z"}}) is False
    tainted = {"metadata": {"name": "n"}, "spec": {"taints": [
        {"key": "other", "effect": "NoSchedule"},
        {"key": "ToBeDeletedByClusterAutoscaler", "value": "1", "effect": "NoSchedule"},
    ]}}
    assert node_eligible(tainted) is False
    assert node_eligible(None) is False


def test_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        ProxierHealth(0)


# ---- bind addresses


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("0.0.0.0:10256", BindAddress("0.0.0.0", 10256)),
        ("127.0.0.1:0", BindAddress("127.0.0.1", 0)),
        ("[::]:10256", BindAddress("::", 10256)),
        ("[fd00:0::1]:9", BindAddress("fd00::1", 9)),
        ("", None),
    ],
)
def test_bind_addresses_parse(text: str, want: BindAddress | None) -> None:
    assert parse_bind_address(text, "--healthz-bind-address") == want


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("10.0.0.1", "not ip:port"),
        (":10256", "not ip:port"),
        ("::1:80", "in brackets"),
        ("[10.0.0.1]:80", "only for IPv6"),
        ("localhost:80", "not an IP address"),
        ("10.0.0.1:70000", "0 to 65535"),
        ("10.0.0.1:http", "0 to 65535"),
        ("10.0.0.1:-1", "0 to 65535"),
    ],
)
def test_bad_bind_addresses_name_the_flag(text: str, why: str) -> None:
    with pytest.raises(FlagError, match=f"--metrics-bind-address: .*{why}"):
        parse_bind_address(text, "--metrics-bind-address")


def test_serve_validates_before_binding() -> None:
    h = ProxierHealth(60)
    m = ProxyMetrics(CollectorRegistry(), process_metrics=False)
    with pytest.raises(FlagError, match="--healthz-bind-address"):
        serve(h, m, "nonsense", "127.0.0.1:0", netns="unused")


# ---- real HTTP, inside a throwaway namespace


def get(ns: str, addr: BindAddress, path: str) -> tuple[int, dict[str, str], bytes]:
    with netns_mod.entered(ns):
        conn = http.client.HTTPConnection(addr.host, addr.port, timeout=5)
        conn.connect()  # the socket is made here: inside the namespace
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


@pytest.fixture
def served(netns: str) -> Iterator[tuple[str, ProxierHealth, ProxyMetrics, object]]:
    clock = Clock()
    h = ProxierHealth(60, clock)
    m = ProxyMetrics(CollectorRegistry(), process_metrics=False)
    servers = serve(h, m, "127.0.0.1:0", "[::1]:0", netns=netns, proxy_mode="nft")
    try:
        yield netns, h, m, servers
    finally:
        servers.close()


@pytest.mark.kernel
def test_http_healthz_livez_and_probe_counters(served: tuple) -> None:
    ns, h, m, servers = served
    assert servers.healthz.host == "127.0.0.1" and servers.healthz.port > 0
    status, headers, body = get(ns, servers.healthz, "/healthz")
    assert status == 200
    assert headers["content-type"] == "application/json"
    assert headers["x-content-type-options"] == "nosniff"
    doc = json.loads(body)
    assert doc["nodeEligible"] is True and doc["healthy"] is True
    h.set_node_eligible(False)
    status, _, body = get(ns, servers.healthz, "/healthz")
    assert status == 503 and json.loads(body)["nodeEligible"] is False
    status, _, body = get(ns, servers.healthz, "/livez")
    assert status == 200 and "nodeEligible" not in json.loads(body)
    assert get(ns, servers.healthz, "/metrics")[0] == 404
    reg = m.registry
    assert reg.get_sample_value("kubeproxy_proxy_healthz_total", {"code": "200"}) == 1
    assert reg.get_sample_value("kubeproxy_proxy_healthz_total", {"code": "503"}) == 1
    assert reg.get_sample_value("kubeproxy_proxy_livez_total", {"code": "200"}) == 1


@pytest.mark.kernel
def test_http_metrics_endpoint(served: tuple) -> None:
    ns, h, m, servers = served
    assert servers.metrics.host == "::1"
    m.apply_failed("nft", family=IPFamily.V4)
    status, headers, body = get(ns, servers.metrics, "/metrics")
    assert status == 200
    assert headers["content-type"].startswith("text/plain")
    assert b'kubeproxy_sync_proxy_rules_nftables_sync_failures_total{ip_family="IPv4"} 1.0' in body
    assert get(ns, servers.metrics, "/proxyMode")[2] == b"nft"
    assert get(ns, servers.metrics, "/healthz")[2] == b"ok"
    assert get(ns, servers.metrics, "/nope")[0] == 404


@pytest.mark.kernel
def test_close_frees_the_ports_and_empty_address_disables(netns: str) -> None:
    h = ProxierHealth(60)
    m = ProxyMetrics(CollectorRegistry(), process_metrics=False)
    servers = serve(h, m, "127.0.0.1:0", "", netns=netns)
    addr = servers.healthz
    assert servers.metrics is None
    assert get(netns, addr, "/livez")[0] == 200
    servers.close()
    with pytest.raises(ConnectionRefusedError):
        get(netns, addr, "/livez")
    # The same port binds again at once (a restarted daemon gets its port back).
    again = serve(h, m, str(addr), "", netns=netns)
    try:
        assert again.healthz == addr
        assert get(netns, addr, "/livez")[0] == 200
    finally:
        again.close()


@pytest.mark.kernel
def test_port_in_use_fails_cleanly(served: tuple) -> None:
    ns, h, m, servers = served
    with pytest.raises(OSError):
        # The health port is free, the metrics port is taken: the call fails as a whole.
        serve(h, m, "127.0.0.1:0", str(servers.metrics), netns=ns)
    assert get(ns, servers.metrics, "/healthz")[0] == 200

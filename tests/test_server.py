"""Health (/healthz, /livez) and metrics servers: kube-proxy's semantics and JSON, real HTTP.

HTTP tests serve inside a throwaway namespace and connect from inside it: no traffic ever
touches the root namespace.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import socket
import struct
import time
from collections.abc import Callable, Iterator

import pytest
from prometheus_client import CollectorRegistry

from nfproxy.core.flags import FlagError
from nfproxy.kernel import netns as netns_mod
from nfproxy.daemon.metrics import ProxyMetrics
from nfproxy.core.model import IPFamily
from nfproxy.daemon.server import (
    BACKLOG,
    BindError,
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


def get(ns: str, addr: BindAddress, path: str, timeout: float = 5) -> tuple[int, dict[str, str], bytes]:
    with netns_mod.entered(ns):
        conn = http.client.HTTPConnection(addr.host, addr.port, timeout=timeout)
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
    assert get(ns, servers.metrics, "/proxyMode")[2] == b"nftables"
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
def test_port_in_use_fails_cleanly_with_hard_fail(served: tuple) -> None:
    ns, h, m, servers = served
    with pytest.raises(OSError) as err:
        # The health port is free, the metrics port is taken: the call fails as a whole.
        serve(h, m, "127.0.0.1:0", str(servers.metrics), netns=ns, hard_fail=True)
    assert isinstance(err.value, BindError)
    assert "--metrics-bind-address" in str(err.value) and str(servers.metrics) in str(err.value)
    assert "--bind-address-hard-fail" in str(err.value)
    assert get(ns, servers.metrics, "/healthz")[0] == 200


def wait_for(predicate: Callable[[], object], timeout: float = 30.0) -> bool:
    """Poll until `predicate()` is true: a bound on a wait, never a figure asserted."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return bool(predicate())


@pytest.mark.kernel
def test_port_in_use_is_logged_and_retried(netns: str, caplog: pytest.LogCaptureFixture) -> None:
    h = ProxierHealth(60)
    m = ProxyMetrics(CollectorRegistry(), process_metrics=False)
    with netns_mod.entered(netns):
        squatter = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    squatter.bind(("127.0.0.1", 0))
    squatter.listen(1)
    taken = squatter.getsockname()[1]
    with caplog.at_level(logging.ERROR, logger="nfproxy.daemon.server"):
        servers = serve(h, m, "127.0.0.1:0", f"127.0.0.1:{taken}", netns=netns, retry_interval=0.1)
    try:
        # The healthz server runs; the metrics one is logged (kube-proxy's message) and waits.
        assert get(netns, servers.healthz, "/healthz")[0] == 200
        assert servers.metrics is None
        assert "Metrics server failed" in caplog.text and f"127.0.0.1:{taken}" in caplog.text
        squatter.close()
        assert wait_for(lambda: servers.metrics is not None), "the freed port was never retried"
        assert servers.metrics == BindAddress("127.0.0.1", taken)
        assert get(netns, servers.metrics, "/metrics")[0] == 200
    finally:
        squatter.close()
        servers.close()


@pytest.mark.kernel
def test_proxy_mode_names_kube_proxys_modes(netns: str) -> None:
    h = ProxierHealth(60)
    m = ProxyMetrics(CollectorRegistry(), process_metrics=False)
    for backend, mode in (("iptables", b"iptables"), ("nft", b"nftables"), ("nftables", b"nftables")):
        with serve(h, m, "", "127.0.0.1:0", netns=netns, proxy_mode=backend) as servers:
            assert get(netns, servers.metrics, "/proxyMode")[2] == mode
    with pytest.raises(ValueError, match="ipvs"):
        serve(h, m, "", "127.0.0.1:0", netns=netns, proxy_mode="ipvs")


# ---- load: many connections at once, idle ones, rude ones


async def _request(host: str, port: int, path: str, timeout: float) -> tuple[int, bytes]:
    """One HTTP/1.1 request on its own connection: (status, body)."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def concurrent_requests(ns: str, addr: BindAddress, path: str, n: int, timeout: float = 120.0) -> list:
    """`n` requests started at once from inside `ns` (sockets are made on this thread)."""

    async def all_at_once() -> list:
        return await asyncio.gather(
            *(_request(addr.host, addr.port, path, timeout) for _ in range(n)), return_exceptions=True
        )

    with netns_mod.entered(ns):
        return asyncio.run(all_at_once())


@pytest.mark.kernel
def test_a_thousand_concurrent_healthz_requests_are_all_answered(served: tuple) -> None:
    ns, h, m, servers = served
    answers = concurrent_requests(ns, servers.healthz, "/healthz", 1000)
    failed = [a for a in answers if isinstance(a, BaseException)]
    assert not failed, f"{len(failed)} of 1000 failed, e.g. {failed[0]!r}"
    assert {status for status, _ in answers} == {200}
    assert all(json.loads(body)["healthy"] is True for _, body in answers)
    assert m.registry.get_sample_value("kubeproxy_proxy_healthz_total", {"code": "200"}) == 1000


def listen_state(ns: str) -> tuple[dict[int, int], int]:
    """The namespace's TCP listeners as port -> backlog (`ss` shows it as Send-Q), and how many
    SYNs its full listen queues dropped so far (TcpExt ListenOverflows + ListenDrops)."""
    from nfproxy.kernel.process import run

    backlogs = {}
    for line in run(["ss", "-Hltn"], netns=ns).splitlines():
        _, _, send_q, local, *_ = line.split()
        backlogs[int(local.rpartition(":")[2])] = int(send_q)
    with netns_mod.entered(ns):
        lines = open("/proc/thread-self/net/netstat").read().splitlines()  # noqa: SIM115
    names, values = next((a.split(), b.split()) for a, b in zip(lines[::2], lines[1::2]) if a.startswith("TcpExt:"))
    counts = dict(zip(names[1:], map(int, values[1:])))
    return backlogs, counts["ListenOverflows"] + counts["ListenDrops"]


@pytest.mark.kernel
def test_the_listen_queue_holds_a_thousand_connections_at_once(served: tuple) -> None:
    """Issue J: a backlog of 5 dropped SYNs under a burst, and a dropped SYN is retried only
    after a second. With 1 024, a burst of 1 000 never overflows it, however slowly the
    server accepts (a count, not a timing)."""
    ns, h, m, servers = served
    with netns_mod.entered(ns):
        somaxconn = int(open("/proc/sys/net/core/somaxconn").read())  # noqa: SIM115
    backlogs, dropped = listen_state(ns)
    assert backlogs[servers.healthz.port] == backlogs[servers.metrics.port] == min(BACKLOG, somaxconn) == 1024
    answers = concurrent_requests(ns, servers.healthz, "/healthz", 1000)
    assert [a for a in answers if isinstance(a, BaseException)] == []
    assert listen_state(ns)[1] == dropped


@pytest.mark.kernel
def test_metrics_answered_while_many_are_scraping(served: tuple) -> None:
    ns, h, m, servers = served
    answers = concurrent_requests(ns, servers.metrics, "/metrics", 200)
    assert [a for a in answers if isinstance(a, BaseException)] == []
    assert {status for status, _ in answers} == {200}
    assert all(b"kubeproxy_sync_proxy_rules_duration_seconds" in body for _, body in answers)


@pytest.mark.kernel
def test_idle_connections_are_closed_and_do_not_block_probes(netns: str) -> None:
    h = ProxierHealth(60)
    m = ProxyMetrics(CollectorRegistry(), process_metrics=False)
    with serve(h, m, "127.0.0.1:0", "", netns=netns, idle_timeout=0.5) as servers:
        addr = servers.healthz
        with netns_mod.entered(netns):
            idle = [socket.create_connection((addr.host, addr.port), timeout=30) for _ in range(100)]
        try:
            idle[0].sendall(b"GET /healthz HTTP/1.1\r\nHost: x")  # half a request: a slow client
            assert get(netns, addr, "/healthz", timeout=30)[0] == 200
            # Each idle one is closed by the server (recv sees EOF) well within the bound.
            for sock in idle:
                assert sock.recv(1024) == b""
        finally:
            for sock in idle:
                sock.close()


@pytest.mark.kernel
def test_clients_that_hang_up_leave_no_traceback(served: tuple, caplog: pytest.LogCaptureFixture) -> None:
    ns, h, m, servers = served
    with caplog.at_level(logging.DEBUG):
        for addr, path in ((servers.metrics, "/metrics"), (servers.healthz, "/healthz")):
            for _ in range(50):
                with netns_mod.entered(ns):
                    sock = socket.create_connection((addr.host, addr.port), timeout=30)
                sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
                # Reset at once, before the answer is read: the server writes into a dead socket.
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                sock.close()
        assert get(ns, servers.healthz, "/healthz")[0] == 200
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    assert loud == [], [r.getMessage() for r in loud]


@pytest.mark.kernel
def test_configz_and_healthz_ping_as_kube_proxys_metrics_mux(netns: str) -> None:
    h = ProxierHealth(60, Clock())
    m = ProxyMetrics(CollectorRegistry(), process_metrics=False)
    config = {"apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration", "mode": "nftables"}
    servers = serve(h, m, "", "127.0.0.1:0", netns=netns, proxy_mode="nft", configz=config)
    try:
        status, headers, body = get(netns, servers.metrics, "/configz")
        assert status == 200 and headers["content-type"].startswith("application/json")
        assert json.loads(body) == {"kubeproxy.config.k8s.io": config}
        assert get(netns, servers.metrics, "/healthz/ping")[:3:2] == (200, b"ok")
    finally:
        servers.close()
    servers = serve(h, m, "", "127.0.0.1:0", netns=netns, proxy_mode="nft")
    try:
        assert get(netns, servers.metrics, "/configz")[0] == 404  # nothing to say: not served
    finally:
        servers.close()


@pytest.mark.kernel
def test_malformed_requests_are_answered_400_and_not_logged(served: tuple, caplog: pytest.LogCaptureFixture) -> None:
    """Go's net/http answers a malformed request 400 and logs nothing; aiohttp logged each at
    ERROR with the client's bytes, so a flood of them filled the disk."""
    ns, h, m, servers = served
    bad = (b"GET /healthz HTTP/1.1\r\nHost: x\r\nX: a\x00b\r\n\r\n", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03")
    with caplog.at_level(logging.INFO):
        for addr in (servers.healthz, servers.metrics):
            for payload in bad:
                with netns_mod.entered(ns):
                    sock = socket.create_connection((addr.host, addr.port), timeout=30)
                try:
                    sock.sendall(payload)
                    answer = sock.recv(64)
                finally:
                    sock.close()
                assert answer.startswith(b"HTTP/1.") and b" 400 " in answer[:16], answer
        assert get(ns, servers.healthz, "/healthz")[0] == 200
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    assert loud == [], [r.getMessage() for r in loud]


def test_client_errors_are_debug_lines_and_our_own_stay_errors() -> None:
    from aiohttp.http_exceptions import BadHttpMessage

    from nfproxy.daemon.server import _HTTP_LOG, _ClientErrors

    def record(exc: BaseException) -> logging.LogRecord:
        return _HTTP_LOG.makeRecord(_HTTP_LOG.name, logging.ERROR, __file__, 1, "Error handling request", (), (type(exc), exc, None))

    quiet = _ClientErrors()
    level = _HTTP_LOG.level
    try:
        _HTTP_LOG.setLevel(logging.INFO)
        assert quiet.filter(record(BadHttpMessage("bad"))) is False
        assert quiet.filter(record(ConnectionResetError())) is False
        ours = record(RuntimeError("a bug of ours"))
        assert quiet.filter(ours) is True and ours.levelno == logging.ERROR
        _HTTP_LOG.setLevel(logging.DEBUG)
        shown = record(BadHttpMessage("bad"))
        assert quiet.filter(shown) is True and shown.levelno == logging.DEBUG
    finally:
        _HTTP_LOG.setLevel(level)


def test_running_out_of_descriptors_is_reported_once_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    from nfproxy.daemon.server import ACCEPT_LOG_INTERVAL, _AcceptFailures

    clock = Clock()
    handler = _AcceptFailures(clock)
    others: list[dict] = []

    class Loop:
        def default_exception_handler(self, context: dict) -> None:
            others.append(context)

    emfile = {"message": "socket.accept() out of system resource", "exception": OSError(24, "Too many open files")}
    with caplog.at_level(logging.ERROR, logger="nfproxy.daemon.server"):
        for _ in range(1024):
            handler(Loop(), emfile)  # type: ignore[arg-type]
        clock.now += ACCEPT_LOG_INTERVAL
        handler(Loop(), emfile)  # type: ignore[arg-type]
        handler(Loop(), {"message": "something else"})  # type: ignore[arg-type]
    assert [r.getMessage() for r in caplog.records] == [
        "Cannot accept connections: [Errno 24] Too many open files; retrying",
        "Cannot accept connections: [Errno 24] Too many open files (1023 more since the last report); retrying",
    ]
    assert others == [{"message": "something else"}]


@pytest.mark.kernel
def test_a_scrape_after_a_change_sees_it(served: tuple) -> None:
    """Concurrent scrapes share one encoding; a later scrape never gets an older one."""
    ns, h, m, servers = served
    for n in range(1, 4):
        m.apply_failed("nft", family=IPFamily.V6)
        body = get(ns, servers.metrics, "/metrics")[2]
        assert f'kubeproxy_sync_proxy_rules_nftables_sync_failures_total{{ip_family="IPv6"}} {n}.0'.encode() in body

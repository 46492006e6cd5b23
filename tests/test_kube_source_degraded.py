"""The API source on clusters that are not quite what it expects: a ServiceCIDR API that is not
served or not allowed, a Node without a pod CIDR, a rotated service account token, an API
server that accepts connections and never answers. Against tests/apiserver.py, with the real
`kubernetes` client."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from nfproxy.core.model import LocalMode, NodeConfig
from nfproxy.sources.kube import KubeSource, WatchSettings, api_client
from tests.apiserver import FakeApiServer, node, service, service_cidr
from tests.test_kube_source import FAST, NODE, _fields, eventually

# Relisting a kind that is not served: rare in real life, fast here.
ABSENT = WatchSettings(**{**_fields(FAST), "absent_relist": 0.3})


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    with FakeApiServer(bookmark_interval=0.2) as server:
        server.apply(node(NODE, ips=["192.168.0.2"]))
        server.apply(service("web", "10.96.0.10"))
        yield server


@pytest.fixture
def sources() -> Iterator[list[KubeSource]]:
    started: list[KubeSource] = []
    yield started
    for source in started:
        source.stop()


def _start(api: FakeApiServer, sources: list[KubeSource], node_config: NodeConfig,
           settings: WatchSettings = ABSENT) -> KubeSource:
    source = KubeSource(api_client(master=api.url), node_config, settings)
    sources.append(source)
    source.start(lambda: None)
    return source


def _said(caplog: pytest.LogCaptureFixture, text: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if text in r.getMessage()]


# --------------------------------------------------------------------------------------------
# ServiceCIDRs not served (Kubernetes <= 1.32) or not allowed (RBAC)


def test_service_cidrs_not_served_mean_none_and_the_flag_decides(api, sources, caplog):
    caplog.set_level(logging.INFO, logger="nfproxy.sources.kube")
    api.not_served.add("servicecidrs")
    source = _start(api, sources, NodeConfig(name=NODE, service_cidrs=("10.0.0.0/24",)))
    assert source.wait_ready(10), "a cluster without the ServiceCIDR API must not block the proxy"
    assert source.snapshot().state.node.service_cidrs == ("10.0.0.0/24",)

    # Listed again now and then (an upgrade may bring the API), said once.
    assert eventually(lambda: api.count("servicecidrs", watch=False) >= 3)
    said = _said(caplog, "ServiceCIDRs are not served")
    assert len(said) == 1 and said[0].levelname == "INFO"
    assert "--service-cluster-ip-range" in said[0].getMessage()
    assert not any(r.levelname == "WARNING" and "servicecidrs" in r.getMessage() for r in caplog.records)

    # The upgrade: served, listed and watched from then on.
    api.apply(service_cidr("kubernetes", ["10.96.0.0/16"]))
    api.not_served.clear()
    assert eventually(lambda: source.snapshot().state.node.service_cidrs == ("10.96.0.0/16",))
    assert eventually(lambda: api.open_watches("servicecidrs") == 1)


def test_service_cidrs_forbidden_warn_once_naming_the_permission(api, sources, caplog):
    api.forbidden.add("servicecidrs")
    source = _start(api, sources, NodeConfig(name=NODE, service_cidrs=("10.0.0.0/24",)))
    assert source.wait_ready(10)
    assert source.snapshot().state.node.service_cidrs == ("10.0.0.0/24",)
    assert eventually(lambda: api.count("servicecidrs", watch=False) >= 3)
    said = _said(caplog, "HTTP 403")
    assert len(said) == 1 and said[0].levelname == "WARNING"
    assert "list and watch on servicecidrs.networking.k8s.io" in said[0].getMessage()


def test_other_service_cidr_errors_still_hold_readiness(api, sources):
    """A 500 says nothing about whether the API exists: retried as before, not ready."""
    api.fail(500, count=10**6, plural="servicecidrs")
    source = _start(api, sources, NodeConfig(name=NODE))
    assert not source.wait_ready(1.5)
    assert api.count("servicecidrs", watch=False) >= 2


def test_service_cidrs_that_stop_being_served_are_dropped(api, sources):
    api.apply(service_cidr("kubernetes", ["10.96.0.0/16"]))
    source = _start(api, sources, NodeConfig(name=NODE, service_cidrs=("10.0.0.0/24",)))
    assert source.wait_ready(10)
    assert source.snapshot().state.node.service_cidrs == ("10.96.0.0/16",)
    # A downgrade: the watch fails, the relist finds the API gone.
    api.not_served.add("servicecidrs")
    api.compact()
    api.drop_watches()
    assert eventually(lambda: source.snapshot().state.node.service_cidrs == ("10.0.0.0/24",))


# --------------------------------------------------------------------------------------------
# NodeCIDR local-traffic detection without a pod CIDR


def test_node_cidr_mode_without_a_pod_cidr_warns_until_it_has_one(api, sources, caplog):
    config = NodeConfig(name=NODE, detect_local_mode=LocalMode.NODE_CIDR)
    source = _start(api, sources, config)
    assert source.wait_ready(10)
    assert source.snapshot().state.node.cluster_cidrs == ()
    source.snapshot()
    said = _said(caplog, "has no podCIDR")
    assert len(said) == 1 and said[0].levelname == "WARNING"
    assert "cannot be detected" in said[0].getMessage()

    api.apply(node(NODE, ips=["192.168.0.2"], pod_cidr="10.244.0.0/24"))
    assert eventually(lambda: source.snapshot().state.node.cluster_cidrs == ("10.244.0.0/24",))
    assert len(_said(caplog, "has no podCIDR")) == 1


# --------------------------------------------------------------------------------------------
# kubeconfig tokenFile: a projected token the kubelet rotates


def test_a_rotated_token_file_is_read_again(api, sources, tmp_path: Path):
    token = tmp_path / "token"
    token.write_text("token-one\n")
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(f"""apiVersion: v1
kind: Config
clusters: [{{name: c, cluster: {{server: "{api.url}"}}}}]
users: [{{name: u, user: {{tokenFile: token}}}}]
contexts: [{{name: x, context: {{cluster: c, user: u}}}}]
current-context: x
""")
    source = KubeSource(api_client(str(kubeconfig), token_period=0.2), NodeConfig(name=NODE), FAST)
    sources.append(source)
    source.start(lambda: None)
    assert source.wait_ready(10)
    assert {r.authorization for r in api.requests} == {"Bearer token-one"}

    token.write_text("token-two\n")  # the kubelet rotated it
    time.sleep(0.3)
    seen = len(api.requests)
    api.drop_watches()
    assert eventually(lambda: any(r.authorization == "Bearer token-two" for r in api.requests[seen:]))
    assert all(r.authorization == "Bearer token-two" for r in api.requests[seen:])

    # Unreadable for a while: the last token is kept, not an empty one.
    token.unlink()
    time.sleep(0.3)
    seen = len(api.requests)
    api.drop_watches()
    assert eventually(lambda: len(api.requests) > seen)
    assert all(r.authorization == "Bearer token-two" for r in api.requests[seen:])


def test_a_token_file_is_read_again_only_after_its_period(api, tmp_path: Path):
    token = tmp_path / "token"
    token.write_text("token-one")
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(f"""apiVersion: v1
kind: Config
clusters: [{{name: c, cluster: {{server: "{api.url}"}}}}]
users: [{{name: u, user: {{tokenFile: {token}}}}}]
contexts: [{{name: x, context: {{cluster: c, user: u}}}}]
current-context: x
""")
    client = api_client(str(kubeconfig))
    hook = client.configuration.refresh_api_key_hook
    assert hook is not None and hook.period == 60.0
    token.write_text("token-two")
    assert client.configuration.get_api_key_with_prefix("BearerToken") == "Bearer token-one"
    client.close()


# --------------------------------------------------------------------------------------------
# Stopping while the API server accepts connections and never answers


def test_stop_is_prompt_with_lists_in_flight_to_a_silent_server(sources):
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                held.append(silent.accept()[0])  # never read, never answered
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    settings = WatchSettings(**{**_fields(FAST), "list_timeout": 30.0})
    source = KubeSource(
        api_client(master=f"http://127.0.0.1:{silent.getsockname()[1]}"), NodeConfig(name=NODE), settings
    )
    try:
        source.start(lambda: None)
        assert eventually(lambda: len(held) == 4), "every reflector has a list in flight"
        started = time.monotonic()
        source.stop()
        assert time.monotonic() - started < 2.0
    finally:
        silent.close()
        for conn in held:
            conn.close()
    # Left behind, they end once their request fails, without touching the state.
    assert eventually(lambda: not any(r.thread.is_alive() for r in source.reflectors))
    assert source.cache.counts()["Service"] == 0 and not source.ready()

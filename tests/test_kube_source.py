"""The Kubernetes API source against the test API server (tests/apiserver.py).

The code under test drives the real `kubernetes` client over real HTTP; only the server is ours.
Source-level tests check that the state converges; the kernel tests at the end check that the
changes reach rules in a throwaway network namespace through the proxier's sync loop.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from nfproxy.cli.config import FlagError, add_node_flags
from nfproxy.core.model import IPFamily, NodeConfig, Protocol, ServicePortName
from nfproxy.sources import kube
from nfproxy.sources.kube import (
    ENDPOINT_SLICES,
    NODES,
    SERVICES,
    KubeSource,
    ObjectCache,
    WatchSettings,
    api_client,
)
from nfproxy.cli.kube_flags import add_kube_flags, source_from_args
from nfproxy.sources.manifests import load, load_objects
from tests.apiserver import FakeApiServer, endpoint_slice, node, service, service_cidr

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
NODE = "node-a"
FAST = WatchSettings(
    watch_timeout=5,
    connect_timeout=1.0,
    watch_read_margin=3.0,
    list_timeout=3.0,
    backoff_initial=0.05,
    backoff_max=0.4,
    min_watch_seconds=0.2,
)


def eventually(predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


class Notices:
    """Counts `notify()` calls, as the sync loop would receive them."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            self.count += 1


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    with FakeApiServer(bookmark_interval=0.2) as server:
        yield server


@pytest.fixture
def start_source(api: FakeApiServer) -> Iterator[Callable[..., tuple[KubeSource, Notices]]]:
    started: list[KubeSource] = []

    def start(settings: WatchSettings = FAST, node_name: str = NODE) -> tuple[KubeSource, Notices]:
        source = KubeSource(api_client(master=api.url), NodeConfig(name=node_name), settings)
        notices = Notices()
        source.start(notices)
        started.append(source)
        assert source.wait_ready(10), "the source never finished its initial lists"
        return source, notices

    yield start
    for source in started:
        source.stop()


def spn(namespace: str, name: str, port: str = "http", proto: Protocol = Protocol.TCP) -> Any:
    return (ServicePortName(namespace, name, port, proto), IPFamily.V4)


def endpoints_of(source: KubeSource, namespace: str, name: str, port: str = "http") -> list[str]:
    state = source.snapshot().state
    return [e.address for e in state.endpoints.get(spn(namespace, name, port), ())]


def example_objects() -> list[dict[str, Any]]:
    """The example cluster's objects, `kind: List` documents opened."""
    objects = []
    for path in sorted(EXAMPLES.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc:
                continue
            if doc["kind"].endswith("List"):
                objects.extend(doc["items"])
            else:
                objects.append(doc)
    return [o for o in objects if o["kind"] in ("Service", "EndpointSlice", "Node")]


# --------------------------------------------------------------------------------------------
# Initial list


def test_initial_list_builds_the_same_state_as_the_manifests(api, start_source):
    for obj in example_objects():
        api.apply(obj)
    api.apply(node("node-b", zone="zone-b", ips=["192.168.0.3"]))  # not ours: not watched
    source, notices = start_source()

    got = source.snapshot()
    want = load(EXAMPLES, NodeConfig(name=NODE))
    assert got.state == want.state
    assert got.errors == want.errors == ()
    assert got.state.node.zone == "zone-a"
    assert got.state.node.ips == ("192.168.0.2",)
    assert len(got.state.services) >= 10
    assert notices.count >= 1
    node_requests = [r for r in api.requests if r.plural == "nodes"]
    assert node_requests and all(
        r.query.get("fieldSelector") == f"metadata.name={NODE}" for r in node_requests
    )
    assert all(r.user_agent.startswith("nfproxy/") for r in api.requests)


def test_lists_ask_for_versions_as_client_go_does(api, start_source):
    """client-go's reflector (tools/cache/reflector.go, relistResourceVersion): the first list
    asks for resourceVersion "0", served from the watch cache, which ignores `limit`; after a
    410 it lists with no resourceVersion (a consistent read), page by page, and a continuation
    carries no resourceVersion (the server refuses one)."""
    for i in range(7):
        api.apply(service(f"svc-{i}", f"10.96.0.{10 + i}"))
    source, _ = start_source(WatchSettings(**{**_fields(FAST), "page_size": 3}))

    assert len(source.snapshot().state.services) == 7
    first = [r for r in api.requests if r.plural == "services" and not r.watch]
    assert [(r.query.get("resourceVersion"), r.query.get("limit")) for r in first] == [("0", "3")]
    assert not any(r.query.get("continue") for r in first), "the watch cache does not paginate"

    with api.paused():
        api.apply(service("svc-7", "10.96.0.17"))
        api.compact()
    assert eventually(lambda: len(source.snapshot().state.services) == 8)
    relist = [r for r in api.requests if r.plural == "services" and not r.watch][1:]
    assert [bool(r.query.get("continue")) for r in relist] == [False, True, True]
    assert all("resourceVersion" not in r.query and r.query["limit"] == "3" for r in relist)
    assert all(r.status == 200 for r in relist)


def test_invalid_objects_are_reported_and_the_rest_is_used(api, start_source):
    api.apply(service("good", "10.96.0.10"))
    bad = service("bad", "10.96.0.11")
    bad["spec"]["clusterIP"] = bad["spec"]["clusterIPs"][0] = "10.96.0.300"
    api.apply(bad)
    source, _ = start_source()

    result = source.snapshot()
    assert spn("default", "good") in result.state.services
    assert spn("default", "bad") not in result.state.services
    assert {(e.kind, e.name) for e in result.errors} == {("Service", "bad")}
    assert "spec.clusterIP" in {e.field for e in result.errors}


# --------------------------------------------------------------------------------------------
# Watch: changes


def test_service_and_slice_changes_reach_the_state(api, start_source):
    api.apply(service("web", "10.96.0.10"))
    api.apply(endpoint_slice("web-1", "web", ["10.244.0.5", "10.244.0.6"], node_name=NODE))
    source, notices = start_source()
    assert endpoints_of(source, "default", "web") == ["10.244.0.5:8080", "10.244.0.6:8080"]

    before = notices.count
    api.apply(endpoint_slice("web-2", "web", ["10.244.1.7"], node_name="node-b"))
    assert eventually(lambda: len(endpoints_of(source, "default", "web")) == 3)
    assert notices.count > before

    api.apply(endpoint_slice("web-1", "web", ["10.244.0.5"], node_name=NODE, ready=False))
    assert eventually(
        lambda: [e.ready for e in source.snapshot().state.endpoints[spn("default", "web")]]
        == [False, True]
    )

    api.apply(service("web", "10.96.0.10", [("http", 81, "TCP")]))
    assert eventually(lambda: source.snapshot().state.services[spn("default", "web")].port == 81)

    api.apply(service("api", "10.96.0.20", namespace="shop"))
    assert eventually(lambda: spn("shop", "api") in source.snapshot().state.services)

    api.delete("EndpointSlice", "default", "web-2")
    assert eventually(lambda: endpoints_of(source, "default", "web") == ["10.244.0.5:8080"])

    api.delete("Service", "default", "web")
    assert eventually(lambda: spn("default", "web") not in source.snapshot().state.services)
    # The slice of a deleted service stays cached but yields no endpoints.
    assert spn("default", "web") not in source.snapshot().state.endpoints
    assert [r for r in api.requests if not r.watch and r.plural not in ("nodes", "servicecidrs")].__len__() == 2


def test_slice_moving_to_another_service(api, start_source):
    api.apply(service("a", "10.96.0.10"))
    api.apply(service("b", "10.96.0.11"))
    api.apply(endpoint_slice("s", "a", ["10.244.0.5"]))
    source, _ = start_source()
    assert endpoints_of(source, "default", "a") == ["10.244.0.5:8080"]

    api.apply(endpoint_slice("s", "b", ["10.244.0.5"]))
    assert eventually(lambda: endpoints_of(source, "default", "b") == ["10.244.0.5:8080"])
    assert endpoints_of(source, "default", "a") == []


def test_node_label_change_changes_the_node_and_heartbeats_do_not(api, start_source):
    api.apply(node(NODE, zone="zone-a", ips=["192.168.0.2"], pod_cidr="10.244.0.0/24"))
    source, notices = start_source()
    assert source.snapshot().state.node.zone == "zone-a"
    assert source.snapshot().state.node.cluster_cidrs == ("10.244.0.0/24",)

    # A heartbeat: only status.conditions moves. Nothing the proxy reads changed.
    beat = api.get("Node", "", NODE)
    before = notices.count
    for i in range(3):
        beat["status"]["conditions"] = [{"type": "Ready", "status": "True", "reason": f"beat-{i}"}]
        api.apply(beat)
    marker = api.apply(service("marker", "10.96.0.99"))
    assert eventually(lambda: spn("default", "marker") in source.snapshot().state.services)
    assert notices.count == before + 1, "a heartbeat was reported as a change"
    assert marker["metadata"]["resourceVersion"]

    relabelled = api.get("Node", "", NODE)
    relabelled["metadata"]["labels"]["topology.kubernetes.io/zone"] = "zone-b"
    api.apply(relabelled)
    assert eventually(lambda: source.snapshot().state.node.zone == "zone-b")
    assert notices.count == before + 2


def test_zone_label_decides_topology_hints(api, start_source):
    api.apply(node(NODE, zone="zone-a"))
    api.apply(service("web", "10.96.0.10"))
    near = endpoint_slice("near", "web", ["10.244.0.5"], zone_hints=["zone-a"])
    far = endpoint_slice("far", "web", ["10.244.1.5"], zone_hints=["zone-b"])
    api.apply(near)
    api.apply(far)
    source, _ = start_source()
    from nfproxy.core.categorize import categorize

    def cluster_endpoints() -> list[str]:
        state = source.snapshot().state
        key = spn("default", "web")
        routing = categorize(state.services[key], state.endpoints[key], state.node)
        return [e.address for e in routing.cluster]

    assert cluster_endpoints() == ["10.244.0.5:8080"]
    moved = api.get("Node", "", NODE)
    moved["metadata"]["labels"]["topology.kubernetes.io/zone"] = "zone-b"
    api.apply(moved)
    assert eventually(lambda: cluster_endpoints() == ["10.244.1.5:8080"])


def test_own_node_gone_keeps_its_last_facts(api, start_source, caplog):
    """A deleted Node (or one a relist lacks) must not take the NodeCIDR rule and the NodePort
    addresses with it: kube-proxy fixes them at start and only logs the deletion."""
    api.apply(node(NODE, zone="zone-a", ips=["192.168.0.2"], pod_cidr="10.244.0.0/24"))
    source, _ = start_source()
    seen = source.snapshot().state.node
    assert (seen.ips, seen.zone, seen.cluster_cidrs) == (("192.168.0.2",), "zone-a", ("10.244.0.0/24",))

    api.delete("Node", "", NODE)
    assert eventually(lambda: source.node_object() is None), "/healthz must still see it gone"
    assert source.snapshot().state.node == seen
    gone = [r for r in caplog.records if "is gone from the API server" in r.getMessage()]
    assert len(gone) == 1 and gone[0].levelname == "WARNING"

    # Back with other facts: those are used.
    api.apply(node(NODE, zone="zone-b", ips=["192.168.0.3"], pod_cidr="10.244.1.0/24"))
    assert eventually(lambda: source.snapshot().state.node.ips == ("192.168.0.3",))
    back = source.snapshot().state.node
    assert (back.zone, back.cluster_cidrs) == ("zone-b", ("10.244.1.0/24",))

    # Gone again, this time missing from a relist (deleted while the watch was behind).
    with api.paused():
        api.delete("Node", "", NODE)
        api.compact()
    assert eventually(lambda: source.node_object() is None)
    assert source.snapshot().state.node == back
    assert len([r for r in caplog.records if "is gone from the API server" in r.getMessage()]) == 2


# --------------------------------------------------------------------------------------------
# Watch: faults


def _lists(api: FakeApiServer) -> dict[str, int]:
    return {plural: api.count(plural, watch=False) for plural in ("services", "endpointslices", "nodes")}


def test_dropped_watch_resumes_from_its_resource_version_without_relisting(api, start_source):
    api.apply(service("web", "10.96.0.10"))
    api.apply(endpoint_slice("web-1", "web", ["10.244.0.5"]))
    source, notices = start_source()
    api.apply(endpoint_slice("web-1", "web", ["10.244.0.6"]))
    assert eventually(lambda: endpoints_of(source, "default", "web") == ["10.244.0.6:8080"])
    before = notices.count
    watches = api.count("endpointslices", watch=True)

    for n in range(1, 4):
        api.drop_watches()
        assert eventually(lambda: api.count("endpointslices", watch=True) == watches + n)
        assert eventually(lambda: api.open_watches() == 4)
    assert notices.count == before, "a reconnect without changes was reported as a change"
    assert _lists(api) == {"services": 1, "endpointslices": 1, "nodes": 1}
    resumed = [r for r in api.requests if r.watch and r.plural == "endpointslices"][-1]
    assert int(resumed.query["resourceVersion"]) >= int(
        api.get("EndpointSlice", "default", "web-1")["metadata"]["resourceVersion"]
    )

    # Changes made while the watch was down (and after) are delivered by the resumed watch.
    with api.paused():
        api.apply(endpoint_slice("web-1", "web", ["10.244.0.7"]))
        api.drop_watches()
    assert eventually(lambda: endpoints_of(source, "default", "web") == ["10.244.0.7:8080"])
    assert _lists(api) == {"services": 1, "endpointslices": 1, "nodes": 1}
    assert notices.count == before + 1


def test_gone_relists_and_converges(api, start_source):
    api.apply(service("web", "10.96.0.10"))
    api.apply(service("old", "10.96.0.11"))
    api.apply(endpoint_slice("web-1", "web", ["10.244.0.5"]))
    source, notices = start_source()

    # Watchers fall behind (events held), then the history they need is compacted away:
    # the server answers their resumed position with 410 Gone.
    with api.paused():
        api.apply(endpoint_slice("web-1", "web", ["10.244.0.8", "10.244.0.9"]))
        api.apply(service("new", "10.96.0.12"))
        api.delete("Service", "default", "old")
        api.compact()
    assert eventually(lambda: _lists(api)["services"] == 2 and _lists(api)["endpointslices"] == 2)
    assert eventually(
        lambda: endpoints_of(source, "default", "web") == ["10.244.0.8:8080", "10.244.0.9:8080"]
    )
    # Each kind relists on its own: the server counting a list request is not its answer being
    # applied yet, so wait for the Services' relist too.
    assert eventually(
        lambda: spn("default", "new") in source.snapshot().state.services
        and spn("default", "old") not in source.snapshot().state.services
    )
    assert source.snapshot().state == load_objects(
        [api.get("Service", "default", n) for n in ("web", "new")]
        + [api.get("EndpointSlice", "default", "web-1")],
        NodeConfig(name=NODE),
    ).state
    assert notices.count >= 2


def test_gone_as_http_status_relists(api, start_source):
    api.apply(service("web", "10.96.0.10"))
    source, notices = start_source()
    before = _lists(api)["services"]
    api.fail(410, plural="services", watch=True)
    api.drop_watches()
    assert eventually(lambda: _lists(api)["services"] == before + 1)
    # Same objects after the relist: no change to report.
    time.sleep(0.3)
    assert spn("default", "web") in source.snapshot().state.services
    assert notices.count == 4  # one per reflector's first list (services, slices, node, ServiceCIDRs)


def test_server_errors_are_retried_with_backoff(api, start_source):
    api.apply(service("web", "10.96.0.10"))
    api.fail(500, count=4, plural="services", watch=False)
    source, _ = start_source()
    attempts = [r for r in api.requests if r.plural == "services" and not r.watch]
    assert [r.status for r in attempts] == [500, 500, 500, 500, 200]
    assert spn("default", "web") in source.snapshot().state.services


def test_slow_responses_still_converge(api, start_source):
    api.apply(service("web", "10.96.0.10"))
    api.delay = 0.4
    source, _ = start_source()
    api.apply(service("api", "10.96.0.20"))
    assert eventually(lambda: spn("default", "api") in source.snapshot().state.services)


def test_a_response_slower_than_the_read_timeout_is_retried(api, start_source):
    api.apply(service("web", "10.96.0.10"))
    api.delay = 1.0
    settings = WatchSettings(**{**_fields(FAST), "list_timeout": 0.3})
    source = KubeSource(api_client(master=api.url), NodeConfig(name=NODE), settings)
    source.start(Notices())
    try:
        assert not source.wait_ready(1.5)
        api.delay = 0.0
        assert source.wait_ready(10)
        assert spn("default", "web") in source.snapshot().state.services
        assert api.count("services", watch=False) >= 2
    finally:
        source.stop()


def test_short_outage_keeps_the_state_and_resumes(api, start_source):
    api.apply(service("web", "10.96.0.10"))
    api.apply(endpoint_slice("web-1", "web", ["10.244.0.5"]))
    source, notices = start_source()
    before_state, before_notices = source.snapshot().state, notices.count

    api.stop()
    api.apply(endpoint_slice("web-1", "web", ["10.244.0.6"]))  # changed while unreachable
    time.sleep(1.5)
    assert source.ready()
    assert source.snapshot().state == before_state
    assert notices.count == before_notices
    api.start()

    assert eventually(lambda: endpoints_of(source, "default", "web") == ["10.244.0.6:8080"])
    # History was kept: the watch resumed, nothing was relisted.
    assert _lists(api) == {"services": 1, "endpointslices": 1, "nodes": 1}


def test_outage_with_compaction_relists_when_the_server_returns(api, start_source):
    api.apply(service("web", "10.96.0.10"))
    source, _ = start_source()
    api.stop()
    api.apply(service("web", "10.96.0.10", [("http", 8443, "TCP")]))
    api.compact()
    time.sleep(0.5)
    api.start()
    assert eventually(lambda: source.snapshot().state.services[spn("default", "web")].port == 8443)
    assert _lists(api)["services"] == 2


def test_stop_is_prompt_and_idempotent(api):
    # Watches of ten minutes: a stop that waited one out would take that long.
    settings = WatchSettings(**{**_fields(FAST), "watch_timeout": 600})
    source = KubeSource(api_client(master=api.url), NodeConfig(name=NODE), settings)
    source.start(Notices())
    assert source.wait_ready(10)
    start = time.monotonic()
    source.stop()
    source.stop()
    # Not waiting out a watch is what "prompt" means; the bound is a tenth of the watch, far
    # from anything a loaded machine adds.
    assert time.monotonic() - start < 60.0
    assert not any(r.thread.is_alive() for r in source.reflectors)


# --------------------------------------------------------------------------------------------
# The per-group parse cache


def _random_objects(rng: random.Random) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    services = [
        service(f"s{i}", f"10.96.0.{i + 1}", namespace=rng.choice(("a", "b")))
        for i in range(rng.randint(1, 6))
    ]
    slices = []
    for j in range(rng.randint(0, 8)):
        owner = rng.choice(services)
        sl = endpoint_slice(
            f"e{j}",
            owner["metadata"]["name"] if rng.random() < 0.9 else "nobody",
            [f"10.244.{rng.randint(0, 1)}.{rng.randint(1, 9)}" for _ in range(rng.randint(0, 3))],
            namespace=owner["metadata"]["namespace"],
            node_name=rng.choice(("", NODE, "node-b")),
        )
        if rng.random() < 0.1:
            del sl["metadata"]["labels"]
        slices.append(sl)
    return services, slices


@pytest.mark.parametrize("seed", range(25))
def test_cache_snapshot_equals_a_full_parse(seed):
    """Random sequences of events: the cached snapshot always equals parsing everything."""
    rng = random.Random(seed)
    config = NodeConfig(name=NODE, cluster_cidrs=("10.244.0.0/16",))
    cache = ObjectCache(config)
    live: dict[tuple[str, str, str], dict[str, Any]] = {}
    for _ in range(12):
        services, slices = _random_objects(rng)
        if rng.random() < 0.3:
            cache.replace(SERVICES, copy.deepcopy(services))
            cache.replace(ENDPOINT_SLICES, copy.deepcopy(slices))
            live = {("Service",) + _ident(o): o for o in services}
            live.update({("EndpointSlice",) + _ident(o): o for o in slices})
        else:
            for obj in services + slices:
                kind = SERVICES if obj["kind"] == "Service" else ENDPOINT_SLICES
                key = (obj["kind"],) + _ident(obj)
                if key in live and rng.random() < 0.3:
                    cache.apply(kind, "DELETED", live.pop(key))
                elif rng.random() < 0.5:
                    cache.apply(kind, "MODIFIED" if key in live else "ADDED", copy.deepcopy(obj))
                    live[key] = obj
        if rng.random() < 0.5:
            cache.apply(NODES, "ADDED", node(NODE, zone=rng.choice(("z1", "z2"))))
        got = cache.snapshot()
        want = load_objects(
            [o for _, o in sorted(live.items())]
            + ([cache._node] if cache._node else []),  # noqa: SLF001 - the node under test
            config,
        )
        assert got.state == want.state
        assert sorted(map(str, got.errors)) == sorted(map(str, want.errors))


def _ident(obj: dict[str, Any]) -> tuple[str, str]:
    return (obj["metadata"].get("namespace", ""), obj["metadata"]["name"])


def test_unchanged_groups_are_not_parsed_again():
    cache = ObjectCache(NodeConfig(name=NODE))
    cache.replace(SERVICES, [service("a", "10.96.0.1"), service("b", "10.96.0.2")])
    first = cache.snapshot().state
    cache.apply(SERVICES, "MODIFIED", service("b", "10.96.0.2", [("http", 81, "TCP")]))
    second = cache.snapshot().state
    assert second.services[spn("default", "a")] is first.services[spn("default", "a")]
    assert second.services[spn("default", "b")].port == 81
    # Equal content again (a relist returning the same objects) is no change at all.
    assert not cache.replace(SERVICES, [service("a", "10.96.0.1"),
                                        service("b", "10.96.0.2", [("http", 81, "TCP")])])


def test_backoff_grows_to_its_cap_with_bounded_jitter():
    settings = WatchSettings(backoff_initial=1.0, backoff_max=8.0, jitter=0.2)
    rng = random.Random(1)
    delays = [settings.backoff(n, rng) for n in range(1, 8)]
    bases = [1, 2, 4, 8, 8, 8, 8]
    assert all(0.8 * b <= d <= 1.2 * b for d, b in zip(delays, bases))


# --------------------------------------------------------------------------------------------
# Flags and configuration


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_node_flags(parser)
    add_kube_flags(parser)
    return parser.parse_args(argv)


def _fields(settings: WatchSettings) -> dict[str, Any]:
    return {name: getattr(settings, name) for name in settings.__slots__}


def test_kubeconfig_gives_server_and_credentials(api, tmp_path):
    api.apply(service("web", "10.96.0.10"))
    config = tmp_path / "kubeconfig"
    config.write_text(yaml.safe_dump({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": api.url}}],
        "users": [{"name": "u", "user": {"token": "s3cret"}}],
        "contexts": [{"name": "ctx", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "ctx",
    }))
    source = source_from_args(_parse(["--kubeconfig", str(config), "--hostname-override", NODE]), FAST)
    source.start(Notices())
    try:
        assert source.wait_ready(10)
        assert spn("default", "web") in source.snapshot().state.services
    finally:
        source.stop()
    assert api.requests and all(r.authorization == "Bearer s3cret" for r in api.requests)


def test_master_overrides_the_kubeconfig_server(api, tmp_path):
    config = tmp_path / "kubeconfig"
    config.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": "https://192.0.2.1:6443"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "x",
    }))
    client = api_client(str(config), api.url)
    assert client.configuration.host == api.url
    client.close()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--master", "ftp://example.org"], "--master"),
        (["--master", "http://"], "--master"),
        (["--master", "http://h:99999"], "--master"),
        (["--kubeconfig", "/nonexistent/kubeconfig"], "--kubeconfig"),
        (["--hostname-override", "Not_A_Node"], "--node-name"),
    ],
)
def test_bad_flags_name_the_flag(argv, message):
    if "--hostname-override" not in argv:
        argv = argv + ["--hostname-override", NODE]
    with pytest.raises(FlagError, match=message):
        source_from_args(_parse(argv))


def test_broken_kubeconfig_is_a_flag_error(tmp_path):
    config = tmp_path / "kubeconfig"
    config.write_text("apiVersion: v1\nkind: Config\nclusters: []\ncontexts: []\n")
    with pytest.raises(FlagError, match="--kubeconfig"):
        source_from_args(_parse(["--kubeconfig", str(config), "--hostname-override", NODE]))


def test_no_configuration_at_all_says_what_to_give(monkeypatch, tmp_path):
    monkeypatch.setattr(kube.incluster_config, "SERVICE_TOKEN_FILENAME", str(tmp_path / "none"))
    with pytest.raises(FlagError, match="--kubeconfig or --master"):
        source_from_args(_parse(["--hostname-override", NODE]))


def test_in_cluster_configuration_uses_the_service_account(monkeypatch, tmp_path):
    token, ca = tmp_path / "token", tmp_path / "ca.crt"
    token.write_text("sa-token")
    ca.write_text("-----BEGIN CERTIFICATE-----\n-----END CERTIFICATE-----\n")
    monkeypatch.setattr(kube.incluster_config, "SERVICE_TOKEN_FILENAME", str(token))
    monkeypatch.setattr(kube.incluster_config, "SERVICE_CERT_FILENAME", str(ca))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    source = source_from_args(_parse(["--hostname-override", NODE]))
    try:
        configuration = source._api_client.configuration  # noqa: SLF001
        assert configuration.host == "https://10.96.0.1:443"
        assert configuration.api_key["BearerToken"].lower() == "bearer sa-token"
        assert configuration.ssl_ca_cert == str(ca)
    finally:
        source.stop()


def test_node_name_defaults_to_the_host_name(monkeypatch, tmp_path):
    monkeypatch.setattr(kube.socket, "gethostname", lambda: "Worker-7.Example.org ")
    source = source_from_args(_parse(["--master", "http://127.0.0.1:1"]))
    try:
        assert source.node.name == "worker-7.example.org"
        assert source.reflectors[2]._field_selector == "metadata.name=worker-7.example.org"  # noqa: SLF001
    finally:
        source.stop()


def test_the_daemon_command_line_builds_the_api_source(api):
    from nfproxy.cli.main import build_parser

    api.apply(service("web", "10.96.0.10"))
    args = build_parser().parse_args(
        ["run", "--backend", "nft", "--master", api.url, "--hostname-override", NODE]
    )
    source = source_from_args(args, FAST)
    source.start(Notices())
    try:
        assert source.wait_ready(10)
        assert spn("default", "web") in source.snapshot().state.services
    finally:
        source.stop()


def test_node_deletion_state_is_a_change_and_the_raw_node_is_available(api, start_source):
    from nfproxy.daemon.server import node_eligible

    api.apply(node(NODE, zone="zone-a"))
    source, notices = start_source()
    assert node_eligible(source.node_object())
    before = notices.count
    doomed = api.get("Node", "", NODE)
    doomed["spec"]["taints"] = [
        {"key": "ToBeDeletedByClusterAutoscaler", "value": "1", "effect": "NoSchedule"}
    ]
    api.apply(doomed)
    assert eventually(lambda: not node_eligible(source.node_object()))
    assert notices.count == before + 1


# --------------------------------------------------------------------------------------------
# Through the sync loop into the kernel (a sandbox node, real packets)

MIN_SYNC = 1.0
# A change must arrive long before the hourly periodic sync; how long it takes is a figure
# (printed), not an assertion: on a loaded machine it is anyone's guess.
DELIVERY_TIMEOUT = 60.0
SERVICE_IP = "10.96.0.10"
EPS = ("10.244.0.5", "10.244.0.6", "10.244.0.7")


class Synced:
    """Every successful sync the proxier reports: (when, state, result)."""

    def __init__(self) -> None:
        self.records: list[tuple[float, Any, Any]] = []
        self._lock = threading.Lock()

    def __call__(self, _previous: Any, state: Any, result: Any) -> None:
        with self._lock:
            self.records.append((time.monotonic(), state, result))

    def count(self) -> int:
        with self._lock:
            return len(self.records)

    def first_after(self, since: float, predicate: Callable[[Any], bool], timeout: float) -> float:
        """Seconds from `since` to the end of the first sync whose state satisfies `predicate`."""
        return self.delivery(since, predicate, timeout)[0]

    def delivery(self, since: float, predicate: Callable[[Any], bool], timeout: float) -> tuple[float, int]:
        """(seconds from `since` to the end of the first sync whose state satisfies `predicate`,
        how many syncs ended after `since` before that one)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                after = [(when, state) for when, state, _ in self.records if when >= since]
            for i, (when, state) in enumerate(after):
                if predicate(state):
                    return when - since, i
            time.sleep(0.01)
        raise AssertionError(f"no sync reached the expected state within {timeout}s")


def _without_counts(doc: Any) -> Any:
    """An `nft -j` document with every counter's packets and bytes left out."""
    if isinstance(doc, dict):
        return {k: _without_counts(v) for k, v in doc.items() if k not in ("packets", "bytes")}
    if isinstance(doc, list):
        return [_without_counts(v) for v in doc]
    return doc


class Node:
    """A sandbox node driven by the API source through the real sync loop."""

    def __init__(self, api: FakeApiServer, sb: Any, loop: Any, proxier: Any, synced: Synced):
        self.api, self.sb, self.loop, self.proxier, self.synced = api, sb, loop, proxier, synced

    def reach(self, count: int = 9, port: int = 80) -> dict[str, int]:
        from nfproxy.verify.sandbox import summarize

        return dict(summarize(self.sb.connect("client", SERVICE_IP, port, "tcp", count, timeout=0.4)))

    def change(self, obj_or_delete: Any, predicate: Callable[[Any], bool]) -> tuple[float, int]:
        """Apply a change on the API server; (seconds until a sync put it into the kernel, syncs
        that ended before that one). The periodic sync is an hour away, so any delivery within
        the timeout came from the change itself."""
        since = time.monotonic()
        if callable(obj_or_delete):
            obj_or_delete()
        else:
            self.api.apply(obj_or_delete)
        return self.synced.delivery(since, predicate, timeout=DELIVERY_TIMEOUT)

    def dump(self) -> str:
        """Everything the node's kernel holds for this backend (layout-agnostic: compared whole)."""
        from nfproxy.kernel.iptables import IptablesRunner
        from nfproxy.kernel.nft import NftSession

        if self.proxier.backend_name == "nft":
            # Without the counters' values: per-endpoint counters move with every connection.
            return json.dumps(_without_counts(NftSession(self.sb.node_ns).list_ruleset()), sort_keys=True)
        lines = []
        for family in IPFamily:
            for line in IptablesRunner(family, self.sb.node_ns).save().splitlines():
                if not line.startswith("#"):
                    lines.append(re.sub(r"\[\d+:\d+\]", "", line))
        return "\n".join(lines)


@pytest.fixture
def kernel_node(api) -> Iterator[Callable[..., Node]]:
    from nfproxy.daemon.proxier import Proxier, SyncLoop
    from nfproxy.verify.sandbox import Sandbox, SandboxSpec

    spec = SandboxSpec.of(
        node_ips=["192.168.0.2"],
        service_cidrs=["10.96.0.0/16"],
        clients={"client": "203.0.113.10"},
        endpoints={ip: [(8080, "tcp")] for ip in EPS},
    )
    opened: list[tuple[Any, Any]] = []

    def build(backend: str, settings: WatchSettings = FAST) -> Node:
        sb = Sandbox(spec)
        sb.start()
        try:
            source = KubeSource(api_client(master=api.url), NodeConfig(name=NODE), settings)
            proxier = Proxier(backend, netns=sb.node_ns)
            synced = Synced()
            proxier.hooks.on_synced.append(synced)
            loop = SyncLoop(source, proxier, min_sync_period=MIN_SYNC, sync_period=3600.0)
            opened.append((sb, loop))
            loop.start()
        except BaseException:
            sb.close()
            raise
        assert loop.wait_synced(DELIVERY_TIMEOUT), "the first sync never happened"
        assert synced.first_after(0, lambda s: True, timeout=DELIVERY_TIMEOUT) >= 0
        return Node(api, sb, loop, proxier, synced)

    yield build
    for sb, loop in opened:
        try:
            loop.stop()
        finally:
            sb.close()


def _endpoint_set(state: Any) -> set[str]:
    return {e.address for e in state.endpoints.get(spn("default", "web"), ())}


def _seed(api: FakeApiServer) -> None:
    api.apply(node(NODE, zone="zone-a", ips=["192.168.0.2"]))
    api.apply(service("web", SERVICE_IP, [("http", 80, "TCP")]))
    api.apply(endpoint_slice("web-a", "web", [EPS[0]], node_name=NODE))


@pytest.mark.kernel
@pytest.mark.parametrize("backend", ["nft", "iptables"])
def test_api_changes_reach_the_kernel_by_the_next_sync(api, kernel_node, backend):
    """Every kind of API change reaches the kernel through the sync it triggers (the periodic
    sync is an hour away): at most one sync that was already under way ends before it, and
    the loop never needs a third. The latencies are printed, not asserted (timing belongs in
    bench/; under load they say nothing about the code)."""
    _seed(api)
    n = kernel_node(backend)
    assert n.reach() == {f"{EPS[0]}:8080": 9}
    latencies = {}

    # Add a slice: both endpoints serve.
    latencies["slice added"] = n.change(
        endpoint_slice("web-b", "web", [EPS[1]], node_name="node-b"),
        lambda s: _endpoint_set(s) == {f"{EPS[0]}:8080", f"{EPS[1]}:8080"},
    )
    assert eventually(lambda: set(n.reach(16)) == {f"{EPS[0]}:8080", f"{EPS[1]}:8080"}, 30)

    # Modify a slice: its endpoint is replaced.
    latencies["slice modified"] = n.change(
        endpoint_slice("web-a", "web", [EPS[2]], node_name=NODE),
        lambda s: f"{EPS[2]}:8080" in _endpoint_set(s),
    )
    assert set(n.reach(16)) == {f"{EPS[1]}:8080", f"{EPS[2]}:8080"}

    # Node label: zone hints now pick the endpoint hinted for the new zone.
    api.apply(endpoint_slice("web-a", "web", [EPS[2]], node_name=NODE, zone_hints=["zone-a"]))
    latencies["hints added"] = n.change(
        endpoint_slice("web-b", "web", [EPS[1]], node_name="node-b", zone_hints=["zone-b"]),
        lambda s: all(e.zone_hints for e in s.endpoints.get(spn("default", "web"), ()))
        and len(_endpoint_set(s)) == 2,
    )
    assert set(n.reach(12)) == {f"{EPS[2]}:8080"}
    relabelled = api.get("Node", "", NODE)
    relabelled["metadata"]["labels"]["topology.kubernetes.io/zone"] = "zone-b"
    full_before = sum(1 for _, _, r in n.synced.records if r.kind == "full")
    latencies["node label"] = n.change(relabelled, lambda s: s.node.zone == "zone-b")
    assert set(n.reach(12)) == {f"{EPS[1]}:8080"}
    assert sum(1 for _, _, r in n.synced.records if r.kind == "full") > full_before

    # Modify the service: a new port.
    latencies["service modified"] = n.change(
        service("web", SERVICE_IP, [("http", 81, "TCP")]),
        lambda s: s.services.get(spn("default", "web")) is not None
        and s.services[spn("default", "web")].port == 81,
    )
    assert set(n.reach(6, port=81)) == {f"{EPS[1]}:8080"}
    # The old port: nothing rewrites it. iptables leaves it to the sink, which drops it; nft
    # rejects a cluster IP's unused port (kube-proxy's nftables mode, docs/semantics.md).
    assert set(n.reach(3, port=80)) == ({"refused"} if backend == "nft" else {"timeout"})

    # Delete the slices: the service has no endpoints and rejects.
    api.delete("EndpointSlice", "default", "web-a")
    latencies["slices deleted"] = n.change(
        lambda: api.delete("EndpointSlice", "default", "web-b"),
        lambda s: not _endpoint_set(s),
    )
    assert set(n.reach(4, port=81)) == {"refused"}

    # Delete the service: no rule for it any more.
    latencies["service deleted"] = n.change(
        lambda: api.delete("Service", "default", "web"),
        lambda s: spn("default", "web") not in s.services,
    )
    assert set(n.reach(3, port=81)) == {"timeout"}

    # Add a service: served again.
    api.apply(endpoint_slice("web-c", "web", [EPS[0]]))
    latencies["service added"] = n.change(
        service("web", SERVICE_IP, [("http", 80, "TCP")]),
        lambda s: _endpoint_set(s) == {f"{EPS[0]}:8080"},
    )
    assert set(n.reach(6)) == {f"{EPS[0]}:8080"}

    print(f"{backend} change-to-kernel latencies (s):",
          {k: round(v[0], 3) for k, v in latencies.items()})
    late = {k: v for k, v in latencies.items() if v[1] > 1}
    assert not late, f"changes that needed more than the sync they triggered: {late}"


@pytest.mark.kernel
def test_dropped_watch_changes_nothing_and_gone_relists_into_the_kernel(api, kernel_node):
    _seed(api)
    n = kernel_node("nft")
    time.sleep(MIN_SYNC + 0.2)  # let any start-up syncs settle
    syncs, dump = n.synced.count(), n.dump()
    lists = _lists(api)

    for i in range(1, 4):
        watches = api.count("services", watch=True)
        api.drop_watches()
        assert eventually(lambda: api.count("services", watch=True) > watches, 30)
    time.sleep(MIN_SYNC + 0.3)
    assert n.synced.count() == syncs, "a reconnect caused a sync"
    assert _lists(api) == lists, "a reconnect caused a relist"
    assert n.dump() == dump
    assert n.reach() == {f"{EPS[0]}:8080": 9}

    # 410 Gone: the missed changes come from the relist and reach the kernel.
    with api.paused():
        api.apply(endpoint_slice("web-a", "web", [EPS[1], EPS[2]], node_name=NODE))
        api.compact()
    latency = n.synced.first_after(
        time.monotonic() - 0.5,
        lambda s: _endpoint_set(s) == {f"{EPS[1]}:8080", f"{EPS[2]}:8080"},
        timeout=DELIVERY_TIMEOUT,
    )
    assert _lists(api)["endpointslices"] == lists["endpointslices"] + 1
    assert n.synced.records[-1][2].kind == "partial"
    assert set(n.reach(16)) == {f"{EPS[1]}:8080", f"{EPS[2]}:8080"}
    print(f"410 relist to kernel: {latency:.3f}s")


# --------------------------------------------------------------------------------------------
# ServiceCIDRs (networking.k8s.io/v1): the node's service ranges


def test_service_cidrs_are_listed_watched_and_relisted_after_gone(api, start_source):
    api.apply(service_cidr("kubernetes", ["10.96.0.0/16", "fd00:96::/112"]))
    source, notices = start_source()
    assert source.snapshot().state.node.service_cidrs == ("10.96.0.0/16", "fd00:96::/112")
    assert source.cache.counts()["ServiceCIDR"] == 1

    # A new range arrives by the watch; a status-only change is not a change.
    api.apply(service_cidr("extra", ["10.97.0.0/24"]))
    assert eventually(lambda: "10.97.0.0/24" in source.snapshot().state.node.service_cidrs)
    before = notices.count
    updated = service_cidr("extra", ["10.97.0.0/24"])
    updated["status"] = {"conditions": [{"type": "Ready", "status": "False"}]}
    api.apply(updated)
    watched = api.resource_version
    assert eventually(lambda: source.cache.counts()["ServiceCIDR"] == 2)
    assert notices.count == before, "a ServiceCIDR status change was reported as a change"

    # Deleted while the watch is behind and history compacted: 410, relist, converged.
    with api.paused():
        api.delete("ServiceCIDR", "", "extra")
        api.compact()
    assert eventually(lambda: source.snapshot().state.node.service_cidrs == ("10.96.0.0/16", "fd00:96::/112"))
    assert api.count("servicecidrs", watch=False) >= 2
    assert watched <= api.resource_version


def test_without_service_cidr_objects_the_flag_decides(api):
    source = KubeSource(api_client(master=api.url), NodeConfig(name=NODE, service_cidrs=("10.0.0.0/24",)), FAST)
    source.start(lambda: None)
    try:
        assert source.wait_ready(10)
        assert source.snapshot().state.node.service_cidrs == ("10.0.0.0/24",)
        api.apply(service_cidr("kubernetes", ["10.96.0.0/16"]))
        assert eventually(lambda: source.snapshot().state.node.service_cidrs == ("10.96.0.0/16",))
    finally:
        source.stop()


@pytest.mark.parametrize("label", ["service.kubernetes.io/service-proxy-name", "service.kubernetes.io/headless"])
def test_services_meant_for_another_proxy_get_no_rules_from_the_api(api, start_source, label):
    """kube-proxy's informers skip these Services (any value): so does the API source."""
    other = service("other", "10.96.0.20")
    other["metadata"].setdefault("labels", {})[label] = "someone-else"
    api.apply(other)
    api.apply(endpoint_slice("other-1", "other", ["10.244.0.7"]))
    api.apply(service("web", "10.96.0.10"))
    api.apply(endpoint_slice("web-1", "web", ["10.244.0.5"]))
    source, _ = start_source()
    services = source.snapshot().state.services
    assert spn("default", "web") in services
    assert spn("default", "other") not in services


def test_the_cache_keeps_no_managed_fields():
    """Server-side apply writes managedFields into every object; no rule reads them, and at
    10 000 services they were most of the API source's memory."""
    managed = [{"manager": "kubectl", "operation": "Apply", "fieldsType": "FieldsV1",
                "fieldsV1": {"f:spec": {"f:ports": {}}}}]
    cache = ObjectCache(NodeConfig(name=NODE))
    listed = service("a", "10.96.0.1")
    listed["metadata"]["managedFields"] = managed
    cache.replace(SERVICES, [listed])
    watched = service("b", "10.96.0.2")
    watched["metadata"]["managedFields"] = managed
    assert cache.apply(SERVICES, "ADDED", watched)
    # Services and slices are kept as parsed (docs/design.md, "The API source's memory"): no
    # JSON at all, managedFields or other.
    stored = cache._objects.values()
    assert len(stored) == 2 and all(type(o) is kube._Record for o in stored)
    assert not any(isinstance(e, dict) for o in stored for e in o.entries)
    assert listed["metadata"]["managedFields"] == managed, "the caller's object is not changed"
    assert set(cache.snapshot().state.services) == {spn("default", "a"), spn("default", "b")}
    # Only managedFields differ: no change.
    again = service("b", "10.96.0.2")
    again["metadata"]["managedFields"] = managed + managed
    assert not cache.apply(SERVICES, "MODIFIED", again)

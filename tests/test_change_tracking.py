"""Change tracking: the keys the sources say they touched, checked one by one, find exactly what a
whole-state diff finds, on random sequences of edits (hypothesis), and a proxier fed them ends
where a full sync of the same state would.

The sources are driven as the daemon drives them: the API source's object cache by watch events
and relists, the manifest source by files written, replaced and removed in a temporary
directory; each snapshot goes through a `ChangeTracker` exactly as `Proxier.sync` uses it, with
syncs that succeed, fail (the tracker is then not told) or are skipped at random.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from nfproxy.core.changes import NO_CHANGES, ChangeTracker, Touched, diff, verify
from nfproxy.core.model import ClusterState, Endpoint, IPFamily, sort_endpoints
from nfproxy.daemon.proxier import Proxier
from nfproxy.kernel.memory.nft import MemoryNft
from nfproxy.core.model import NodeConfig
from nfproxy.sources.files import ManifestSource
from nfproxy.sources.kube import ENDPOINT_SLICES, NODES, SERVICES, TRIGGER_TIME, ObjectCache
from nfproxy.testing import uniform_cluster
from tests.apiserver import endpoint_slice, node, service
from tests.test_proxier_memory import resolved

NODE = "node-a"
CONFIG = NodeConfig(name=NODE, cluster_cidrs=("10.244.0.0/16",))
NAMES = ("s0", "s1", "s2", "s3")
NAMESPACES = ("a", "default")


# --------------------------------------------------------------------------------------------
# A small universe of objects, with variants that change something and variants that do not


@st.composite
def services(draw: st.DrawFn) -> dict[str, Any]:
    name, namespace = draw(st.sampled_from(NAMES)), draw(st.sampled_from(NAMESPACES))
    ip = f"10.96.{NAMESPACES.index(namespace)}.{NAMES.index(name) + 1}"
    ports = draw(st.sampled_from(([("http", 80, "TCP")], [("http", 81, "TCP")],
                                  [("http", 80, "TCP"), ("dns", 53, "UDP")])))
    obj = service(name, ip, ports, namespace=namespace)
    if draw(st.booleans()):  # an annotation: a new object, the same rules
        obj["metadata"]["annotations"] = {"touched": str(draw(st.integers(0, 3)))}
    if draw(st.integers(0, 9)) == 0:
        obj["spec"]["sessionAffinity"] = "ClientIP"
    if namespace == "default" and draw(st.booleans()):
        obj["metadata"]["namespace"] = draw(st.sampled_from((None, "")))  # read as `default`
    return obj


@st.composite
def slices(draw: st.DrawFn) -> dict[str, Any]:
    namespace = draw(st.sampled_from(NAMESPACES))
    owner = draw(st.sampled_from(NAMES + ("nobody",)))
    addresses = draw(st.lists(st.sampled_from([f"10.244.0.{i}" for i in range(1, 5)]), max_size=3))
    obj = endpoint_slice(
        f"e{draw(st.integers(0, 4))}", owner, addresses, namespace=namespace,
        node_name=draw(st.sampled_from(("", NODE, "node-b"))),
        ready=draw(st.booleans()),
    )
    if draw(st.booleans()):
        obj["metadata"]["annotations"] = {"touched": str(draw(st.integers(0, 3)))}
    return obj


objects = st.one_of(services(), slices())


def _ident(obj: dict[str, Any]) -> tuple[str, str, str]:
    return (obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"])


class Syncs:
    """The proxier's use of the tracker, without a kernel: each sync that succeeds checks the
    tracked changes against the whole-state diff and moves the synced state on."""

    def __init__(self) -> None:
        self.tracker = ChangeTracker()
        self.synced: ClusterState | None = None
        self.checked = 0

    def snapshot(self, state: ClusterState, touched: Touched | None, outcome: str) -> None:
        self.tracker.add(state, touched)
        if outcome == "skip":
            return
        tracked = self.tracker.changes(self.synced, state)
        assert tracked == diff(self.synced, state)
        self.checked += 1
        if outcome == "ok":
            self.tracker.synced(state)
            self.synced = state


outcomes = st.sampled_from(("ok", "ok", "ok", "failed", "skip"))


# --------------------------------------------------------------------------------------------
# The API source's cache


api_steps = st.lists(
    st.one_of(
        st.tuples(st.just("event"), objects, st.sampled_from(("ADDED", "MODIFIED", "DELETED"))),
        st.tuples(st.just("relist"), st.lists(objects, max_size=8), st.none()),
        st.tuples(st.just("node"), st.sampled_from(("z1", "z2")), st.none()),
        st.tuples(st.just("peek"), st.none(), st.none()),  # snapshot() by someone else
        st.tuples(st.just("sync"), outcomes, st.none()),
    ),
    max_size=30,
)


@given(api_steps)
def test_api_cache_touched_keys_find_what_the_full_diff_finds(steps: list[tuple[Any, Any, Any]]) -> None:
    cache = ObjectCache(CONFIG)
    syncs = Syncs()
    for op, arg, event in steps + [("sync", "ok", None)]:
        if op == "event":
            kind = SERVICES if arg["kind"] == "Service" else ENDPOINT_SLICES
            cache.apply(kind, event, copy.deepcopy(arg))
        elif op == "relist":
            unique = {_ident(o): o for o in arg}
            for kind in (SERVICES, ENDPOINT_SLICES):
                cache.replace(kind, [copy.deepcopy(o) for o in unique.values() if o["kind"] == kind.kind])
        elif op == "node":
            cache.apply(NODES, "MODIFIED", node(NODE, zone=arg))
        elif op == "peek":
            cache.snapshot()
        else:
            result, touched = cache.snapshot_changes()
            syncs.snapshot(result.state, touched, arg)
    assert syncs.checked >= 1


def test_api_cache_reports_only_the_group_an_event_touched() -> None:
    cache = ObjectCache(CONFIG)
    cache.replace(SERVICES, [service(n, f"10.96.0.{i + 1}") for i, n in enumerate(NAMES)])
    cache.replace(ENDPOINT_SLICES, [endpoint_slice(f"{n}-1", n, ["10.244.0.1"]) for n in NAMES])
    first, _ = cache.snapshot_changes()
    changed = endpoint_slice("s1-1", "s1", ["10.244.0.1", "10.244.0.2"])
    cache.apply(ENDPOINT_SLICES, "MODIFIED", changed)
    second, touched = cache.snapshot_changes()
    assert touched.base is first.state
    assert {key[0].name for key in touched.keys} == {"s1"}
    changes = verify(first.state, second.state, touched.keys)
    assert not changes.services and {k[0].name for k in changes.endpoints} == {"s1"}
    # A new object that reads the same (an annotation, a resourceVersion): the cache keeps
    # objects as parsed, so nothing changed and nothing is touched.
    relabelled = copy.deepcopy(changed)
    relabelled["metadata"]["annotations"] = {"note": "x"}
    assert not cache.apply(ENDPOINT_SLICES, "MODIFIED", relabelled)
    same, touched = cache.snapshot_changes()
    assert same is second and touched.keys == frozenset()
    # A new trigger time (metrics read it, rules do not): touched, not changed.
    retriggered = copy.deepcopy(changed)
    retriggered["metadata"]["annotations"] = {TRIGGER_TIME: "2026-12-07T05:00:00Z"}
    assert cache.apply(ENDPOINT_SLICES, "MODIFIED", retriggered)
    third, touched = cache.snapshot_changes()
    assert third.state is not second.state and touched.keys
    assert verify(second.state, third.state, touched.keys) is NO_CHANGES
    # Nothing since: the same state, nothing touched.
    fourth, touched = cache.snapshot_changes()
    assert fourth is third and touched.keys == frozenset() and touched.base is third.state


# --------------------------------------------------------------------------------------------
# The manifest source


def _write(path: Path, docs: list[dict[str, Any]] | str) -> None:
    """Replace the file (a new inode, so the signature changes however fast the test runs)."""
    text = docs if isinstance(docs, str) else "\n---\n".join(json.dumps(d) for d in docs)
    tmp = path.with_name("." + path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


file_steps = st.lists(
    st.one_of(
        st.tuples(st.just("write"), st.integers(0, 2), st.lists(objects, max_size=6)),
        st.tuples(st.just("list"), st.integers(0, 2), st.lists(objects, max_size=6)),
        st.tuples(st.just("garbage"), st.integers(0, 2), st.none()),
        st.tuples(st.just("remove"), st.integers(0, 2), st.none()),
        st.tuples(st.just("sync"), outcomes, st.none()),
    ),
    max_size=14,
)


@settings(max_examples=40)
@given(file_steps)
def test_manifest_touched_keys_find_what_the_full_diff_finds(steps: list[tuple[Any, Any, Any]]) -> None:
    with tempfile.TemporaryDirectory(prefix="nfp-track-") as root:
        # Duplicate names across files are allowed on purpose: the first file's object wins.
        files = [Path(root) / f"{i}.yaml" for i in range(3)]
        _write(files[0], [service("s0", "10.96.0.1", namespace="a")])
        source = ManifestSource(root, CONFIG, empty_grace=0)
        syncs = Syncs()
        for op, arg, docs in steps + [("sync", "ok", None)]:
            if op == "sync":
                result, touched = source.snapshot_changes()
                syncs.snapshot(result.state, touched, arg)
                continue
            path = files[arg]
            if op == "write":
                _write(path, docs)
            elif op == "list":
                _write(path, [{"apiVersion": "v1", "kind": "List", "items": docs}])
            elif op == "garbage":
                _write(path, "kind: [unclosed")
            elif path.exists():
                path.unlink()
            source.rescan()
            source.rescan()  # read once it has held still for one poll
        assert syncs.checked >= 1


def test_manifest_source_reports_only_the_services_whose_objects_changed(tmp_path: Path) -> None:
    docs = [service(n, f"10.96.0.{i + 1}") for i, n in enumerate(NAMES)]
    docs += [endpoint_slice(f"{n}-1", n, ["10.244.0.1"]) for n in NAMES]
    _write(tmp_path / "all.yaml", docs)
    source = ManifestSource(tmp_path, CONFIG)
    first, touched = source.snapshot_changes()
    assert touched is None  # the first state: nothing to count from
    docs[5] = endpoint_slice("s1-1", "s1", ["10.244.0.1", "10.244.0.9"])
    _write(tmp_path / "all.yaml", docs)
    source.rescan()
    assert source.rescan()
    second, touched = source.snapshot_changes()
    assert touched is not None and touched.base is first.state
    assert {key[0].name for key in touched.keys} == {"s1"}
    assert verify(first.state, second.state, touched.keys) == diff(first.state, second.state)


# --------------------------------------------------------------------------------------------
# The proxier


def memory_proxier() -> tuple[Proxier, dict[IPFamily, MemoryNft]]:
    kernels: dict[IPFamily, MemoryNft] = {}
    return Proxier("nft", kernels=lambda f: kernels.setdefault(f, MemoryNft(f))), kernels


@settings(max_examples=30)
@given(st.lists(st.tuples(st.sampled_from(("event", "sync")), objects,
                          st.sampled_from(("ADDED", "MODIFIED", "DELETED"))), max_size=20))
def test_proxier_fed_touched_keys_ends_where_a_full_sync_does(steps: list[tuple[str, Any, str]]) -> None:
    cache = ObjectCache(CONFIG)
    cache.replace(SERVICES, [service(n, f"10.96.0.{i + 1}", namespace="a") for i, n in enumerate(NAMES)])
    cache.replace(ENDPOINT_SLICES, [])
    proxier, kernels = memory_proxier()
    result, touched = cache.snapshot_changes()
    proxier.sync(result.state, touched=touched)
    for op, obj, event in steps + [("sync", None, "")]:
        if op == "event":
            kind = SERVICES if obj["kind"] == "Service" else ENDPOINT_SLICES
            cache.apply(kind, event, copy.deepcopy(obj))
            continue
        result, touched = cache.snapshot_changes()
        sync = proxier.sync(result.state, touched=touched)
        assert sync.kind in ("partial", "noop")
        assert sync.changes == diff(proxier.state, result.state) or proxier.state is result.state
    if proxier.backend.pending():  # stale chains are deleted by a sync of their own, as the loop runs
        result, touched = cache.snapshot_changes()
        proxier.sync(result.state, touched=touched)
    reference, fresh_kernels = memory_proxier()
    reference.sync(proxier.state)
    # Slot numbers are the allocator's business: partial syncs and one full sync may differ.
    assert {f: resolved(k) for f, k in kernels.items()} == {f: resolved(k) for f, k in fresh_kernels.items()}


def test_an_equal_newly_built_snapshot_is_a_noop_checked_per_touched_key() -> None:
    """The no-op the bench times: one service's values rebuilt equal, its keys touched."""
    state = uniform_cluster(200, 3)
    proxier, _ = memory_proxier()
    proxier.sync(state)
    key = sorted(state.services)[17]
    rebuilt_eps = tuple(dataclasses.replace(e) for e in state.endpoints[key])
    services = dict(state.services)
    services[key] = dataclasses.replace(state.services[key])
    endpoints = dict(state.endpoints)
    endpoints[key] = sort_endpoints(list(rebuilt_eps))
    rebuilt = ClusterState(dataclasses.replace(state.node), services, endpoints)
    assert rebuilt == state and rebuilt.services[key] is not state.services[key]
    result = proxier.sync(rebuilt, touched=Touched(state, frozenset({key})))
    assert result.kind == "noop" and result.changes.empty
    assert proxier.state is rebuilt  # touched keys now count from the new snapshot
    # A real change next, touched: partial, and only that key.
    endpoints = dict(rebuilt.endpoints)
    endpoints[key] = sort_endpoints(list(rebuilt_eps) + [Endpoint("10.255.0.1", 8080)])
    changed = ClusterState(rebuilt.node, rebuilt.services, endpoints)
    result = proxier.sync(changed, touched=Touched(rebuilt, frozenset({key})))
    assert result.kind == "partial" and result.changes.endpoints == {key}


def test_a_broken_chain_falls_back_to_the_full_diff() -> None:
    state = uniform_cluster(20, 2)
    keys = sorted(state.services)
    tracker = ChangeTracker()
    tracker.add(state, None)
    tracker.synced(state)
    endpoints = dict(state.endpoints)
    endpoints[keys[3]] = ()
    missed = ClusterState(state.node, state.services, endpoints)
    # Touched from a snapshot the tracker never saw: its keys cannot be trusted.
    tracker.add(missed, Touched(uniform_cluster(20, 2), frozenset({keys[5]})))
    assert not tracker.tracking
    assert tracker.changes(state, missed).endpoints == {keys[3]}


def test_a_duplicate_slice_in_another_file_is_touched_with_the_one_that_changed(tmp_path: Path) -> None:
    """Two files define slice `e` (for different Services): the first file's wins. When it goes,
    the other file's takes over, so its Service changes too though its file did not."""
    _write(tmp_path / "0.yaml", [service("s1", "10.96.0.1"), endpoint_slice("e", "s1", ["10.244.0.1"])])
    _write(tmp_path / "1.yaml", [service("s2", "10.96.0.2"), endpoint_slice("e", "s2", ["10.244.0.2"])])
    source = ManifestSource(tmp_path, CONFIG)
    first, _ = source.snapshot_changes()
    assert {k[0].name for k in first.state.endpoints} == {"s1"}
    _write(tmp_path / "0.yaml", [service("s1", "10.96.0.1")])
    source.rescan()
    source.rescan()
    second, touched = source.snapshot_changes()
    assert {k[0].name for k in second.state.endpoints} == {"s2"}
    assert verify(first.state, second.state, touched.keys) == diff(first.state, second.state)


def test_the_sync_loop_passes_touched_keys_and_partial_syncs_never_diff_whole_states(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """The hot path: a loop over a tracking source syncs changes with no whole-state diff."""
    from nfproxy.core import changes as changes_module
    from nfproxy.daemon import proxier as proxier_module
    from nfproxy.daemon.proxier import SyncLoop

    docs = [service(n, f"10.96.0.{i + 1}") for i, n in enumerate(NAMES)]
    docs += [endpoint_slice(f"{n}-1", n, ["10.244.0.1"]) for n in NAMES]
    _write(tmp_path / "all.yaml", docs)
    source = ManifestSource(tmp_path, CONFIG)
    proxier, _ = memory_proxier()
    loop = SyncLoop(source, proxier, min_sync_period=0)
    assert loop.run_once().kind == "full"  # the first sync: a full diff, as ever

    def no_diff(*_: object) -> None:
        raise AssertionError("a whole-state diff on a partial sync")

    monkeypatch.setattr(proxier_module, "diff", no_diff)
    monkeypatch.setattr(changes_module, "diff", no_diff)
    docs[5] = endpoint_slice("s1-1", "s1", ["10.244.0.1", "10.244.0.9"])
    _write(tmp_path / "all.yaml", docs)
    source.rescan()
    source.rescan()
    result, touched = proxier_module._take(source)  # what the loop's thread does
    sync = proxier.sync(result.state, touched=touched)
    assert sync.kind == "partial" and {k[0].name for k in sync.changes.endpoints} == {"s1"}
    again, touched = proxier_module._take(source)
    assert proxier.sync(again.state, touched=touched).kind == "noop"


def test_a_service_with_a_null_namespace_is_tracked_as_in_default(tmp_path: Path) -> None:
    svc = service("s0", "10.96.0.1")
    svc["metadata"]["namespace"] = None
    _write(tmp_path / "0.yaml", [svc])
    source = ManifestSource(tmp_path, CONFIG)
    first, _ = source.snapshot_changes()
    svc["spec"]["ports"][0]["port"] = 81
    _write(tmp_path / "0.yaml", [svc])
    source.rescan()
    source.rescan()
    second, touched = source.snapshot_changes()
    assert diff(first.state, second.state).services
    assert verify(first.state, second.state, touched.keys) == diff(first.state, second.state)

"""Bad input and faults never cost live services (issue J, points 1, 4 and 6).

Logic tests drive `ManifestSource.rescan()` by hand with a fake clock, so nothing here waits on
time. The kernel tests run a real daemon (and real commands) in throwaway namespaces and wait on
conditions only: a poll of the watcher completed, a sync recorded, a line printed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from nfproxy.core.model import NodeConfig
from nfproxy.daemon.metrics import ProxyMetrics
from nfproxy.kernel import lock
from nfproxy.sources.files import ManifestSource

ROOT = Path(__file__).resolve().parent.parent


def service_yaml(name: str, cluster_ip: str, endpoints: list[str]) -> str:
    objects: list[dict[str, Any]] = [
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"clusterIP": cluster_ip, "ports": [{"name": "http", "port": 80, "protocol": "TCP"}]},
        },
        {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": f"{name}-1",
                "namespace": "default",
                "labels": {"kubernetes.io/service-name": name},
            },
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
            "endpoints": [{"addresses": [ip], "conditions": {"ready": True}} for ip in endpoints],
        },
    ]
    return yaml.safe_dump_all(objects)


A = service_yaml("a", "10.96.0.10", ["10.244.1.1", "10.244.1.2"])
A_FIXED = service_yaml("a", "10.96.0.10", ["10.244.1.1", "10.244.1.2", "10.244.1.3"])
B = service_yaml("b", "10.96.0.11", ["10.244.2.1"])


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "manifests"
    root.mkdir()
    (root / "a.yaml").write_text(A)
    (root / "b.yaml").write_text(B)
    return root


def settle(source: ManifestSource) -> bool:
    """Two looks, as two polls: a changed file is read once it has held still for one poll."""
    first = source.rescan()
    return source.rescan() or first


def names(source: ManifestSource) -> list[str]:
    return sorted({key[0].name for key in source.snapshot().state.services})


def endpoint_count(source: ManifestSource, name: str) -> int:
    state = source.snapshot().state
    return sum(len(eps) for key, eps in state.endpoints.items() if key[0].name == name)


# Each fault turns `a.yaml` into something that must not replace its objects.
def _empty(path: Path) -> None:
    path.write_text("")


def _comment(path: Path) -> None:
    path.write_text("# being rewritten\n")


def _garbage(path: Path) -> None:
    path.write_text("apiVersion: v1\nkind: Service\nmetadata: {name: a, namespace: def")


def _scalar(path: Path) -> None:
    path.write_text("just some text\n")


def _binary(path: Path) -> None:
    path.write_bytes(b"\xff\xfe\x00garbage")


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _dev_zero(path: Path) -> None:
    path.unlink()
    path.symlink_to("/dev/zero")


def _loop(path: Path) -> None:
    path.unlink()
    other = path.with_name("a.loop")  # not a manifest name: only a.yaml is read
    path.symlink_to(other)
    other.symlink_to(path)


def _too_big(path: Path) -> None:
    path.write_text(A + "#" * 5000 + "\n")


def _cut_inside_an_object(path: Path) -> None:
    # safe_dump sorts keys: the slice's first line alone is a mapping without a kind.
    text = path.read_text()
    path.write_text(text[: text.index("addressType: IPv4") + len("addressType: IPv4\n")])


def _overwritten(path: Path) -> None:
    path.write_text("foo: bar\n")


def _empty_list(path: Path) -> None:
    path.write_text("apiVersion: v1\nkind: List\nitems: []\n")


FAULTS: dict[str, tuple[Callable[[Path], None], str]] = {
    "cut inside an object": (_cut_inside_an_object, "1 new problem in its objects, and EndpointSlice default/a-1 it held is gone"),
    "overwritten by something else": (
        _overwritten, "1 new problem in its objects, and EndpointSlice default/a-1, Service default/a it held are gone"
    ),
    "an empty List": (_empty_list, "holds no Kubernetes object"),
    "emptied": (_empty, "holds no Kubernetes object"),
    "comment only": (_comment, "holds no Kubernetes object"),
    "half-written": (_garbage, "invalid YAML"),
    "a scalar": (_scalar, "holds no Kubernetes object"),
    "not UTF-8": (_binary, "not UTF-8"),
    "a FIFO": (_fifo, "a FIFO, not a regular file"),
    "a /dev/zero symlink": (_dev_zero, "a character device, not a regular file"),
    "a symlink loop": (_loop, "symlink loop"),
    "over the size cap": (_too_big, "larger than the 4096-byte limit"),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_bad_file_keeps_its_last_good_objects(
    tree: Path, fault: str, caplog: pytest.LogCaptureFixture
) -> None:
    source = ManifestSource(tree, max_bytes=4096, clock=Clock())
    errors: list[str] = []
    source.on_error.append(errors.append)
    before = source.snapshot().state
    assert names(source) == ["a", "b"]

    damage, message = FAULTS[fault]
    damage(tree / "a.yaml")
    with caplog.at_level(logging.WARNING, logger="nfproxy.sources.files"):
        assert settle(source) is False
    assert source.snapshot().state == before
    warning = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(str(tree / "a.yaml") in w and message in w and "keeping its last good" in w for w in warning), warning
    assert errors == ["manifests"]
    (problem,) = source.problems().items()
    assert problem[0].startswith(str(tree / "a.yaml")) and message in problem[1]
    assert any("last good objects are kept" in e.message for e in source.snapshot().errors)

    # Nothing new: no second warning, no second count.
    caplog.clear()
    assert settle(source) is False
    assert errors == ["manifests"] and not caplog.records

    # The fix is applied at once, and is the only change.
    (tree / "a.yaml").unlink()
    (tree / "a.yaml").write_text(A_FIXED)
    assert settle(source) is True
    assert names(source) == ["a", "b"] and endpoint_count(source, "a") == 3
    assert source.problems() == {}


def test_a_file_cut_between_objects_is_applied_and_says_what_went(
    tree: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Cut at a document boundary, a file is valid and cannot be told from an edit: it is
    applied, and the log names what it no longer holds."""
    source = ManifestSource(tree, clock=Clock())
    (tree / "a.yaml").write_text(A.split("---")[0])  # the Service without its EndpointSlice
    with caplog.at_level(logging.INFO, logger="nfproxy.sources.files"):
        assert settle(source) is True
    assert endpoint_count(source, "a") == 0
    assert any(
        r.getMessage() == f"{tree / 'a.yaml'} no longer holds EndpointSlice default/a-1" for r in caplog.records
    ), [r.getMessage() for r in caplog.records]


def test_a_service_edited_into_an_invalid_one_is_kept(tree: Path, caplog: pytest.LogCaptureFixture) -> None:
    """An edit that breaks a Service does not remove it: the file keeps its last good objects
    (and the edit's other changes wait for the fix), with the object's error in the log."""
    source = ManifestSource(tree, clock=Clock())
    before = source.snapshot().state
    (tree / "a.yaml").write_text(A_FIXED.replace("port: 80\n", "port: 80000\n", 1))
    with caplog.at_level(logging.WARNING, logger="nfproxy.sources.files"):
        assert settle(source) is False
    assert source.snapshot().state == before
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("skipped: ") and "Service default/a" in m and "80000" in m for m in messages), messages
    assert any("1 new problem in its objects, and EndpointSlice default/a-1, Service default/a it held are changed" in m for m in messages), messages
    (tree / "a.yaml").write_text(A_FIXED)
    assert settle(source) is True and endpoint_count(source, "a") == 3


def test_a_problem_the_file_already_had_does_not_hold_up_its_other_edits(tree: Path) -> None:
    broken = service_yaml("c", "10.96.0.12", ["10.244.3.1"]).replace("port: 80\n", "port: 0\n", 1)
    (tree / "a.yaml").write_text(A + "---\n" + broken)
    source = ManifestSource(tree, clock=Clock())
    assert names(source) == ["a", "b"]
    (tree / "a.yaml").write_text(A_FIXED + "---\n" + broken)
    assert settle(source) is True and endpoint_count(source, "a") == 3
    assert source.problems() == {}


def _refusing(monkeypatch: pytest.MonkeyPatch, where: Path, code: int) -> None:
    """os.walk cannot list `where` (as without read permission, or out of file descriptors)."""
    scandir = os.scandir

    def refuse(path: Any = ".") -> Any:
        if Path(path) == where:
            raise OSError(code, os.strerror(code), str(path))
        return scandir(path)

    monkeypatch.setattr(os, "scandir", refuse)


@pytest.mark.parametrize("code", [13, 24], ids=["EACCES", "EMFILE"])
@pytest.mark.parametrize("unlistable", ["the directory", "a subdirectory"])
def test_a_directory_that_cannot_be_listed_keeps_its_files_objects(
    tree: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, unlistable: str, code: int
) -> None:
    (tree / "sub").mkdir()
    (tree / "b.yaml").rename(tree / "sub" / "b.yaml")
    source = ManifestSource(tree, clock=Clock())
    errors: list[str] = []
    source.on_error.append(errors.append)
    before = source.snapshot().state
    assert names(source) == ["a", "b"]

    where = tree if unlistable == "the directory" else tree / "sub"
    _refusing(monkeypatch, where, code)
    with caplog.at_level(logging.INFO, logger="nfproxy.sources.files"):
        assert settle(source) is False
        assert settle(source) is False  # a second look says nothing new
    assert source.snapshot().state == before
    messages = [r.getMessage() for r in caplog.records]
    assert [m for m in messages if "cannot list" in m] == [
        f"{where}: cannot list: {os.strerror(code)}; keeping the last good objects of the files below it"
    ], messages
    assert not any("removed" in m or "no longer holds" in m for m in messages), messages
    assert errors == ["manifests"]
    assert str(where) in source.problems()

    monkeypatch.undo()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="nfproxy.sources.files"):
        assert settle(source) is False
    assert [r.getMessage() for r in caplog.records] == [f"{where} can be listed again"]
    assert source.problems() == {}
    (tree / "sub" / "b.yaml").unlink()  # a deletion seen through a listing is still one
    assert settle(source) is True and names(source) == ["a"]


def test_a_command_stops_on_a_directory_it_cannot_list(tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from nfproxy.sources.manifests import UnsafeFile, load

    (tree / "sub").mkdir()
    _refusing(monkeypatch, tree / "sub", 13)
    with pytest.raises(UnsafeFile, match=f"^{tree / 'sub'}: cannot list: Permission denied$"):
        load(tree)


def test_a_file_is_read_once_it_has_held_still_for_a_poll(tree: Path) -> None:
    source = ManifestSource(tree, clock=Clock())
    (tree / "a.yaml").write_text(A.split("---")[0])  # the first half of a rewrite in place
    assert source.rescan() is False and endpoint_count(source, "a") == 2
    (tree / "a.yaml").write_text(A_FIXED)  # the writer goes on: still not read
    assert source.rescan() is False and endpoint_count(source, "a") == 2
    assert source.rescan() is True and endpoint_count(source, "a") == 3


def test_every_file_emptied_keeps_every_service(tree: Path) -> None:
    source = ManifestSource(tree, clock=Clock())
    before = source.snapshot().state
    (tree / "a.yaml").write_text("")
    (tree / "b.yaml").write_text("# nothing\n")
    assert settle(source) is False
    assert source.snapshot().state == before
    assert sorted(Path(p).name for p in source.problems()) == ["a.yaml", "b.yaml"]


def test_a_deleted_file_takes_its_objects_with_it(tree: Path) -> None:
    source = ManifestSource(tree, clock=Clock())
    (tree / "b.yaml").unlink()
    assert settle(source) is True
    assert names(source) == ["a"]


def test_a_new_bad_file_is_reported_and_the_rest_kept(tree: Path) -> None:
    source = ManifestSource(tree, clock=Clock())
    errors: list[str] = []
    source.on_error.append(errors.append)
    before = source.snapshot().state
    os.mkfifo(tree / "pipe.yaml")
    (tree / "zero.json").symlink_to("/dev/zero")
    (tree / "new.yaml").write_text("")  # a file being created: nothing to keep, not an error
    assert settle(source) is False
    assert source.snapshot().state == before
    assert sorted(Path(p).name for p in source.problems()) == ["pipe.yaml", "zero.json"]
    assert errors == ["manifests", "manifests"]


def test_an_empty_source_is_applied_only_after_the_grace(tree: Path, caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    source = ManifestSource(tree, empty_grace=30.0, clock=clock)
    errors: list[str] = []
    source.on_error.append(errors.append)
    before = source.snapshot().state
    (tree / "a.yaml").unlink()
    (tree / "b.yaml").unlink()
    with caplog.at_level(logging.WARNING, logger="nfproxy.sources.files"):
        assert settle(source) is False
        clock.now = 29.9
        assert settle(source) is False
        assert source.snapshot().state == before
        assert errors == ["manifests"]
        assert any("no service at all" in r.getMessage() for r in caplog.records)
        clock.now = 30.0
        assert settle(source) is True
    assert names(source) == []
    assert any("removing every service" in r.getMessage() for r in caplog.records)
    # Once applied, it stays applied without further warnings.
    clock.now = 100.0
    assert settle(source) is False and errors == ["manifests"]


def test_services_back_within_the_grace_cancel_the_empty_state(tree: Path) -> None:
    clock = Clock()
    source = ManifestSource(tree, empty_grace=30.0, clock=clock)
    (tree / "a.yaml").unlink()
    (tree / "b.yaml").unlink()
    assert settle(source) is False
    clock.now = 20.0
    (tree / "b.yaml").write_text(B)
    assert settle(source) is True
    assert names(source) == ["b"]
    # The grace starts again from zero for the next empty spell.
    (tree / "b.yaml").unlink()
    clock.now = 40.0
    assert settle(source) is False
    clock.now = 69.9
    assert settle(source) is False and names(source) == ["b"]
    clock.now = 70.0
    assert settle(source) is True and names(source) == []


@pytest.mark.parametrize("given", ["directory", "file"])
def test_a_vanished_path_never_means_no_services(tmp_path: Path, tree: Path, given: str) -> None:
    clock = Clock()
    path = tree if given == "directory" else tree / "a.yaml"
    source = ManifestSource(path, empty_grace=1.0, clock=clock)
    errors: list[str] = []
    source.on_error.append(errors.append)
    before = source.snapshot().state
    assert before.services
    moved = tmp_path / "moved-away"
    path.rename(moved)
    for step in range(5):
        clock.now = 1000.0 * (step + 1)
        assert settle(source) is False
    assert source.snapshot().state == before
    assert errors == ["manifests"]
    assert "vanished" in source.problems()[str(path)]
    moved.rename(path)
    assert settle(source) is False  # back as it was: nothing changed
    assert source.snapshot().state == before and source.problems() == {}


def test_a_source_with_nothing_good_yet_is_not_ready(tree: Path) -> None:
    (tree / "a.yaml").write_text("")
    (tree / "b.yaml").write_text("{{{")
    source = ManifestSource(tree, clock=Clock())
    assert not source.ready()
    (tree / "b.yaml").write_text(B)
    assert settle(source) is True and source.ready() and names(source) == ["b"]


def test_a_fifo_never_freezes_the_watcher(tree: Path) -> None:
    source = ManifestSource(tree, poll=0.01, clock=Clock())
    changed = threading.Event()
    source.start(changed.set)
    try:
        os.mkfifo(tree / "pipe.yaml")
        (tree / "c.yaml").symlink_to("/dev/zero")
        assert source.wait_polled(30)
        assert not changed.is_set()
        (tree / "b.yaml").unlink()
        assert changed.wait(30), "the watcher stopped applying changes"
        assert names(source) == ["a"]
    finally:
        source.stop()


def test_a_failure_while_reading_never_ends_the_watcher(
    tree: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Whatever a look at the files raises (a bug, a resource running out), the last state
    stays and the next poll looks again: one WARNING per distinct failure, counted."""
    source = ManifestSource(tree, poll=0.01, clock=Clock())
    errors: list[str] = []
    source.on_error.append(errors.append)
    rescan = source.rescan
    failures = iter([RecursionError("maximum recursion depth exceeded")] * 5)

    def flaky() -> bool:
        exc = next(failures, None)
        if exc is not None:
            raise exc
        return rescan()

    monkeypatch.setattr(source, "rescan", flaky)
    changed = threading.Event()
    with caplog.at_level(logging.INFO, logger="nfproxy.sources.files"):
        source.start(changed.set)
        try:
            (tree / "b.yaml").unlink()
            assert changed.wait(30), "the watcher stopped after a failure"
            assert names(source) == ["a"]
        finally:
            source.stop()
    messages = [r.getMessage() for r in caplog.records]
    failed = [m for m in messages if "reading the manifests failed" in m]
    assert failed == [
        f"{tree}: reading the manifests failed (RecursionError: maximum recursion depth exceeded); keeping the last good state"
    ], messages
    assert f"{tree} can be read again" in messages
    assert errors == ["manifests"]


def test_source_errors_are_counted_under_their_source() -> None:
    metrics = ProxyMetrics(process_metrics=False)
    metrics.source_error("manifests")
    metrics.source_error("manifests")
    metrics.source_error("api")
    get = metrics.registry.get_sample_value
    assert get("nfproxy_source_errors_total", {"source": "manifests"}) == 2
    assert get("nfproxy_source_errors_total", {"source": "api"}) == 1


# --------------------------------------------------------------------------------------------
# One owner per namespace (J.4): the lock itself, without root


def test_the_owner_lock_admits_one_holder_per_namespace_and_backend(tmp_path: Path) -> None:
    first = lock.acquire("nft", None, str(tmp_path))
    try:
        with pytest.raises(lock.NamespaceTaken) as caught:
            lock.acquire("nft", None, str(tmp_path))
        message = str(caught.value)
        assert f"pid {os.getpid()}" in message and "nft backend" in message and first.path in message
        other = lock.acquire("iptables", None, str(tmp_path))  # another backend: another key
        other.release()
    finally:
        first.release()
    again = lock.acquire("nft", None, str(tmp_path))
    again.release()
    assert list(tmp_path.iterdir()) == []


def test_the_owner_lock_is_held_across_processes_and_freed_by_death(tmp_path: Path) -> None:
    import multiprocessing

    ctx = multiprocessing.get_context("fork")  # not a new interpreter: see conftest.run_cli_forked
    held, stop = ctx.Event(), ctx.Event()

    def hold() -> None:
        lock.acquire("nft", None, str(tmp_path))
        held.set()
        stop.wait(60)

    holder = ctx.Process(target=hold)
    holder.start()
    try:
        assert held.wait(30), "the holder never took the lock"
        with pytest.raises(lock.NamespaceTaken, match=f"pid {holder.pid}"):
            lock.acquire("nft", None, str(tmp_path))
    finally:
        holder.kill()
        holder.join()
    lock.acquire("nft", None, str(tmp_path)).release()


def test_the_lock_key_is_the_namespace_not_its_name() -> None:
    assert lock.namespace_key(None) == f"netns-{os.stat('/proc/self/ns/net').st_ino}"


# --------------------------------------------------------------------------------------------
# The API source: an empty relist after an outage is held the same way


@contextlib.contextmanager
def _kube_source(grace: float) -> Iterator[Any]:
    from nfproxy.sources.kube import KubeSource, WatchSettings, api_client
    from tests.apiserver import FakeApiServer, endpoint_slice, service

    settings = WatchSettings(
        watch_timeout=5, connect_timeout=1.0, watch_read_margin=3.0, list_timeout=3.0,
        backoff_initial=0.05, backoff_max=0.2, min_watch_seconds=0.2, empty_grace=grace,
    )
    with FakeApiServer(bookmark_interval=0.2) as api:
        api.apply(service("web", "10.96.0.10"))
        api.apply(endpoint_slice("web-1", "web", ["10.244.0.5"]))
        source = KubeSource(api_client(master=api.url), NodeConfig(name="node-a"), settings)
        errors: list[str] = []
        source.on_error.append(errors.append)
        source.start(lambda: None)
        try:
            assert source.wait_ready(10)
            assert source.snapshot().state.services
            # An outage, and the server comes back with an empty store (restored from an old
            # backup, say) and no history: the resumed watches get 410 Gone and relist.
            api.stop()
            api.delete("Service", "default", "web")
            api.delete("EndpointSlice", "default", "web-1")
            api.compact()
            api.start()
            yield api, source, errors
        finally:
            source.stop()


def test_an_empty_relist_keeps_the_services_within_the_grace() -> None:
    from tests.apiserver import service

    with _kube_source(grace=3600.0) as (api, source, errors):
        before = source.snapshot().state
        # Three empty relists of services seen: the copy is still what it was.
        assert api.wait_for(lambda: api.count("services", watch=False) >= 4, timeout=30)
        assert source.snapshot().state == before
        assert errors and set(errors) == {"api"}
        # The server fills up again: the relist that finds them resumes normal service.
        api.apply(service("web", "10.96.0.10", [("http", 8443, "TCP")]))
        assert api.wait_for(
            lambda: any(sp.port == 8443 for sp in source.snapshot().state.services.values()), timeout=30
        )


def test_an_empty_relist_is_applied_once_it_stays_empty_for_the_grace() -> None:
    with _kube_source(grace=0.3) as (api, source, errors):
        assert api.wait_for(lambda: not source.snapshot().state.services, timeout=30)
        assert errors


# --------------------------------------------------------------------------------------------
# Kernel: the daemon through every fault, with traffic (J "Done means" 1)

NODE = NodeConfig(name="node-a", ips=("192.168.0.2",), cluster_cidrs=("10.244.0.0/16",))
SERVICES = {"10.96.0.10": "a", "10.96.0.11": "b"}


def _replace_tree(tree: Path, files: dict[str, str]) -> None:
    """Put a complete directory in place in one rename, so no poll sees half of it."""
    staging = tree.with_name(tree.name + ".new")
    staging.mkdir()
    for name, text in files.items():
        (staging / name).write_text(text)
    staging.rename(tree)


def replace_file(path: Path, text: str) -> None:
    """Each fault in one step (write aside, rename over), so each is seen, and counted, once."""
    aside = path.with_name("." + path.name + ".tmp")
    aside.write_text(text)
    aside.rename(path)


@pytest.mark.kernel
@pytest.mark.parametrize("backend", ["nft", "iptables"])
def test_the_daemon_serves_every_service_through_every_fault(tmp_path: Path, backend: str, netns: str) -> None:  # noqa: ARG001 - the fixture asserts root
    from nfproxy.daemon.node import Daemon, DaemonConfig
    from nfproxy.daemon.proxier import SyncResult
    from nfproxy.verify.sandbox import Sandbox, SandboxSpec

    tree = tmp_path / "manifests"
    _replace_tree(tree, {"a.yaml": A, "b.yaml": B})
    spec = SandboxSpec.of(
        node_ips=["192.168.0.2"],
        clients={"pod": "10.244.5.5"},
        endpoints={ip: [(8080, "tcp")] for ip in ("10.244.1.1", "10.244.1.2", "10.244.1.3", "10.244.2.1")},
    )
    synced: list[SyncResult] = []
    cond = threading.Condition()

    def record(_previous: object, _state: object, result: SyncResult) -> None:
        if result.kind != "noop":
            with cond:
                synced.append(result)
                cond.notify_all()

    def syncs_reach(n: int) -> bool:
        with cond:
            return cond.wait_for(lambda: len(synced) >= n, 60)

    with Sandbox(spec) as sb:
        source = ManifestSource(tree, NODE, poll=0.02, empty_grace=3600.0)
        daemon = Daemon(source, DaemonConfig(backend, netns=sb.node_ns, min_sync_period=0.02,
                                             healthz_bind_address="", metrics_bind_address="",
                                             conntrack=False))
        daemon.proxier.hooks.on_synced.append(record)
        daemon.start()
        try:
            assert syncs_reach(1) and daemon.loop.wait_synced(60)
            assert [r.kind for r in synced] == ["full"]
            with sb.open("pod", "10.96.0.10", 80, "tcp", timeout=10) as held:
                first = held.exchange()
                assert first.ok, first

                def every_service_serves(step: str) -> None:
                    again = held.exchange()
                    assert again.ok and again.endpoint == first.endpoint, (step, again)
                    for ip, name in SERVICES.items():
                        outcomes = sb.connect("pod", ip, 80, "tcp", 4, timeout=10)
                        assert all(o.ok for o in outcomes), (step, name, outcomes)

                def fifo() -> None:
                    os.mkfifo(tree / "pipe.yaml")
                    (tree / "zero.yaml").symlink_to("/dev/zero")

                faults: list[tuple[str, Callable[[], None], set[str]]] = [
                    ("one file emptied", lambda: (tree / "a.yaml").write_text(""), {"a.yaml"}),
                    ("every file emptied", lambda: replace_file(tree / "b.yaml", "# later\n"), {"a.yaml", "b.yaml"}),
                    ("a file replaced by garbage", lambda: replace_file(tree / "a.yaml", "kind: [Serv"), {"a.yaml", "b.yaml"}),
                    ("a FIFO and a /dev/zero symlink dropped in", fifo, {"a.yaml", "b.yaml", "pipe.yaml", "zero.yaml"}),
                    # Renamed away, then deleted: the path vanishes in one step. (A plain
                    # `rm -rf` is covered too, but only while it unlinks faster than a poll.)
                    ("the directory removed", lambda: shutil.rmtree(tree.rename(tmp_path / "gone")), {"manifests"}),
                ]
                for step, fault, problems in faults:
                    fault()
                    assert source.wait_polled(60), step
                    assert {Path(p.split(":")[0]).name for p in source.problems()} == problems, (step, source.problems())
                    every_service_serves(step)
                    assert daemon.loop.wait_synced(60)
                    assert len(synced) == 1, (step, synced)

                # The fix (with one real change: a third endpoint for a) is one partial sync.
                _replace_tree(tree, {"a.yaml": A_FIXED, "b.yaml": B})
                assert syncs_reach(2)
                assert source.wait_polled(60) and daemon.loop.wait_synced(60)
                assert len(synced) == 2 and synced[1].kind == "partial", synced
                assert synced[1].services_changed == 0 and synced[1].endpoints_changed == 1, synced[1]
                assert source.problems() == {}
                every_service_serves("after the fix")
            errors = daemon.metrics.registry.get_sample_value("nfproxy_source_errors_total", {"source": "manifests"})
            # One per problem seen: a emptied, b emptied, a garbage, the FIFO, /dev/zero, the directory.
            assert errors == 6, errors
        finally:
            daemon.stop()


# --------------------------------------------------------------------------------------------
# Kernel: one owner per namespace (J.4)

EXAMPLES = ROOT / "examples"


def _nfproxy(*argv: str) -> list[str]:
    return [sys.executable, "-m", "nfproxy.cli.main", *argv]


def _wait(predicate: Callable[[], bool], timeout: float = 60.0) -> bool:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


@pytest.mark.kernel
@pytest.mark.parametrize("backend", ["nft", "iptables"])
def test_a_second_daemon_on_the_namespace_exits_1_and_touches_nothing(netns: str, backend: str) -> None:
    from nfproxy.kernel.process import run

    def rules() -> str:
        if backend == "nft":
            return run(["nft", "list", "ruleset"], netns=netns)
        text = run(["iptables-save"], netns=netns)
        return "\n".join(line for line in text.splitlines() if not line.startswith("#"))

    daemon = _nfproxy("--backend", backend, "--manifests", str(EXAMPLES), "--healthz-bind-address", "",
                      "--metrics-bind-address", "", "--min-sync-period", "100ms", "--v=2")
    first = subprocess.Popen([*daemon, "--netns", netns], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, cwd=ROOT)
    log: list[str] = []
    reader = threading.Thread(target=lambda: log.extend(iter(first.stderr.readline, "")), daemon=True)  # type: ignore[union-attr]
    reader.start()
    try:
        assert _wait(lambda: any('kind="full"' in line for line in log)), "".join(log)
        before = rules()
        # By name, and from inside the namespace without --netns: the same namespace both times.
        for argv in ([*daemon, "--netns", netns], ["ip", "netns", "exec", netns, *daemon]):
            second = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=ROOT)
            assert second.returncode == 1, second.stderr
            assert f"another nfproxy (pid {first.pid}) already programs" in second.stderr, second.stderr
            assert f"with the {backend} backend" in second.stderr and "Traceback" not in second.stderr
        assert first.poll() is None, "the first daemon must keep running"
        after = rules()
        assert after == before
        if backend == "iptables":
            jumps = [l for l in after.splitlines() if l.startswith("-A PREROUTING") and "KUBE-SERVICES" in l]
            assert len(jumps) == 1, jumps
    finally:
        first.terminate()
        first.wait(timeout=30)
        reader.join(30)
    assert first.returncode == 0, "".join(log)


# --------------------------------------------------------------------------------------------
# Kernel: throwaway namespaces never leak (J.6)

# The command's kernel step is made to wait on a FIFO nobody writes, after it announced its
# namespace: the signal then always lands inside the namespace's lifetime, never by timing.
_BLOCKED = """
import sys
from nfproxy.verify import {module} as target
real = target.{function}
def blocked(*args):
    print("inside", flush=True)
    open(sys.argv[1]).read()
    return real(*args)
target.{function} = blocked
for name, step in list(getattr(target, "APPLY", {{}}).items()):  # the backends' table of steps
    if step is real:
        target.APPLY[name] = blocked
from nfproxy.cli.main import main
sys.exit(main(sys.argv[2:]))
"""


def _made_by(pid: int) -> set[str]:
    from nfproxy.kernel import netns as netns_mod

    return {n for n in netns_mod.netns.listnetns() if f"-{pid}-" in n}


def _interrupt(tmp_path: Path, sig: signal.Signals, module: str, function: str, argv: list[str]) -> None:
    gate = tmp_path / "gate"
    os.mkfifo(gate)
    code = _BLOCKED.format(module=module, function=function)

    def default_signals() -> None:
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(s, signal.SIG_DFL)

    proc = subprocess.Popen([sys.executable, "-c", code, str(gate), *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, preexec_fn=default_signals)
    try:
        assert proc.stdout is not None
        lines = iter(proc.stdout.readline, "")
        assert "inside\n" in lines, proc.stderr.read() if proc.poll() is not None else "no marker"
        assert len(_made_by(proc.pid)) == 1, _made_by(proc.pid)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
        leaked = _made_by(proc.pid)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for leaked in _made_by(proc.pid):  # never leave one behind, even when the test fails
            subprocess.run(["ip", "netns", "delete", leaked], check=False)
    assert proc.returncode == 128 + sig, err
    assert f"interrupted ({sig.name})" in err and "Traceback" not in err, err
    assert not leaked, f"the throwaway namespace leaked: {leaked}"


@pytest.mark.kernel
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=lambda s: s.name)
def test_validate_stopped_by_a_signal_removes_its_namespace(tmp_path: Path, netns: str, sig: signal.Signals) -> None:  # noqa: ARG001
    _interrupt(tmp_path, sig, "validate", "apply_nft", ["validate", "--backends", "nft", str(EXAMPLES)])


def test_compare_makes_no_namespace_to_leak(monkeypatch: pytest.MonkeyPatch) -> None:
    """compare reads nft rules back through the in-memory kernel: no namespace, none to leak
    when it is stopped (it needs no root at all)."""
    from nfproxy.cli.main import main
    from nfproxy.kernel import netns as netns_mod

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("compare made a network namespace")

    monkeypatch.setattr(netns_mod, "throwaway", refuse)
    monkeypatch.setattr(netns_mod, "create", refuse)
    assert main(["compare", str(EXAMPLES)]) == 0


@pytest.mark.kernel
@pytest.mark.parametrize("command", ["validate", "compare"])
def test_kernel_commands_refuse_a_fifo_before_making_any_namespace(tmp_path: Path, netns: str, command: str) -> None:  # noqa: ARG001
    tree = tmp_path / "manifests"
    _replace_tree(tree, {"a.yaml": A})
    os.mkfifo(tree / "pipe.yaml")
    proc = subprocess.Popen(_nfproxy(command, str(tree)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT)
    try:
        _, err = proc.communicate(timeout=60)  # a hang fails here
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 2, err
    assert f"{tree / 'pipe.yaml'}: a FIFO, not a regular file" in err and "Traceback" not in err
    assert not _made_by(proc.pid)


def test_rm_rf_of_the_directory_never_removes_a_service(tree: Path) -> None:
    """`rm -rf` unlinks the files, then the directory: a poll in between must not count as the
    files being removed one by one."""
    source = ManifestSource(tree, clock=Clock())
    before = source.snapshot().state
    (tree / "a.yaml").unlink()  # a poll lands here, mid-way
    assert source.rescan() is False and source.snapshot().state == before
    (tree / "b.yaml").unlink()
    tree.rmdir()
    assert settle(source) is False and source.snapshot().state == before
    assert "vanished" in source.problems()[str(tree)]


def test_an_owner_lock_that_cannot_be_taken_is_a_clear_error(tmp_path: Path) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("")
    with pytest.raises(lock.KernelError, match="cannot take the owner lock .*/file/nft-"):
        lock.acquire("nft", None, str(blocked))  # a file where the directory should be

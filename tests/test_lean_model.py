"""The model a node holds is lean: loaders share what repeats, and a full sync gives its memory back.

Sizes are measured with tracemalloc, which counts allocations exactly: the same input gives the
same figure on any load, so the bounds cannot fail by chance.
"""

from __future__ import annotations

import gc
import inspect
import json
import tracemalloc
from dataclasses import replace
from pathlib import Path

import pytest

from nfproxy.core import model
from nfproxy.core.model import NO_HINTS, ClusterState, Endpoint, IPFamily, hint_set, sort_endpoints
from nfproxy.daemon import heap
from nfproxy.daemon import proxier as proxier_module
from nfproxy.daemon.proxier import Proxier
from nfproxy.kernel import memory as memory_kernels
from nfproxy.sources.manifests import build, load_objects, read_manifest
from nfproxy.testing import NODE, manifest_objects, uniform_cluster


def _hinted(state: ClusterState) -> ClusterState:
    """Every third endpoint with zone hints, every fifth with node hints; a zone on all."""
    endpoints = {}
    for key, eps in state.endpoints.items():
        endpoints[key] = sort_endpoints([
            replace(
                e,
                zone=f"zone-{i % 2}",
                zone_hints=frozenset({f"zone-{i % 2}"}) if i % 3 == 0 else frozenset(),
                node_hints=frozenset({"node-a"}) if i % 5 == 0 else frozenset(),
            )
            for i, e in enumerate(eps)
        ])
    return replace(state, endpoints=endpoints)


def _decoded(state: ClusterState) -> list[dict]:
    # Through JSON text, as a file or the API hands them over: every string its own object.
    return json.loads(json.dumps(manifest_objects(state)))


def _all_endpoints(state: ClusterState) -> list[Endpoint]:
    return [e for eps in state.endpoints.values() for e in eps]


def test_generated_manifests_load_back_to_the_same_state() -> None:
    state = _hinted(uniform_cluster(30, 4))
    result = load_objects(_decoded(state), NODE)
    assert result.errors == ()
    assert result.state.services == state.services
    assert result.state.endpoints == state.endpoints


def test_loaded_endpoints_share_hint_sets_and_repeated_strings() -> None:
    state = load_objects(_decoded(_hinted(uniform_cluster(30, 4))), NODE).state
    endpoints = _all_endpoints(state)
    assert all(e.node_hints is NO_HINTS for e in endpoints if not e.node_hints)
    assert len({id(e.zone_hints) for e in endpoints}) == 3  # none, {zone-0}, {zone-1}
    assert len({id(e.node_hints) for e in endpoints}) == 2
    assert len({id(e.node_name) for e in endpoints}) == 1
    assert len({id(e.zone) for e in endpoints}) == 2
    names = [key[0] for key in state.services]
    assert len({id(n.namespace) for n in names}) == len({n.namespace for n in names})
    assert len({id(n.port) for n in names}) == 1


def test_endpoint_keys_are_the_services_own_key_objects() -> None:
    state = load_objects(_decoded(uniform_cluster(20, 2)), NODE).state
    services = {id(key[0]) for key in state.services}
    assert {id(key[0]) for key in state.endpoints} <= services


def test_hint_set_shares_equal_sets() -> None:
    assert hint_set([]) is NO_HINTS and hint_set(["", ""]) is NO_HINTS
    first = hint_set(iter(["zone-x", "zone-y"]))
    assert hint_set(["zone-y", "zone-x"]) is first
    assert first == frozenset({"zone-x", "zone-y"})


def _intern_line() -> tuple[str, int]:
    """Where `model.shared` calls sys.intern (file, line)."""
    lines, start = inspect.getsourcelines(model.shared)
    return model.__file__, start + next(i for i, line in enumerate(lines) if "sys.intern(" in line)


def _traced(make: object) -> tuple[object, int]:
    """Bytes `make` allocated and kept, less the growth of the interpreter's table of interned
    strings: that table is the process's, and it grows (one block of megabytes) whenever the
    strings interned so far cross its next size, which depends on every module the test run
    imported before, not on the model (the strings themselves existed before the intern)."""
    gc.collect()
    tracemalloc.start()
    try:
        value = make()  # type: ignore[operator]
        gc.collect()
        snapshot = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    path, line = _intern_line()
    kept = snapshot.filter_traces([tracemalloc.Filter(False, path, lineno=line)])
    return value, sum(stat.size for stat in kept.statistics("filename"))


def test_the_model_loaded_from_manifests_is_small() -> None:
    """300 x 10: about 215 bytes per endpoint (its Endpoint, address string and share of the
    service); before sharing, 630 (two frozensets and a node name string each)."""
    objects = _decoded(uniform_cluster(300, 10))
    result, size = _traced(lambda: load_objects(objects, NODE))
    assert len(_all_endpoints(result.state)) == 3_000  # type: ignore[attr-defined]
    assert size / 3_000 < 300


def test_a_read_file_keeps_its_objects_not_its_documents(tmp_path: Path) -> None:
    """What the manifest source keeps per file (its last good contents) is near the model's size,
    not the decoded JSON's (several times larger)."""
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({"apiVersion": "v1", "kind": "List",
                                "items": manifest_objects(uniform_cluster(300, 10))}))
    read, size = _traced(lambda: read_manifest(path))
    assert read.objects == 600  # the List's items  # type: ignore[attr-defined]
    assert build([read], NODE).state.endpoints  # type: ignore[list-item]
    assert size / 3_000 < 400


def test_heap_release_trims_on_glibc() -> None:
    assert heap.release() is True


@pytest.mark.parametrize("backend", ["nft", "iptables"])
def test_the_proxier_releases_memory_after_full_syncs_only(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[bool] = []
    monkeypatch.setattr(proxier_module.heap, "release", lambda collect=True: calls.append(collect) or True)
    proxier = Proxier(backend, families=(IPFamily.V4,), kernels=memory_kernels.kernels(backend))
    state = uniform_cluster(5, 2)
    # Once before the kernel takes the full payload, once after the sync: trims of what
    # rendering and the kernel's payload freed, acyclic, so no collection.
    assert proxier.sync(state).kind == "full"
    assert calls == [False, False]
    key = next(iter(state.endpoints))
    endpoints = dict(state.endpoints)
    endpoints[key] = endpoints[key][:1]
    assert proxier.sync(replace(state, endpoints=endpoints)).kind == "partial"
    assert len(calls) == 2
    assert proxier.sync(state, full=True).kind == "full"
    assert len(calls) == 4


def test_the_iptables_belief_keeps_no_rule_text() -> None:
    """A full plan's belief keeps chain names, rule counts and digests, not the ~50 MiB of rules
    (at 10 000 x 10) that no later sync reads; a partial plan still sees what changed."""
    from nfproxy.backends.iptables.plan import HeldChains, full_plan, held, partial_plan
    from nfproxy.backends.iptables.render import render

    state = uniform_cluster(4, 3)
    plan = full_plan(state, IPFamily.V4, None)
    assert plan.belief is not None and plan.belief.rules.service_chains == {}
    assert all(type(h) is HeldChains for h in plan.belief.services.values())
    rendered = render(state, IPFamily.V4).service_chains
    assert {k: held(c) for k, c in rendered.items()} == dict(plan.belief.services)
    key = sorted(state.endpoints)[0]
    endpoints = dict(state.endpoints)
    endpoints[key] = endpoints[key][:2]
    changed = replace(state, endpoints=endpoints)
    assert partial_plan(state, [key], IPFamily.V4, plan.belief) is None
    partial = partial_plan(changed, [key], IPFamily.V4, plan.belief)
    assert partial is not None and "-X KUBE-SEP-" in partial.payload.text  # type: ignore[attr-defined]
    assert partial.belief is not None and partial.belief.services[key].rules < plan.belief.services[key].rules

"""The proxier's sync logic on the in-memory nft kernel: no root, no namespace.

The in-memory kernel has the kernel's existence semantics (kernel/memory/nft.py), so these
tests say what the kernel tests in test_proxier.py say, as specifications: a partial sync writes
only what changed and ends where a full sync of the same state would; a refused transaction
leaves the kernel as it was and makes the next sync full; a full sync after a restart removes
what the previous run left.
"""

from __future__ import annotations

import dataclasses
import random
import re
import time

import pytest

from nfproxy.backends.nft import render as nft_render
from nfproxy.core.changes import NO_CHANGES
from nfproxy.core.model import ClusterState, Endpoint, IPFamily, sort_endpoints
from nfproxy.daemon.proxier import Proxier
from nfproxy.kernel.memory.nft import MemoryNft
from nfproxy.kernel.process import KernelError
from nfproxy.nftables import Chain, Element, Rule, Transaction, Verb
from nfproxy.nftables import expr as x
from nfproxy.nftables import text as nft_text
from nfproxy.testing import random_cluster, uniform_cluster

V4 = IPFamily.V4
_SLOT = re.compile(r"offset \d+ map @endpoints-\w+-\d+")


def memory_proxier(kernels: dict[IPFamily, MemoryNft] | None = None) -> tuple[Proxier, dict[IPFamily, MemoryNft]]:
    kernels = kernels if kernels is not None else {}

    def make(family: IPFamily) -> MemoryNft:
        return kernels.setdefault(family, MemoryNft(family))

    return Proxier("nft", kernels=make), kernels


def resolved(kernel: MemoryNft) -> str:
    """The kernel's dump with endpoint slots resolved to what they hold: slot numbers are the
    allocator's business and differ between partial syncs and one full sync."""
    lines = []
    for line in kernel.dump().splitlines():
        table = kernel.tables[line.split()[3]]  # add <kind> <family> <table> ...
        if line.startswith(("add map", "add element")) and line.split()[4].startswith(nft_render.SHARD_PREFIX):
            continue
        m = re.search(r"numgen random mod (\d+) offset (\d+) map @(\S+)", line)
        if m:
            n, first, shard = int(m.group(1)), int(m.group(2)), m.group(3)
            targets = sorted(lane_targets(dict(table.sets[shard].elements), first, n))
            line = line[: m.start()] + f"mod {n}: {targets}"
        lines.append(line)
    return "\n".join(sorted(lines))


def lane_targets(elements: dict[str, Element], first: int, n: int) -> list[tuple[int, str]]:
    """(values, endpoint) of every range of an endpoint map inside [first, first + n)."""
    out = []
    for key, el in elements.items():
        low, _, high = key.partition("-")
        low_, high_ = int(low), int(high or low)
        if first <= low_ and high_ < first + n:
            out.append((high_ - low_ + 1, el.value))
    return out


def fresh(state: ClusterState) -> dict[IPFamily, str]:
    proxier, kernels = memory_proxier()
    proxier.sync(state)
    return {f: resolved(k) for f, k in kernels.items()}


def with_endpoints(state: ClusterState, key, eps) -> ClusterState:  # noqa: ANN001
    return dataclasses.replace(state, endpoints={**state.endpoints, key: sort_endpoints(eps)})


def without_service(state: ClusterState, key) -> ClusterState:  # noqa: ANN001
    return dataclasses.replace(
        state,
        services={k: v for k, v in state.services.items() if k != key},
        endpoints={k: v for k, v in state.endpoints.items() if k != key},
    )


def test_first_sync_is_full_and_the_next_with_no_change_is_a_noop() -> None:
    state = uniform_cluster(5, 3)
    proxier, kernels = memory_proxier()
    assert proxier.sync(state).kind == "full"
    applied = kernels[V4].applied
    result = proxier.sync(state)
    assert (result.kind, result.operations) == ("noop", 0)
    assert kernels[V4].applied == applied  # nothing was sent


def test_one_endpoint_more_is_a_small_partial_sync() -> None:
    state = uniform_cluster(20, 3)
    proxier, kernels = memory_proxier()
    proxier.sync(state)
    key = sorted(k for k in state.services if k[1] is V4)[0]
    # On this node, so it is a hairpin candidate (kube-proxy's nftables mode hairpins local ones).
    added = Endpoint(ip="10.250.0.1", port=8080, node_name=state.node.name)
    grown = with_endpoints(state, key, [*state.endpoints[key], added])
    result = proxier.sync(grown)
    assert result.kind == "partial"
    last = kernels[V4].last
    assert last is not None
    ops = list(last.operations())
    # The service's chains are rewritten, one slot and one hairpin element added: no other
    # service is touched, no declaration sent.
    touched = {o.chain for _, o in ops if isinstance(o, Rule)} | {o.name for _, o in ops if isinstance(o, Chain)}
    assert all(nft_render.service_chain_base(key[0]) in name for name in touched), touched
    assert len(ops) <= 8, ops
    assert (Verb.ADD, Element(nft_render.HAIRPIN_SET, "10.250.0.1 . 10.250.0.1")) in ops
    assert resolved(kernels[V4]) == fresh(grown)[V4]


def test_removing_a_service_deletes_its_chains_on_the_next_sync() -> None:
    state = uniform_cluster(10, 2)
    proxier, kernels = memory_proxier()
    proxier.sync(state)
    key = sorted(k for k in state.services if k[1] is V4)[3]
    base = nft_render.service_chain_base(key[0])
    gone = without_service(state, key)
    assert proxier.sync(gone).kind == "partial"
    # Emptied now (an element in flight may still name it), deleted by the next sync.
    assert any(base in c for c in kernels[V4].owned().chains)
    assert proxier.backend.pending()
    assert proxier.sync(gone).kind == "partial"
    assert not any(base in c for c in kernels[V4].owned().chains)
    assert not proxier.backend.pending()
    assert resolved(kernels[V4]) == fresh(gone)[V4]


@pytest.mark.parametrize("seed", range(4))
def test_partial_syncs_converge_to_the_full_ruleset(seed: int) -> None:
    rng = random.Random(seed)
    state = random_cluster(rng, 25)
    pool = random_cluster(random.Random(seed + 50), 40)
    proxier, kernels = memory_proxier()
    proxier.sync(state)
    kinds = set()
    for _ in range(12):
        key = rng.choice(sorted(pool.services, key=str))
        if rng.random() < 0.3 and key in state.services:
            state = without_service(state, key)
        else:
            state = dataclasses.replace(
                state,
                services={**state.services, key: pool.services[key]},
                endpoints={**state.endpoints, key: pool.endpoints.get(key, ())},
            )
        kinds.add(proxier.sync(state).kind)
    proxier.sync(state)  # stale objects of the last sync deleted
    assert "partial" in kinds
    want = fresh(state)
    assert {f: resolved(k) for f, k in kernels.items()} == want


def test_a_refused_transaction_changes_nothing_and_the_next_sync_is_full() -> None:
    state = uniform_cluster(10, 2)
    proxier, kernels = memory_proxier()
    proxier.sync(state)
    before = kernels[V4].dump()
    key = sorted(k for k in state.services if k[1] is V4)[0]
    grown = with_endpoints(state, key, [*state.endpoints[key], Endpoint(ip="10.250.0.9", port=80)])

    real = MemoryNft.apply

    def broken(self: MemoryNft, tx: Transaction) -> None:
        tx.add(Rule("services", x.body(x.jump("no-such-chain"))))
        real(self, tx)

    MemoryNft.apply = broken  # type: ignore[method-assign]
    try:
        with pytest.raises(KernelError, match="no-such-chain"):
            proxier.sync(grown)
    finally:
        MemoryNft.apply = real  # type: ignore[method-assign]
    assert kernels[V4].dump() == before  # all or nothing
    result = proxier.sync(grown)
    assert result.kind == "full" and result.reason == "after failure or start"
    assert resolved(kernels[V4]) == fresh(grown)[V4]


def test_a_restart_removes_what_the_previous_run_left() -> None:
    state = uniform_cluster(10, 2)
    proxier, kernels = memory_proxier()
    proxier.sync(state)
    key = sorted(k for k in state.services if k[1] is V4)[2]
    base = nft_render.service_chain_base(key[0])
    gone = without_service(state, key)
    # A new proxier (a restart) on the same kernels, while the service vanished.
    again, _ = memory_proxier(kernels)
    assert again.sync(gone).kind == "full"
    assert again.backend.pending()  # leftovers emptied, deleted next
    again.sync(gone)
    assert not any(base in c for c in kernels[V4].owned().chains)
    assert resolved(kernels[V4]) == fresh(gone)[V4]


def test_memory_kernel_existence_semantics() -> None:
    k = MemoryNft(V4)
    tx = Transaction("ip", "nfproxy")
    tx.add(Chain("a"))  # no table yet
    with pytest.raises(KernelError, match="no table"):
        k.apply(tx)
    from nfproxy.nftables import Map, Table

    setup = Transaction("ip", "nfproxy")
    setup.add(Table("ip", "nfproxy"))
    setup.add(Chain("a"))
    setup.add(Map("m", "ipv4_addr : verdict"))
    setup.add(Element("m", "10.0.0.1", "goto a"))
    k.apply(setup)
    for verb, obj, why in [
        ("create", Chain("a"), "File exists"),
        ("flush", Chain("b"), "No such file"),
        ("delete", Chain("a"), "referenced"),
        ("delete", Element("m", "10.0.0.2"), "No such file"),
        ("add", Element("m", "10.0.0.1", "goto b"), "File exists"),
        ("add", Rule("a", x.body(x.Lookup(x.payload("ip", "saddr"), "nope"), x.DROP)), "@nope"),
    ]:
        tx = Transaction("ip", "nfproxy")
        tx.add(Chain("c"))
        getattr(tx, verb)(obj)
        before = k.dump()
        with pytest.raises(KernelError, match=why):
            k.apply(tx)
        assert k.dump() == before
    assert k.last is setup


# --------------------------------------------------------------------------------------------
# Stale objects (issue J.3): every sync sequence ends with exactly what a fresh apply holds,
# byte for byte once the last sync was full, and the sync loop itself runs the cleanup sync.


def affinity_cluster() -> ClusterState:
    state = uniform_cluster(6, 3)
    key = sorted(k for k in state.services if k[1] is V4)[1]
    sticky = dataclasses.replace(state.services[key], affinity_timeout=300)
    return dataclasses.replace(state, services={**state.services, key: sticky})


def sticky_key(state: ClusterState):  # noqa: ANN201
    return next(k for k, s in state.services.items() if s.affinity_timeout)


def names_of(kernel: MemoryNft, prefix: str) -> set[str]:
    owned = kernel.owned()
    return {n for n in owned.chains | owned.sets if n.startswith(prefix)}


def moved_endpoint(state: ClusterState) -> ClusterState:
    key = sticky_key(state)
    eps = list(state.endpoints[key])
    return with_endpoints(state, key, [*eps[1:], Endpoint(ip="10.250.3.3", port=8080)])


def test_an_affinity_endpoint_that_changes_leaves_no_endpoint_chain_or_affinity_set() -> None:
    state = affinity_cluster()
    proxier, kernels = memory_proxier()
    proxier.sync(state)
    old = names_of(kernels[V4], nft_render.ENDPOINT_PREFIX) | names_of(kernels[V4], nft_render.AFFINITY_PREFIX)
    moved = moved_endpoint(state)
    assert proxier.sync(moved).kind == "partial"
    assert proxier.backend.pending()
    proxier.sync(moved)  # the cleanup sync the loop runs (test_the_loop_runs_the_cleanup_sync)
    now = names_of(kernels[V4], nft_render.ENDPOINT_PREFIX) | names_of(kernels[V4], nft_render.AFFINITY_PREFIX)
    gone = old - now
    assert len(gone) == 2 and all(n.endswith(f"__{state.endpoints[sticky_key(state)][0].ip}/8080") for n in gone)  # the old endpoint's chain and its affinity set
    assert not proxier.backend.pending()
    assert resolved(kernels[V4]) == fresh(moved)[V4]
    # A full sync (--sync-period) and a restart keep it so, byte for byte.
    proxier.sync(moved, full=True)
    proxier.sync(moved)
    assert kernels[V4].dump() == fresh_dump(moved)[V4]
    again, _ = memory_proxier(kernels)
    again.sync(moved)
    again.sync(moved)
    assert kernels[V4].dump() == fresh_dump(moved)[V4]


def fresh_dump(state: ClusterState) -> dict[IPFamily, str]:
    proxier, kernels = memory_proxier()
    proxier.sync(state)
    return {f: k.dump() for f, k in kernels.items()}


@pytest.mark.parametrize("how", ["full sync", "restart"])
def test_stale_objects_left_by_a_killed_run_go_with_the_next_full_sync(how: str) -> None:
    """A run killed between a partial sync and its cleanup sync (kill -9 mid-churn) leaves
    emptied chains and sets; the full sync of a restart, or a periodic one, removes them all."""
    state = affinity_cluster()
    proxier, kernels = memory_proxier()
    proxier.sync(state)
    removed = without_service(moved_endpoint(state), sorted(k for k in state.services if k[1] is V4)[4])
    proxier.sync(removed)
    assert proxier.backend.pending()  # ... and the run dies here
    if how == "restart":
        proxier, _ = memory_proxier(kernels)
    result = proxier.sync(removed, full=how == "full sync")
    assert result.kind == "full"
    assert proxier.backend.pending()  # strays emptied, deleted by the next sync
    proxier.sync(removed)
    assert not proxier.backend.pending()
    if how == "restart":
        assert kernels[V4].dump() == fresh_dump(removed)[V4]
    else:
        # A periodic full sync keeps the endpoint slots the kernel holds (so their per-endpoint
        # counters survive it): the same table as a fresh one but for slot numbering.
        assert resolved(kernels[V4]) == fresh(removed)[V4]


def test_a_full_sync_keeps_endpoint_slots_and_rewrites_only_changed_elements() -> None:
    """A periodic full sync diffs the endpoint maps against what the kernel holds instead of
    flushing them: unchanged elements are re-added (a no-op that keeps their counters), changed
    ones deleted first; after a restart (nothing believed) the maps are flushed."""
    state = affinity_cluster()
    proxier, kernels = memory_proxier()
    proxier.sync(state)
    moved = moved_endpoint(state)
    proxier.sync(moved)
    proxier.sync(moved)
    before = {n: dict(kernels[V4].elements(n)) for n in kernels[V4].table.sets if n.startswith(nft_render.SHARD_PREFIX)}
    plan = proxier.backend.plan(moved, NO_CHANGES, V4, full=True, found=None)
    assert plan is not None and plan.full
    text = nft_text.script(plan.payload)
    assert before and not any(f"flush map ip nfproxy {n}" in text for n in before)
    assert "delete element ip nfproxy" not in text  # nothing changed: nothing deleted
    proxier.sync(moved, full=True)
    after = {n: dict(kernels[V4].elements(n)) for n in before}
    assert after == before
    assert resolved(kernels[V4]) == fresh(moved)[V4]
    restarted, _ = memory_proxier(kernels)
    plan = restarted.backend.plan(moved, NO_CHANGES, V4, full=True, found=None)
    assert all(f"flush map ip nfproxy {n}" in nft_text.script(plan.payload) for n in before)


def test_a_removed_service_leaves_no_empty_chain_through_a_restart() -> None:
    state = affinity_cluster()
    proxier, kernels = memory_proxier()
    proxier.sync(state)
    key = sticky_key(state)
    base = nft_render.service_chain_base(key[0])
    gone = without_service(state, key)
    proxier.sync(gone)  # emptied; killed before the cleanup sync
    again, _ = memory_proxier(kernels)
    again.sync(gone)
    again.sync(gone)
    owned = kernels[V4].owned()
    assert not any(base in n for n in owned.chains | owned.sets)
    assert kernels[V4].dump() == fresh_dump(gone)[V4]


class _StaticSource:
    """A source whose state never changes: any sync after the first is the loop's own doing."""

    def __init__(self, state: ClusterState) -> None:
        self.state = state

    def start(self, notify) -> None:  # noqa: ANN001
        pass

    def snapshot(self):  # noqa: ANN201
        from nfproxy.sources.manifests import LoadResult

        return LoadResult(self.state)

    def ready(self) -> bool:
        return True

    def stop(self) -> None:
        pass


def test_the_loop_runs_the_cleanup_sync_without_waiting_for_a_change() -> None:
    """A restart's full sync empties the strays; the loop must delete them on its own, not an
    hour later at the next --sync-period (the daemon's kill -9 test: tests/test_converge.py)."""
    from nfproxy.daemon.proxier import SyncLoop

    state = affinity_cluster()
    first, kernels = memory_proxier()
    first.sync(state)
    moved = moved_endpoint(state)
    first.sync(moved)  # killed before its cleanup sync
    proxier, _ = memory_proxier(kernels)
    loop = SyncLoop(_StaticSource(moved), proxier, min_sync_period=0.01, sync_period=3600)
    loop.start()
    try:
        deadline = time.monotonic() + 30
        while kernels[V4].dump() != fresh_dump(moved)[V4] and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        loop.stop()
    assert kernels[V4].dump() == fresh_dump(moved)[V4]
    assert not proxier.backend.pending()

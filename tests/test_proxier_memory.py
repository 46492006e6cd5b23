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

import pytest

from nfproxy.backends.nft import render as nft_render
from nfproxy.core.model import ClusterState, Endpoint, IPFamily, sort_endpoints
from nfproxy.daemon.proxier import Proxier
from nfproxy.kernel.memory.nft import MemoryNft
from nfproxy.kernel.process import KernelError
from nfproxy.nftables import Chain, Element, Rule, Transaction, Verb
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
    shards = {n for n in (kernel.table.sets if kernel.table else {}) if n.startswith(nft_render.SHARD_PREFIX)}
    for line in kernel.dump().splitlines():
        if any(f" {s} " in line for s in shards) and line.startswith(("add map", "add element")):
            continue
        m = re.search(r"numgen random mod (\d+) offset (\d+) map @(\S+)", line)
        if m:
            n, first, shard = int(m.group(1)), int(m.group(2)), m.group(3)
            targets = sorted(kernel.elements(shard)[str(first + i)].value for i in range(n))
            line = line[: m.start()] + f"one of {targets}"
        lines.append(line)
    return "\n".join(sorted(lines))


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
    grown = with_endpoints(state, key, [*state.endpoints[key], Endpoint(ip="10.250.0.1", port=8080)])
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
        tx.add(Rule("services", "jump no-such-chain"))
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
        ("add", Rule("a", "ip saddr @nope drop"), "@nope"),
    ]:
        tx = Transaction("ip", "nfproxy")
        tx.add(Chain("c"))
        getattr(tx, verb)(obj)
        before = k.dump()
        with pytest.raises(KernelError, match=why):
            k.apply(tx)
        assert k.dump() == before
    assert k.last is setup

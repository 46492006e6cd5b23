"""The off table (nftables.OFF_TABLE, docs/nft-layouts.md "Chains off the lane"), on the
in-memory kernel: a weighted port whose chain draws a modulus of its own lives there, so that a
weight change rewrites rules only in that small table; it moves in and out through partial
syncs that end where a fresh full sync of the same state would, through failures and restarts.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from nfproxy.backends.nft import render as nft_render
from nfproxy.core.model import ClusterState, Endpoint, IPFamily, sort_endpoints
from nfproxy.kernel.memory.nft import MemoryNft
from nfproxy.kernel.process import KernelError
from nfproxy.nftables import OFF_TABLE, TABLE, Element, Rule, Table, Transaction, Verb
from nfproxy.testing import uniform_cluster
from tests.test_proxier_memory import fresh, memory_proxier, resolved, without_service

V4 = IPFamily.V4


def weighted(state: ClusterState, key, weights: list[int]) -> ClusterState:  # noqa: ANN001
    """`key`'s endpoints (as many as `weights`, 10.251.x.y) weighted so."""
    eps = [Endpoint(ip=f"10.251.{key[0].name[4:]}.{i + 1}", port=8080, weight=w) for i, w in enumerate(weights)]
    return dataclasses.replace(state, endpoints={**state.endpoints, key: sort_endpoints(eps)})


def keys_of(state: ClusterState) -> list:
    return sorted((k for k in state.services if k[1] is V4), key=lambda k: k[0].name)


def tables_of(kernel: MemoryNft) -> set[str]:
    return set(kernel.tables)


def test_only_ports_whose_draw_leaves_the_lane_live_in_the_off_table() -> None:
    state = uniform_cluster(6, 3)
    a, b, c, d = keys_of(state)[:4]
    state = weighted(state, a, [1, 2, 7])  # sum 10 divides the lane: nfproxy
    state = weighted(state, b, [1, 2, 14])  # sum 17: off
    state = weighted(state, c, [5, 5, 5])  # equal weights are no weights: nfproxy
    state = weighted(state, d, [1, 16])  # sum 17 over gcd 1: off
    rs = nft_render.render(state, V4)
    assert rs.off is not None
    assert set(rs.off.services) == {b, d}
    assert {a, c} <= set(rs.services)
    # nfproxy keeps of them only their cluster IPs (its cluster-ips-check runs first).
    for key in (b, d):
        stub = rs.services[key]
        assert not stub.chains and not stub.elements and stub.cluster_ip in rs.cluster_ip_refs
    # The off table has its own frame one priority step after nfproxy's, and no INVALID drop.
    assert {c.name: c.priority for c in rs.off.base_chains} == {
        c.name: str(int(c.priority or 0) + 1) for c in rs.base_chains
    }
    assert not rs.off.counters
    assert "\ntable ip nfproxy-off" in "\n" + rs.script().replace("add table", "table")


def test_without_off_ports_there_is_no_off_table() -> None:
    state = uniform_cluster(5, 4)
    rs = nft_render.render(state, V4)
    assert rs.off is None
    proxier, kernels = memory_proxier()
    proxier.sync(state)
    assert tables_of(kernels[V4]) == {TABLE}


def _main_validates(tx: Transaction) -> list[str]:
    """What in an nfproxy transaction makes the kernel validate the whole table: a rule, or
    an element whose verdict jumps (docs/nft-layouts.md, "What the kernel validates")."""
    out = []
    for verb, obj in tx.operations():
        if verb is Verb.DELETE:
            continue
        if isinstance(obj, Rule):
            out.append(f"rule {obj.chain}: {obj.body}")
        elif isinstance(obj, Element) and ("goto" in obj.value or "jump" in obj.value):
            out.append(f"element {obj.set} {obj.key}: {obj.value}")
    return out


def test_a_weight_change_off_the_lane_leaves_nfproxy_validated_by_nothing() -> None:
    state = uniform_cluster(30, 3)
    key = keys_of(state)[4]
    state = weighted(state, key, [1, 2, 7])
    proxier, kernels = memory_proxier()
    proxier.sync(state)
    assert tables_of(kernels[V4]) == {TABLE}

    applied: list[Transaction] = []
    real = MemoryNft.apply

    def record(self: MemoryNft, payload: object) -> None:
        if isinstance(payload, Transaction):
            applied.append(payload)
        real(self, payload)

    MemoryNft.apply = record  # type: ignore[method-assign]
    try:
        moved = weighted(state, key, [1, 2, 7, 7])  # sum 17: off the lane
        assert proxier.sync(moved).kind == "partial"
        # The new home first, then nfproxy: there only deletions and flushes.
        assert [tx.table for tx in applied] == [OFF_TABLE, TABLE]
        assert _main_validates(applied[1]) == []
        assert any(isinstance(o, Rule) for _, o in applied[0].operations())
        proxier.sync(moved)  # the port's emptied chains in nfproxy deleted
        assert resolved(kernels[V4]) == fresh(moved)[V4]

        applied.clear()
        again = weighted(state, key, [1, 2, 7, 9])  # sum 19: still off, its rule changes there
        assert proxier.sync(again).kind == "partial"
        assert [tx.table for tx in applied] == [OFF_TABLE]
        proxier.sync(again)
        assert resolved(kernels[V4]) == fresh(again)[V4]

        applied.clear()
        back = weighted(state, key, [1, 2, 7])  # the lane again: nfproxy first, then the off table goes
        assert proxier.sync(back).kind == "partial"
        assert [tx.table for tx in applied] == [TABLE, OFF_TABLE]
        assert [(v, o) for v, o in applied[1].operations()] == [(Verb.DELETE, Table("ip", OFF_TABLE))]
    finally:
        MemoryNft.apply = real  # type: ignore[method-assign]
    proxier.sync(back)  # stale objects of the last sync deleted
    assert tables_of(kernels[V4]) == {TABLE}
    assert resolved(kernels[V4]) == fresh(back)[V4]
    assert not proxier.backend.pending()


@pytest.mark.parametrize("seed", range(6))
def test_partial_syncs_through_moves_converge_to_a_fresh_full_sync(seed: int) -> None:
    rng = random.Random(seed)
    state = uniform_cluster(12, 2)
    keys = keys_of(state)
    proxier, kernels = memory_proxier()
    proxier.sync(state)
    kinds = set()
    for _ in range(16):
        key = rng.choice(keys)
        roll = rng.random()
        if roll < 0.15 and key in state.services:
            state = without_service(state, key)
        elif roll < 0.3 and key not in state.services:
            state = dataclasses.replace(
                state, services={**state.services, key: uniform_cluster(12, 2).services[key]}
            )
        else:
            weights = [rng.choice([0, 1, 1, 2, 3, 7, 9, 16]) for _ in range(rng.randint(1, 6))]
            if key in state.services and any(weights):
                state = weighted(state, key, weights)
        kinds.add(proxier.sync(state).kind)
        assert resolved(kernels[V4]) == fresh(state)[V4] or proxier.backend.pending()
    proxier.sync(state)
    assert "partial" in kinds
    assert resolved(kernels[V4]) == fresh(state)[V4]


def test_a_failure_between_the_two_tables_forces_a_full_sync_that_converges() -> None:
    state = uniform_cluster(10, 3)
    key = keys_of(state)[1]
    state = weighted(state, key, [1, 2, 7])
    proxier, kernels = memory_proxier()
    proxier.sync(state)
    moved = weighted(state, key, [1, 2, 7, 7])
    real = MemoryNft.apply

    def refuse_nfproxy(self: MemoryNft, payload: object) -> None:
        if isinstance(payload, Transaction) and payload.table == TABLE:
            raise KernelError("nft (memory) rejected the transaction: injected")
        real(self, payload)

    MemoryNft.apply = refuse_nfproxy  # type: ignore[method-assign]
    try:
        with pytest.raises(KernelError, match="injected"):
            proxier.sync(moved)
    finally:
        MemoryNft.apply = real  # type: ignore[method-assign]
    # The off table took the port, nfproxy kept it: both hold it, and nfproxy's runs first.
    assert tables_of(kernels[V4]) == {TABLE, OFF_TABLE}
    result = proxier.sync(moved)
    assert result.kind == "full"
    proxier.sync(moved)
    assert resolved(kernels[V4]) == fresh(moved)[V4]


def test_a_restart_removes_an_off_table_nobody_renders_any_more() -> None:
    state = uniform_cluster(8, 3)
    key = keys_of(state)[2]
    off = weighted(state, key, [1, 16])
    proxier, kernels = memory_proxier()
    proxier.sync(off)
    assert tables_of(kernels[V4]) == {TABLE, OFF_TABLE}
    again, _ = memory_proxier(kernels)  # a restart, the weights gone meanwhile
    assert again.sync(state).kind == "full"
    again.sync(state)
    assert tables_of(kernels[V4]) == {TABLE}
    assert resolved(kernels[V4]) == fresh(state)[V4]
    # And one that finds the off table it would render keeps it, rewritten.
    third, _ = memory_proxier(kernels)
    third.sync(off)
    third.sync(off)
    assert resolved(kernels[V4]) == fresh(off)[V4]


def test_a_port_removed_while_off_takes_the_off_table_with_it() -> None:
    state = uniform_cluster(6, 3)
    key = keys_of(state)[0]
    off = weighted(state, key, [1, 2, 14])
    proxier, kernels = memory_proxier()
    proxier.sync(off)
    gone = without_service(off, key)
    assert proxier.sync(gone).kind == "partial"
    assert tables_of(kernels[V4]) == {TABLE}
    proxier.sync(gone)
    assert resolved(kernels[V4]) == fresh(gone)[V4]


def test_an_unserved_port_of_an_off_ports_cluster_ip_is_rejected_not_dropped() -> None:
    """nfproxy's filter chains run before the off table's: its cluster-ips-check must know the
    off table's cluster IPs, or its "unallocated ClusterIP" drop would win over the reject."""
    from nfproxy.analysis.interpret import Packet, interpret
    from nfproxy.verify.compare import nft_ruleset

    state = uniform_cluster(4, 3)
    state = dataclasses.replace(state, node=dataclasses.replace(state.node, service_cidrs=("172.30.0.0/16",)))
    key = keys_of(state)[1]
    state = weighted(state, key, [1, 16])
    ip = state.services[key].cluster_ip
    ruleset = nft_ruleset(state, V4)
    served = interpret(ruleset, Packet("10.244.9.9", ip, 80, "tcp", "pod"))
    assert {o.verdict for o in served} == {"dnat"}
    unserved = interpret(ruleset, Packet("10.244.9.9", ip, 81, "tcp", "pod"))
    assert {o.verdict for o in unserved} == {"reject"}, unserved
    nowhere = interpret(ruleset, Packet("10.244.9.9", "172.30.200.1", 80, "tcp", "pod"))
    assert {o.verdict for o in nowhere} == {"drop"}, nowhere


def test_the_commands_read_the_off_table(tmp_path, capsys) -> None:  # noqa: ANN001
    """`render` writes both tables, `check` and `trace` read the port that lives in the off
    table, `compare` holds both backends equivalent (examples-weighted: shop/search, 1:2:14)."""
    from pathlib import Path

    from nfproxy.cli.main import main

    example = Path(__file__).resolve().parent.parent / "examples-weighted"
    assert main(["render", "--backend", "nft", str(example)]) == 0
    script = capsys.readouterr().out
    assert "add table ip nfproxy-off" in script and "add chain ip nfproxy-off service-" in script
    dump = tmp_path / "nft.txt"
    dump.write_text(script)
    assert main(["check", "--from-file", str(dump), "--manifests", str(example)]) == 0
    out = capsys.readouterr().out
    assert "shop/search:http" in out and "(weight share 14/17)" in out and "no problems found" in out
    assert main(["trace", "--from-file", str(dump), "--manifests", str(example), "10.244.0.9", "10.96.10.80:80/tcp"]) == 0
    out = capsys.readouterr().out
    assert "nfproxy-off service-" in out and "written 14/17, weight 14)" in out
    assert main(["compare", str(example)]) == 0
    assert capsys.readouterr().out.rstrip().endswith("EQUIVALENT")

"""iptables sync planning on the in-memory kernel (no root): full, partial, failure then full,
stale chains, restarts; after any sequence of partial syncs the kernel holds what one full sync
of the same state writes into an empty one."""

from __future__ import annotations

import dataclasses
import random
import re

import pytest

from nfproxy.backends.iptables.render import JUMPS, JUMPS_TO_PREPEND, LARGE_CLUSTER_ENDPOINTS, SERVICE_CHAIN_PREFIXES
from nfproxy.core.model import Endpoint, IPFamily, sort_endpoints
from nfproxy.kernel.memory.iptables import MemoryIptablesKernel
from nfproxy.kernel.process import KernelError
from nfproxy.testing import random_cluster, uniform_cluster
from tests.iptables_sync import OneFamily, fresh_dump
from tests.test_proxier import mutate, with_endpoints, without_service

V4 = IPFamily.V4


def declared(text: str) -> set[str]:
    return set(re.findall(r"^:(\S+) ", text, re.M))


def service_chains(kernel: MemoryIptablesKernel) -> set[str]:
    return {c for c in kernel.owned().chains if c.startswith(SERVICE_CHAIN_PREFIXES)}


def test_first_sync_is_full_with_jumps_and_writes_the_render() -> None:
    state = uniform_cluster(4, 3)
    kernel = MemoryIptablesKernel()
    node = OneFamily(kernel)
    plan = node.sync(state)
    assert plan is not None and plan.full and kernel.last is plan.payload
    assert plan.payload.jumps == JUMPS_TO_PREPEND
    assert plan.operations == plan.payload.text.count("\n") > 0
    again = MemoryIptablesKernel()
    again.restore(node.backend.render(state, V4).restore_text(with_jumps=True))
    # The same rules; the built-in chains' jumps, each inserted first in turn, end up in
    # kube-proxy's order (JUMPS), as on a kube-proxy node and in the text a fresh restore reads.
    assert sorted(kernel.dump().splitlines()) == sorted(again.dump().splitlines())
    inserted = [line for line in kernel.save().splitlines() if line.startswith("-A INPUT ")]
    assert inserted == [j.line for j in JUMPS if j.table == "filter" and j.chain == "INPUT"]
    assert inserted == [line for line in again.save().splitlines() if line.startswith("-A INPUT ")]


def test_jumps_are_checked_before_insert() -> None:
    state = uniform_cluster(2, 1)
    kernel = MemoryIptablesKernel()
    for _ in range(3):
        OneFamily(kernel).sync(state)
    save = kernel.save()
    for jump in JUMPS:
        assert save.count(jump.line + "\n") == 1


def test_no_change_plans_nothing() -> None:
    state = uniform_cluster(3, 2)
    node = OneFamily(MemoryIptablesKernel())
    node.sync(state)
    assert node.sync(state) is None
    key = sorted(state.services, key=str)[0]
    # An endpoint that is neither ready nor serving changes the model, not the rules.
    idle = Endpoint(ip="10.99.0.1", port=8080, ready=False, serving=False, node_name="node-b")
    assert node.sync(with_endpoints(state, key, [*state.endpoints[key], idle])) is None


def test_partial_sync_writes_only_the_changed_port_and_the_top_level_chains() -> None:
    state = uniform_cluster(20, 3)
    kernel = MemoryIptablesKernel()
    node = OneFamily(kernel)
    node.sync(state)
    key = sorted(state.services, key=str)[7]
    changed = with_endpoints(state, key, list(state.endpoints[key])[:-1])
    plan = node.sync(changed)
    assert plan is not None and not plan.full and plan.payload.jumps == ()
    group = node.backend.render(changed, V4).service_chains[key]
    top = set(node.backend.render(changed, V4).nat) | set(node.backend.render(changed, V4).filter)
    gone = set(node.backend.render(state, V4).service_chains[key].chains) - set(group.chains)
    assert len(gone) == 1
    assert declared(plan.payload.text) == top | set(group.chains) | gone
    assert re.findall(r"^-X (\S+)$", plan.payload.text, re.M) == sorted(gone)
    assert kernel.dump() == fresh_dump(changed)


def test_removed_service_chains_are_deleted_in_the_same_restore() -> None:
    state = uniform_cluster(6, 2)
    kernel = MemoryIptablesKernel()
    node = OneFamily(kernel)
    node.sync(state)
    key = sorted(state.services, key=str)[2]
    mine = set(node.backend.render(state, V4).service_chains[key].chains)
    assert mine <= service_chains(kernel)
    smaller = without_service(state, key)
    plan = node.sync(smaller)
    assert plan is not None and not plan.full
    assert not mine & service_chains(kernel)
    assert not node.backend.pending()
    assert kernel.dump() == fresh_dump(smaller)


def test_failed_restore_keeps_the_table_and_the_next_sync_is_full() -> None:
    state = uniform_cluster(5, 2)
    kernel = MemoryIptablesKernel()
    node = OneFamily(kernel)
    node.sync(state)
    key = sorted(state.services, key=str)[1]
    svc_chain = node.backend.render(state, V4).service_chains[key].chains[0]
    # Somebody else jumps to the service's chain: deleting it must fail, and with it the restore.
    kernel.restore(f"*nat\n:OTHER - [0:0]\n-A OTHER -j {svc_chain}\nCOMMIT\n")
    before = kernel.save()
    smaller = without_service(state, key)
    with pytest.raises(KernelError, match="referenced"):
        node.sync(smaller)
    after = kernel.save()
    nat = lambda text: text[text.index("*nat") :]  # noqa: E731
    assert nat(after) == nat(before)  # the failing table kept what it had
    kernel.restore("*nat\n-F OTHER\n-X OTHER\nCOMMIT\n")
    plan = node.sync(smaller)
    assert plan is not None and plan.full
    assert kernel.dump() == fresh_dump(smaller)


def test_restart_full_sync_removes_what_a_previous_run_left() -> None:
    big, small = uniform_cluster(30, 2), uniform_cluster(10, 2)
    kernel = MemoryIptablesKernel()
    OneFamily(kernel).sync(big)
    plan = OneFamily(kernel).sync(small)
    assert plan is not None and plan.full
    assert kernel.dump() == fresh_dump(small)


@pytest.mark.parametrize("family", list(IPFamily))
@pytest.mark.parametrize("seed", range(8))
def test_random_partial_syncs_end_where_a_full_sync_does(seed: int, family: IPFamily) -> None:
    rng = random.Random(seed)
    state = random_cluster(rng, 20, 8)
    pool = random_cluster(random.Random(seed + 100), 30, 8)
    kernel = MemoryIptablesKernel(family)
    node = OneFamily(kernel, family)
    node.sync(state)
    partial = 0
    for _ in range(20):
        state = mutate(rng, state, pool)
        plan = node.sync(state)
        partial += plan is not None and not plan.full
        assert kernel.dump() == fresh_dump(state, family)
    assert partial > 0
    counts = node.backend.counts()[family]
    rules = [line for line in kernel.save().splitlines() if line.startswith("-A KUBE-")]
    assert counts["nat"] + counts["filter"] == len(rules)


def test_crossing_the_large_cluster_threshold_rewrites_every_port() -> None:
    per = 10
    state = uniform_cluster(LARGE_CLUSTER_ENDPOINTS // per, per)
    kernel = MemoryIptablesKernel()
    node = OneFamily(kernel)
    node.sync(state)
    assert "-m comment" in kernel.save().split(":KUBE-SEP-", 1)[1]
    key = sorted(state.services, key=str)[0]
    extra = Endpoint(ip="10.250.0.9", port=8080, node_name="node-b")
    grown = with_endpoints(state, key, [*state.endpoints[key], extra])
    plan = node.sync(grown)
    assert plan is not None and not plan.full
    assert kernel.dump() == fresh_dump(grown)
    endpoints = {**grown.endpoints, key: sort_endpoints(state.endpoints[key])}
    shrunk = dataclasses.replace(grown, endpoints=endpoints)
    node.sync(shrunk)
    assert kernel.dump() == fresh_dump(shrunk)


# --------------------------------------------------------------------------------------------
# The in-memory kernel's own rules, as iptables 1.8.9 (both flavours) applies them; the kernel
# test runs the same table against the real tools.

RESTORE_CASES: list[tuple[str, str, bool]] = [
    ("a later table fails", "*filter\n:KUBE-A - [0:0]\n-A KUBE-A -j ACCEPT\nCOMMIT\n"
     "*nat\n:KUBE-B - [0:0]\n-A KUBE-B -j KUBE-NOPE\nCOMMIT\n", False),
    ("create an empty chain", "*nat\n:KUBE-C - [0:0]\nCOMMIT\n", True),
    ("delete an empty undeclared chain", "*nat\n-X KUBE-C\nCOMMIT\n", True),
    ("create a chain with a rule", "*nat\n:KUBE-D - [0:0]\n-A KUBE-D -j ACCEPT\nCOMMIT\n", True),
    ("delete a chain with rules", "*nat\n-X KUBE-D\nCOMMIT\n", False),
    ("delete a referenced chain", "*nat\n:KUBE-E - [0:0]\n:KUBE-F - [0:0]\n-A KUBE-F -j KUBE-E\n"
     "-X KUBE-E\nCOMMIT\n", False),
    ("append before the declaration", "*nat\n-A KUBE-G -j ACCEPT\n:KUBE-G - [0:0]\nCOMMIT\n", False),
    ("jump declared later", "*nat\n:KUBE-H - [0:0]\n-A KUBE-H -j KUBE-I\n:KUBE-I - [0:0]\nCOMMIT\n",
     False),
    ("delete a missing rule", "*nat\n:KUBE-J - [0:0]\n-D KUBE-J -j ACCEPT\nCOMMIT\n", False),
    ("new chain that exists", "*nat\n-N KUBE-D\nCOMMIT\n", False),
    ("append to a deleted chain", "*nat\n:KUBE-K - [0:0]\n-X KUBE-K\n-A KUBE-K -j ACCEPT\nCOMMIT\n",
     False),
    ("declare", "*nat\n:KUBE-L - [0:0]\nCOMMIT\n", True),
    ("jump to a chain deleted above", "*nat\n:KUBE-L - [0:0]\n:KUBE-M - [0:0]\n-X KUBE-L\n"
     "-A KUBE-M -j KUBE-L\nCOMMIT\n", False),
    ("flush by declaring, insert, delete", "*nat\n:KUBE-D - [0:0]\n-A KUBE-D -j RETURN\n"
     '-I KUBE-D 1 -m comment --comment "a b" -j MARK --or-mark 0x4000\n-D KUBE-D -j RETURN\n'
     "COMMIT\n", True),
    ("REJECT in nat", "*nat\n:KUBE-N - [0:0]\n-A KUBE-N -j REJECT\nCOMMIT\n", False),
    ("DNAT in filter", "*filter\n:KUBE-N - [0:0]\n-A KUBE-N -p tcp -j DNAT --to-destination "
     "10.0.0.1:80\nCOMMIT\n", False),
]


def test_in_memory_restore_accepts_and_refuses_like_iptables_restore() -> None:
    kernel = MemoryIptablesKernel()
    for name, text, ok in RESTORE_CASES:
        before = kernel.save()
        try:
            kernel.restore(text)
            accepted = True
        except KernelError:
            accepted = False
        assert accepted == ok, name
        if not accepted and not text.startswith("*filter"):
            assert kernel.save() == before, name
    chains = kernel.owned().chains
    assert chains == {"KUBE-A", "KUBE-D", "KUBE-L"}
    assert '-A KUBE-D -m comment --comment "a b" -j MARK --or-mark 0x4000' in kernel.save()

"""A full nft sync removes every object of the nfproxy table the new state does not render
(issue J.3): chains, sets, maps and named counters alike, whoever left them (a feature turned
off, a killed run, an older release).

On the in-memory kernel (kernel/memory/nft.py has the kernel's existence and reference rules)
and once on the real kernel in a throwaway namespace.
"""

from __future__ import annotations

import dataclasses

import pytest

from nfproxy.backends.nft import render as nft_render
from nfproxy.backends.nft.backend import strays
from nfproxy.core.model import ClusterState, IPFamily
from nfproxy.core.owned import Owned
from nfproxy.daemon.proxier import Proxier
from nfproxy.kernel.memory.nft import MemoryNft
from nfproxy.nftables import TABLE, Chain, Counter, Element, Map, Rule, Set, Transaction
from nfproxy.nftables import expr as x
from nfproxy.testing import uniform_cluster

V4 = IPFamily.V4
COUNTER = nft_render.INVALID_DROP_COUNTER


def memory_proxier(kernels: dict[IPFamily, MemoryNft]) -> Proxier:
    return Proxier("nft", kernels=lambda family: kernels.setdefault(family, MemoryNft(family)))


def fresh_dump(state: ClusterState) -> str:
    kernels: dict[IPFamily, MemoryNft] = {}
    memory_proxier(kernels).sync(state)
    return kernels[V4].dump()


def without_drop_invalid(state: ClusterState) -> ClusterState:
    return dataclasses.replace(state, node=dataclasses.replace(state.node, drop_invalid=False))


def litter() -> Transaction:
    """Objects no configuration of this release renders, wired as an older one might have: a
    chain jumped to from a static chain, a set and a map it names, and a counter it counts in."""
    tx = Transaction("ip", TABLE)
    tx.add(Counter("old-counter"))
    tx.add(Set("old-set", "ipv4_addr"))
    tx.add(Map("old-map", "ipv4_addr : verdict"))
    tx.add(Chain("old-chain"))
    tx.add(Rule("old-chain", x.body(x.Lookup(x.payload("ip", "saddr"), "old-set"), x.Counter("old-counter"), x.DROP)))
    tx.add(Rule("old-chain", x.body(x.VerdictMap(x.payload("ip", "daddr"), "old-map"))))
    tx.add(Element("old-set", "10.9.9.9"))
    tx.add(Rule(nft_render.SERVICES_CHAIN, x.body(x.jump("old-chain"))))
    return tx


def converge(proxier: Proxier, state: ClusterState, *, full: bool) -> None:
    """The sync asked for, then the cleanup syncs the loop would run for what it emptied."""
    proxier.sync(state, full=full)
    for _ in range(3):
        if not proxier.backend.pending():
            return
        proxier.sync(state)
    assert not proxier.backend.pending()


def test_turning_drop_invalid_off_removes_its_counter() -> None:
    state = uniform_cluster(4, 2)
    assert state.node.drop_invalid
    kernels: dict[IPFamily, MemoryNft] = {}
    proxier = memory_proxier(kernels)
    proxier.sync(state)
    assert COUNTER in kernels[V4].owned().counters
    off = without_drop_invalid(state)
    converge(proxier, off, full=False)
    assert COUNTER not in kernels[V4].owned().counters
    assert kernels[V4].dump() == fresh_dump(off)
    # ... and back on: declared again, rules count into it.
    converge(proxier, state, full=False)
    assert kernels[V4].dump() == fresh_dump(state)


@pytest.mark.parametrize("how", ["periodic full sync", "restart"])
def test_a_full_sync_removes_objects_no_state_renders(how: str) -> None:
    state = uniform_cluster(4, 2)
    kernels: dict[IPFamily, MemoryNft] = {}
    proxier = memory_proxier(kernels)
    proxier.sync(state)
    kernels[V4].apply(litter())
    held = kernels[V4].owned()
    assert {"old-chain"} <= held.chains and {"old-set", "old-map"} <= held.sets
    assert "old-counter" in held.counters
    if how == "restart":
        proxier = memory_proxier(kernels)
    converge(proxier, state, full=True)
    assert kernels[V4].dump() == fresh_dump(state)


def test_strays_are_everything_unrendered_and_nothing_rendered() -> None:
    state = uniform_cluster(3, 2)
    new = nft_render.render(state, V4)
    rendered = Owned(
        frozenset(new.chains) | {c for svc in new.services.values() for c in svc.chains},
        frozenset(new.sets) | frozenset(new.shard_users) | frozenset(new.unused_sets),
        frozenset(new.counters),
    )
    assert strays(new, rendered).chains == strays(new, rendered).sets == strays(new, rendered).counters == ()
    extra = Owned(rendered.chains | {"x-chain"}, rendered.sets | {"x-set"}, rendered.counters | {"x-counter"})
    found = strays(new, extra)
    assert (found.chains, found.sets, found.counters) == (("x-chain",), ("x-set",), ("x-counter",))
    off = nft_render.render(without_drop_invalid(state), V4)
    assert strays(off, rendered).counters == (COUNTER,)


@pytest.mark.kernel
def test_on_the_kernel_a_full_sync_removes_objects_no_state_renders(netns: str) -> None:
    from nfproxy.kernel.nft import NftKernel, NftSession

    state = uniform_cluster(4, 2)
    kernels: dict[IPFamily, NftKernel] = {}

    def make(family: IPFamily) -> NftKernel:
        return kernels.setdefault(family, NftKernel(family, netns=netns))

    proxier = Proxier("nft", kernels=make)
    proxier.sync(state)
    kernels[V4].apply(litter())
    session = NftSession(netns)
    names = session.object_names("ip", TABLE)
    assert names is not None and "old-chain" in names[0] and "old-map" in names[1] and "old-counter" in names[2]
    assert COUNTER in names[2]
    # The proxier asks netlink for the counters (libnftables fetches every rule to list them).
    assert kernels[V4].owned().counters == frozenset(names[2])
    off = without_drop_invalid(state)
    converge(Proxier("nft", kernels=make), off, full=True)  # a restart with drop_invalid off
    chains, sets, counters = session.object_names("ip", TABLE) or (set(), set(), set())
    assert not {"old-chain"} & chains and not {"old-set", "old-map"} & sets
    assert counters == set()
    want = nft_render.render(off, V4)
    wanted_chains = set(want.chains) | {c for svc in want.services.values() for c in svc.chains}
    assert chains == wanted_chains
    assert sets == set(want.sets) | set(want.shard_users)


@pytest.mark.kernel
@pytest.mark.parametrize(
    "old_map, flags, keys",
    [
        ("endpoints-counted-tcp-0", (), ("0", "1")),  # single-slot maps, before the lanes
        ("endpoints-counted-tcp-ranges-0", ("interval",), ("0-111711599", "111711600-223423199")),  # lanes only
    ],
)
def test_an_upgrade_from_older_endpoint_maps_converges(netns: str, old_map: str, flags: tuple[str, ...], keys: tuple[str, str]) -> None:
    """A node upgraded from a release with other endpoint maps (single-slot maps
    `endpoints-counted-tcp-0`; or interval lanes `endpoints-counted-tcp-ranges-0` for every
    chain, before unweighted chains drew into hash maps): the first full sync writes the new
    maps beside them (nft refuses to redeclare a map with other flags, hence other names) and
    the old maps and chains go as strays."""
    from nfproxy.kernel.nft import NftKernel, NftSession

    state = uniform_cluster(4, 2)
    old = Transaction("ip", TABLE)
    old.add(Map(old_map, typeof="numgen random mod 1 : ip daddr . tcp dport", flags=flags, counter=True))
    old.add(Chain("service-OLDHASH1-ns/old/tcp/p"))
    modulus = 2 if not flags else 223423200
    old.add(Rule("service-OLDHASH1-ns/old/tcp/p", f"meta l4proto tcp dnat ip to numgen random mod {modulus} offset 0 map @{old_map}"))
    old.add(Element(old_map, keys[0], "10.9.0.1 . 80"))
    old.add(Element(old_map, keys[1], "10.9.0.2 . 80"))
    kernels: dict[IPFamily, NftKernel] = {}

    def make(family: IPFamily) -> NftKernel:
        return kernels.setdefault(family, NftKernel(family, netns=netns))

    first = Proxier("nft", kernels=make)
    first.sync(state)
    kernels[V4].apply(old)
    converge(Proxier("nft", kernels=make), state, full=True)  # the upgraded daemon starts
    session = NftSession(netns)
    chains, sets, _ = session.object_names("ip", TABLE) or (set(), set(), set())
    want = nft_render.render(state, V4)
    assert old_map not in sets and "service-OLDHASH1-ns/old/tcp/p" not in chains
    assert sets == set(want.sets) | set(want.shard_users)
    assert want.shard_users and all("-hash-" in name for name in want.shard_users)


def test_an_upgrade_from_the_separate_external_no_endpoint_map_converges(netns: str) -> None:
    """Releases before issue S kept external and LoadBalancer IPs without endpoints in a map of
    their own, `no-endpoint-external-ips`, checked by `external-endpoints-check` from input-new,
    forward-new and filter-output-post-dnat. The upgraded daemon's first full sync rewrites the
    base and new-connection chains without the jumps, and the old chain and map go as strays."""
    from nfproxy.kernel.nft import NftKernel, NftSession

    state = uniform_cluster(4, 2)
    old = Transaction("ip", TABLE)
    old.add(Map("no-endpoint-external-ips", type="ipv4_addr . inet_proto . inet_service : verdict"))
    old.add(Chain("external-endpoints-check"))
    old.add(Rule("external-endpoints-check", "ip daddr . meta l4proto . th dport vmap @no-endpoint-external-ips"))
    old.add(Element("no-endpoint-external-ips", "203.0.113.7 . tcp . 80", "drop"))
    old.add(Rule("forward-new", "jump external-endpoints-check"))
    old.add(Rule("filter-output-post-dnat", "ct state new jump external-endpoints-check"))
    kernels: dict[IPFamily, NftKernel] = {}

    def make(family: IPFamily) -> NftKernel:
        return kernels.setdefault(family, NftKernel(family, netns=netns))

    Proxier("nft", kernels=make).sync(state)
    kernels[V4].apply(old)
    converge(Proxier("nft", kernels=make), state, full=True)  # the upgraded daemon starts
    chains, sets, _ = NftSession(netns).object_names("ip", TABLE) or (set(), set(), set())
    want = nft_render.render(state, V4)
    assert "external-endpoints-check" not in chains and "no-endpoint-external-ips" not in sets
    assert chains == set(want.chains) | {c for svc in want.services.values() for c in svc.chains}
    assert sets == set(want.sets) | set(want.shard_users)


def _lane_upgrade_state() -> ClusterState:
    """Ports whose weight sums sit on one side of the lane change of 2026-12-03 (LANE 67 026 960
    with 64 lanes per map before, 223 423 200 with 16 after): 25 and 32 only on the new lane,
    27 only on the old one, 10 on both; 40 ports, so more than one map of 16 lanes."""
    state = uniform_cluster(40, 3)
    keys = sorted(state.services, key=lambda k: k[0].name)
    endpoints = dict(state.endpoints)
    for key, weights in zip(keys, [(7, 8, 10), (1, 2, 29), (1, 1, 25), (1, 2, 7)]):
        endpoints[key] = tuple(dataclasses.replace(e, weight=w) for e, w in zip(endpoints[key], weights))
    return dataclasses.replace(state, endpoints=endpoints)


def _old_lane(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every module of the backend that holds the lane's numbers, as an older release had them."""
    from nfproxy.backends.nft import full, names, structure

    for module in (names, structure, full, nft_render):
        for name, value in (("LANE", 67_026_960), ("LANES_PER_MAP", 64)):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, value)


def test_an_upgrade_to_another_lane_converges(monkeypatch: pytest.MonkeyPatch) -> None:
    """A node whose rules a release with another lane wrote (other moduli, offsets, map
    packing, ports in the other table): the upgraded daemon's first full sync leaves what a
    fresh apply of the same state leaves."""
    state = _lane_upgrade_state()
    kernels: dict[IPFamily, MemoryNft] = {}
    with monkeypatch.context() as m:
        _old_lane(m)
        memory_proxier(kernels).sync(state)
        old = kernels[V4].dump()
        assert "mod 67026960" in old and "mod 25 " in old and "mod 32 " in old and "mod 27 " not in old
    converge(memory_proxier(kernels), state, full=True)  # the upgraded daemon starts
    new = kernels[V4].dump()
    assert "mod 27 " in new and "mod 25 " not in new and "mod 32 " not in new and "mod 67026960" not in new
    assert new == fresh_dump(state)


@pytest.mark.kernel
def test_on_the_kernel_an_upgrade_to_another_lane_converges(netns: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same on the real kernel: its interval maps refuse overlapping ranges, and the new
    lane's ranges overlap the old ones in every map both use."""
    from nfproxy.kernel.netns import throwaway
    from nfproxy.kernel.nft import NftKernel

    state = _lane_upgrade_state()
    kernels: dict[IPFamily, NftKernel] = {}

    def make(family: IPFamily) -> NftKernel:
        return kernels.setdefault(family, NftKernel(family, netns=netns))

    with monkeypatch.context() as m:
        _old_lane(m)
        Proxier("nft", kernels=make).sync(state)
    assert "mod 25 " in kernels[V4].dump()
    converge(Proxier("nft", kernels=make), state, full=True)
    with throwaway("nfp-lane-ref") as ref:
        fresh: dict[IPFamily, NftKernel] = {}
        Proxier("nft", kernels=lambda family: fresh.setdefault(family, NftKernel(family, netns=ref))).sync(state)
        assert kernels[V4].dump() == fresh[V4].dump()
        assert kernels[V4].owned() == fresh[V4].owned()


@pytest.mark.kernel
def test_a_stale_verdict_map_that_names_a_stale_chain_goes_with_it(netns: str) -> None:
    """An older release's verdict map whose element jumps to a chain of that release: both are
    strays; the chain is emptied by the full sync and both are deleted by the next, the map
    first (the kernel refuses to delete a chain a map element still names: EBUSY)."""
    from nfproxy.kernel.nft import NftKernel, NftSession

    state = uniform_cluster(4, 2)
    old = Transaction("ip", TABLE)
    old.add(Map("old-dispatch", "ipv4_addr : verdict"))
    old.add(Chain("old-target"))
    old.add(Rule("old-target", "drop"))
    old.add(Element("old-dispatch", "10.8.8.8", "goto old-target"))
    old.add(Rule(nft_render.SERVICES_CHAIN, "ip daddr vmap @old-dispatch"))
    kernels: dict[IPFamily, NftKernel] = {}

    def make(family: IPFamily) -> NftKernel:
        return kernels.setdefault(family, NftKernel(family, netns=netns))

    Proxier("nft", kernels=make).sync(state)
    kernels[V4].apply(old)
    converge(Proxier("nft", kernels=make), state, full=True)  # a restart onto the same state
    chains, sets, _ = NftSession(netns).object_names("ip", TABLE) or (set(), set(), set())
    assert "old-target" not in chains and "old-dispatch" not in sets
    want = nft_render.render(state, V4)
    assert sets == set(want.sets) | set(want.shard_users)

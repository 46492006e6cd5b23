"""kubernetes#138571 (kube-proxy 1.37): no forced full resync in iptables' large cluster mode.

kube-proxy's iptables proxier skips its hourly full sync (proxyutil.FullSyncPeriod) while the
last sync counted more than largeClusterEndpointsThreshold (1000) endpoints over its service
ports: `doFullSync := needFullSync || (time.Since(lastFullSync) > FullSyncPeriod &&
!largeClusterMode)`. Its nftables proxier still does the hourly full sync, and a failure (or, in
nfproxy, a write by someone else) still makes the next sync full. On the in-memory kernels.
"""

from __future__ import annotations

import dataclasses

import pytest

from nfproxy.backends.iptables.render import LARGE_CLUSTER_ENDPOINTS
from nfproxy.core.model import (
    ClusterState,
    Endpoint,
    IPFamily,
    Protocol,
    ServicePort,
    ServicePortName,
    ServiceType,
)
from nfproxy.daemon.proxier import Proxier, SyncLoop
from nfproxy.kernel import memory
from nfproxy.testing import uniform_cluster
from tests.test_periodic_check import Recorder, delete_externally
from tests.test_proxier_memory import _StaticSource

V4, V6 = IPFamily.V4, IPFamily.V6
LARGE = uniform_cluster(101, 10)  # 1010 endpoints: kube-proxy's `totalEndpoints > 1000`
SMALL = uniform_cluster(100, 10)  # exactly 1000: not large


def proxier(backend: str, families: tuple[IPFamily, ...] = (V4,)) -> Proxier:
    make = memory.kernels(backend)
    return Proxier(backend, families=families, kernels=make)


def test_the_threshold_is_kube_proxys() -> None:
    assert LARGE_CLUSTER_ENDPOINTS == 1000
    assert sum(map(len, LARGE.endpoints.values())) == 1010
    assert sum(map(len, SMALL.endpoints.values())) == 1000


def test_iptables_in_large_cluster_mode_skips_the_forced_resync() -> None:
    p = proxier("iptables")
    assert p.sync(LARGE).kind == "full"
    result = p.sync(LARGE, resync=True)
    assert (result.kind, result.operations, result.resync_skipped) == ("noop", 0, (V4,))


@pytest.mark.parametrize(("backend", "state"), [("iptables", SMALL), ("nft", LARGE)])
def test_a_small_iptables_cluster_and_nftables_still_resync_in_full(backend: str, state: ClusterState) -> None:
    p = proxier(backend)
    p.sync(state)
    result = p.sync(state, resync=True)
    assert (result.kind, result.reason, result.resync_skipped) == ("full", "requested", ())


def test_large_cluster_mode_is_judged_on_the_last_sync_as_upstream() -> None:
    """The sync that shrinks the cluster is judged on the large state before it (kube-proxy sets
    largeClusterMode during the sync, after deciding doFullSync); the next one resyncs in full."""
    p = proxier("iptables")
    p.sync(LARGE)
    assert p.sync(SMALL, resync=True).kind == "partial"
    assert p.sync(SMALL, resync=True).kind == "full"


def test_outside_writes_and_requested_full_syncs_are_still_full() -> None:
    p = proxier("iptables")
    p.sync(LARGE)
    delete_externally(p.kernels[V4])
    result = p.sync(LARGE, resync=True, check=True)
    assert (result.kind, result.reason) == ("full", "rules changed outside nfproxy")
    assert p.sync(LARGE, full=True).kind == "full"  # run --once, a node change's caller


def _v6_service(i: int) -> tuple[ServicePort, tuple[Endpoint, ...]]:
    svc = ServicePort(
        name=ServicePortName("v6", f"svc-{i}", "http", Protocol.TCP), family=V6,
        type=ServiceType.CLUSTER_IP, cluster_ip=f"fd00:30::{i + 1:x}", port=80,
    )
    return svc, (Endpoint(f"fd00:10::{i + 1:x}", 8080, node_name="node-b"),)


def test_each_family_is_judged_on_its_own_as_kube_proxys_proxier_per_family() -> None:
    """Dual stack: IPv4 past the threshold, IPv6 with a few endpoints."""
    v6 = dict(_v6_service(i) for i in range(3))
    state = dataclasses.replace(
        LARGE,
        services={**LARGE.services, **{s.key: s for s in v6}},
        endpoints={**LARGE.endpoints, **{s.key: e for s, e in v6.items()}},
    )
    p = proxier("iptables", (V4, V6))
    p.sync(state)
    result = p.sync(state, resync=True)
    assert result.resync_skipped == (V4,)
    assert {f: part.kind for f, part in result.families.items()} == {V4: "noop", V6: "full"}


@pytest.mark.parametrize(("backend", "full_syncs"), [("iptables", False), ("nft", True)])
def test_the_loops_forced_resync(backend: str, full_syncs: bool) -> None:
    """The loop with the forced resync due at every sync (full_period 1 ms): an iptables node
    past the threshold writes nothing after its first sync; nftables resyncs in full."""
    p = proxier(backend)
    seen = Recorder()
    p.hooks.on_synced.append(seen)
    loop = SyncLoop(_StaticSource(LARGE), p, min_sync_period=0.001, sync_period=0.02, full_period=0.001)
    loop.start()
    try:
        results = seen.wait(lambda r: len(r) >= 5)[:5]
    finally:
        loop.stop()
    assert results[0].kind == "full"
    later = [r.kind for r in results[1:]]
    assert ("full" in later) is full_syncs, later
    if not full_syncs:
        assert later == ["noop"] * 4 and all(r.resync_skipped == (V4,) for r in results[1:])

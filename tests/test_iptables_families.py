"""Which families an iptables sync touches: a family with no service and no KUBE chain in its
kernel costs no restore and no jump check, and a family that held rules is still synced."""

from __future__ import annotations

import dataclasses

from nfproxy.backends.iptables.render import SERVICE_CHAIN_PREFIXES
from nfproxy.core.model import (
    ClusterState,
    Endpoint,
    IPFamily,
    Protocol,
    ServicePort,
    ServicePortName,
    ServiceType,
    sort_endpoints,
)
from nfproxy.daemon.proxier import Proxier
from nfproxy.kernel.memory.iptables import MemoryIptablesKernel
from nfproxy.testing import uniform_cluster
from tests.iptables_sync import fresh_dump

V4, V6 = IPFamily.V4, IPFamily.V6


def memory_proxier() -> tuple[Proxier, dict[IPFamily, MemoryIptablesKernel]]:
    kernels: dict[IPFamily, MemoryIptablesKernel] = {}

    def make(family: IPFamily) -> MemoryIptablesKernel:
        return kernels.setdefault(family, MemoryIptablesKernel(family))

    return Proxier("iptables", kernels=make), kernels


def with_v6_service(state: ClusterState) -> ClusterState:
    spn = ServicePortName("ns-v6", "web", "http", Protocol.TCP)
    svc = ServicePort(name=spn, family=V6, type=ServiceType.CLUSTER_IP, cluster_ip="fd00::10", port=80)
    eps = sort_endpoints([Endpoint(ip=f"fd00:1::{i}", port=8080, node_name="node-b") for i in (1, 2)])
    return dataclasses.replace(
        state, services={**state.services, svc.key: svc}, endpoints={**state.endpoints, svc.key: eps}
    )


def service_chains(kernel: MemoryIptablesKernel) -> set[str]:
    return {c for c in kernel.owned().chains if c.startswith(SERVICE_CHAIN_PREFIXES)}


def test_a_family_without_services_gets_no_pass() -> None:
    proxier, kernels = memory_proxier()
    state = uniform_cluster(5, 2)
    proxier.sync(state)
    proxier.sync(uniform_cluster(6, 2))
    proxier.sync(uniform_cluster(6, 2), full=True)
    assert kernels[V4].applied == 3
    assert kernels[V6].applied == 0 and not kernels[V6].owned().chains


def test_the_first_service_of_a_family_writes_it_in_full_and_its_removal_is_synced() -> None:
    proxier, kernels = memory_proxier()
    v4_only = uniform_cluster(5, 2)
    proxier.sync(v4_only)
    dual = with_v6_service(v4_only)
    proxier.sync(dual)  # a partial sync for IPv4; the IPv6 kernel is written for the first time
    assert kernels[V6].dump() == fresh_dump(dual, V6)
    assert service_chains(kernels[V6])
    proxier.sync(v4_only)
    assert not service_chains(kernels[V6])
    applied = kernels[V6].applied
    proxier.sync(v4_only, full=True)  # it held rules: it keeps being synced
    assert kernels[V6].applied == applied + 1


def test_leftover_chains_of_a_family_without_services_are_removed() -> None:
    previous, kernels = memory_proxier()
    dual = with_v6_service(uniform_cluster(5, 2))
    previous.sync(dual)
    assert service_chains(kernels[V6])

    def make(family: IPFamily) -> MemoryIptablesKernel:
        return kernels[family]

    restarted = Proxier("iptables", kernels=make)
    restarted.sync(uniform_cluster(5, 2))
    assert not service_chains(kernels[V6])

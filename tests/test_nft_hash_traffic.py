"""Endpoint-count changes of an nft hash-map chain, with real connections.

An unweighted chain of at most 16 endpoints draws `numgen random mod n` into a hash map, so a
count change rewrites its rule; past 16 it moves to an interval lane and back. Each step here
is a partial sync through the proxier: connections must reach exactly the endpoints the state
holds, and the table must then equal a fresh apply of the same state (endpoint maps resolved:
where a partial sync puts a chain's keys is the allocator's business).
"""

from __future__ import annotations

import pytest

from nfproxy.backends.nft import render as nft_render
from nfproxy.core.model import ClusterState, IPFamily, sort_endpoints
from nfproxy.daemon.proxier import Proxier
from nfproxy.kernel import netns
from nfproxy.kernel.nft import NftKernel
from nfproxy.verify.sandbox import Sandbox, SandboxSpec
from tests.test_converge import slots_resolved
from tests.test_sync_traffic import NODE, service

pytestmark = pytest.mark.kernel

IPS = [f"10.244.1.{i}" for i in range(1, 18)]
# 300 connections miss one of 17 equally likely endpoints with probability 17 * (16/17)^300,
# about 2e-7 a step: the six steps below fail by chance less than once in 10^6 runs.
CONNECTIONS = 300


def state_with(n: int) -> ClusterState:
    sp, eps = service("web", "10.96.0.10", IPS[:n])
    return ClusterState(NODE, {sp.key: sp}, {sp.key: sort_endpoints(eps)})


def dump(ns: str) -> str:
    kernel = NftKernel(IPFamily.V4, netns=ns)
    try:
        return kernel.dump()
    finally:
        kernel.close()


def fresh(state: ClusterState) -> str:
    with netns.throwaway("nfp-hash-ref") as ref:
        kernel = NftKernel(IPFamily.V4, netns=ref)
        try:
            kernel.apply(nft_render.render(state, IPFamily.V4).transactions())
        finally:
            kernel.close()
        return dump(ref)


def test_endpoint_count_changes_of_a_hash_chain_serve_exactly_the_endpoints_held() -> None:
    spec = SandboxSpec.of(node_ips=["192.168.0.2"], clients={"pod": "10.244.5.5"},
                          endpoints={ip: [(8080, "tcp")] for ip in IPS})
    with Sandbox(spec) as sb:
        proxier = Proxier("nft", netns=sb.node_ns)
        assert proxier.sync(state_with(10)).kind == "full"
        first = True
        for n, form in [(10, "-hash-"), (11, "-hash-"), (10, "-hash-"), (16, "-hash-"), (17, "-ranges-"), (16, "-hash-")]:
            state = state_with(n)
            result = proxier.sync(state)
            assert result.kind == ("noop" if n == 10 and first else "partial"), (n, result)
            first = False
            table = dump(sb.node_ns)
            rule = next(line for line in table.splitlines() if "numgen random" in line)
            assert form in rule, (n, rule)
            assert form == "-ranges-" or f"numgen random mod {n} " in rule, (n, rule)
            # A generous timeout and few in flight: a connection slowed by load is not a wrong one.
            outcomes = sb.connect("pod", "10.96.0.10", 80, "tcp", CONNECTIONS, timeout=10.0, parallel=16)
            assert all(o.ok for o in outcomes), [o for o in outcomes if not o.ok][:3]
            assert {o.endpoint for o in outcomes} == {f"{ip}:8080" for ip in IPS[:n]}, n
        assert slots_resolved(dump(sb.node_ns)) == slots_resolved(fresh(state_with(16)))


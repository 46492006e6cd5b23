"""The off table on the real kernel (docs/nft-layouts.md, "Chains off the lane"): a weighted
port whose weight sum leaves the lane's divisors lives in `nfproxy-off`; moves in and out are
partial syncs (nfnetlink and libnftables as the daemon sends them) that end where a fresh full
sync ends, and real connections are split by weight there and keep flowing across moves.

Chi-square thresholds as tests/test_weights_traffic.py argues them: p > 1e-5.
"""

from __future__ import annotations

from fractions import Fraction

import pytest

from nfproxy.core.model import (
    ClusterState,
    Endpoint,
    IPFamily,
    NodeConfig,
    Protocol,
    ServicePort,
    ServicePortName,
    ServiceType,
    sort_endpoints,
)
from nfproxy.daemon.proxier import Proxier
from nfproxy.kernel import netns
from nfproxy.kernel.nft import NftSession
from nfproxy.nftables import OFF_TABLE
from nfproxy.testing import uniform_cluster
from nfproxy.verify.sandbox import Sandbox, SandboxSpec, summarize
from nfproxy.verify.stats import goodness_of_fit
from tests.test_off_table import weighted
from tests.test_proxier import fresh, snapshot

pytestmark = pytest.mark.kernel

NODE = NodeConfig(name="node-a", ips=("192.168.0.2",), cluster_cidrs=("10.244.0.0/16",))
P_MIN = 1e-5
SPN = ServicePortName("weights", "off", "p", Protocol.TCP)
SVC = ServicePort(SPN, IPFamily.V4, ServiceType.CLUSTER_IP, "10.96.1.10", 80)
OTHER = ServicePort(ServicePortName("weights", "plain", "p", Protocol.TCP), IPFamily.V4,
                    ServiceType.CLUSTER_IP, "10.96.1.20", 80)
IPS = ("10.244.1.1", "10.244.1.2", "10.244.1.3")


def state_of(weights: tuple[int, ...]) -> ClusterState:
    eps = sort_endpoints([Endpoint(ip, 8080, weight=w) for ip, w in zip(IPS, weights)])
    other = sort_endpoints([Endpoint("10.244.2.1", 8080), Endpoint("10.244.2.2", 8080)])
    return ClusterState(NODE, {SVC.key: SVC, OTHER.key: OTHER}, {SVC.key: eps, OTHER.key: other})


def has_off_table(ns: str) -> bool:
    return NftSession(ns).list_table("ip", OFF_TABLE, terse=True) is not None


def test_moves_in_and_out_of_the_off_table_converge_to_a_fresh_full_sync() -> None:
    state = uniform_cluster(40, 3)
    keys = sorted((k for k in state.services if k[1] is IPFamily.V4), key=lambda k: k[0].name)
    steps = [
        (keys[3], [1, 2, 7]),  # on the lane: nfproxy
        (keys[3], [1, 2, 7, 7]),  # sum 17: the off table is made
        (keys[5], [1, 16]),  # a second port there
        (keys[3], [1, 2, 7, 9]),  # sum 19: its rule changes in the off table
        (keys[3], [1, 2, 7]),  # back
        (keys[5], [1, 1]),  # back: the last one, the off table goes
    ]
    with netns.throwaway("nfp-off") as ns:
        proxier = Proxier("nft", netns=ns)
        proxier.sync(state)
        tables = []
        for key, weights in steps:
            state = weighted(state, key, weights)
            assert proxier.sync(state).kind == "partial"
            proxier.sync(state)  # emptied chains deleted
            tables.append(has_off_table(ns))
            assert snapshot("nft", ns) == fresh("nft", state), (key, weights)
        assert tables == [False, True, True, True, True, False]


@pytest.mark.parametrize("backend", ["nft", "iptables"])
def test_a_sum_of_17_splits_real_connections_and_moves_keep_them(backend: str) -> None:
    """1:2:14 (sum 17, off the lane: the off table in nft) over 5 000 connections; a connection
    held across the moves into and out of the off table keeps its endpoint."""
    spec = SandboxSpec.of(node_ips=list(NODE.ips), clients={"pod": "10.244.5.5"},
                          endpoints={ip: [(8080, "tcp")] for ip in (*IPS, "10.244.2.1", "10.244.2.2")})
    on_lane = state_of((1, 2, 7))
    off_lane = state_of((1, 2, 14))
    with Sandbox(spec) as sb:
        proxier = Proxier(backend, netns=sb.node_ns)
        proxier.sync(on_lane)
        with sb.open("pod", SVC.cluster_ip, SVC.port, "tcp") as held:
            first = held.exchange()
            assert first.ok, first
            assert proxier.sync(off_lane).kind == "partial"
            if backend == "nft":
                assert has_off_table(sb.node_ns)
            outcomes = sb.connect("pod", SVC.cluster_ip, SVC.port, "tcp", 5000, timeout=3.0)
            counts = summarize(outcomes)
            want = {f"{ip}:8080": Fraction(w, 17) for ip, w in zip(IPS, (1, 2, 14))}
            assert set(counts) == set(want) and sum(counts.values()) == 5000, counts
            _, p = goodness_of_fit(counts, want)
            assert p > P_MIN, (counts, p)
            # The plain service beside it still answers from nfproxy's table.
            plain = {o.endpoint for o in sb.connect("pod", OTHER.cluster_ip, OTHER.port, "tcp", 60) if o.ok}
            assert plain == {"10.244.2.1:8080", "10.244.2.2:8080"}
            assert proxier.sync(on_lane).kind == "partial"
            proxier.sync(on_lane)
            if backend == "nft":
                assert not has_off_table(sb.node_ns)
            again = held.exchange()
            assert again.ok and again.endpoint == first.endpoint, again
        seen = {o.endpoint for o in sb.connect("pod", SVC.cluster_ip, SVC.port, "tcp", 200) if o.ok}
        assert seen == {f"{ip}:8080" for ip in IPS}

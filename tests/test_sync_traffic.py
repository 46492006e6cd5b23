"""Syncs under traffic: a held connection survives 100 partial syncs of other services' churn.

The proxier, not a one-shot apply, programs the sandbox's node here: every sync is the real
partial path (nfnetlink batches for nft, partial restores for iptables).
"""

from __future__ import annotations

import random

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
from nfproxy.verify.sandbox import Sandbox, SandboxSpec

pytestmark = pytest.mark.kernel

NODE = NodeConfig(name="node-a", ips=("192.168.0.2",), cluster_cidrs=("10.244.0.0/16",))
HELD = ("10.244.1.1", "10.244.1.2", "10.244.1.3")


def service(name: str, cluster_ip: str, ips: list[str]) -> tuple[ServicePort, tuple[Endpoint, ...]]:
    sp = ServicePort(ServicePortName("churn", name, "p", Protocol.TCP), IPFamily.V4,
                     ServiceType.CLUSTER_IP, cluster_ip, 80)
    return sp, sort_endpoints([Endpoint(ip, 8080, node_name="node-b") for ip in ips])


def state_of(services: list[tuple[ServicePort, tuple[Endpoint, ...]]]) -> ClusterState:
    return ClusterState(NODE, {sp.key: sp for sp, _ in services}, {sp.key: e for sp, e in services if e})


@pytest.mark.parametrize("backend", ["nft", "iptables"])
def test_established_connection_survives_100_syncs_of_churn(backend: str) -> None:
    rng = random.Random(5)
    held = service("held", "10.96.0.10", list(HELD))
    others = {i: service(f"other-{i}", f"10.96.1.{i}", [f"10.244.2.{rng.randrange(1, 200)}" for _ in range(3)])
              for i in range(1, 40)}
    spec = SandboxSpec.of(node_ips=["192.168.0.2"], clients={"pod": "10.244.5.5"},
                          endpoints={ip: [(8080, "tcp")] for ip in HELD})
    with Sandbox(spec) as sb:
        proxier = Proxier(backend, netns=sb.node_ns)
        live = dict(list(others.items())[:20])
        assert proxier.sync(state_of([held, *live.values()])).kind == "full"
        with sb.open("pod", "10.96.0.10", 80, "tcp") as conn:
            first = conn.exchange()
            assert first.ok, first
            kinds = []
            for step in range(100):
                # Churn: add or remove another service, or change another service's endpoints.
                i = rng.choice(list(others))
                if i in live and rng.random() < 0.4:
                    del live[i]
                elif i in live:
                    sp, eps = live[i]
                    live[i] = (sp, sort_endpoints([*eps[1:], Endpoint(f"10.244.3.{step + 1}", 8080)]))
                else:
                    live[i] = others[i]
                kinds.append(proxier.sync(state_of([held, *live.values()])).kind)
                if step % 10 == 9:
                    again = conn.exchange()
                    assert again.ok and again.endpoint == first.endpoint, (step, again)
            assert kinds.count("partial") == 100, kinds
        # And the service itself still balances across its endpoints after the churn.
        seen = {o.endpoint for o in sb.connect("pod", "10.96.0.10", 80, "tcp", 60) if o.ok}
        assert seen == {f"{ip}:8080" for ip in HELD}

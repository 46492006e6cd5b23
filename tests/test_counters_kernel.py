"""The kernel's per-endpoint connection counters under a real proxier: exact, kept through
partial syncs of other services (and, nft, through full syncs), and exported as a metric."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from nfproxy.analysis.counters import read_live_counts
from nfproxy.core.model import Endpoint, sort_endpoints
from nfproxy.daemon.endpoint_connections import EndpointConnectionsCollector, reader
from nfproxy.daemon.proxier import Proxier
from nfproxy.verify.sandbox import Sandbox, SandboxSpec
from tests.test_sync_traffic import service, state_of

pytestmark = pytest.mark.kernel

HELD = ("10.244.1.1", "10.244.1.2", "10.244.1.3")


def _counted(backend: str, ns: str) -> Counter[str]:
    return Counter({c.endpoint: c.connections for c in read_live_counts(backend, ns) if c.service == "held"})


@pytest.mark.parametrize("backend", ["nft", "iptables"])
def test_counters_are_exact_and_survive_other_services_syncs(backend: str) -> None:
    rng = random.Random(7)
    held = service("held", "10.96.0.10", list(HELD))
    others = {i: service(f"other-{i}", f"10.96.1.{i}", [f"10.244.2.{rng.randrange(1, 200)}" for _ in range(3)])
              for i in range(1, 20)}
    spec = SandboxSpec.of(node_ips=["192.168.0.2"], clients={"pod": "10.244.5.5"},
                          endpoints={ip: [(8080, "tcp")] for ip in HELD})
    with Sandbox(spec) as sb:
        proxier = Proxier(backend, netns=sb.node_ns)
        live = dict(list(others.items())[:10])
        assert proxier.sync(state_of([held, *live.values()])).kind == "full"
        seen: Counter[str] = Counter()

        def traffic(n: int) -> None:
            outcomes = sb.connect("pod", "10.96.0.10", 80, "tcp", n)
            assert all(o.ok for o in outcomes), outcomes
            seen.update(o.endpoint for o in outcomes)

        traffic(90)
        assert _counted(backend, sb.node_ns) == seen and sum(seen.values()) == 90
        kinds = []
        for step in range(12):
            i = rng.choice(list(others))
            if i in live:
                sp, eps = live.pop(i)
                if step % 2:
                    live[i] = (sp, sort_endpoints([*eps[1:], Endpoint(f"10.244.3.{step + 1}", 8080)]))
            else:
                live[i] = others[i]
            kinds.append(proxier.sync(state_of([held, *live.values()])).kind)
        assert set(kinds) == {"partial"}, kinds
        traffic(30)
        assert _counted(backend, sb.node_ns) == seen  # nothing reset, nothing counted twice

        registry = CollectorRegistry()
        registry.register(EndpointConnectionsCollector(reader(backend, sb.node_ns)))
        text = generate_latest(registry).decode()
        for ep, n in seen.items():
            line = (f'nfproxy_endpoint_new_connections_total{{endpoint="{ep}",namespace="churn",'
                    f'port="p",service="held"}} {float(n)}')
            assert line in text, text

        # A full sync with another service's endpoints changed: nft's endpoint maps are diffed
        # against what the kernel holds, not flushed, so held's counters go on; iptables
        # rewrites every chain on a full sync, which resets them (docs/metrics.md).
        i, (sp, eps) = next(iter(live.items()))
        live[i] = (sp, sort_endpoints([*eps[1:], Endpoint("10.244.4.1", 8080)]))
        assert proxier.sync(state_of([held, *live.values()]), full=True).kind == "full"
        traffic(30)
        if backend == "nft":
            assert _counted(backend, sb.node_ns) == seen
        else:
            assert sum(_counted(backend, sb.node_ns).values()) == 30
        # Replacing an endpoint (the count stays): nft gives the new one the old one's range,
        # from zero, and the others keep their counts; iptables rewrites the changed service's
        # chains, so all restart.
        gone = f"{HELD[0]}:8080"
        swapped = [*HELD[1:], "10.244.1.9"]
        assert proxier.sync(state_of([service("held", "10.96.0.10", swapped), *live.values()])).kind == "partial"
        counted = _counted(backend, sb.node_ns)
        assert set(counted) == set(seen) - {gone} | {"10.244.1.9:8080"}
        if backend == "nft":
            assert counted == {**{ep: seen[ep] for ep in seen if ep != gone}, "10.244.1.9:8080": 0}, (counted, seen)
        else:
            assert set(counted.values()) == {0}
        # Removing an endpoint removes its counter. nft (a hash-map chain: one key per endpoint)
        # keeps the others on their keys and their counts, but for the one that moves from the
        # last key to the freed one, which starts from zero; iptables restarts them all.
        before = counted
        assert proxier.sync(state_of([service("held", "10.96.0.10", list(HELD[1:])), *live.values()])).kind == "partial"
        counted = _counted(backend, sb.node_ns)
        assert set(counted) == set(seen) - {gone}, (counted, seen)
        if backend == "nft":
            moved = [ep for ep in counted if counted[ep] != before[ep]]
            assert len(moved) <= 1 and all(counted[ep] == 0 for ep in moved), (counted, before)
            assert sum(counted.values()) > 0, (counted, before)
        else:
            assert set(counted.values()) == {0}, (counted, seen)

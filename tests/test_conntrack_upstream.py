"""kube-proxy's own conntrack cleanup tests, on nfproxy's daemon (no root).

Translated from kubernetes v1.37.2 pkg/proxy/conntrack/cleanup_test.go: TestCleanStaleEntries,
TestServiceWithoutEndpoints (kubernetes#139629: a UDP service scaled to zero) and
TestPerformanceCleanStaleEntries (one dump of the table per cleanup). Upstream drives
CleanStaleEntries with a fake netlink handler; here the daemon syncs the in-memory kernels and
walks a conntrack table held in memory (`Table`, in place of nfproxy.kernel.conntrack's
ctnetlink walk), so what is tested is the daemon's choice of entries and of syncs. Upstream's
entries to `*:NodePort` have no destination address; here they go to the node's address.

Then what kube-proxy does around it (iptables/nftables proxier.go): the cleanup runs after every
sync whose endpoint changes touched a UDP service (EndpointsMap.Update's
ConntrackCleanupRequired), not after the others.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Iterable

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
from nfproxy.daemon.node import Daemon, DaemonConfig
from nfproxy.daemon.proxier import Proxier
from nfproxy.kernel import conntrack as kct
from nfproxy.kernel.conntrack import Flow, FlowFilter
from nfproxy.kernel.memory.nft import MemoryNft

V4 = IPFamily.V4
TCP, UDP, SCTP = Protocol.TCP, Protocol.UDP, Protocol.SCTP
NODE_IP = "192.168.0.2"
NODE = NodeConfig(name="test-worker", ips=(NODE_IP,), cluster_cidrs=("10.240.0.0/12",))

# cleanup_test.go's constants
CLUSTER_IP = "172.30.1.1"
EXTERNAL_IP = "192.168.99.100"
LOAD_BALANCER_IP = "1.2.3.4"
SERVING = "10.240.0.4"
NON_SERVING = "10.240.1.5"
DELETED = "10.240.2.6"
OLD_ENDPOINT_PORT = 8080  # an endpoint whose port changed, its IP the same
ENDPOINT_PORT = 9090
SERVICE_PORT = 8000
NODE_PORT = 32000
NON_SERVICE_PORT = 3000  # flows kube-proxy does not own
FRONTENDS = (CLUSTER_IP, LOAD_BALANCER_IP, EXTERNAL_IP)


class Table:
    """A conntrack table in memory: the daemon's walks judge and delete its flows (upstream's
    fakeHandler), and each walk is counted (upstream counts netlink requests)."""

    def __init__(self, flows: Iterable[Flow]) -> None:
        self.flows = list(flows)
        self.walks = 0

    def delete_judged(self, _netns: object, family: IPFamily, protocol: Protocol, *rest: object) -> int:
        judge: Callable[[Flow], str | None] = rest[-1]  # type: ignore[assignment]
        self.walks += 1
        kept = [f for f in self.flows if f.family is not family or f.protocol is not protocol or judge(f) is None]
        deleted = len(self.flows) - len(kept)
        self.flows = kept
        return deleted

    def delete_per_family(self, filters: Iterable[FlowFilter], _netns: object = None) -> dict[IPFamily, int]:
        """The filters' way in (the daemon before 2026-12-07 also deleted by them)."""
        filters = list(filters)
        self.walks += 1
        kept = [f for f in self.flows if not any(
            x.family is f.family and x.matches(f.protocol, f.orig_dst, f.orig_dport, f.reply_src, f.reply_sport)
            for x in filters)]
        deleted = len(self.flows) - len(kept)
        self.flows = kept
        return {V4: deleted}


_sports = iter(range(10_000, 1 << 30))


def conntrack_entry(orig_dst: str, orig_dport: int, reply_src: str, reply_sport: int | None,
                    protocol: Protocol) -> Flow:
    """generateConntrackEntry: each with its own client port, so no two are equal."""
    sport = next(_sports)
    return Flow(V4, protocol, "10.250.0.1", sport, orig_dst or NODE_IP, orig_dport, reply_src, reply_sport,
                "10.250.0.1", sport)


def service(protocol: Protocol, name: str, node_port: int = 0) -> ServicePort:
    return ServicePort(
        name=ServicePortName("test", "cleanup-test", name, protocol), family=V4,
        type=ServiceType.LOAD_BALANCER if node_port else ServiceType.CLUSTER_IP,
        cluster_ip=CLUSTER_IP, port=SERVICE_PORT, node_port=node_port,
        external_ips=(EXTERNAL_IP,), load_balancer_ips=(LOAD_BALANCER_IP,),
    )


def endpoints() -> tuple[Endpoint, ...]:
    return sort_endpoints([
        Endpoint(SERVING, ENDPOINT_PORT, node_name="test-worker", ready=True, serving=True),
        Endpoint(NON_SERVING, ENDPOINT_PORT, node_name="test-worker", ready=False, serving=False),
    ])


def cluster(*ports: tuple[ServicePort, tuple[Endpoint, ...]]) -> ClusterState:
    return ClusterState(NODE, {p.key: p for p, _ in ports}, {p.key: eps for p, eps in ports if eps})


def daemon(table: Table, monkeypatch: pytest.MonkeyPatch) -> Daemon:
    monkeypatch.setattr(kct, "delete_judged", table.delete_judged)
    monkeypatch.setattr(kct, "delete_per_family", table.delete_per_family)
    proxier = Proxier("nft", families=(V4,), kernels=lambda family: MemoryNft(family))
    config = DaemonConfig("nft", health_check_node_ports=False, healthz_bind_address="", metrics_bind_address="")
    return Daemon(None, config, proxier)  # type: ignore[arg-type]  # driven through its proxier


def deleted_total(d: Daemon) -> float:
    return d.metrics.conntrack_reconciler_deleted.labels("IPv4")._value.get()


def test_clean_stale_entries(monkeypatch: pytest.MonkeyPatch) -> None:
    state = cluster(
        (service(TCP, "test-tcp"), endpoints()),
        (service(UDP, "test-udp", NODE_PORT), endpoints()),
        (service(SCTP, "test-sctp", NODE_PORT), endpoints()),
    )
    before: list[Flow] = []
    after: list[Flow] = []
    # The endpoint's port changed, its IP did not: stale.
    for dst in FRONTENDS:
        before.append(conntrack_entry(dst, SERVICE_PORT, SERVING, OLD_ENDPOINT_PORT, UDP))
    # 3 endpoints x 3 protocols x (3 frontends x 2 ports + the node port)
    for dnat in (SERVING, NON_SERVING, DELETED):
        for proto in (TCP, UDP, SCTP):
            for dst in FRONTENDS:
                for port in (SERVICE_PORT, NON_SERVICE_PORT):
                    e = conntrack_entry(dst, port, dnat, ENDPOINT_PORT, proto)
                    before.append(e)
                    if not (proto is UDP and port == SERVICE_PORT and dnat != SERVING):
                        after.append(e)
            e = conntrack_entry("", NODE_PORT, dnat, ENDPOINT_PORT, proto)
            before.append(e)
            if not (proto is UDP and dnat != SERVING):
                after.append(e)
    # Not DNATed (no DROP/REJECT rule yet for a service without endpoints): --orig-dst is
    # --reply-src; stale on the service port.
    for ip in FRONTENDS:
        for port in (SERVICE_PORT, NON_SERVICE_PORT):
            e = conntrack_entry(ip, port, ip, None, UDP)
            before.append(e)
            if port != SERVICE_PORT:
                after.append(e)
    assert (len(before), len(after)) == (72, 58)

    table = Table(before)
    d = daemon(table, monkeypatch)
    d.proxier.sync(state)
    assert sorted(table.flows, key=repr) == sorted(after, key=repr)
    assert deleted_total(d) == len(before) - len(after)


def test_service_without_endpoints(monkeypatch: pytest.MonkeyPatch) -> None:
    """kubernetes#139629: the slice belongs to another service, so this one has none."""
    udp = service(UDP, "test-udp", NODE_PORT)
    before: list[Flow] = []
    after: list[Flow] = []
    # Every UDP entry to a frontend of a service without serving endpoints is stale, whichever
    # (deleted) endpoint it is DNATed to.
    for dst in FRONTENDS:
        for dnat in (SERVING, DELETED):
            before.append(conntrack_entry(dst, SERVICE_PORT, dnat, ENDPOINT_PORT, UDP))
    kept = [
        conntrack_entry(EXTERNAL_IP, NON_SERVICE_PORT, DELETED, ENDPOINT_PORT, UDP),  # no frontend
        conntrack_entry(EXTERNAL_IP, SERVICE_PORT, DELETED, ENDPOINT_PORT, TCP),  # not UDP
        # *:NodePort is matched on the port alone: with no endpoints it would take anyone's
        # flow to that port, so upstream leaves it.
        conntrack_entry("", NODE_PORT, DELETED, ENDPOINT_PORT, UDP),
    ]
    before += kept
    after += kept

    table = Table(before)
    d = daemon(table, monkeypatch)
    d.proxier.sync(cluster((udp, ())))
    assert sorted(table.flows, key=repr) == sorted(after, key=repr)
    assert deleted_total(d) == 6


def test_performance_clean_stale_entries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Upstream's 1 000 000 random entries, scaled to 100 000: one walk of the table deletes
    exactly those to the service port (upstream: 1 dump, then one request per stale entry)."""
    udp = dataclasses.replace(service(UDP, "test-udp"), load_balancer_ips=(LOAD_BALANCER_IP,))
    flows = [
        conntrack_entry(EXTERNAL_IP, SERVICE_PORT, SERVING, ENDPOINT_PORT, UDP),  # valid
        conntrack_entry(EXTERNAL_IP, SERVICE_PORT, DELETED, ENDPOINT_PORT, UDP),  # stale
    ]
    expected_entries, expected_deleted = 1, 1
    rng = random.Random(139629)
    for _ in range(100_000):
        port = rng.randrange(65535)
        if port == SERVICE_PORT:
            expected_deleted += 1
        else:
            expected_entries += 1
        flows.append(conntrack_entry(EXTERNAL_IP, port, DELETED, ENDPOINT_PORT, UDP))
    table = Table(flows)
    d = daemon(table, monkeypatch)
    d.proxier.sync(cluster((udp, endpoints())))
    assert len(table.flows) == expected_entries
    assert (table.walks, deleted_total(d)) == (1, expected_deleted)


# ---- when: kube-proxy cleans after each sync that changed a UDP service's endpoints


def dns(cluster_ip: str = "10.96.0.10", name: str = "dns", protocol: Protocol = UDP) -> ServicePort:
    return ServicePort(name=ServicePortName("kube-system", name, "p", protocol), family=V4,
                       type=ServiceType.NODE_PORT, cluster_ip=cluster_ip, port=53,
                       node_port=30053 if protocol is UDP else 30080)


def ep(ip: str) -> Endpoint:
    return Endpoint(ip, 5353, node_name="test-worker")


def with_endpoints(state: ClusterState, svc: ServicePort, *ips: str) -> ClusterState:
    return dataclasses.replace(state, endpoints={**state.endpoints, svc.key: sort_endpoints([ep(i) for i in ips])})


def test_every_sync_that_changes_a_udp_service_walks_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """An entry stale for a reason no change names (left by a crash, another program, a walk
    that failed unnoticed) goes at the next sync that changes a UDP service's endpoints, as
    upstream; a sync that changes only TCP services does not walk the table."""
    udp, tcp = dns(), dns("10.96.0.80", "web", TCP)
    start = with_endpoints(with_endpoints(cluster((udp, ()), (tcp, ())), udp, "10.244.0.5"), tcp, "10.244.0.9")
    table = Table([])
    d = daemon(table, monkeypatch)
    d.proxier.sync(start)
    assert table.walks == 1  # the first sync: what changed while the daemon was down is unknown
    stray = conntrack_entry("10.96.0.10", 53, "10.244.7.7", 5353, UDP)  # no endpoint of the service
    pinned = conntrack_entry("10.96.0.10", 53, "10.244.0.5", 5353, UDP)
    table.flows += [stray, pinned]

    tcp_change = with_endpoints(start, tcp, "10.244.0.9", "10.244.0.10")
    assert d.proxier.sync(tcp_change).kind == "partial"
    assert (table.walks, table.flows) == (1, [stray, pinned])

    udp_change = with_endpoints(tcp_change, udp, "10.244.0.5", "10.244.0.6")  # one more endpoint
    assert d.proxier.sync(udp_change).kind == "partial"
    assert (table.walks, table.flows) == (2, [pinned])
    assert d.proxier.sync(udp_change).kind == "noop" and table.walks == 2


def test_scaled_to_zero_at_a_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    """kubernetes#139629 as a node sees it: the service's last endpoint goes. Every entry to its
    address goes, DNATed or not; through the node port, those DNATed to the gone endpoints
    (nfproxy knows them from the change), not someone else's flow to that port."""
    udp = dns()
    table = Table([])
    d = daemon(table, monkeypatch)
    d.proxier.sync(with_endpoints(cluster((udp, ())), udp, "10.244.0.5", "10.244.0.6"))
    gone = [
        conntrack_entry("10.96.0.10", 53, "10.244.0.5", 5353, UDP),
        conntrack_entry("10.96.0.10", 53, "10.244.0.6", 5353, UDP),
        conntrack_entry("10.96.0.10", 53, "10.96.0.10", 53, UDP),  # never DNATed
        conntrack_entry("", 30053, "10.244.0.6", 5353, UDP),
    ]
    theirs = conntrack_entry("192.168.0.77", 30053, "192.168.0.77", 30053, UDP)
    table.flows += [*gone, theirs]
    assert d.proxier.sync(cluster((udp, ()))).kind == "partial"
    assert table.flows == [theirs]
    assert deleted_total(d) == 4

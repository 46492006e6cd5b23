"""The conntrack reconciliation: every entry sent to a UDP frontend judged against its
serving endpoints, as kube-proxy's CleanStaleEntries.

The probe that first found it: a UDP service 10.96.0.53:53, an entry pinned to endpoint .5, the
daemon stopped, .5 replaced by .6, the daemon restarted: its first sync had no previous state to
diff, so it cleaned nothing and the client stayed pinned to .5. Since then the first sync walked
the table; now every sync that changes a UDP service port does (tests/test_conntrack_upstream.py).
"""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import given

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
from nfproxy.core.changes import diff
from nfproxy.daemon.conntrack import Frontends, sweeps, udp_frontends
from nfproxy.daemon.node import Daemon, DaemonConfig
from nfproxy.daemon.proxier import Proxier
from nfproxy.kernel import conntrack as kct
from nfproxy.kernel.conntrack import Flow
from nfproxy.kernel.memory.nft import MemoryNft
from nfproxy.testing import clusters, random_cluster
from tests.test_conntrack import add_entry

V4, V6 = IPFamily.V4, IPFamily.V6
UDP = Protocol.UDP
NODE = NodeConfig(name="node-a", ips=("192.168.0.2",), cluster_cidrs=("10.244.0.0/16",))
OLD, NEW = "10.244.0.5", "10.244.0.6"
CLIENT = "10.244.1.9"


def port_of(name: str, protocol: Protocol = UDP, **kw: object) -> ServicePort:
    fields: dict = dict(name=ServicePortName("kube-system", name, "dns", protocol), family=V4,
                        type=ServiceType.CLUSTER_IP, port=53)
    fields.update(kw)
    return ServicePort(**fields)


def cluster(*ports: tuple[ServicePort, list[Endpoint]]) -> ClusterState:
    return ClusterState(
        NODE, {p.key: p for p, _ in ports}, {p.key: sort_endpoints(eps) for p, eps in ports if eps}
    )


def ep(ip: str, port: int = 53, **kw: object) -> Endpoint:
    return Endpoint(ip, port, node_name="node-a", **kw)  # type: ignore[arg-type]


DNS = port_of("dns", cluster_ip="10.96.0.53", type=ServiceType.NODE_PORT, node_port=30053,
              external_ips=("203.0.113.7",))
DNS6 = port_of("dns", family=V6, cluster_ip="fd00:96::35")
EMPTY = port_of("empty", cluster_ip="10.96.0.99")
DNS_TCP = port_of("dns", protocol=Protocol.TCP, cluster_ip="10.96.0.53")
NOW = cluster((DNS, [ep(NEW), ep("10.244.0.7", serving=False)]), (DNS6, [ep("fd01::6")]),
              (EMPTY, []), (DNS_TCP, [ep(NEW)]))


def flow(dst: str, dport: int, reply: str, rport: int = 53, family: IPFamily = V4,
         protocol: Protocol = UDP, src: str = CLIENT) -> Flow:
    return Flow(family, protocol, src, 40000, dst, dport, reply, rport, src, 40000)


# ---- which entries are stale (pure)


def test_frontends_are_every_udp_port_and_the_node_ports_with_serving_endpoints() -> None:
    frontends = udp_frontends(NOW)
    assert set(frontends) == {V4, V6}
    assert frontends[V4].addresses == {
        ("10.96.0.53", 53): frozenset({(NEW, 53)}), ("203.0.113.7", 53): frozenset({(NEW, 53)}),
        ("10.96.0.99", 53): frozenset(),  # no serving endpoint: every entry to it is stale
    }
    assert frontends[V4].node_ports == {30053: frozenset({(NEW, 53)})}
    assert frontends[V6].addresses == {("fd00:96::35", 53): frozenset({("fd01::6", 53)})}
    empty_np = port_of("empty", cluster_ip="10.96.0.99", type=ServiceType.NODE_PORT, node_port=30099)
    assert udp_frontends(cluster((empty_np, []), (DNS_TCP, [ep(NEW)]))) == {
        V4: Frontends(V4, {("10.96.0.99", 53): frozenset()}, {}),  # a node port only with endpoints
    }
    assert udp_frontends(cluster((DNS_TCP, [ep(NEW)]))) == {}


def test_entries_whose_reply_is_no_serving_endpoint_are_stale() -> None:
    v4 = udp_frontends(NOW)[V4]
    stale = [
        flow("10.96.0.53", 53, OLD),  # the endpoint went away while the daemon was down
        flow("203.0.113.7", 53, OLD),  # through an external IP
        flow("192.168.0.2", 30053, OLD),  # through the node port
        flow("10.96.0.53", 53, NEW, 5353),  # the target port moved
        flow("10.96.0.53", 53, "10.96.0.53"),  # not NATed: the black hole before the rules
        flow("10.96.0.53", 53, "10.244.0.7"),  # no longer serving
        flow("10.96.0.99", 53, OLD),  # a service without serving endpoints (kubernetes#139629)
    ]
    kept = [
        flow("10.96.0.53", 53, NEW),
        flow("192.168.0.2", 30053, NEW),
        flow("10.96.0.53", 53, OLD, protocol=Protocol.TCP),  # TCP is never touched
        flow("10.96.0.53", 54, OLD),  # another port
        flow("8.8.8.8", 53, "8.8.8.8"),  # not a service
    ]
    assert [f for f in stale if not v4.stale(f)] == []
    assert [f for f in kept if v4.stale(f)] == []
    assert v4.stale(stale[0]) == "10.96.0.53:53: reply from 10.244.0.5:53, not a serving endpoint"
    assert "node port 30053" in (v4.stale(stale[2]) or "")
    assert v4.stale(stale[-1]) == "10.96.0.99:53: reply from 10.244.0.5:53, the service has no serving endpoint"
    v6 = udp_frontends(NOW)[V6]
    assert v6.stale(flow("fd00:96::35", 53, "fd01::5", family=V6)) == (
        "fd00:96::35:53: reply from [fd01::5]:53, not a serving endpoint"
    )
    assert v6.stale(flow("fd00:96::35", 53, "fd01::6", family=V6)) is None


@given(clusters(max_services=15, max_endpoints=6))
def test_a_restart_finds_what_the_sync_would_have_through_the_addresses(old: ClusterState) -> None:
    """Whatever the sync old -> new deletes among flows DNATed through cluster IPs to the old
    serving endpoints, the first sync after a restart into `new` (no old state) deletes too."""
    new = dataclasses.replace(old, endpoints={k: eps[::2] for k, eps in old.endpoints.items()})
    seen = {s.family: s for s in sweeps(old, new, diff(old, new).keys)}
    blind = {s.family: s for s in sweeps(None, new, ())}
    for key, eps in old.endpoints.items():
        svc = old.services[key]
        for e in eps:
            if not e.serving or svc.protocol is not UDP or not svc.cluster_ip:
                continue
            f = flow(svc.cluster_ip, svc.port, e.ip, e.port, family=key[1])
            if key[1] in seen and seen[key[1]].stale(f):
                assert blind[key[1]].stale(f), (f, new.endpoints.get(key))


def test_serving_endpoints_are_never_stale_on_random_clusters() -> None:
    state = random_cluster(random.Random(11), 40)
    for key, eps in state.endpoints.items():
        svc = state.services[key]
        frontends = udp_frontends(state).get(key[1])
        for e in eps:
            if svc.protocol is UDP and e.serving and svc.cluster_ip:
                assert frontends is not None
                assert frontends.stale(flow(svc.cluster_ip, svc.port, e.ip, e.port, family=key[1])) is None


# ---- the daemon's first sync, against a real conntrack table in a throwaway namespace


class StillSource:
    def snapshot(self) -> None:  # the daemon is driven through its proxier here
        raise AssertionError("not used")


def daemon_in(netns: str) -> Daemon:
    proxier = Proxier("nft", kernels=lambda family: MemoryNft(family))
    config = DaemonConfig("nft", netns=netns, health_check_node_ports=False,
                          healthz_bind_address="", metrics_bind_address="")
    return Daemon(StillSource(), config, proxier)  # type: ignore[arg-type]


def udp_entries(netns: str, family: IPFamily) -> set[tuple[str, int | None, str, int | None]]:
    return {(f.orig_dst, f.orig_dport, f.reply_src, f.reply_sport) for f in kct.list_flows(netns, family)}


@pytest.mark.kernel
def test_the_first_sync_after_a_start_deletes_entries_to_endpoints_gone_meanwhile(netns: str) -> None:
    def entry(sport: int, dst: str, dport: int, reply: str, rport: int = 53, proto: int = 17) -> None:
        add_entry(netns, V4, (CLIENT, sport, dst, dport), (reply, rport, CLIENT, sport), proto=proto)

    entry(40001, "10.96.0.53", 53, OLD)  # the probe's entry: pinned to .5, which went away
    entry(40002, "10.96.0.53", 53, NEW)
    entry(40003, "10.96.0.53", 53, "10.96.0.53")  # un-NATed
    entry(40004, "192.168.0.2", 30053, OLD)
    entry(40005, "192.168.0.2", 30053, NEW)
    entry(40006, "10.96.0.99", 53, OLD)  # a service without endpoints (kubernetes#139629)
    entry(40007, "10.96.0.53", 53, OLD, proto=6)
    add_entry(netns, V6, ("fd01::9", 40008, "fd00:96::35", 53), ("fd01::5", 53, "fd01::9", 40008))
    add_entry(netns, V6, ("fd01::9", 40009, "fd00:96::35", 53), ("fd01::6", 53, "fd01::9", 40009))

    daemon = daemon_in(netns)
    daemon.proxier.sync(NOW)  # the first sync: no previous state
    assert udp_entries(netns, V4) == {("10.96.0.53", 53, NEW, 53), ("192.168.0.2", 30053, NEW, 53)}
    assert [f.orig_sport for f in kct.list_flows(netns, V4, Protocol.TCP)] == [40007]
    assert udp_entries(netns, V6) == {("fd00:96::35", 53, "fd01::6", 53)}
    deleted = daemon.metrics.conntrack_deleted
    assert deleted.labels("IPv4")._value.get() == 4 and deleted.labels("IPv6")._value.get() == 1
    assert not daemon._conntrack_unreconciled
    for family in ("IPv4", "IPv6"):  # kube-proxy's duration of a reconciliation, once per family
        assert reconciliations(daemon, family) == 1


def reconciliations(daemon: Daemon, family: str) -> float | None:
    return daemon.metrics.registry.get_sample_value(
        "kubeproxy_conntrack_reconciler_sync_duration_seconds_count", {"ip_family": family})


@pytest.mark.kernel
def test_a_failed_cleanup_is_made_good_by_the_next_sync_even_one_that_writes_nothing(
    netns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cleanup that fails leaves stale entries the next syncs' changes may not name: the next
    sync walks every family with UDP services, also when it writes no rule, and stops once that
    worked."""
    daemon = daemon_in(netns)
    daemon.proxier.sync(NOW)  # reconciled at start
    later = dataclasses.replace(NOW, endpoints={**NOW.endpoints, DNS.key: sort_endpoints([ep("10.244.0.8")])})
    add_entry(netns, V4, (CLIENT, 40011, "10.96.0.53", 53), (NEW, 53, CLIENT, 40011))  # pinned to .6, replaced below

    def unreadable(*_: object, **__: object) -> int:
        raise OSError("conntrack table unreadable")

    monkeypatch.setattr(kct, "delete_judged", unreadable)
    assert daemon.proxier.sync(later).kind == "partial"
    assert daemon._conntrack_unreconciled and ("10.96.0.53", 53, NEW, 53) in udp_entries(netns, V4)
    monkeypatch.undo()
    assert daemon.proxier.sync(later).kind == "noop"
    assert ("10.96.0.53", 53, NEW, 53) not in udp_entries(netns, V4)
    assert not daemon._conntrack_unreconciled and reconciliations(daemon, "IPv4") == 2
    assert daemon.proxier.sync(later).kind == "noop" and reconciliations(daemon, "IPv4") == 2  # nothing owed


@pytest.mark.kernel
def test_a_reconciliation_that_cannot_read_the_table_is_retried_and_never_fails_the_sync() -> None:
    daemon = daemon_in("nfp-test-no-such-namespace")
    assert daemon.proxier.sync(NOW).kind == "full"
    assert daemon._conntrack_unreconciled
    assert daemon.metrics.conntrack_failures.labels("IPv4")._value.get() == 1


@pytest.mark.kernel
def test_a_service_scaled_to_zero_keeps_no_entry_to_its_addresses(netns: str) -> None:
    """kubernetes#139629 on the real table: the sync that takes the last endpoint away deletes
    every entry sent to the service's addresses, DNATed or not, and those DNATed to the gone
    endpoint through the node port; someone else's flow to that port number stays."""
    daemon = daemon_in(netns)
    daemon.proxier.sync(NOW)
    add_entry(netns, V4, (CLIENT, 40021, "10.96.0.53", 53), (NEW, 53, CLIENT, 40021))
    add_entry(netns, V4, (CLIENT, 40022, "203.0.113.7", 53), (NEW, 53, CLIENT, 40022))
    add_entry(netns, V4, (CLIENT, 40023, "10.96.0.53", 53), ("10.96.0.53", 53, CLIENT, 40023))  # not DNATed
    add_entry(netns, V4, (CLIENT, 40024, "192.168.0.2", 30053), (NEW, 53, CLIENT, 40024))
    add_entry(netns, V4, (CLIENT, 40025, "192.168.0.9", 30053), ("192.168.0.9", 30053, CLIENT, 40025))
    add_entry(netns, V6, ("fd01::9", 40026, "fd00:96::35", 53), ("fd01::6", 53, "fd01::9", 40026))
    zero = dataclasses.replace(NOW, endpoints={k: v for k, v in NOW.endpoints.items() if k != DNS.key})
    assert daemon.proxier.sync(zero).kind == "partial"
    assert udp_entries(netns, V4) == {("192.168.0.9", 30053, "192.168.0.9", 30053)}
    assert udp_entries(netns, V6) == {("fd00:96::35", 53, "fd01::6", 53)}  # IPv6 did not change
    assert reconciliations(daemon, "IPv6") == 1  # the first sync only

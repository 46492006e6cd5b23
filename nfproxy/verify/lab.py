"""The lab: both backends, the same services, real connections, and what the rules promise.

A claim like "both backends split traffic 1/n" is only worth something when it is measured on
real packets and compared with an exact expectation. The lab builds one traffic sandbox per
backend (so conntrack and affinity state never leak between them), applies the backend to the
node namespace, reads the rules back from that kernel, asks the exact interpreter what each
traffic class should see, opens real connections, and tests the counts against the expectation
(chi-square goodness of fit) and against the other backend (a two-sample test).

Layout: a pure planning part (`plan`: which clients, endpoints and traffic classes a cluster
needs, as verify.probe's `Probe`s), a pure judging part (expected outcomes as the sandbox
reports them; `judge` turns what was seen into problems; the statistics and the result types
are verify.probe's, shared with the compat corpus), and a thin imperative part (`run`) that
owns every namespace it creates.
"""

from __future__ import annotations

import ipaddress
import os
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from nfproxy.backends.registry import backend_names
from nfproxy.core.categorize import NoEndpoints, Routing, categorize
from nfproxy.kernel import netns
from nfproxy.nftables import OFF_TABLE, TABLE
from nfproxy.kernel.iptables import IptablesRunner
from nfproxy.kernel.nft import NftSession
from nfproxy.kernel.process import KernelError
from nfproxy.core.model import ClusterState, Endpoint, IPFamily, Protocol, ServicePort
from nfproxy.verify.probe import Check, Measured, Probe, ProbeResult, Seen, Test, observed, of_family
from nfproxy.verify.sandbox import NODE, Outcome, Sandbox, SandboxSpec

BACKENDS = backend_names()
ALPHA = 0.001
"""Below this p-value a distribution counts as not matching (a correct ruleset trips it in
about 0.1 % of the tests it runs)."""

MAX_CONNECTIONS = 10_000
"""Per service; UDP probes need a fresh client source port per connection (28 232 per client)."""

_UDP_SOURCE_PORTS = 60999 - 32768 + 1
_CHUNK = 250  # connections per sandbox call: the progress granularity
_DROP_TIMEOUT = 0.5  # seconds a dropped flow is waited for: the kernel answers in microseconds


class LabError(RuntimeError):
    """The lab cannot run (not root, a kernel feature missing, nothing to measure)."""


# --------------------------------------------------------------------------------------------
# Planning (pure)


@dataclass(frozen=True, slots=True)
class Plan:
    spec: SandboxSpec
    probes: tuple[Probe, ...]
    node_ips: tuple[str, ...]
    node_name: str
    connections_per_service: int
    skipped: tuple[str, ...] = ()
    """Service ports the sandbox cannot exercise, with the reason."""
    sticky: frozenset[str] = frozenset()
    """Service ports with ClientIP session affinity: on every row of theirs, whatever the
    origin or address, one client's connections all go to the one endpoint its first got."""

    @property
    def distributions(self) -> tuple[Probe, ...]:
        return tuple(p for p in self.probes if p.check is None)

    @property
    def checks(self) -> tuple[Probe, ...]:
        return tuple(p for p in self.probes if p.check is not None)

    @property
    def connections(self) -> int:
        return sum(p.count for p in self.probes)


def _net(text: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    return ipaddress.ip_network(text, strict=False)


def _in_any(ip: str, nets: Iterable[str]) -> bool:
    addr = ipaddress.ip_address(ip)
    return any(addr.version == _net(n).version and addr in _net(n) for n in nets)


# Where the outside client lives when nothing in the cluster claims it: shared address space
# (RFC 6598) and a unique-local prefix, far from documentation ranges examples like to use.
_OUTSIDE_CANDIDATES = {
    IPFamily.V4: ("100.64.0.0/24", "172.31.255.0/24", "10.255.255.0/24"),
    IPFamily.V6: ("fd7a:1ab::/120", "fd7a:1ac::/120"),
}


def _pick(candidates: Iterable[str], taken: set[str], avoid: Iterable[str] = ()) -> str | None:
    avoid = tuple(avoid)
    for ip in candidates:
        if ip not in taken and not _in_any(ip, avoid):
            return ip
    return None


def _hosts_from_top(cidr: str, limit: int = 4096) -> Iterator[str]:
    """Host addresses of a range, highest first: far from the low addresses pods usually get."""
    net = _net(cidr)
    if net.num_addresses <= 2:
        yield from (str(a) for a in net)
        return
    top = int(net.broadcast_address) - 1
    low = int(net.network_address) + 1
    for value in range(top, max(low, top - limit) - 1, -1):
        yield str(ipaddress.ip_address(value))


def _hosts_from_bottom(cidr: str) -> Iterator[str]:
    net = _net(cidr)
    yield from (str(a) for a in net.hosts())


def _testable(svc: ServicePort) -> bool:
    return svc.protocol in (Protocol.TCP, Protocol.UDP)


def plan(state: ClusterState, connections: int = 2000) -> Plan:
    """Derive the sandbox and the traffic classes from the services, so any cluster can be run.

    Clients: a pod in this node's pod CIDR (one address per family), an outside client that no
    pod CIDR or source range contains, one allowed client per LoadBalancer with source ranges
    (an address inside its first range), and the node itself. Endpoints: every endpoint IP with
    every (port, protocol) it serves. One distribution probe per load-balanced service port,
    one pass/fail probe per traffic class beyond ClusterIP.
    """
    if not 1 <= connections <= MAX_CONNECTIONS:
        raise LabError(f"connections per service must be 1..{MAX_CONNECTIONS}, not {connections}")
    families = sorted({svc.family for svc in state.services.values()})
    endpoint_ports = _endpoint_ports(state)
    clients = _Clients(state, taken=_used_addresses(state) | set(endpoint_ports))
    for family in families:
        clients.claim_pod_and_outside(family)
    clients.claim_allowed()
    probes = _Probes(state, clients, connections)
    for svc, eps in (pair for f in families for pair in state.service_ports(f)):
        probes.add_service(svc, eps)
    probes.check_udp_source_ports()
    if not probes.probes:
        raise LabError("nothing to measure: no TCP or UDP service port with a cluster IP")
    spec = SandboxSpec.of(
        node_ips=state.node.ips,
        clients={name: tuple(addrs.values()) for name, addrs in clients.by_name.items()},
        endpoints={ip: list(ports) for ip, ports in endpoint_ports.items()},
    )
    return Plan(spec, tuple(probes.probes), state.node.ips, state.node.name, connections,
                tuple([*clients.skipped, *probes.skipped]), _sticky(state))


def _sticky(state: ClusterState) -> frozenset[str]:
    return frozenset(str(svc.name) for svc in state.services.values() if svc.affinity_timeout)


def _used_addresses(state: ClusterState) -> set[str]:
    """Every address the cluster already uses: no client may take one of them."""
    taken: set[str] = set(state.node.ips)
    for svc in state.services.values():
        taken.add(svc.cluster_ip)
        taken.update(svc.external_ips)
        taken.update(svc.load_balancer_ips)
    return taken


def _endpoint_ports(state: ClusterState) -> dict[str, dict[tuple[int, str], None]]:
    """Endpoint IP -> every (port, protocol) it serves, in first-seen order."""
    out: dict[str, dict[tuple[int, str], None]] = {}
    for key, eps in state.endpoints.items():
        svc = state.services.get(key)
        if svc is None or not _testable(svc):
            continue
        for ep in eps:
            out.setdefault(ep.ip, {})[(ep.port, svc.protocol.lower)] = None
    return out


class _Clients:
    """The sandbox's clients as they are claimed: name -> address per family (planning state)."""

    def __init__(self, state: ClusterState, taken: set[str]) -> None:
        self.node = state.node
        self.state = state
        self.taken = taken
        self.ranges = [r for svc in state.services.values() for r in svc.load_balancer_source_ranges]
        self.by_name: dict[str, dict[IPFamily, str]] = {}
        self.skipped: list[str] = []
        self.allowed_for: dict[tuple[str, IPFamily], str] = {}  # (service, family) -> client

    def claim(self, name: str, family: IPFamily, ip: str) -> None:
        self.taken.add(ip)
        self.by_name.setdefault(name, {})[family] = ip

    def claim_pod_and_outside(self, family: IPFamily) -> None:
        cidrs = self.node.cluster_cidrs_of(family)
        if cidrs:
            ip = _pick(_hosts_from_top(cidrs[0]), self.taken)
            if ip is None:
                raise LabError(f"no free address for a pod client in pod CIDR {cidrs[0]}")
            self.claim("pod", family, ip)
        candidates = (a for c in _OUTSIDE_CANDIDATES[family] for a in _hosts_from_bottom(c))
        ip = _pick(candidates, self.taken, [*self.node.cluster_cidrs, *self.ranges])
        if ip is None:
            raise LabError(f"no free IPv{family.value} address outside every pod CIDR and source range")
        self.claim("outside", family, ip)

    def claim_allowed(self) -> None:
        """One client inside each LoadBalancer's own source ranges, shared where one fits several."""
        for (spn, family), svc in sorted(self.state.services.items()):
            own = of_family(svc.load_balancer_source_ranges, family)
            if not (svc.load_balancer_ips and own and _testable(svc)):
                continue
            reuse = next(
                (n for n, a in self.by_name.items() if n.startswith("allowed") and family in a
                 and _in_any(a[family], own)),
                None,
            )
            if reuse is None:
                ip = _pick(_hosts_from_top(own[0]), self.taken, self.node.cluster_cidrs)
                if ip is None:
                    self.skipped.append(f"{spn}: no free client address inside {own[0]}")
                    continue
                reuse = f"allowed{sum(1 for n in self.by_name if n.startswith('allowed'))}"
                self.claim(reuse, family, ip)
            self.allowed_for[(str(spn), family)] = reuse

    def address(self, client: str, family: IPFamily) -> str | None:
        if client == NODE:
            ips = self.node.ips_of(family)
            return ips[0] if ips else None
        return self.by_name.get(client, {}).get(family)


class _Probes:
    """The probes as they are planned, one service port at a time (planning state)."""

    def __init__(self, state: ClusterState, clients: _Clients, connections: int) -> None:
        self.node = state.node
        self.clients = clients
        self.connections = connections
        self.check_count = max(20, min(connections // 10, 200))
        self.probes: list[Probe] = []
        self.skipped: list[str] = []
        self.udp_per_client: Counter[tuple[str, IPFamily]] = Counter()

    def add(self, svc: ServicePort, client: str, dst: str, port: int, count: int,
            check: Check | None = None, timeout: float = 1.0) -> None:
        src = self.clients.address(client, svc.family)
        if src is None:
            self.skipped.append(f"{svc.name} {svc.protocol.value}: no IPv{svc.family.value} {client} client")
            return
        if svc.protocol is Protocol.UDP:
            self.udp_per_client[(client, svc.family)] += count
        origin = "node" if client == NODE else "pod" if client == "pod" else "outside"
        self.probes.append(Probe(src, dst, port, svc.protocol.lower, origin, service=str(svc.name),
                                 client=client, count=count, timeout=timeout, check=check))

    def add_service(self, svc: ServicePort, eps: tuple[Endpoint, ...]) -> None:
        if not _testable(svc):
            self.skipped.append(f"{svc.name} {svc.protocol.value}: the sandbox speaks TCP and UDP only")
            return
        routing = categorize(svc, eps, self.node)
        self._add_cluster_ip(svc, routing)
        if routing.has_endpoints:
            self._add_external(svc, routing)

    def _add_cluster_ip(self, svc: ServicePort, routing: Routing) -> None:
        """The distribution row, or the check row a cluster IP without a plain split needs."""
        inside = "pod" if "pod" in self.clients.by_name else "outside"
        n = self.check_count
        to = (svc, inside, svc.cluster_ip, svc.port)
        if routing.internal_no_endpoints is NoEndpoints.REJECT:
            self.add(*to, n, Check.NO_ENDPOINTS, _DROP_TIMEOUT)
        elif routing.internal_no_endpoints is None and svc.affinity_timeout:
            self.add(*to, n, Check.AFFINITY)
        elif routing.internal_no_endpoints is NoEndpoints.DROP:
            self.add(*to, min(n, 20), Check.NO_LOCAL_ENDPOINTS, _DROP_TIMEOUT)
        else:
            self.add(*to, self.connections)

    def _add_external(self, svc: ServicePort, routing: Routing) -> None:
        """Node port, external IPs and LoadBalancer IPs: one check row per address."""
        n = self.check_count
        dropped = routing.external_no_endpoints is not None
        timeout = _DROP_TIMEOUT if dropped else 1.0
        few = min(n, 20) if dropped else n
        if svc.node_port:
            for ip in self.node.ips_of(svc.family)[:1]:
                self.add(svc, "outside", ip, svc.node_port, few, Check.NODE_PORT, timeout)
                self.add(svc, NODE, ip, svc.node_port, n, Check.FROM_NODE)
        for ip in svc.external_ips:
            self.add(svc, "outside", ip, svc.port, few, Check.EXTERNAL_IP, timeout)
        for ip in svc.load_balancer_ips:
            allowed = self.clients.allowed_for.get((str(svc.name), svc.family))
            if allowed is not None:
                self.add(svc, allowed, ip, svc.port, few, Check.LB_ALLOWED, timeout)
                outside = self.clients.by_name["outside"][svc.family]
                if not _in_any(outside, svc.load_balancer_source_ranges):
                    self.add(svc, "outside", ip, svc.port, min(n, 20), Check.LB_BLOCKED, _DROP_TIMEOUT)
            elif not svc.load_balancer_source_ranges:
                self.add(svc, "outside", ip, svc.port, few, Check.LB_ALLOWED, timeout)

    def check_udp_source_ports(self) -> None:
        for (client, family), n in self.udp_per_client.items():
            if n > _UDP_SOURCE_PORTS:
                raise LabError(
                    f"{n} UDP connections from the {client} client (IPv{family.value}) need more fresh "
                    f"source ports than exist ({_UDP_SOURCE_PORTS}): lower --connections"
                )


# --------------------------------------------------------------------------------------------
# What the sandbox should see (pure): the interpreter's outcomes, as the client observes them

def seen_as(verdict: str, endpoint: str | None, masquerade: bool, probe: Probe,
            node_ips: Sequence[str]) -> Seen:
    """How one interpreter outcome shows up in the sandbox.

    A DNAT to an endpoint is answered by that endpoint, which sees the node's first address of
    the family when masqueraded (the sandbox routes endpoints with that preferred source) and
    the client's own otherwise. A reject is refused at once; a drop is a timeout; a packet let
    through untouched reaches the node itself when it was sent to a node IP (nothing listens:
    refused) and the sandbox's silent uplink otherwise (timeout).
    """
    verdict = verdict.lower()
    if endpoint:
        own = of_family(node_ips, probe.family)
        src = own[0] if masquerade and own else probe.src
        return (endpoint, src)
    if verdict == "reject":
        return ("refused", None)
    if verdict == "drop":
        return ("timeout", None)
    return ("refused" if probe.dst in node_ips else "timeout", None)


def judge(probe: Probe, expected: Mapping[Seen, Fraction], seen: Mapping[Seen, int],
          sticky: bool = False) -> tuple[str, ...]:
    """What is wrong with what a backend's connections saw: outcomes the rules give no chance
    (wrong endpoint, source or failure), and for check rows an endpoint the rules give a fair
    chance never reached, or (affinity) one client spread over several endpoints. Distribution
    p-values are reported beside this, not folded in: a correct ruleset falls below any alpha
    now and then.

    `sticky`: the probe's service has session affinity, so whatever the row, the interpreter's
    split (of a fresh connection) only says which endpoints the client may stick to: the first
    connection picks one with those shares and every later one follows it."""
    m = Measured(expected, seen, 0.0)
    problems = [f"{n} connection(s) saw {label} (source {src}), which the rules give no chance"
                for (label, src), n in sorted(m.unexpected.items(), key=str)]
    if probe.check is Check.AFFINITY or sticky:
        if len(m.seen_labels) != 1:
            problems.append(f"one client reached {len(m.seen_labels)} endpoints under affinity")
    elif probe.check is not None:
        total = m.sent
        for label, share in m.expected_labels.items():
            # Must be seen unless missing it is plausible (probability above one in a million).
            if share and (1 - float(share)) ** total < 1e-6 and not m.seen_labels.get(label):
                problems.append(f"{label} (share {share}) never reached in {total} connections")
    return tuple(problems)


def measure(probe: Probe, expected: Mapping[Seen, Fraction], seen: Mapping[Seen, int],
            seconds: float, sticky: bool = False) -> Measured:
    return Measured(expected, seen, seconds, judge(probe, expected, seen, sticky))


EndpointKey = tuple[str, str]
"""(service port `ns/name:port`, endpoint `ip:port`)."""


@dataclass(frozen=True, slots=True)
class CountRow:
    """One endpoint of one service port: what the clients saw answer, and the connections the
    kernel's counter at its DNAT says it sent there. They must be equal: every connection the
    rules DNAT is counted once, and each one the lab opens reaches the endpoint it was given."""

    service: str
    endpoint: str
    seen: int
    counted: int


def client_counts(results: Iterable[ProbeResult], backend: str) -> Counter[EndpointKey]:
    """Connections per (service port, endpoint) the clients saw answer, over every probe."""
    out: Counter[EndpointKey] = Counter()
    for r in results:
        m = r.by_backend.get(backend)
        if m is None:
            continue
        for (label, src), n in m.seen.items():
            if src is not None:  # an answer: the label is the endpoint that gave it
                out[(r.probe.service, label)] += n
    return out


def count_rows(seen: Mapping[EndpointKey, int], counted: Mapping[EndpointKey, int]) -> tuple[CountRow, ...]:
    keys = sorted(set(seen) | {k for k, v in counted.items() if v})
    return tuple(CountRow(svc, ep, seen.get((svc, ep), 0), counted.get((svc, ep), 0)) for svc, ep in keys)


@dataclass(frozen=True, slots=True)
class Report:
    plan: Plan
    backends: tuple[str, ...]
    results: tuple[ProbeResult, ...]
    seconds: float
    apply_seconds: Mapping[str, float] = field(default_factory=dict)
    alpha: float = ALPHA
    counted: Mapping[str, Mapping[EndpointKey, int]] = field(default_factory=dict)
    """Per backend, the kernel's per-endpoint connection counters after the run."""

    def counts(self, backend: str) -> tuple[CountRow, ...]:
        """Clients' view beside the kernel's, per endpoint; empty without counters read."""
        if backend not in self.counted:
            return ()
        return count_rows(client_counts(self.results, backend), self.counted[backend])

    def count_mismatches(self) -> list[tuple[str, CountRow]]:
        return [(b, row) for b in self.backends for row in self.counts(b) if row.seen != row.counted]

    @property
    def distributions(self) -> tuple[ProbeResult, ...]:
        return tuple(r for r in self.results if r.probe.check is None)

    @property
    def checks(self) -> tuple[ProbeResult, ...]:
        return tuple(r for r in self.results if r.probe.check is not None)

    @property
    def passed(self) -> bool:
        return all(r.passed(b) for r in self.results for b in self.backends) and not self.count_mismatches()

    def low_p(self) -> list[tuple[ProbeResult, str, Test]]:
        """Distribution tests below alpha: (result, backend or "two-sample", test)."""
        out = []
        for r in self.distributions:
            for b, t in r.fits().items():
                if t.p < self.alpha:
                    out.append((r, b, t))
            between = r.between()
            if between is not None and between.p < self.alpha:
                out.append((r, "two-sample", between))
        return out


# --------------------------------------------------------------------------------------------
# The kernel side: feature probes, applying, reading back, expectations


@dataclass(frozen=True, slots=True)
class Feature:
    name: str
    backend: str
    payload: str
    """An nft script (nft) or an iptables-restore payload (iptables) that needs the feature."""


_NFT_BASE = (
    "add table ip nfp_lab_probe\n"
    "add chain ip nfp_lab_probe f { type filter hook input priority 0; }\n"
    "add chain ip nfp_lab_probe n { type nat hook prerouting priority -100; }\n"
    "add chain ip nfp_lab_probe p { type nat hook postrouting priority 100; }\n"
)
FEATURES: tuple[Feature, ...] = (
    Feature("nf_tables", "nft", "add table ip nfp_lab_probe\n"),
    Feature("nf_tables NAT chains (nft_chain_nat)", "nft", _NFT_BASE),
    Feature("nft numgen (nft_numgen)", "nft",
            _NFT_BASE + "add rule ip nfp_lab_probe f numgen random mod 2 vmap { 0 : accept, 1 : accept }\n"),
    Feature("nft conntrack expressions (nft_ct)", "nft",
            _NFT_BASE + "add rule ip nfp_lab_probe f ct state new accept\n"),
    Feature("nft DNAT (nft_nat)", "nft",
            _NFT_BASE + "add rule ip nfp_lab_probe n ip daddr 10.0.0.1 tcp dport 80 dnat to 10.0.0.2:80\n"),
    Feature("nft masquerade (nft_masq)", "nft",
            _NFT_BASE + "add rule ip nfp_lab_probe p masquerade fully-random\n"),
    Feature("nft reject (nft_reject)", "nft", _NFT_BASE + "add rule ip nfp_lab_probe f reject\n"),
    Feature("nft dynamic sets with timeouts (nft_set_hash, nft_dynset)", "nft",
            _NFT_BASE + "add set ip nfp_lab_probe s { type ipv4_addr; flags dynamic,timeout; timeout 10s; }\n"
            "add rule ip nfp_lab_probe f update @s { ip saddr }\n"),
    Feature("iptables statistic match (xt_statistic)", "iptables",
            "*filter\n:P - [0:0]\n-A P -m statistic --mode random --probability 0.5 -j RETURN\nCOMMIT\n"),
    Feature("iptables recent match (xt_recent)", "iptables",
            "*filter\n:P - [0:0]\n-A P -m recent --name p --rcheck --seconds 10 --reap -j RETURN\nCOMMIT\n"),
    Feature("iptables conntrack match (xt_conntrack)", "iptables",
            "*filter\n:P - [0:0]\n-A P -m conntrack --ctstate NEW -j RETURN\nCOMMIT\n"),
    Feature("iptables comment and mark (xt_comment, xt_mark)", "iptables",
            '*filter\n:P - [0:0]\n-A P -m comment --comment "x" -m mark --mark 0x4000/0x4000 -j RETURN\nCOMMIT\n'),
    Feature("iptables REJECT (ipt_REJECT)", "iptables",
            "*filter\n:P - [0:0]\n-A P -j REJECT\nCOMMIT\n"),
    Feature("iptables DNAT (xt_nat)", "iptables",
            "*nat\n:P - [0:0]\n-A P -p tcp -m tcp -j DNAT --to-destination 10.0.0.2:80\nCOMMIT\n"),
    Feature("iptables MASQUERADE --random-fully (xt_MASQUERADE)", "iptables",
            "*nat\n:P - [0:0]\n-A P -j MASQUERADE --random-fully\nCOMMIT\n"),
)


def preflight(backends: Sequence[str], features: Sequence[Feature] = FEATURES) -> None:
    """Try each kernel feature the backends need in a throwaway namespace; name the first one
    missing, instead of failing later on a large ruleset with an error that names none."""
    wanted = [f for f in features if f.backend in backends]
    if not wanted:
        return
    with netns.throwaway("nfp-lab-probe") as ns:
        session = NftSession(ns) if "nft" in backends else None
        runner = IptablesRunner(IPFamily.V4, ns) if "iptables" in backends else None
        for feature in wanted:
            try:
                if feature.backend == "nft":
                    assert session is not None
                    session.apply(feature.payload)
                    session.apply("delete table ip nfp_lab_probe\n")
                else:
                    assert runner is not None
                    runner.restore(feature.payload, noflush=False)
            except KernelError as exc:
                raise LabError(f"this kernel lacks {feature.name}, which the {feature.backend} "
                               f"backend needs ({exc})") from None


def apply(backend: str, state: ClusterState, ns: str) -> float:
    """Apply a backend's full ruleset for both families into `ns`; return the seconds taken."""
    from nfproxy.verify.validate import APPLY

    start = time.perf_counter()
    if backend in APPLY:
        APPLY[backend](state, ns)
    else:
        raise LabError(f"unknown backend {backend!r} (choose from {', '.join(BACKENDS)})")
    return time.perf_counter() - start


def read_back(backend: str, ns: str, family: IPFamily) -> Any:
    """The rules the kernel of `ns` holds, parsed for the interpreter (never what we meant)."""
    from nfproxy.analysis import iptables_save, nft_json

    try:
        if backend == "iptables":
            return iptables_save.parse(IptablesRunner(family, ns).save(), family)
        name = "ip" if family is IPFamily.V4 else "ip6"
        session = NftSession(ns)
        doc = session.list_table(name, TABLE)
        if doc is None:
            raise LabError(f"the nft backend left no table {name} {TABLE} in the node namespace")
        off = session.list_table(name, OFF_TABLE)  # weighted ports off the lane, if any
        if off is not None:
            doc = {"nftables": [*doc["nftables"], *(o for o in off["nftables"] if "metainfo" not in o)]}
        return nft_json.parse(doc)
    except (iptables_save.ParseError, nft_json.ParseError) as exc:
        raise LabError(f"cannot parse the {backend} rules read back (IPv{family.value}): {exc}") from None


def kernel_counts(backend: str, ns: str) -> dict[EndpointKey, int]:
    """The per-endpoint connection counters the node namespace's kernel holds
    (analysis/counters.py), keyed as the clients' counts are."""
    from nfproxy.analysis.counters import read_live_counts

    out: dict[EndpointKey, int] = {}
    for c in read_live_counts(backend, ns):
        key = (c.service_port, c.endpoint)
        out[key] = out.get(key, 0) + c.connections
    return out


def expectation(ruleset: Any, probe: Probe, node_ips: Sequence[str]) -> dict[Seen, Fraction]:
    """The exact share of each outcome the rules give a fresh connection of this probe, from
    the interpreter in kernel mode (the kernel's quantised probabilities, not 1/n)."""
    from nfproxy.analysis import interpret

    packet = probe.packet(node_ips)
    try:
        outcomes = interpret.interpret(ruleset, packet, node_ips=tuple(node_ips), mode="kernel")
    except interpret.InterpretError as exc:
        raise LabError(f"the interpreter cannot follow the rules for {probe.title}: {exc}") from None
    out: dict[Seen, Fraction] = {}
    for outcome, share in outcomes.items():
        key = seen_as(_verdict(outcome.verdict), outcome.endpoint, bool(outcome.masquerade),
                      probe, node_ips)
        out[key] = out.get(key, Fraction(0)) + Fraction(share)
    return out


def _verdict(v: Any) -> str:
    return str(getattr(v, "value", v))


# Sandbox building and teardown hold SIGINT/SIGTERM (delivered afterwards), so that Ctrl-C
# cannot strand a namespace that pyroute2's helper is still creating.
uninterrupted = netns.signals_held


Progress = Callable[[int, int, str], None]
"""(done, total, what): called as connections complete."""


def run(
    state: ClusterState,
    *,
    backends: Sequence[str] = BACKENDS,
    connections: int = 2000,
    progress: Progress | None = None,
    alpha: float = ALPHA,
) -> Report:
    """Measure each backend on its own sandbox; every namespace is gone when this returns or
    raises (Sandbox and throwaway clean up on any exception, Ctrl-C included)."""
    if os.geteuid() != 0:
        raise LabError("the lab needs root: it creates network namespaces and applies rules there")
    for b in backends:
        if b not in BACKENDS:
            raise LabError(f"unknown backend {b!r} (choose from {', '.join(BACKENDS)})")
    the_plan = plan(state, connections)
    with uninterrupted():
        preflight(backends)
    started = time.perf_counter()
    total = the_plan.connections * len(backends)
    done = 0
    measured: dict[Probe, dict[str, Measured]] = {p: {} for p in the_plan.probes}
    applied: dict[str, float] = {}
    counted: dict[str, Mapping[EndpointKey, int]] = {}
    for backend in backends:
        sb = Sandbox(the_plan.spec)
        try:
            with uninterrupted():
                sb.start()
            applied[backend] = apply(backend, state, sb.node_ns)
            rulesets = {f: read_back(backend, sb.node_ns, f)
                        for f in {p.family for p in the_plan.probes}}
            for p in the_plan.probes:
                expected = expectation(rulesets[p.family], p, the_plan.node_ips)
                t0 = time.perf_counter()
                outcomes: list[Outcome] = []
                while len(outcomes) < p.count:
                    n = min(_CHUNK, p.count - len(outcomes))
                    outcomes += sb.connect(p.client, p.dst, p.port, p.proto, n,
                                           timeout=p.timeout)
                    done += n
                    if progress is not None:
                        progress(done, total, f"{backend}: {p.service}")
                measured[p][backend] = measure(p, expected, observed(outcomes),
                                               time.perf_counter() - t0,
                                               sticky=p.service in the_plan.sticky)
            counted[backend] = kernel_counts(backend, sb.node_ns)
        finally:
            with uninterrupted():
                sb.close()
    results = tuple(ProbeResult(p, measured[p]) for p in the_plan.probes)
    return Report(the_plan, tuple(backends), results, time.perf_counter() - started, applied, alpha, counted)

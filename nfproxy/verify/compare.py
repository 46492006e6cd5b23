"""`compare`: do the two backends do the same thing with every service? Proved on the rules.

Both backends are rendered from one ClusterState, each rendering is read back through the
analysis parsers (iptables: the restore text as written; nft: the transaction applied to the
in-memory kernel and listed back as the JSON `nft -j` prints, which a kernel test holds equal to
the real kernel's; no root needed), and the exact
interpreter walks both for every service port and traffic class: cluster IP, node port,
LoadBalancer IP and external IP, from a pod, from the node and from outside, plus hairpin and,
for source ranges, an allowed and a blocked source.

Equivalent means: for every probe, the same outcomes (verdict, endpoint, masquerade), with exactly
equal probabilities in ideal mode and within 1e-9 of each other in kernel mode (the two kernels'
quantisations genuinely differ by that much).

Documented differences: where upstream's two modes differ, ours differ the same way, and a
probe says so (`Probe.nft_only`): kube-proxy's nftables mode rejects traffic to a cluster IP on
a port no service uses and drops traffic to an unallocated address of the service CIDRs; its
iptables mode leaves both alone. Such a probe passes when each backend does exactly its own
upstream thing (docs/semantics.md lists the differences).

Public API: `compare(state) -> Comparison`; `probes(state, family)` (verify.probe's `Probe`);
`Agreement`, one probe's four exact distributions. It is not verify.probe's `ProbeResult`: no
traffic is sent, so there is nothing measured, only two rule sets' promises side by side.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction

from nfproxy.core.gc_pause import gc_paused
from nfproxy.analysis import iptables_save, nft_json
from nfproxy.analysis.interpret import Origin, Outcome, interpret_both
from nfproxy.analysis.ir import Ruleset
from nfproxy.backends.iptables import render as iptables_backend
from nfproxy.backends.nft import render as nft_backend
from nfproxy.core.categorize import categorize
from nfproxy.kernel.memory.nft import MemoryNft
from nfproxy.core.model import ClusterState, IPFamily, ServicePort
from nfproxy.verify.probe import Probe, of_family

KERNEL_TOLERANCE = Fraction(1, 10**9)


@dataclass(frozen=True, slots=True)
class Agreement:
    """What the two backends' rules do with one probe, exactly, in both interpreter modes."""

    probe: Probe
    iptables: dict[Outcome, Fraction]
    nft: dict[Outcome, Fraction]
    iptables_ideal: dict[Outcome, Fraction]
    nft_ideal: dict[Outcome, Fraction]

    @property
    def max_difference(self) -> Fraction:
        """Largest probability difference; a documented difference that holds counts as none."""
        if self.documented:
            return Fraction(0)
        keys = set(self.iptables) | set(self.nft)
        return max((abs(self.iptables.get(k, Fraction(0)) - self.nft.get(k, Fraction(0))) for k in keys), default=Fraction(0))

    @property
    def total_variation(self) -> Fraction:
        if self.documented:
            return Fraction(0)
        keys = set(self.iptables) | set(self.nft)
        return sum((abs(self.iptables.get(k, Fraction(0)) - self.nft.get(k, Fraction(0))) for k in keys), Fraction(0)) / 2

    @property
    def iptables_deviation(self) -> Fraction:
        """How far iptables' kernel arithmetic (31-bit thresholds) moves any outcome from the
        probabilities as written; weighted or not, the same bound holds (docs/weights.md)."""
        return _deviation(self.iptables, self.iptables_ideal)

    @property
    def nft_deviation(self) -> Fraction:
        """The same for nft: numgen's reciprocal_scale buckets against 1/N per slot."""
        return _deviation(self.nft, self.nft_ideal)

    @property
    def documented(self) -> bool:
        """A documented difference, and both backends behave as documented."""
        want = self.probe.nft_only
        if not want:
            return False
        return all(
            all(o.verdict == want for o in nft) and all(o.verdict == "accept" for o in ipt)
            for nft, ipt in ((self.nft, self.iptables), (self.nft_ideal, self.iptables_ideal))
        )

    @property
    def equivalent(self) -> bool:
        if self.probe.nft_only:
            return self.documented
        return (
            set(self.iptables) == set(self.nft)
            and self.iptables_ideal == self.nft_ideal
            and self.max_difference <= KERNEL_TOLERANCE
        )


@dataclass(frozen=True, slots=True)
class Comparison:
    results: tuple[Agreement, ...]

    @property
    def equivalent(self) -> bool:
        return all(r.equivalent for r in self.results)

    @property
    def max_difference(self) -> Fraction:
        return max((r.max_difference for r in self.results), default=Fraction(0))

    @property
    def total_variation(self) -> Fraction:
        return max((r.total_variation for r in self.results), default=Fraction(0))

    @property
    def iptables_deviation(self) -> Fraction:
        return max((r.iptables_deviation for r in self.results), default=Fraction(0))

    @property
    def nft_deviation(self) -> Fraction:
        return max((r.nft_deviation for r in self.results), default=Fraction(0))


def _deviation(kernel: dict[Outcome, Fraction], ideal: dict[Outcome, Fraction]) -> Fraction:
    keys = set(kernel) | set(ideal)
    return max((abs(kernel.get(k, Fraction(0)) - ideal.get(k, Fraction(0))) for k in keys), default=Fraction(0))


# --------------------------------------------------------------------------------------------
# Traffic classes.


_OUTSIDE = {
    IPFamily.V4: ["203.0.113.201", "198.51.100.201", "192.0.2.201", "100.64.0.201", "172.31.255.201"],
    IPFamily.V6: ["2001:db8:ffff::c9", "2001:db8:fffe::c9", "3fff::c9", "fc00:ffff::c9"],
}


def _inside(cidr: str) -> str:
    """A host address inside `cidr` that an endpoint is unlikely to hold: its last usable one."""
    net = ipaddress.ip_network(cidr, strict=False)
    if net.num_addresses == 1:
        return str(net.network_address)
    return str(net.broadcast_address - 1) if net.version == 4 else str(net.broadcast_address)


def _outside(state: ClusterState, family: IPFamily, avoid: list[str]) -> str | None:
    nets = [ipaddress.ip_network(c, strict=False) for c in avoid + list(state.node.cluster_cidrs_of(family))]
    for cand in _OUTSIDE[family]:
        addr = ipaddress.ip_address(cand)
        if addr.version == family.value and not any(addr in n for n in nets if n.version == addr.version):
            if cand not in state.node.ips:
                return cand
    return None


def probes(state: ClusterState, family: IPFamily) -> Iterator[Probe]:
    node = state.node
    node_ips = node.ips_of(family)
    pods = node.cluster_cidrs_of(family)
    for svc, endpoints in state.service_ports(family):
        name = f"{svc.name} ({svc.protocol.lower})"
        proto = svc.protocol.lower
        ranges = of_family(svc.load_balancer_source_ranges, family)
        outside = _outside(state, family, ranges)
        sources: list[tuple[str, str, Origin]] = []  # (label, src, origin)
        if pods:
            sources.append(("pod", _inside(pods[0]), "pod"))
        if node_ips:
            sources.append(("node", node_ips[0], "node"))
        if outside:
            sources.append(("outside", outside, "outside"))
        routing = categorize(svc, endpoints, node)
        if routing.reachable:
            ep = routing.reachable[0].ip
            sources.append(("hairpin endpoint", ep, "pod"))

        def emit(traffic: str, dst: str, port: int, srcs: list[tuple[str, str, Origin]]) -> Iterator[Probe]:
            for label, src, origin in srcs:
                yield Probe(src, dst, port, proto, origin, service=name, traffic=f"{traffic} from {label}")

        yield from emit("cluster IP", svc.cluster_ip, svc.port, sources)
        if svc.node_port and node_ips:
            yield from emit("node port", node_ips[0], svc.node_port, sources)
        for ip in of_family(svc.external_ips, family):
            yield from emit(f"external IP {ip}", ip, svc.port, sources)
        for ip in of_family(svc.load_balancer_ips, family):
            srcs = list(sources)
            if ranges:
                srcs.append(("allowed range", _inside(ranges[0]), "outside"))
            yield from emit(f"LB IP {ip}", ip, svc.port, srcs)


UNUSED_PORT = "unused port of cluster IP"
UNALLOCATED = "unallocated address of service CIDR"


def documented_probes(state: ClusterState, family: IPFamily) -> Iterator[Probe]:
    """Probes of the documented nft/iptables differences (see the module docstring)."""
    node = state.node
    pods = node.cluster_cidrs_of(family)
    src, origin = (_inside(pods[0]), "pod") if pods else (_outside(state, family, []), "outside")
    if src is None:
        return
    used: dict[str, set[int]] = {}
    for svc, _ in state.service_ports(family):
        used.setdefault(svc.cluster_ip, set()).update((svc.port, svc.node_port))
    for ip, ports in used.items():
        port = next(p for p in range(1, 65536) if p not in ports)
        yield Probe(src, ip, port, "tcp", origin, service=ip, traffic=f"{UNUSED_PORT} from {origin}", nft_only="reject")  # type: ignore[arg-type]
    for cidr in node.service_cidrs_of(family):
        net = ipaddress.ip_network(cidr, strict=False)
        if net.num_addresses < 4:
            continue
        for offset in range(2, min(net.num_addresses - 1, 1 << 16)):
            addr = str(net.broadcast_address - offset)
            if addr not in used:
                yield Probe(src, addr, 80, "tcp", origin, service=cidr, traffic=f"{UNALLOCATED} from {origin}", nft_only="drop")  # type: ignore[arg-type]
                break


# --------------------------------------------------------------------------------------------
# Renderings read back.


def iptables_ruleset(state: ClusterState, family: IPFamily) -> Ruleset:
    text = iptables_backend.render(state, family).restore_text(with_jumps=True)
    return iptables_save.parse(text, family)


def nft_ruleset(state: ClusterState, family: IPFamily) -> Ruleset:
    """Apply the full transaction to the in-memory kernel and read its JSON: what the kernel
    would print (tests/test_memory_kernel.py checks that they agree), without root."""
    kernel = MemoryNft(family)
    kernel.apply(nft_backend.render(state, family).transaction())
    return nft_json.parse(kernel.json())


def families(state: ClusterState) -> list[IPFamily]:
    return sorted({k[1] for k in state.services}, key=lambda f: f.value)


@gc_paused()  # both rule sets read back and every probe walked
def compare(state: ClusterState) -> Comparison:
    results: list[Agreement] = []
    for family in families(state):
        # nft first: its JSON document, the largest transient, is gone before iptables is read.
        nft = nft_ruleset(state, family)
        ipt = iptables_ruleset(state, family)
        node_ips = state.node.ips_of(family)
        for probe in (*probes(state, family), *documented_probes(state, family)):
            packet = probe.packet()
            ipt_kernel, ipt_ideal = interpret_both(ipt, packet, node_ips=node_ips)
            nft_kernel, nft_ideal = interpret_both(nft, packet, node_ips=node_ips)
            results.append(Agreement(probe, ipt_kernel, nft_kernel, ipt_ideal, nft_ideal))
    return Comparison(tuple(results))

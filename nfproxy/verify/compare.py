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

Public API: `compare(state) -> Comparison`; `probes(state, family)`; `ProbeResult`.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction

from nfproxy.analysis import iptables_save, nft_json
from nfproxy.analysis.interpret import Outcome, Packet, interpret
from nfproxy.analysis.ir import Ruleset
from nfproxy.backends.iptables import render as iptables_backend
from nfproxy.backends.nft import render as nft_backend
from nfproxy.core.categorize import categorize
from nfproxy.kernel.memory.nft import MemoryNft
from nfproxy.core.model import ClusterState, IPFamily, ServicePort

KERNEL_TOLERANCE = Fraction(1, 10**9)


@dataclass(frozen=True, slots=True)
class Probe:
    service: str
    traffic: str  # e.g. "cluster IP from pod"
    packet: Packet


@dataclass(frozen=True, slots=True)
class ProbeResult:
    probe: Probe
    iptables: dict[Outcome, Fraction]
    nft: dict[Outcome, Fraction]
    iptables_ideal: dict[Outcome, Fraction]
    nft_ideal: dict[Outcome, Fraction]

    @property
    def max_difference(self) -> Fraction:
        keys = set(self.iptables) | set(self.nft)
        return max((abs(self.iptables.get(k, Fraction(0)) - self.nft.get(k, Fraction(0))) for k in keys), default=Fraction(0))

    @property
    def total_variation(self) -> Fraction:
        keys = set(self.iptables) | set(self.nft)
        return sum((abs(self.iptables.get(k, Fraction(0)) - self.nft.get(k, Fraction(0))) for k in keys), Fraction(0)) / 2

    @property
    def equivalent(self) -> bool:
        return (
            set(self.iptables) == set(self.nft)
            and self.iptables_ideal == self.nft_ideal
            and self.max_difference <= KERNEL_TOLERANCE
        )


@dataclass(frozen=True, slots=True)
class Comparison:
    results: tuple[ProbeResult, ...]

    @property
    def equivalent(self) -> bool:
        return all(r.equivalent for r in self.results)

    @property
    def max_difference(self) -> Fraction:
        return max((r.max_difference for r in self.results), default=Fraction(0))

    @property
    def total_variation(self) -> Fraction:
        return max((r.total_variation for r in self.results), default=Fraction(0))


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
        ranges = [r for r in svc.load_balancer_source_ranges if (":" in r) == (family is IPFamily.V6)]
        outside = _outside(state, family, ranges)
        sources: list[tuple[str, str, str]] = []  # (label, src, origin)
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

        def emit(traffic: str, dst: str, port: int, srcs: list[tuple[str, str, str]]) -> Iterator[Probe]:
            for label, src, origin in srcs:
                yield Probe(name, f"{traffic} from {label}", Packet(src, dst, port, proto, origin))  # type: ignore[arg-type]

        yield from emit("cluster IP", svc.cluster_ip, svc.port, sources)
        if svc.node_port and node_ips:
            yield from emit("node port", node_ips[0], svc.node_port, sources)
        for ip in _of(svc.external_ips, family):
            yield from emit(f"external IP {ip}", ip, svc.port, sources)
        for ip in _of(svc.load_balancer_ips, family):
            srcs = list(sources)
            if ranges:
                srcs.append(("allowed range", _inside(ranges[0]), "outside"))
            yield from emit(f"LB IP {ip}", ip, svc.port, srcs)


def _of(ips: tuple[str, ...], family: IPFamily) -> list[str]:
    return [ip for ip in ips if (":" in ip) == (family is IPFamily.V6)]


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


def compare(state: ClusterState) -> Comparison:
    results: list[ProbeResult] = []
    for family in families(state):
        ipt = iptables_ruleset(state, family)
        nft = nft_ruleset(state, family)
        node_ips = state.node.ips_of(family)
        for probe in probes(state, family):
            results.append(
                ProbeResult(
                    probe,
                    interpret(ipt, probe.packet, node_ips=node_ips),
                    interpret(nft, probe.packet, node_ips=node_ips),
                    interpret(ipt, probe.packet, node_ips=node_ips, mode="ideal"),
                    interpret(nft, probe.packet, node_ips=node_ips, mode="ideal"),
                )
            )
    return Comparison(tuple(results))

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
quantisations genuinely differ by that much). One exception, said in the output: a service whose
iptables cascade has a rule w / rest that kube-proxy's ten decimals cannot pin to one fraction
(reduced denominator above 100 000: hundreds of weighted endpoints) is held to 1e-9 in ideal mode
too (`Agreement.ideal_exact`, docs/weights.md). The verdicts compare exact values; the sums and
differences are taken over one common denominator, so a 2 000-endpoint service costs no gcd
per endpoint.

Documented differences: where upstream's two modes differ, ours differ the same way, and a
probe says so (`Probe.nft_only`): kube-proxy's nftables mode rejects traffic to a cluster IP on
a port no service uses and drops traffic to an unallocated address of the service CIDRs; its
iptables mode leaves both alone. Such a probe passes when each backend does exactly its own
upstream thing (docs/semantics.md lists the differences).

Bounded work: the interpreter finds a probe's rule in iptables' KUBE-SERVICES through an index
on the destination address (analysis/index.py), so the rules of the other service ports at that
same address are evaluated one by one. Probes at an address grow with its ports, so one Service
of N ports costs N^2 rule evaluations (20 000 ports: hours, where `render` takes 8 s). `compare`
estimates that work from the model before rendering anything and refuses a state over
`WORK_LIMIT` (`TooMuchWork`, naming the address, the figures and the limit), as `check` and
`trace` stop a walk over their budget instead of running for ever (docs/semantics.md,
"Bounded work").

Public API: `compare(state, work_limit=WORK_LIMIT) -> Comparison`; `estimate(state) -> Work`;
`probes(state, family)` (verify.probe's `Probe`); `Agreement`, one probe's four exact
distributions. It is not verify.probe's `ProbeResult`: no traffic is sent, so there is nothing
measured, only two rule sets' promises side by side.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterator
from dataclasses import dataclass, field
from fractions import Fraction

from nfproxy.core.gc_pause import gc_paused
from nfproxy.analysis import iptables_save, nft_json, quantize
from nfproxy.analysis.interpret import Origin, Outcome, interpret_both
from nfproxy.analysis.ir import Ruleset
from nfproxy.backends.iptables import render as iptables_backend
from nfproxy.backends.nft import render as nft_backend
from nfproxy.core.categorize import cascade_order, cascade_probabilities, categorize, weighted
from nfproxy.kernel.memory.nft import MemoryNft
from nfproxy.core.model import ClusterState, Endpoint, IPFamily, ServicePort
from nfproxy.verify.probe import Probe, of_family

KERNEL_TOLERANCE = Fraction(1, 10**9)
_ZERO = Fraction(0)


@dataclass(frozen=True, slots=True)
class _Differences:
    """Two distributions' differences, from one pass over a common denominator."""

    largest: Fraction  # max over outcomes of |a - b|
    total_variation: Fraction  # sum over outcomes of |a - b|, halved


def _differences(a: dict[Outcome, Fraction], b: dict[Outcome, Fraction], total: bool = True) -> _Differences:
    """Exact, and linear in the size of the values: every value is put over one common
    denominator (quantize.common_denominator), so the differences and their sum are integer
    operations. Adding the Fractions one by one paid a gcd of up to 60 000 bits per endpoint
    (a 2 000-endpoint iptables cascade's shares are k / 2^(31 i)): 20 s of a 22 s compare."""
    keys = list(a.keys() | b.keys())
    if not keys:
        return _Differences(_ZERO, _ZERO)
    nums, den = quantize.common_denominator([a.get(k, _ZERO) for k in keys] + [b.get(k, _ZERO) for k in keys])
    n = len(keys)
    diffs = [abs(x - y) for x, y in zip(nums[:n], nums[n:])]
    # `total=False` (deviations need only the largest) skips the one gcd of the sum's Fraction.
    return _Differences(Fraction(max(diffs), den), Fraction(sum(diffs), 2 * den) if total else _ZERO)


@dataclass(frozen=True, slots=True)
class _Figures:
    kernel: _Differences  # iptables against nft, kernel mode
    ideal: _Differences  # iptables against nft, as written
    iptables_deviation: Fraction
    nft_deviation: Fraction


@dataclass(frozen=True, slots=True)
class Agreement:
    """What the two backends' rules do with one probe, exactly, in both interpreter modes."""

    probe: Probe
    iptables: dict[Outcome, Fraction]
    nft: dict[Outcome, Fraction]
    iptables_ideal: dict[Outcome, Fraction]
    nft_ideal: dict[Outcome, Fraction]
    # False when iptables' probabilities as written cannot be read back exactly for this
    # probe's service: kube-proxy's ten decimals pin a weighted cascade rule w / rest only while
    # its denominator is at most quantize.TEN_DECIMAL_EXACT_DENOMINATOR (docs/weights.md). Ideal
    # mode is then held to KERNEL_TOLERANCE instead of exact equality, and says so.
    ideal_exact: bool = True
    # The differences, computed once on first use (each is asked for several times per probe).
    _figures: _Figures | None = field(default=None, init=False, repr=False, compare=False)

    def _computed(self) -> _Figures:
        if self._figures is None:
            figures = _Figures(
                _differences(self.iptables, self.nft),
                _differences(self.iptables_ideal, self.nft_ideal),
                _differences(self.iptables, self.iptables_ideal, total=False).largest,
                _differences(self.nft, self.nft_ideal, total=False).largest,
            )
            object.__setattr__(self, "_figures", figures)
            return figures
        return self._figures

    @property
    def max_difference(self) -> Fraction:
        """Largest probability difference; a documented difference that holds counts as none."""
        if self.documented:
            return _ZERO
        return self._computed().kernel.largest

    @property
    def total_variation(self) -> Fraction:
        if self.documented:
            return _ZERO
        return self._computed().kernel.total_variation

    @property
    def ideal_max_difference(self) -> Fraction:
        """Largest difference of the probabilities as written (0 whenever `equivalent` holds
        with `ideal_exact`)."""
        if self.documented:
            return _ZERO
        return self._computed().ideal.largest

    @property
    def iptables_deviation(self) -> Fraction:
        """How far iptables' kernel arithmetic (31-bit thresholds) moves any outcome from the
        probabilities as written; weighted or not, the same bound holds (docs/weights.md)."""
        return self._computed().iptables_deviation

    @property
    def nft_deviation(self) -> Fraction:
        """The same for nft: numgen's reciprocal_scale buckets against 1/N per slot."""
        return self._computed().nft_deviation

    @property
    def documented(self) -> bool:
        """A documented difference, and both backends behave as documented."""
        want = self.probe.nft_only
        if not want:
            return False
        return all(
            all(o.verdict == want for o in nft) and all(o.verdict == self.probe.iptables_documented for o in ipt)
            for nft, ipt in ((self.nft, self.iptables), (self.nft_ideal, self.iptables_ideal))
        )

    @property
    def equivalent(self) -> bool:
        """Same outcomes; kernel probabilities within KERNEL_TOLERANCE; ideal ones exactly equal
        (dict equality of reduced Fractions: exact and cheap), or, where `ideal_exact` is False,
        within KERNEL_TOLERANCE too. Every test is on exact values: no float decides."""
        if self.probe.nft_only:
            return self.documented
        if set(self.iptables) != set(self.nft) or self.max_difference > KERNEL_TOLERANCE:
            return False
        if self.ideal_exact:
            return self.iptables_ideal == self.nft_ideal
        return set(self.iptables_ideal) == set(self.nft_ideal) and self.ideal_max_difference <= KERNEL_TOLERANCE


@dataclass(frozen=True, slots=True)
class Comparison:
    results: tuple[Agreement, ...]

    @property
    def equivalent(self) -> bool:
        return all(r.equivalent for r in self.results)

    @property
    def ideal_exact(self) -> bool:
        """Whether every probe's ideal mode was compared exactly (see Agreement.ideal_exact)."""
        return all(r.ideal_exact for r in self.results)

    @property
    def ideal_inexact_services(self) -> list[str]:
        """The services whose probes' ideal mode could only be compared within the tolerance."""
        return list(dict.fromkeys(r.probe.service for r in self.results if not r.ideal_exact))

    @property
    def max_difference(self) -> Fraction:
        return max((r.max_difference for r in self.results), default=_ZERO)

    @property
    def total_variation(self) -> Fraction:
        return max((r.total_variation for r in self.results), default=_ZERO)

    @property
    def iptables_deviation(self) -> Fraction:
        return max((r.iptables_deviation for r in self.results), default=_ZERO)

    @property
    def nft_deviation(self) -> Fraction:
        return max((r.nft_deviation for r in self.results), default=_ZERO)


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
        # A hairpin starts from a pod on this node: traffic from a remote endpoint never meets
        # this node's DNAT on its way to its own service (and upstream's modes differ there:
        # iptables masquerades it, nftables does not; docs/semantics.md).
        local = [e for e in routing.reachable if node.name and e.node_name == node.name]
        if local:
            sources.append(("hairpin endpoint", local[0].ip, "pod"))

        # The node's own packet to an external or LB IP that no DNAT takes (nothing for the
        # short-circuit to reach): kube-proxy's nftables mode rejects or drops it on output, its
        # iptables mode lets it out (docs/semantics.md, "Documented differences").
        unserved = routing.external_no_endpoints
        node_external = unserved.value if unserved is not None and not routing.cluster else ""
        # Source ranges without any endpoint: kube-proxy's nftables mode still drops a source
        # outside them (its firewall runs before DNAT, for every LB IP with ranges), its
        # iptables mode writes no firewall then and rejects every source alike.
        fenced = [ipaddress.ip_network(c, strict=False) for c in ranges] if not routing.has_endpoints else []

        def documented(lb: bool, external: bool, src: str, origin: Origin) -> tuple[str, str]:
            if lb and fenced and not any(ipaddress.ip_address(src) in n for n in fenced):
                # iptables: no firewall, so REJECT on input; the node's own packet is let out.
                return "drop", "accept" if origin == "node" else "reject"
            if external and origin == "node" and node_external:
                return node_external, "accept"
            return "", "accept"

        def emit(traffic: str, dst: str, port: int, srcs: list[tuple[str, str, Origin]],
                 external: bool = False, lb: bool = False) -> Iterator[Probe]:
            for label, src, origin in srcs:
                nft, ipt = documented(lb, external, src, origin)
                yield Probe(src, dst, port, proto, origin, service=name, traffic=f"{traffic} from {label}",
                            nft_only=nft, iptables_documented=ipt)

        yield from emit("cluster IP", svc.cluster_ip, svc.port, sources)
        if svc.node_port and node_ips:
            yield from emit("node port", node_ips[0], svc.node_port, sources)
        for ip in of_family(svc.external_ips, family):
            yield from emit(f"external IP {ip}", ip, svc.port, sources, external=True)
        for ip in of_family(svc.load_balancer_ips, family):
            srcs = list(sources)
            if ranges:
                srcs.append(("allowed range", _inside(ranges[0]), "outside"))
            yield from emit(f"LB IP {ip}", ip, svc.port, srcs, external=True, lb=True)


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
    kernel.apply(nft_backend.render(state, family).transactions())
    return nft_json.parse(kernel.json())


def _cascade_exact(endpoints: tuple[Endpoint, ...]) -> bool:
    """Whether every rule of the iptables cascade over `endpoints` (core.categorize's order and
    probabilities, as the renderer prints them) reads back exactly from its ten decimals."""
    if len(endpoints) < 2:
        return True
    weights = [e.weight for e in endpoints] if weighted(endpoints) else [1] * len(endpoints)
    ordered = [weights[k] for k in cascade_order(weights)]
    return all(quantize.ten_decimal_exact(w, rest) for w, rest in cascade_probabilities(ordered))


def ideal_inexact_services(state: ClusterState, family: IPFamily) -> set[str]:
    """The services (named as `probes` names them) with a selection chain whose iptables
    probabilities cannot be read back exactly: a weighted cascade with a rule w / rest whose
    reduced denominator exceeds quantize.TEN_DECIMAL_EXACT_DENOMINATOR (400 endpoints with
    weights up to 1000 have rest sums of 200 000 and more). Known from the model, not the
    rules: the rules cannot tell which fraction ten decimals were printed from."""
    out: set[str] = set()
    for svc, endpoints in state.service_ports(family):
        routing = categorize(svc, endpoints, state.node)
        if not (_cascade_exact(routing.cluster) and _cascade_exact(routing.local)):
            out.add(f"{svc.name} ({svc.protocol.lower})")
    return out


def families(state: ClusterState) -> list[IPFamily]:
    return sorted({k[1] for k in state.services}, key=lambda f: f.value)


# --------------------------------------------------------------------------------------------
# Bounded work (see the module docstring).

# Rule evaluations allowed by the estimate below: ~9 us each here, so at most ~40 s of
# evaluations past those one rule each (one Service of about 1 400 ports, 2 probes per port;
# 10 000 Services of one port each, 5 probes per port, estimate 50 000).
WORK_LIMIT = 4_000_000


@dataclass(frozen=True, slots=True)
class Work:
    """The estimated rule evaluations of a compare, and the address that costs the most."""

    evaluations: int
    family: IPFamily | None = None
    address: str = ""
    ports: int = 0  # service ports whose rules demand `address`
    probes: int = 0  # probes sent to `address`


class TooMuchWork(ValueError):
    """The estimate is over the limit: refused before anything is rendered."""


def _destinations(svc: ServicePort, family: IPFamily) -> set[str]:
    """Addresses whose KUBE-SERVICES rules name this service port (node ports have a chain
    indexed by port, so they crowd nothing)."""
    return {svc.cluster_ip, *of_family(svc.external_ips, family), *of_family(svc.load_balancer_ips, family)}


def _family_work(state: ClusterState, family: IPFamily) -> Work:
    """Each probe to an address may evaluate every rule of that address: the sum over addresses
    of probes x service ports there, an upper bound of the scans the index leaves."""
    ports: dict[str, int] = {}
    for svc, _ in state.service_ports(family):
        for address in _destinations(svc, family):
            ports[address] = ports.get(address, 0) + 1
    sent: dict[str, int] = {}
    for probe in (*probes(state, family), *documented_probes(state, family)):
        if probe.dst in ports:
            sent[probe.dst] = sent.get(probe.dst, 0) + 1
    total = sum(n * ports[address] for address, n in sent.items())
    worst = max(sent, key=lambda a: sent[a] * ports[a], default="")
    return Work(total, family, worst, ports.get(worst, 0), sent.get(worst, 0))


def estimate(state: ClusterState) -> Work:
    """The whole compare's estimate; the family and address reported are the costliest."""
    works = [_family_work(state, family) for family in families(state)]
    if not works:
        return Work(0)
    worst = max(works, key=lambda w: w.ports * w.probes)
    return Work(sum(w.evaluations for w in works), worst.family, worst.address, worst.ports, worst.probes)


def bounded(state: ClusterState, work_limit: int = WORK_LIMIT) -> Work:
    """The estimate, or TooMuchWork when it is over `work_limit` (0: no limit)."""
    work = estimate(state)
    if work_limit and work.evaluations > work_limit:
        assert work.family is not None
        raise TooMuchWork(
            f"about {work.evaluations} rule evaluations, over the limit of {work_limit} "
            f"(--work-limit): {work.ports} service ports share the address {work.address} "
            f"(IPv{work.family.value}), and each of its {work.probes} probes may evaluate the "
            f"rules of all of them, so the work grows with the square of the ports "
            f"(docs/semantics.md, \"Bounded work\")"
        )
    return work


@gc_paused()  # both rule sets read back and every probe walked
def compare(state: ClusterState, work_limit: int = WORK_LIMIT) -> Comparison:
    """Both renderings walked for every probe; TooMuchWork, at once, when the estimate of the
    work is over `work_limit` (0: no limit)."""
    bounded(state, work_limit)
    results: list[Agreement] = []
    for family in families(state):
        # nft first: its JSON document, the largest transient, is gone before iptables is read.
        nft = nft_ruleset(state, family)
        ipt = iptables_ruleset(state, family)
        node_ips = state.node.ips_of(family)
        inexact = ideal_inexact_services(state, family)
        for probe in (*probes(state, family), *documented_probes(state, family)):
            packet = probe.packet()
            ipt_kernel, ipt_ideal = interpret_both(ipt, packet, node_ips=node_ips)
            nft_kernel, nft_ideal = interpret_both(nft, packet, node_ips=node_ips)
            results.append(Agreement(probe, ipt_kernel, nft_kernel, ipt_ideal, nft_ideal,
                                     ideal_exact=probe.service not in inexact))
    return Comparison(tuple(results))

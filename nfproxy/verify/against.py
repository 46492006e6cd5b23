"""`compare --against-netns / --against-file`: nfproxy's rules beside another proxy's, exactly.

The migration question: would nfproxy do, for every service port and traffic class, exactly what
the proxy programming this node now does (kube-proxy, iptables or nftables mode)? The other
proxy's rules are read back (live, read-only, or from a dump), nfproxy's are rendered for the
same cluster in the matching backend, and the exact interpreter walks both with the probes of
`compare` (verify.compare.probes and documented_probes: cluster IP, node port, external and LB
IPs from a pod, the node, outside and the hairpin endpoint; unused ports and unallocated service
addresses).

Equal means what `compare` means between nfproxy's two backends: the same outcomes (verdict,
endpoint, masquerade); kernel-mode probabilities within 1e-9 (kube-proxy's nftables mode draws
`numgen random mod N`, nfproxy's lanes `mod 223423200`: their integer buckets differ by less
than that), and the probabilities as written exactly equal. Anything else is a difference,
named with the probe (the traffic) that shows it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction

from nfproxy.analysis.interpret import Outcome, interpret_both
from nfproxy.analysis.ir import Ruleset
from nfproxy.core.gc_pause import gc_paused
from nfproxy.core.model import ClusterState, IPFamily
from nfproxy.verify import compare as both
from nfproxy.verify.probe import Probe

_ZERO = Fraction(0)


@dataclass(frozen=True, slots=True)
class Side:
    """One probe's exact outcome distribution under one ruleset, in both interpreter modes."""

    kernel: dict[Outcome, Fraction]
    ideal: dict[Outcome, Fraction]


@dataclass(frozen=True, slots=True)
class Match:
    """nfproxy's and the other proxy's rules for one probe."""

    probe: Probe
    ours: Side
    theirs: Side

    @property
    def max_difference(self) -> Fraction:
        """The largest |ours - theirs| of any outcome, kernel mode."""
        keys = self.ours.kernel.keys() | self.theirs.kernel.keys()
        return max((abs(self.ours.kernel.get(k, _ZERO) - self.theirs.kernel.get(k, _ZERO)) for k in keys),
                   default=_ZERO)

    @property
    def equal(self) -> bool:
        return (set(self.ours.kernel) == set(self.theirs.kernel)
                and self.max_difference <= both.KERNEL_TOLERANCE
                and self.ours.ideal == self.theirs.ideal)

    @property
    def why(self) -> str:
        """What differs, in words: outcomes only one side has, or the probabilities."""
        only_ours = sorted(str(o) for o in self.ours.kernel.keys() - self.theirs.kernel.keys())
        only_theirs = sorted(str(o) for o in self.theirs.kernel.keys() - self.ours.kernel.keys())
        if only_ours or only_theirs:
            parts = [f"only nfproxy: {', '.join(only_ours)}" if only_ours else "",
                     f"only theirs: {', '.join(only_theirs)}" if only_theirs else ""]
            return "; ".join(p for p in parts if p)
        if self.max_difference > both.KERNEL_TOLERANCE:
            return f"probabilities differ by up to {float(self.max_difference):.3e} (kernel arithmetic)"
        return "probabilities as written differ (kernel arithmetic agrees within 1e-9)"


@dataclass(frozen=True, slots=True)
class Against:
    backend: str  # nfproxy's backend, the other proxy's mode
    description: str  # where their rules came from
    matches: tuple[Match, ...]

    @property
    def equal(self) -> bool:
        return all(m.equal for m in self.matches)

    @property
    def differences(self) -> list[Match]:
        return [m for m in self.matches if not m.equal]


def ours(state: ClusterState, backend: str, family: IPFamily) -> Ruleset:
    """nfproxy's rules for `state`, rendered and read back as `compare` reads them."""
    return both.nft_ruleset(state, family) if backend == "nft" else both.iptables_ruleset(state, family)


def _probes(state: ClusterState, family: IPFamily) -> Iterator[Probe]:
    yield from both.probes(state, family)
    yield from both.documented_probes(state, family)


@gc_paused()
def against(state: ClusterState, theirs: Ruleset, backend: str, description: str,
            work_limit: int = both.WORK_LIMIT) -> Against:
    """Every probe walked through nfproxy's rendering and through `theirs`; TooMuchWork at once
    when the estimate is over `work_limit` (0: no limit), as `compare`."""
    both.bounded(state, work_limit)
    matches: list[Match] = []
    for family in both.families(state):
        mine = ours(state, backend, family)
        node_ips = state.node.ips_of(family)
        for probe in _probes(state, family):
            packet = probe.packet()
            matches.append(Match(probe, Side(*interpret_both(mine, packet, node_ips=node_ips)),
                                 Side(*interpret_both(theirs, packet, node_ips=node_ips))))
    return Against(backend, description, tuple(matches))

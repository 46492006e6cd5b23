"""A probe: one traffic class sent at the rules, and what each backend did with it.

compare walks probes through the rules read back, the lab and the compat corpus's kernel runner
send them as real connections; all three describe traffic with this one `Probe`, so a packet
means the same thing in each (its first five fields are the interpreter's `Packet`, one for
one). The lab and the kernel runner record what real connections saw in the one result type,
`ProbeResult` (a `Measured` per backend, with the problems the runner found); compare's exact
agreement between two rule sets (`compare.Agreement`) observes no traffic, so it has no counts.
"""

from __future__ import annotations

import enum
import ipaddress
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Literal

from nfproxy.analysis.interpret import Origin, Packet
from nfproxy.core.model import IPFamily, NodeConfig, Protocol
from nfproxy.verify.sandbox import NODE, Outcome, endpoint_label

Verdict = Literal["dnat", "reject", "drop", "accept"]


class Check(enum.Enum):
    """The lab's traffic classes shown as pass/fail rows (the distributions are rows of their own)."""

    NODE_PORT = "NodePort"
    LB_ALLOWED = "LoadBalancer, allowed source"
    LB_BLOCKED = "LoadBalancer, blocked source"
    EXTERNAL_IP = "external IP"
    FROM_NODE = "NodePort from the node itself"
    AFFINITY = "session affinity"
    NO_ENDPOINTS = "no endpoints"
    NO_LOCAL_ENDPOINTS = "internalTrafficPolicy Local, no local endpoint"


@dataclass(frozen=True, slots=True)
class Expect:
    """What kube-proxy does with a probe's first packet, written by hand (the compat corpus).

    `uniform` lists the `ip:port` endpoints the connection is spread over with equal
    probability (verdict "dnat"); `masquerade` is whether the endpoint sees the node instead
    of the client (None: not asserted).
    """

    uniform: tuple[str, ...] | None
    verdict: Verdict
    masquerade: bool | None


@dataclass(frozen=True, slots=True)
class Probe:
    """One traffic class: `count` fresh connections from one source to one address and port."""

    src: str
    """An IP address, or "node" for the node's own traffic when the runner picks the address."""
    dst: str
    port: int
    proto: str
    """"tcp", "udp" or "sctp"."""
    origin: Origin
    """Where the rules see the packet come from: "node", "pod" (a pod CIDR) or "outside"."""
    service: str = ""
    """The service port under test (`ns/name:port`, or with the protocol for compare)."""
    traffic: str = ""
    """What compare calls the traffic class, e.g. "cluster IP from pod"."""
    client: str = ""
    """The sandbox client that sends it ("node" for the node itself); empty: not sent."""
    count: int = 1
    timeout: float = 1.0
    check: Check | None = None
    """The lab's pass/fail row this probe backs; None for a distribution row."""
    expect: Expect | None = None
    """The hand-written expectation (compat corpus); None where the rules are the expectation."""
    exact_only: str = ""
    """Why the kernel runner cannot send this probe (the exact interpreter still checks it)."""
    expect_iptables: Expect | None = None
    """Where kube-proxy's iptables mode differs from its nftables mode (docs/semantics.md):
    what the iptables backend does instead of `expect`."""
    nft_only: str = ""
    """compare: the nft verdict of a documented difference ("reject", "drop"); "" for every
    ordinary probe."""
    iptables_documented: str = "accept"
    """compare: the iptables verdict of that documented difference: "accept" where the
    iptables backend leaves the packet alone, "reject" where it rejects what nft drops."""

    def expect_for(self, backend: str) -> Expect | None:
        if backend == "iptables" and self.expect_iptables is not None:
            return self.expect_iptables
        return self.expect

    @property
    def family(self) -> IPFamily:
        return IPFamily.V6 if ":" in self.dst else IPFamily.V4

    @property
    def protocol(self) -> Protocol:
        return Protocol(self.proto.upper())

    @property
    def target(self) -> str:
        return endpoint_label(self.dst, self.port)

    @property
    def title(self) -> str:
        what = self.check.value if self.check else "ClusterIP"
        return f"{what} {self.target}/{self.proto} from {self.client}"

    def packet(self, node_ips: Sequence[str] = ()) -> Packet:
        """The interpreter's packet; a "node" source becomes the node's first address of the family."""
        src = self.src
        if src == NODE:
            own = of_family(node_ips, self.family)
            if not own:
                raise ValueError(f"{self}: the node has no IPv{self.family.value} address")
            src = own[0]
        return Packet(src, self.dst, self.port, self.proto, self.origin)

    def __str__(self) -> str:
        return f"{self.proto} {self.src} -> {self.target}"


def of_family(addresses: Iterable[str], family: IPFamily) -> list[str]:
    """The addresses or CIDRs of one family, in order (the model mixes both in one field)."""
    return [a for a in addresses if (":" in a) == (family is IPFamily.V6)]


def origin_of(src: str, node: NodeConfig) -> Origin:
    """Where a packet comes from, as the rules see it: the node, a pod, or off the cluster."""
    if src == NODE:
        return "node"
    addr = ipaddress.ip_address(src)
    for cidr in node.cluster_cidrs:
        net = ipaddress.ip_network(cidr)
        if net.version == addr.version and addr in net:
            return "pod"
    return "outside"


# --------------------------------------------------------------------------------------------
# What real connections saw


Seen = tuple[str, str | None]
"""(label, source): label is `ip:port` of the answering endpoint or the failure kind
(refused, timeout, ...); source is the address the endpoint saw, None for failures."""


def observed(outcomes: Iterable[Outcome]) -> Counter[Seen]:
    return Counter((o.endpoint, o.source) if o.ok else (o.kind, None) for o in outcomes)


def labels(counts: Mapping[Seen, Any]) -> Counter[str]:
    out: Counter[str] = Counter()
    for (label, _), n in counts.items():
        out[label] += n
    return out


@dataclass(frozen=True, slots=True)
class Test:
    statistic: float
    p: float


def goodness_of_fit(observed_counts: Mapping[str, int], expected: Mapping[str, Fraction]) -> Test:
    """Chi-square of the observed labels against the exact shares (an impossible label: p = 0)."""
    from nfproxy.verify import stats

    statistic, p = stats.goodness_of_fit(dict(observed_counts), dict(expected))
    return Test(statistic, p)


def two_sample(a: Mapping[str, int], b: Mapping[str, int]) -> Test:
    """Whether two backends' counts could come from one distribution (chi-square contingency)."""
    from nfproxy.verify import stats

    statistic, p = stats.two_sample(dict(a), dict(b))
    return Test(statistic, p)


@dataclass(frozen=True, slots=True)
class Measured:
    """One probe on one backend: what the connections saw, against what they should have.

    `expected` is the exact share of each outcome when the rules give one (the lab asks the
    interpreter); empty when the expectation is the corpus's hand-written `Expect`. `problems`
    is the runner's judgement: empty means the backend did as it should.
    """

    expected: Mapping[Seen, Fraction]
    seen: Mapping[Seen, int]
    seconds: float
    problems: tuple[str, ...] = ()
    p_value: float | None = None
    """The runner's own test of the split, where it made one."""

    @property
    def sent(self) -> int:
        return sum(self.seen.values())

    @property
    def expected_labels(self) -> dict[str, Fraction]:
        out: dict[str, Fraction] = {}
        for (label, _), share in self.expected.items():
            out[label] = out.get(label, Fraction(0)) + share
        return out

    @property
    def seen_labels(self) -> Counter[str]:
        return labels(self.seen)

    @property
    def unexpected(self) -> dict[Seen, int]:
        """Observations the rules give no chance: a wrong endpoint, failure or source."""
        return {s: n for s, n in self.seen.items() if n and not self.expected.get(s)}

    def fit(self) -> Test:
        return goodness_of_fit(self.seen_labels, self.expected_labels)


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """A probe and what each backend it was sent to did with it."""

    probe: Probe
    by_backend: Mapping[str, Measured]
    not_sent: str = ""
    """Why the probe was not sent at all (exact-only); empty when it was."""

    @property
    def labels(self) -> list[str]:
        """Every label expected or seen on any backend, endpoints first, in address order."""
        found: set[str] = set()
        for m in self.by_backend.values():
            found.update(k for k, v in m.expected_labels.items() if v)
            found.update(m.seen_labels)
        return sorted(found, key=_label_order)

    @property
    def problems(self) -> tuple[str, ...]:
        """Every backend's problems; prefixed by the backend when there are several."""
        if len(self.by_backend) == 1:
            return next(iter(self.by_backend.values())).problems
        return tuple(f"{b}: {p}" for b, m in self.by_backend.items() for p in m.problems)

    @property
    def ok(self) -> bool:
        return not self.problems

    def measured(self) -> Measured:
        """The one backend's measurement, for a runner that sends each backend on its own."""
        (m,) = self.by_backend.values()
        return m

    def passed(self, backend: str) -> bool:
        return not self.by_backend[backend].problems

    def fits(self) -> dict[str, Test]:
        return {b: m.fit() for b, m in self.by_backend.items()}

    def between(self) -> Test | None:
        if len(self.by_backend) != 2:
            return None
        a, b = self.by_backend.values()
        return two_sample(a.seen_labels, b.seen_labels)


def _label_order(label: str) -> tuple[int, int, int, str]:
    """Endpoints by family, address and port; then failure kinds by name."""
    host, _, port = label.rpartition(":")
    try:
        addr = ipaddress.ip_address(host.strip("[]"))
        return (addr.version, int(addr), int(port), "")
    except ValueError:
        return (99, 0, 0, label)

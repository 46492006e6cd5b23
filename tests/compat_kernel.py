"""The compat corpus against the real kernel: every probe sent as real connections.

For each scenario and backend a sandbox is built around the scenario's node: one client
namespace per probe source address, one namespace per endpoint IP with a server on each of its
ports (every endpoint of every service, ready or not, so a wrong choice answers and is seen),
and the backend's full rendering applied in the node namespace. Each probe is then sent for real
and judged from the server side: which endpoint answered, and whether the address and port it
saw are the client's own (masquerade rewrites them; with --random-fully it rewrites the port even
when the node connects with its own address).

What a verdict looks like on the wire:
- dnat: every connection answered, only by expected endpoints, every expected endpoint seen
  (40 connections per endpoint), counts consistent with 1/n (chi-square, for small n). Under
  ClientIP affinity the client must instead stick to one expected endpoint.
- reject: connection refused (RST or ICMP port unreachable), well within a second.
- drop: no answer at all until the timeout (for the node's own traffic, dropped in its output
  path, the send fails at once instead: the sandbox's "denied").
- accept: the packet reaches its own destination unchanged (a server listens there).

SCTP cannot be sent here (the sandbox speaks TCP and UDP, and test kernels often lack SCTP
sockets); such probes must say so in the scenario (`exactOnly`) and are left to the exact
interpreter. Nothing is silently passed: an unsent probe is reported with its reason.
"""

from __future__ import annotations

import collections
import concurrent.futures
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from nfproxy.backends.registry import backend_names
from nfproxy.verify import stats
from nfproxy.kernel.iptables import Flavour, detect_flavour
from nfproxy.core.model import ClusterState, Protocol, ServicePort
from nfproxy.verify.probe import Expect, Measured, Probe, ProbeResult, observed
from nfproxy.verify.sandbox import NODE, Outcome, Sandbox, SandboxSpec, endpoint_label, summarize
from nfproxy.verify.validate import apply_iptables, apply_nft
from tests.scenarios import Scenario

BACKENDS = backend_names()

CONNECTIONS_PER_ENDPOINT = 40
MIN_CONNECTIONS = 60
CHI_SQUARE_MAX_ENDPOINTS = 8
"""Above this the sample per endpoint is too thin for the test to mean much; "every endpoint
seen, nothing else" is the check that matters there."""
P_MIN = 1e-5
"""Per-probe threshold: the corpus runs a few hundred tests, so 1e-3 would fail a run by
chance now and then; a real skew (say one endpoint never picked by a slot) gives p ~ 0."""
AFFINITY_CONNECTIONS = 20
REJECT_CONNECTIONS = 5
REJECT_WITHIN = 1.0
DROP_CONNECTIONS = 3
DROP_TIMEOUT = 0.5
CONNECT_TIMEOUT = 2.0
MASQUERADED_SHARE = 0.9
"""With --random-fully a masqueraded flow keeps its port about once in 28 000; allow a few."""
CLASH_REMAP_SHARE = 1 - MASQUERADED_SHARE
"""Port-only rewrites of the node's own flows that conntrack's tuple-clash remap may explain."""


@dataclass(frozen=True, slots=True)
class ScenarioResult:
    scenario: str
    backend: str
    probes: tuple[ProbeResult, ...]
    seconds: float
    error: str = ""
    """Set when the scenario could not run at all (sandbox or apply failed)."""

    @property
    def ok(self) -> bool:
        return not self.error and all(p.ok for p in self.probes)

    def report(self) -> str:
        """One line per failing probe, for assertion messages."""
        lines = [f"{self.scenario} [{self.backend}]: {self.error}"] if self.error else []
        for p in self.probes:
            if p.problems:
                counts = dict(p.measured().seen_labels) if p.by_backend else {}
                lines.append(
                    f"{self.scenario} [{self.backend}] {p.probe}: {'; '.join(p.problems)} "
                    f"(seen {counts})"
                )
        return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# The sandbox a scenario needs


def _client_names(scenario: Scenario) -> dict[str, str]:
    """Sandbox client name per probe source address (endpoints and the node are their own)."""
    endpoint_ips = _endpoint_ips(scenario.state)
    names: dict[str, str] = {}
    for probe in scenario.probes:
        if probe.src == NODE or probe.src in endpoint_ips or probe.src in names:
            continue
        names[probe.src] = f"c{len(names)}"
    return names


def _endpoint_ips(state: ClusterState) -> set[str]:
    return {e.ip for eps in state.endpoints.values() for e in eps}


def sandbox_spec(scenario: Scenario) -> SandboxSpec:
    """Node IPs, one client per source address, a server on every endpoint port (and on the
    destination of every accept probe, to see it arrive untouched)."""
    state = scenario.state
    servers: dict[str, set[tuple[int, str]]] = collections.defaultdict(set)
    for key, eps in state.endpoints.items():
        proto = key[0].protocol
        if proto is Protocol.SCTP:
            continue
        for e in eps:
            servers[e.ip].add((e.port, proto.lower))
    for probe in scenario.probes:
        accepted = any(probe.expect_for(b).verdict == "accept" for b in ("iptables", "nft"))
        if accepted and probe.proto != "sctp" and not probe.exact_only:
            servers[probe.dst].add((probe.port, probe.proto))
    return SandboxSpec.of(
        node_ips=state.node.ips,
        clients={name: src for src, name in _client_names(scenario).items()},
        endpoints={ip: sorted(ports) for ip, ports in sorted(servers.items())},
    )


def target(state: ClusterState, probe: Probe) -> ServicePort | None:
    """The service port a probe's destination belongs to, if any."""
    for sp in state.services.values():
        if sp.protocol.lower != probe.proto:
            continue
        if probe.port == sp.port and (
            probe.dst == sp.cluster_ip
            or probe.dst in sp.load_balancer_ips
            or probe.dst in sp.external_ips
        ):
            return sp
        if sp.node_port and probe.port == sp.node_port and probe.dst in state.node.ips:
            return sp
    return None


# --------------------------------------------------------------------------------------------
# Judging one probe


def _masquerade_problems(
    outcomes: Sequence[Outcome], expected: bool | None, own: str, node: bool
) -> list[str]:
    """Judge masquerade by the source address the servers saw, and for the node by the port too.

    The node's routes to endpoints take a node IP as source, so a masqueraded flow from the node
    keeps its address and only --random-fully's port rewrite shows it. Conntrack also rewrites a
    source port on its own when two flows' tuples clash after DNAT (an implicit null-binding
    remap, not masquerading), so for the node a port change counts only as a majority: masquerade
    rewrites all but about one in 28 000, a clash a handful at most."""
    if expected is None or not outcomes:
        return []
    moved = sum(1 for o in outcomes if o.source != own)
    ported = sum(1 for o in outcomes if o.source == own and o.source_port != o.client_port)
    sources = dict(collections.Counter(o.source for o in outcomes))
    if expected:
        rewritten = moved + (ported if node else 0)
        if rewritten < MASQUERADED_SHARE * len(outcomes):
            return [f"expected masquerade, {len(outcomes) - rewritten} of {len(outcomes)} kept the "
                    f"client's source {own} (sources seen {sources})"]
        return []
    if moved:
        return [f"expected no masquerade, {moved} of {len(outcomes)} were rewritten "
                f"(sources seen {sources}, client {own})"]
    if node and ported > CLASH_REMAP_SHARE * len(outcomes):
        return [f"expected no masquerade, {ported} of {len(outcomes)} had their source port "
                f"rewritten (more than conntrack's clash remaps explain)"]
    return []


@dataclass(frozen=True, slots=True)
class _Sender:
    """One probe's client in a running sandbox: sends connections and knows its own address."""

    sb: Sandbox
    client: str
    probe: Probe

    @property
    def own(self) -> str:
        return self.sb.address(self.client, self.probe.family.value)

    @property
    def is_node(self) -> bool:
        return self.client == NODE

    def connect(self, count: int, timeout: float = CONNECT_TIMEOUT) -> list[Outcome]:
        p = self.probe
        return self.sb.connect(self.client, p.dst, p.port, p.proto, count, timeout=timeout)


Judged = tuple[list[Outcome], list[str], float | None]
"""What was sent, what is wrong with it, and the split's p-value where one was tested."""


def _judge(sb: Sandbox, scenario: Scenario, probe: Probe, backend: str) -> ProbeResult:
    if probe.exact_only:
        return ProbeResult(probe, {}, not_sent=probe.exact_only)
    if probe.proto == "sctp":
        problem = "SCTP cannot be sent in the sandbox: mark the probe exactOnly"
        return ProbeResult(probe, {backend: Measured({}, {}, 0.0, (problem,))})
    client = NODE if probe.src == NODE else _client_names(scenario).get(probe.src, probe.src)
    sender = _Sender(sb, client, probe)
    expect = probe.expect_for(backend)
    assert expect is not None
    started = time.monotonic()
    outcomes, problems, p_value = _BY_VERDICT[expect.verdict](sender, scenario, expect)
    seen = Measured({}, observed(outcomes), time.monotonic() - started, tuple(problems), p_value)
    return ProbeResult(probe, {backend: seen})


def _judge_dnat(sender: _Sender, scenario: Scenario, expect: Expect) -> Judged:
    assert expect.uniform is not None
    wanted = set(expect.uniform)
    sp = target(scenario.state, sender.probe)
    sticky = sp is not None and sp.affinity_timeout > 0
    count = AFFINITY_CONNECTIONS if sticky else max(
        MIN_CONNECTIONS, CONNECTIONS_PER_ENDPOINT * len(wanted)
    )
    outcomes = sender.connect(count)
    counts = summarize(outcomes)
    answered = [o for o in outcomes if o.ok]
    problems: list[str] = []
    p_value: float | None = None
    if len(answered) != count:
        problems.append(f"{count - len(answered)} of {count} connections were not answered")
    stray = sorted(k for k in set(counts) - wanted if ":" in k)
    if stray:
        problems.append(f"answered by endpoints outside the expected set: {stray}")
    if sticky:
        if len({o.endpoint for o in answered}) > 1:
            problems.append("ClientIP affinity: one client reached several endpoints")
    else:
        missing = sorted(wanted - set(counts))
        if missing:
            problems.append(f"expected endpoints never answered: {missing}")
        if not problems and 1 < len(wanted) <= CHI_SQUARE_MAX_ENDPOINTS:
            _, p_value = stats.goodness_of_fit(
                {k: counts[k] for k in wanted}, stats.uniform(sorted(wanted))
            )
            if p_value < P_MIN:
                problems.append(f"split not uniform: chi-square p = {p_value:.2g}")
    problems += _masquerade_problems(answered, expect.masquerade, sender.own, sender.is_node)
    return outcomes, problems, p_value


def _judge_reject(sender: _Sender, scenario: Scenario, expect: Expect) -> Judged:
    outcomes = sender.connect(REJECT_CONNECTIONS)
    problems = []
    if set(summarize(outcomes)) != {"refused"}:
        problems.append("expected every connection refused")
    slow = [o.seconds for o in outcomes if o.kind == "refused" and o.seconds >= REJECT_WITHIN]
    if slow:
        problems.append(f"refused only after {max(slow):.2f}s")
    return outcomes, problems, None


def _judge_drop(sender: _Sender, scenario: Scenario, expect: Expect) -> Judged:
    outcomes = sender.connect(DROP_CONNECTIONS, DROP_TIMEOUT)
    # What the node itself sends and its own output path drops fails at once (EPERM).
    silent = {"timeout", "denied"} if sender.is_node else {"timeout"}
    if not set(summarize(outcomes)) <= silent:
        return outcomes, ["expected every connection to go unanswered (dropped)"], None
    return outcomes, [], None


def _judge_accept(sender: _Sender, scenario: Scenario, expect: Expect) -> Judged:
    """Delivered to its own destination, untouched."""
    outcomes = sender.connect(REJECT_CONNECTIONS)
    own_server = endpoint_label(sender.probe.dst, sender.probe.port)
    problems = []
    if set(summarize(outcomes)) != {own_server}:
        problems.append(f"expected the packets to reach {own_server} itself")
    problems += _masquerade_problems(
        [o for o in outcomes if o.ok], expect.masquerade, sender.own, sender.is_node
    )
    return outcomes, problems, None


_BY_VERDICT: dict[str, Callable[[_Sender, Scenario, Expect], Judged]] = {
    "dnat": _judge_dnat, "reject": _judge_reject, "drop": _judge_drop, "accept": _judge_accept,
}


# --------------------------------------------------------------------------------------------
# Running scenarios


def _apply(state: ClusterState, backend: str, ns: str, flavour: Flavour | None) -> None:
    if backend == "iptables":
        apply_iptables(state, ns, flavour)
    elif backend == "nft":
        apply_nft(state, ns)
    else:
        raise ValueError(f"unknown backend {backend!r} (have {', '.join(BACKENDS)})")


def run_scenario(
    scenario: Scenario, backend: str, flavour: Flavour | None = None
) -> ScenarioResult:
    """Build the scenario's sandbox, apply the backend's full rendering, send every probe."""
    started = time.monotonic()
    try:
        with Sandbox(sandbox_spec(scenario)) as sb:
            _apply(scenario.state, backend, sb.node_ns, flavour)
            results = tuple(_judge(sb, scenario, probe, backend) for probe in scenario.probes)
    except Exception as exc:  # noqa: BLE001 - reported per scenario, the others still run
        return ScenarioResult(
            scenario.name, backend, (), time.monotonic() - started, f"{type(exc).__name__}: {exc}"
        )
    return ScenarioResult(scenario.name, backend, results, time.monotonic() - started)


def run_corpus(
    scenarios: Iterable[Scenario],
    backends: Sequence[str] = BACKENDS,
    *,
    workers: int = 4,
    flavour: Flavour | None = None,
) -> list[ScenarioResult]:
    """Every scenario under every backend, `workers` sandboxes at a time.

    Threads are enough: the time goes to namespace setup in the kernel and to waiting on
    dropped flows, and each thread enters namespaces for itself only.
    """
    flavour = flavour or detect_flavour()
    jobs = [(s, b) for s in scenarios for b in backends]
    # The biggest first, so a 64-endpoint sandbox does not start last and run alone.
    jobs.sort(key=lambda job: -sum(len(e) for e in job[0].state.endpoints.values()))
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        futures = [pool.submit(run_scenario, s, b, flavour) for s, b in jobs]
        results = [f.result() for f in futures]
    return sorted(results, key=lambda r: (r.scenario, r.backend))

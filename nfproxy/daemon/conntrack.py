"""Which UDP conntrack entries point the wrong way after a sync (pure).

NAT rules run for a connection's first packet only; conntrack replays the decision for every
later packet. UDP has no end, so a client that keeps sending from one source port keeps its
entry alive forever: pinned to an endpoint that went away, or black-holed by an entry made
without NAT before the service had rules.

Each sync that changed a UDP service port walks the family's UDP table once, as kube-proxy's
CleanStaleEntries (pkg/proxy/conntrack/cleanup.go, 1.37) does on such syncs: an entry sent to a
UDP service's address and port, or to its node port, is stale unless its reply comes from one
of the service's serving endpoints (`udp_frontends`, `Frontends.stale`). A service with no
serving endpoint keeps no entry to its addresses (kubernetes#139629). The first sync after a
start, and the one after a cleanup that failed, walk every family with UDP services.

What the current state cannot say, the change can (`stale_flows(old, new)`): entries to an
address or port the service no longer has (a deleted service: kubernetes#141371 does the same
after 1.37), and entries DNATed to a gone endpoint through a node port, also when no endpoint
is left (upstream leaves node ports of such services alone, as it matches them on the port
only; these filters name the endpoint). `sweeps` puts both together, one `Sweep` per family.

"Endpoint" here means a serving one, as kube-proxy's tracker counts: traffic policy, topology
and the terminating fallback are not consulted, so a policy change does not cut existing flows
(UDP then behaves as TCP does). Only the protocol UDP is handled, as upstream: TCP and SCTP
connections end, and the endpoint's own stack resets them. nfproxy.kernel.conntrack reads the
table and deletes what a `Sweep` judges stale.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from nfproxy.core.model import ClusterState, Endpoint, IPFamily, Protocol, ServicePort, ServicePortKey
from nfproxy.kernel.conntrack import Flow, FlowFilter, matcher


def _frontends(svc: ServicePort) -> tuple[tuple[str, int], ...]:
    """Every (address, port) clients reach the service at, besides its node port."""
    ips = (svc.cluster_ip, *svc.external_ips, *svc.load_balancer_ips)
    return tuple((ip, svc.port) for ip in dict.fromkeys(ips) if ip)


def _serving(endpoints: tuple[Endpoint, ...]) -> dict[str, Endpoint]:
    return {ep.address: ep for ep in endpoints if ep.serving}


def _service_flows(
    key: ServicePortKey, old: ClusterState, new: ClusterState
) -> Iterator[FlowFilter]:
    o_svc = old.services.get(key)
    n_svc = new.services.get(key)
    if o_svc is None:
        return
    family = key[1]
    name = str(key[0])
    o_eps = _serving(old.endpoints.get(key, ()))
    n_eps = _serving(new.endpoints.get(key, ())) if n_svc is not None else {}
    n_front = set(_frontends(n_svc)) if n_svc is not None else set()
    n_node_port = n_svc.node_port if n_svc is not None else 0

    # Addresses the service no longer has: nothing DNATs there now, whatever the reply.
    for ip, port in sorted(set(_frontends(o_svc)) - n_front):
        yield FlowFilter(family, orig_dst=ip, orig_dport=port, reason=f"{name}: {ip}:{port} removed")

    # The node port's entries DNATed to an endpoint that no longer serves behind it (or the node
    # port went away): named by the endpoint, since the port alone could be anyone's.
    if o_svc.node_port:
        kept = n_eps if n_node_port == o_svc.node_port else {}
        for address in sorted(set(o_eps) - set(kept)):
            ep = o_eps[address]
            yield FlowFilter(
                family, orig_dport=o_svc.node_port, reply_src=ep.ip, reply_sport=ep.port,
                reason=f"{name}: node port {o_svc.node_port}: endpoint {address} gone",
            )


def stale_flows(
    old: ClusterState, new: ClusterState, changed: Iterable[ServicePortKey] | None = None
) -> list[FlowFilter]:
    """Filters for the UDP entries `old` -> `new` leaves pointing the wrong way that the new
    state alone cannot name (removed addresses; gone endpoints behind a node port).

    Sorted and free of duplicates; empty when nothing UDP changed. Call it with the state the
    kernel held before a sync and the state it holds after (deleting before the new rules are in
    would let the next packet be NATed by the old ones). `changed`, when the caller already knows
    which service ports differ (a sync does), spares walking every service.
    """
    candidates = (*old.services, *new.services) if changed is None else changed
    keys = {
        k for k in candidates
        if (svc := old.services.get(k) or new.services.get(k)) is not None and svc.protocol is Protocol.UDP
    }
    found: dict[FlowFilter, FlowFilter] = {}
    for key in sorted(keys):
        if old.services.get(key) == new.services.get(key) and old.endpoints.get(
            key, ()
        ) == new.endpoints.get(key, ()):
            continue
        for flow in _service_flows(key, old, new):
            found.setdefault(flow, flow)
    return sorted(found, key=FlowFilter.sort_key.fget)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# Reconciling the whole table (every sync that changed a UDP service port, as kube-proxy)

# Where replies may come from: serving endpoints' (ip, port).
Replies = frozenset[tuple[str, int]]


@dataclass(frozen=True, slots=True)
class Frontends:
    """One family's UDP frontends, each with the replies it may get (kube-proxy 1.37's
    serviceIPEndpoints and serviceNodePortEndpoints, pkg/proxy/conntrack/cleanup.go).

    Every UDP service port's addresses are here, those without serving endpoints with no
    replies at all (kubernetes#139629): an entry made while the service had endpoints is DNATed
    by conntrack before the reject rule, which matches the service address, is ever seen, so a
    one-way sender would stay pinned to the gone endpoint for as long as it keeps sending. Node
    ports are here only with serving endpoints, as upstream: they are matched on the port alone,
    so an empty set would delete every UDP flow to that port, someone else's too. The endpoint's
    port counts as well as its address (a target port that moved is stale), as upstream's.
    """

    family: IPFamily
    addresses: Mapping[tuple[str, int], Replies]
    node_ports: Mapping[int, Replies]

    def __bool__(self) -> bool:
        return bool(self.addresses or self.node_ports)

    def stale(self, flow: Flow) -> str | None:
        """Why an entry points the wrong way (None: it does not, or is none of ours)."""
        if flow.protocol is not Protocol.UDP or flow.orig_dport is None:
            return None
        reply = (flow.reply_src, flow.reply_sport)
        replies = self.addresses.get((flow.orig_dst, flow.orig_dport))
        if replies is not None and reply not in replies:
            return f"{flow.orig_dst}:{flow.orig_dport}: reply from {_where(reply)}, {_not_serving(replies)}"
        replies = self.node_ports.get(flow.orig_dport)
        if replies is not None and reply not in replies:
            return f"node port {flow.orig_dport}: reply from {_where(reply)}, not a serving endpoint"
        return None


def _not_serving(replies: Replies) -> str:
    return "not a serving endpoint" if replies else "the service has no serving endpoint"


def _where(reply: tuple[str, int | None]) -> str:
    return f"[{reply[0]}]:{reply[1]}" if ":" in reply[0] else f"{reply[0]}:{reply[1]}"


def udp_frontends(state: ClusterState) -> dict[IPFamily, Frontends]:
    """Per family, the UDP frontends (families without a UDP service port are absent)."""
    addresses: dict[IPFamily, dict[tuple[str, int], set[tuple[str, int]]]] = {}
    node_ports: dict[IPFamily, dict[int, set[tuple[str, int]]]] = {}
    for key, svc in state.services.items():
        if svc.protocol is not Protocol.UDP:
            continue
        replies = {(ep.ip, ep.port) for ep in state.endpoints.get(key, ()) if ep.serving}
        family = key[1]
        for frontend in _frontends(svc):
            addresses.setdefault(family, {}).setdefault(frontend, set()).update(replies)
        if svc.node_port and replies:
            node_ports.setdefault(family, {}).setdefault(svc.node_port, set()).update(replies)
    return {
        family: Frontends(
            family,
            {k: frozenset(v) for k, v in addresses.get(family, {}).items()},
            {k: frozenset(v) for k, v in node_ports.get(family, {}).items()},
        )
        for family in sorted({*addresses, *node_ports})
    }


@dataclass(frozen=True, slots=True)
class Sweep:
    """One family's walk of its UDP conntrack table after a sync: an entry is stale when the
    current frontends say so, or when one of the change's filters (`stale_flows`: addresses
    and node ports that went away, endpoints gone through a node port) matches it."""

    frontends: Frontends
    filters: tuple[FlowFilter, ...] = ()
    _matches: Callable[[Flow], str | None] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_matches", matcher(self.filters))

    @property
    def family(self) -> IPFamily:
        return self.frontends.family

    def stale(self, flow: Flow) -> str | None:
        return self.frontends.stale(flow) or self._matches(flow)


def sweeps(
    previous: ClusterState | None,
    state: ClusterState,
    changed: Iterable[ServicePortKey],
    *,
    owed: bool = False,
) -> list[Sweep]:
    """The walks a sync from `previous` to `state` calls for, one per family at most.

    As kube-proxy (its EndpointsMap.Update's ConntrackCleanupRequired), a family is walked when
    the sync changed one of its UDP service ports; every family with UDP frontends is walked
    when `owed` (a cleanup failed) or at the first sync (no `previous`: what changed while the
    daemon was down is unknown). A family with nothing to judge is not walked.
    """
    changed = tuple(changed)
    every = owed or previous is None
    families = set() if every else {k[1] for k in changed if k[0].protocol is Protocol.UDP}
    if not (every or families):
        return []  # a TCP-only sync: not even the frontends are worked out
    filters = stale_flows(previous, state, changed) if previous is not None else []
    fronts = udp_frontends(state)
    if every:
        families = {*fronts, *(f.family for f in filters)}
    out = []
    for family in sorted(families):
        mine = tuple(f for f in filters if f.family is family)
        front = fronts.get(family, Frontends(family, {}, {}))
        if front or mine:
            out.append(Sweep(front, mine))
    return out

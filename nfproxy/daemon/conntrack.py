"""Which conntrack entries a change of services or endpoints leaves stale (UDP only).

NAT rules run for a connection's first packet only; conntrack replays the decision for every
later packet. UDP has no end, so a client that keeps sending from one source port keeps its
entry alive forever, and two cases go wrong (kube-proxy's pkg/proxy/conntrack/cleanup.go):

- An endpoint goes away: the entry still DNATs the client to the dead address. Entries whose
  original destination is one of the service's addresses and port (cluster IP, external IPs,
  load-balancer IPs), or its node port, and whose reply source is the endpoint are deleted.
- A service goes from no endpoints to some: while it had none, datagrams to its address created
  entries without NAT (before the rules existed, or routed past them), which would keep
  black-holing the client. Entries to the service's addresses and port, and to its node port,
  are deleted.

Also, as kube-proxy does for deleted services: when a service port (or one of its addresses)
disappears, entries to that address and port are deleted.

"Endpoint" here means a serving one, as kube-proxy's tracker counts: traffic policy, topology
and the terminating fallback are not consulted, so a policy change does not cut existing flows
(UDP then behaves as TCP does). Only the protocol UDP is handled, as upstream: TCP and SCTP
connections end, and the endpoint's own stack resets them.

Pure: `stale_flows(old, new)` returns filters (nfproxy.kernel.conntrack.FlowFilter, the value the
kernel layer deletes by); nfproxy.kernel.conntrack deletes what matches.

A change the daemon did not see (made while it was down) has no `old` to compare with, so the
first sync after a start reconciles the table instead, as kube-proxy's CleanStaleEntries does on
every sync: `served_frontends(state)` says, per family, which replies each UDP frontend with
serving endpoints may come from, and `Frontends.stale` judges each entry sent to one.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

from nfproxy.core.model import ClusterState, Endpoint, IPFamily, Protocol, ServicePort, ServicePortKey
from nfproxy.kernel.conntrack import Flow, FlowFilter


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
    family = key[1]
    name = str(key[0])
    o_eps = _serving(old.endpoints.get(key, ())) if o_svc is not None else {}
    n_eps = _serving(new.endpoints.get(key, ())) if n_svc is not None else {}
    o_front = set(_frontends(o_svc)) if o_svc is not None else set()
    n_front = set(_frontends(n_svc)) if n_svc is not None else set()
    o_node_port = o_svc.node_port if o_svc is not None else 0
    n_node_port = n_svc.node_port if n_svc is not None else 0

    # Addresses (or the node port) the service no longer has: nothing should DNAT there now.
    for ip, port in sorted(o_front - n_front):
        yield FlowFilter(family, orig_dst=ip, orig_dport=port, reason=f"{name}: {ip}:{port} removed")
    if o_node_port and o_node_port != n_node_port:
        yield FlowFilter(family, orig_dport=o_node_port, reason=f"{name}: node port {o_node_port} removed")

    # Endpoints gone (or no longer serving): only through the addresses that remain, since the
    # removed ones were cleared whole above.
    for address in sorted(set(o_eps) - set(n_eps)):
        ep = o_eps[address]
        why = f"{name}: endpoint {address} removed"
        for ip, port in sorted(o_front & n_front):
            yield FlowFilter(
                family, orig_dst=ip, orig_dport=port, reply_src=ep.ip, reply_sport=ep.port, reason=why
            )
        if o_node_port and o_node_port == n_node_port:
            yield FlowFilter(
                family, orig_dport=o_node_port, reply_src=ep.ip, reply_sport=ep.port, reason=why
            )

    # From no endpoints to some: whatever went to the service meanwhile was not DNATed.
    if n_svc is not None and n_eps and not o_eps:
        why = f"{name}: first endpoint"
        for ip, port in sorted(n_front):
            yield FlowFilter(family, orig_dst=ip, orig_dport=port, reason=why)
        if n_node_port:
            yield FlowFilter(family, orig_dport=n_node_port, reason=why)


def stale_flows(
    old: ClusterState, new: ClusterState, changed: Iterable[ServicePortKey] | None = None
) -> list[FlowFilter]:
    """Filters for the UDP conntrack entries that `old` -> `new` leaves pointing the wrong way.

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
# Reconciling the whole table (the first sync after a start)

# Where replies may come from: serving endpoints' (ip, port).
Replies = frozenset[tuple[str, int]]


@dataclass(frozen=True, slots=True)
class Frontends:
    """One family's UDP frontends that have serving endpoints, each with the replies it may get.

    kube-proxy's serviceIPEndpointIPs and serviceNodePortEndpointIPs, with the endpoint's port
    as well as its address (nfproxy's filters match both: a target port that moved is stale).
    Frontends without serving endpoints are absent: their rules reject, and their entries are
    left alone, as kube-proxy leaves them.
    """

    family: IPFamily
    addresses: Mapping[tuple[str, int], Replies]
    node_ports: Mapping[int, Replies]

    def __bool__(self) -> bool:
        return bool(self.addresses or self.node_ports)

    def destinations(self) -> set[tuple[str | None, int]]:
        """What the kernel's dumps are narrowed to: each address and port, each node port."""
        return {*self.addresses, *((None, port) for port in self.node_ports)}

    def stale(self, flow: Flow) -> str | None:
        """Why an entry points the wrong way (None: it does not, or is none of ours)."""
        if flow.protocol is not Protocol.UDP or flow.orig_dport is None:
            return None
        reply = (flow.reply_src, flow.reply_sport)
        replies = self.addresses.get((flow.orig_dst, flow.orig_dport))
        if replies is not None and reply not in replies:
            return f"{flow.orig_dst}:{flow.orig_dport}: reply from {_where(reply)}, not a serving endpoint"
        replies = self.node_ports.get(flow.orig_dport)
        if replies is not None and reply not in replies:
            return f"node port {flow.orig_dport}: reply from {_where(reply)}, not a serving endpoint"
        return None


def _where(reply: tuple[str, int | None]) -> str:
    return f"[{reply[0]}]:{reply[1]}" if ":" in reply[0] else f"{reply[0]}:{reply[1]}"


def served_frontends(state: ClusterState) -> dict[IPFamily, Frontends]:
    """Per family, the UDP frontends with serving endpoints (families with none are absent)."""
    addresses: dict[IPFamily, dict[tuple[str, int], set[tuple[str, int]]]] = {}
    node_ports: dict[IPFamily, dict[int, set[tuple[str, int]]]] = {}
    for key, svc in state.services.items():
        if svc.protocol is not Protocol.UDP:
            continue
        replies = {(ep.ip, ep.port) for ep in state.endpoints.get(key, ()) if ep.serving}
        if not replies:
            continue
        family = key[1]
        for frontend in _frontends(svc):
            addresses.setdefault(family, {}).setdefault(frontend, set()).update(replies)
        if svc.node_port:
            node_ports.setdefault(family, {}).setdefault(svc.node_port, set()).update(replies)
    return {
        family: Frontends(
            family,
            {k: frozenset(v) for k, v in addresses.get(family, {}).items()},
            {k: frozenset(v) for k, v in node_ports.get(family, {}).items()},
        )
        for family in sorted({*addresses, *node_ports})
    }

"""The kube-proxy-compatible iptables backend: ClusterState -> `iptables-restore --noflush` text.

The output follows kube-proxy's iptables proxier (v1.30-era layout) rule for rule, so that a node
switched between kube-proxy and nfproxy keeps the same chain names, the same conntrack-visible
behaviour, and an `iptables-save` that people already know how to read. Deliberate differences:

- `nodeport_addresses` CIDRs are matched in the kernel (`-d CIDR -m addrtype --dst-type LOCAL`)
  instead of being resolved to node IPs at sync time;
- what kube-proxy decides from the host comes in through NodeConfig (`drop_invalid`: no
  conntrack-INVALID drop when nf_conntrack_tcp_be_liberal is set) or is fixed here:
  `MASQUERADE --random-fully` is always used, and there is no KUBE-PROXY-CANARY chain (the
  flush monitor's business, not the model's). KUBE-FIREWALL's localnet guard is written, as
  kube-proxy 1.37 does, whenever localhost node ports are on (IPv4);
- built-in-chain jumps are data (`JUMPS`), not `iptables -C/-I` calls: the kernel layer owns that.

Pure: no I/O. Lines are built as f-strings straight into lists because a 10 000-service cluster is
about 300 000 rule lines, and per-rule objects would dominate the sync time.
"""

from __future__ import annotations

import functools
import hashlib
import ipaddress
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from nfproxy.core.gc_pause import gc_paused
from nfproxy.core.categorize import (
    cascade_order,
    cascade_probabilities,
    weighted,
    NoEndpoints,
    PodMatch,
    PodMatchKind,
    Routing,
    categorize,
    firewall_sources,
    nodeport_cidrs,
    pod_match,
)
from nfproxy.core.model import (
    ClusterState,
    Endpoint,
    IPFamily,
    NodeConfig,
    ServicePort,
    ServicePortKey,
    ServicePortName,
)

KUBE_SERVICES = "KUBE-SERVICES"
KUBE_EXTERNAL_SERVICES = "KUBE-EXTERNAL-SERVICES"
KUBE_NODEPORTS = "KUBE-NODEPORTS"
KUBE_POSTROUTING = "KUBE-POSTROUTING"
KUBE_MARK_MASQ = "KUBE-MARK-MASQ"
KUBE_FORWARD = "KUBE-FORWARD"
KUBE_PROXY_FIREWALL = "KUBE-PROXY-FIREWALL"
# kubelet's chain, which kube-proxy duplicates (and never removes): the localnet guard.
KUBE_FIREWALL = "KUBE-FIREWALL"

# Prefixes of the chains that belong to one service port; anything else KUBE-* is top-level.
SERVICE_CHAIN_PREFIXES = ("KUBE-SVC-", "KUBE-SVL-", "KUBE-EXT-", "KUBE-FW-", "KUBE-SEP-")

# kube-proxy drops per-endpoint comments past this many endpoints: they are ~40% of the bytes.
LARGE_CLUSTER_ENDPOINTS = 1000

# nfacct counter of the conntrack-INVALID drop (kube-proxy's metric reads it).
INVALID_DROP_COUNTER = "ct_state_invalid_dropped_pkts"
_NODEPORTS_COMMENT = '"kubernetes service nodeports; NOTE: this must be the last rule in this chain"'


# --------------------------------------------------------------------------------------------
# Names and comments


try:
    # CPython's own SHA-256 skips OpenSSL's per-call EVP setup: ~40% faster on 40-byte inputs.
    from _sha256 import sha256 as _sha256
except ImportError:  # a build without the builtin hashes
    _sha256 = hashlib.sha256

# Maps a 5-bit value (one per byte) to its RFC 4648 base32 digit.
_B32_DIGITS = bytes(b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567"[i] if i < 32 else 0 for i in range(256))


def _repeat(pattern: int, groups: int) -> int:
    return int.from_bytes(pattern.to_bytes(8, "big") * groups, "big")


def _hash16_many(texts: list[str]) -> list[str]:
    """First 16 base32 characters of sha256(text) for each text: kube-proxy's name suffixes.

    16 digits are exactly the first 10 digest bytes, i.e. two 40-bit groups. `base64.b32encode`
    is a pure-Python loop and costs more than the hashing; instead all groups of one sync are
    spread at once, one 5-bit digit per byte, with three mask-and-shift steps on a single big
    integer (C speed), then mapped to digits with `bytes.translate`. 100 000 names: ~80 ms
    instead of ~250 ms.
    """
    groups = 2 * len(texts)
    blob = b"".join([_sha256(t.encode()).digest()[:10] for t in texts])
    # Each 40-bit group goes to the low 5 bytes of its own 8-byte slot.
    wide = bytearray(8 * groups)
    for k in range(5):
        wide[3 + k :: 8] = blob[k::5]
    n = int.from_bytes(wide, "big")
    n = ((n & _repeat(0x000000FFFFF00000, groups)) << 12) | (n & _repeat(0xFFFFF, groups))
    n = ((n & _repeat(0x000FFC00000FFC00, groups)) << 6) | (n & _repeat(0x000003FF000003FF, groups))
    n = ((n & _repeat(0x03E003E003E003E0, groups)) << 3) | (n & _repeat(0x001F001F001F001F, groups))
    digits = n.to_bytes(8 * groups, "big").translate(_B32_DIGITS).decode()
    return [digits[i : i + 16] for i in range(0, len(digits), 16)]


def service_hash(spn: ServicePortName) -> str:
    """The suffix shared by a service port's KUBE-SVC/SVL/EXT/FW chains."""
    return _hash16_many([f"{spn}{spn.protocol.lower}"])[0]


def service_chain_name(spn: ServicePortName) -> str:
    return "KUBE-SVC-" + service_hash(spn)


def endpoint_chain_name(spn: ServicePortName, address: str) -> str:
    """KUBE-SEP name; `address` is `Endpoint.address` (`ip:port`, IPv6 bracketed)."""
    return "KUBE-SEP-" + _hash16_many([f"{spn}{spn.protocol.lower}{address}"])[0]


def quote_comment(text: str) -> str:
    """The only way text reaches a `--comment`: checked, then bare or double-quoted.

    iptables-restore splits on whitespace and honours double quotes, so one `"` or newline in a
    service name would change the meaning of the whole atomic payload. Names are validated
    upstream, but this renderer must be safe on its own: anything but printable ASCII without `"`
    and `\\` is refused rather than escaped (there is no escaping that every iptables version
    reads back the same way). xt_comment stores at most 255 bytes.

    One word of name characters (`ns/svc:port`) stays bare, as kube-proxy writes it: the kernel
    stores the same string either way, so iptables-save prints it the same, and the quotes are
    two bytes on every endpoint rule of a payload. Anything else is quoted.
    """
    if (
        not text
        or len(text) > 255
        or not text.isascii()
        or not text.isprintable()
        or '"' in text
        or "\\" in text
    ):
        raise ValueError(f"unsafe text for an iptables comment: {text!r}")
    return text if _BARE_COMMENT.fullmatch(text) else f'"{text}"'


# What kube-proxy leaves unquoted: a Kubernetes name and port (`ns/svc:port`), never anything
# iptables-restore or getopt could read differently (no blank, quote, backslash or leading `-`).
_BARE_COMMENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9_./:-]*")


# --------------------------------------------------------------------------------------------
# Result


@dataclass(frozen=True, slots=True)
class JumpRule:
    """A rule in a built-in chain: kube-proxy owns only these, never the whole built-in chain.

    A sync loop must ensure them individually (`iptables -C`, then insert), because a restore
    cannot replace one rule of INPUT without flushing everybody else's.
    """

    table: str
    chain: str
    spec: str

    @property
    def line(self) -> str:
        return f"-A {self.chain} {self.spec}"


def _jump(table: str, chain: str, target: str, comment: str, new_only: bool) -> JumpRule:
    gate = "-m conntrack --ctstate NEW " if new_only else ""
    spec = f"{gate}-m comment --comment {quote_comment(comment)} -j {target}"
    return JumpRule(table, chain, spec)


_EXTERNAL_PORTALS = "kubernetes externally-visible service portals"

# kube-proxy's iptablesJumpChains, in the order they end up in the kernel: kube-proxy prepends
# each entry of its list in turn, so the last entry for a built-in chain ends up first in it.
# kubelet's KUBE-FIREWALL jumps, which kube-proxy makes too (no comment), are ensured after its
# own and so end up first (as `iptables-save` of a kube-proxy v1.37.2 node lists them).
JUMPS: tuple[JumpRule, ...] = (
    JumpRule("filter", "INPUT", f"-j {KUBE_FIREWALL}"),
    JumpRule("filter", "OUTPUT", f"-j {KUBE_FIREWALL}"),
    _jump("filter", "INPUT", KUBE_PROXY_FIREWALL, "kubernetes load balancer firewall", True),
    _jump("filter", "INPUT", KUBE_NODEPORTS, "kubernetes health check service ports", False),
    _jump("filter", "INPUT", KUBE_EXTERNAL_SERVICES, _EXTERNAL_PORTALS, True),
    _jump("filter", "FORWARD", KUBE_PROXY_FIREWALL, "kubernetes load balancer firewall", True),
    _jump("filter", "FORWARD", KUBE_FORWARD, "kubernetes forwarding rules", False),
    _jump("filter", "FORWARD", KUBE_SERVICES, "kubernetes service portals", True),
    _jump("filter", "FORWARD", KUBE_EXTERNAL_SERVICES, _EXTERNAL_PORTALS, True),
    _jump("filter", "OUTPUT", KUBE_PROXY_FIREWALL, "kubernetes load balancer firewall", True),
    _jump("filter", "OUTPUT", KUBE_SERVICES, "kubernetes service portals", True),
    _jump("nat", "PREROUTING", KUBE_SERVICES, "kubernetes service portals", False),
    _jump("nat", "OUTPUT", KUBE_SERVICES, "kubernetes service portals", False),
    _jump("nat", "POSTROUTING", KUBE_POSTROUTING, "kubernetes postrouting rules", False),
)
# The same jumps in the order a kernel inserts them, each at the top of its chain (kube-proxy's
# own list order), so that they end up as JUMPS lists them: handed JUMPS itself, a kernel would
# leave every built-in chain's jumps reversed, and FORWARD's established packets would meet both
# NEW-gated jumps before KUBE-FORWARD's ESTABLISHED accept, one conntrack match a packet more
# than on a kube-proxy node (docs/benchmarks.md, issue S).
JUMPS_TO_PREPEND: tuple[JumpRule, ...] = tuple(reversed(JUMPS))


@dataclass(frozen=True, slots=True)
class ServiceChains:
    """The nat chains of one service port: the unit of a kube-proxy-style partial restore.

    `chains` in kube-proxy's declaration order (EXT, FW, SVC, SVL, then SEPs by address);
    `rules` are the complete `-A CHAIN ...` lines of those chains, each chain's rules in order.
    Rules are one flat list rather than one list per chain because a 10 000-service sync has
    ~100 000 endpoint chains and the per-chain containers alone cost a third of the render.
    """

    chains: list[str]
    rules: list[str]

    def rules_of(self, chain: str) -> list[str]:
        prefix = f"-A {chain} "
        return [r for r in self.rules if r.startswith(prefix)]


@dataclass(frozen=True, slots=True)
class IptablesRules:
    """Everything one family needs, split the way kube-proxy's partial restores need it.

    - `filter` / `nat`: the top-level chains (dict order = declaration order) and their rules.
      These are rewritten on every sync, as kube-proxy does: declaring a chain in a `--noflush`
      restore flushes it, so they must always be complete.
    - `service_chains[key]`: the SVC/SVL/EXT/FW/SEP chains of one service port. A partial
      restore writes only the changed services' entries; chains of unchanged services are left
      alone in the kernel (neither declared, which would flush them, nor rewritten). A service
      with no endpoints at all has no entry: it only has filter-table REJECT rules.
    - `jumps`: the rules in built-in chains (see JumpRule).
    - `large`: past LARGE_CLUSTER_ENDPOINTS, so endpoint rules carry no comments; when it flips,
      every service's chains change, not only the changed ones'.

    A render with `only` holds the service chains of those keys alone. Every rule is a complete
    `-A CHAIN ...` line. Nothing is mutated after `render` returns.
    """

    family: IPFamily
    filter: Mapping[str, list[str]]
    nat: Mapping[str, list[str]]
    service_chains: Mapping[ServicePortKey, ServiceChains]
    # In the order a kernel prepends them (JUMPS_TO_PREPEND); `restore_lines` appends them in
    # the reverse, the order they end up in.
    jumps: tuple[JumpRule, ...] = JUMPS_TO_PREPEND
    large: bool = False

    def text(self) -> str:
        """What `nfproxy render` prints for this family: a header naming the tool, then the
        payload with the jumps, ready for a fresh namespace."""
        tool = "iptables-restore" if self.family is IPFamily.V4 else "ip6tables-restore"
        header = f"# IPv{self.family.value}: {tool} --noflush\n"
        return header + self.restore_text(with_jumps=True)

    def restore_text(
        self,
        with_jumps: bool = True,
        *,
        services: Iterable[ServicePortKey] | None = None,
        delete_chains: Iterable[str] = (),
    ) -> str:
        """`restore_lines` as one text."""
        return "\n".join(self.restore_lines(with_jumps, services=services, delete_chains=delete_chains))

    def restore_lines(
        self,
        with_jumps: bool = True,
        *,
        services: Iterable[ServicePortKey] | None = None,
        delete_chains: Iterable[str] = (),
    ) -> list[str]:
        """The `iptables-restore --noflush` payload (one atomic restore of both tables), a line
        each (the last one empty, so that the text ends with a newline).

        `services` limits the per-service chains to those keys (a partial sync); None writes all.
        `delete_chains` are stale nat service chains to flush and delete (`-X`) in the same
        transaction; only SVC/SVL/EXT/FW/SEP names are accepted, so a caller can never delete a
        chain it does not own. `with_jumps` appends the built-in-chain rules with `-A`: right for
        a fresh namespace, wrong for re-applying (they would be duplicated).
        """
        if services is None:
            groups = list(self.service_chains.values())
        else:
            groups = [self.service_chains[k] for k in services if k in self.service_chains]
        stale = list(delete_chains)
        for name in stale:
            if not name.startswith(SERVICE_CHAIN_PREFIXES):
                raise ValueError(f"refusing to delete a chain nfproxy does not own: {name!r}")

        out: list[str] = ["*filter"]
        out.extend([f":{name} - [0:0]" for name in self.filter])
        if with_jumps:
            out.extend([j.line for j in reversed(self.jumps) if j.table == "filter"])
        for rules in self.filter.values():
            out.extend(rules)
        out.append("COMMIT")

        out.append("*nat")
        out.extend([f":{name} - [0:0]" for name in self.nat])
        for group in groups:
            out.extend([f":{name} - [0:0]" for name in group.chains])
        out.extend([f":{name} - [0:0]" for name in stale])
        if with_jumps:
            out.extend([j.line for j in reversed(self.jumps) if j.table == "nat"])
        for rules in self.nat.values():
            out.extend(rules)
        for group in groups:
            out.extend(group.rules)
        out.extend([f"-X {name}" for name in stale])
        out.append("COMMIT")
        out.append("")
        return out


# --------------------------------------------------------------------------------------------
# Rendering


_probabilities: list[str] = ["<bad value>"]


def probability(n: int) -> str:
    """`1/n` exactly as kube-proxy prints it (Go's %0.10f == Python's), cached like kube-proxy."""
    cache = _probabilities
    while len(cache) <= n:
        cache.append("%0.10f" % (1.0 / len(cache)))
    return cache[n]


def _family_of(addr: str) -> IPFamily:
    return IPFamily.V6 if ":" in addr else IPFamily.V4


def render(
    state: ClusterState, family: IPFamily, *, only: Collection[ServicePortKey] | None = None
) -> IptablesRules:
    """Render one family's rules: kube-proxy's syncProxyRules minus the kernel calls.

    Masquerading of cluster-IP traffic uses the *first* cluster CIDR of the family, like
    kube-proxy's `--cluster-cidr` local detector (one CIDR per family; iptables cannot negate
    a list of sources in one rule). With no CIDR and no masquerade-all, no masquerade rule is
    written and the eTP=Local pod short-circuit is omitted, as kube-proxy does with no detector.

    Node ports: with no `nodeport_addresses` for the family, KUBE-SERVICES ends with kube-proxy's
    `-m addrtype --dst-type LOCAL` jump, excluding loopback (127.0.0.0/8, ::1) in every case:
    kube-proxy's iptables mode with `--iptables-localhost-nodeports=false`, and what its (and our)
    nftables mode does, so that both backends accept node ports on the same addresses.
    With CIDRs, kube-proxy resolves them to node IPs at sync time; nfproxy instead writes one
    `-d CIDR -m addrtype --dst-type LOCAL` rule per CIDR, so the kernel does the resolving and an
    address change needs no resync.

    `only` limits the per-service chains to those keys (a partial sync renders just what it
    writes); the top-level chains are always complete, since a restore that declares them
    flushes them.
    """
    with gc_paused():
        return _render(state, family, only)


def _render(
    state: ClusterState, family: IPFamily, only: Collection[ServicePortKey] | None
) -> IptablesRules:
    ports = _service_ports(state, family)
    ctx = _context(state.node, family, ports)
    top = _TopLevel()
    service_chains: dict[ServicePortKey, ServiceChains] = {}
    for port in _name_ports(ports, state.node, only):
        _capture(port, top, family)
        if port.routing.has_endpoints and port.seps is not None:
            # With no endpoints at all there are no nat chains: only the filter REJECTs.
            service_chains[port.svc.key] = _service_chains(port, ctx)
    top.n_services.extend(_nodeports_tail(
        state.node.localhost_nodeports,
        nodeport_cidrs(state.node, family, primary_by_default=False),
        family is IPFamily.V6,
    ))
    filter_table = {
        KUBE_SERVICES: top.f_services,
        KUBE_EXTERNAL_SERVICES: top.f_external,
        KUBE_FORWARD: _forward_rules(state.node.drop_invalid, ctx.mark),
        KUBE_NODEPORTS: top.f_nodeports,
        KUBE_PROXY_FIREWALL: top.f_firewall,
        KUBE_FIREWALL: _localnet_guard(state.node.localhost_nodeports and family is IPFamily.V4),
    }
    nat_table = {
        KUBE_SERVICES: top.n_services,
        KUBE_NODEPORTS: top.n_nodeports,
        KUBE_POSTROUTING: _postrouting_rules(ctx.mark),
        KUBE_MARK_MASQ: [f"-A KUBE-MARK-MASQ -j MARK --or-mark {ctx.mark}"],
    }
    return IptablesRules(family, filter_table, nat_table, service_chains, large=ctx.large)


# ---- Step 1: the service ports of the family, and what every rule reads from the node.


@dataclass(frozen=True, slots=True)
class _Context:
    """Node-wide facts every service's chains read, worked out once per render."""

    family: IPFamily
    node: NodeConfig
    from_pod: str  # the match for "from a pod" ("" without a local-traffic detector)
    masq_match: str | None  # appended to the masquerade rule; None: no masquerade rule at all
    mark: str  # the masquerade mark, e.g. 0x4000
    large: bool  # past LARGE_CLUSTER_ENDPOINTS: no per-endpoint comments


def _service_ports(
    state: ClusterState, family: IPFamily
) -> list[tuple[ServicePort, tuple[Endpoint, ...]]]:
    # Same order as ClusterState.service_ports, but sorted on plain strings: the dataclass
    # comparison it uses costs more than the rest of a 10 000-service sort.
    keys = sorted(
        (k for k in state.services if k[1] is family),
        key=lambda k: (k[0].namespace, k[0].name, k[0].port, k[0].protocol),
    )
    services = state.services
    endpoints = state.endpoints
    return [(services[k], endpoints.get(k, ())) for k in keys]


def _context(
    node: NodeConfig, family: IPFamily, ports: list[tuple[ServicePort, tuple[Endpoint, ...]]]
) -> _Context:
    from_pod, not_from_pod = _pod_matches(pod_match(node, family))
    if node.masquerade_all:
        masq_match: str | None = ""
    elif not_from_pod:
        masq_match = f" {not_from_pod}"
    else:
        masq_match = None
    large = sum(len(eps) for _, eps in ports) > LARGE_CLUSTER_ENDPOINTS
    return _Context(family, node, from_pod, masq_match, f"{node.masquerade_mark:#x}", large)


def _pod_matches(match: PodMatch | None) -> tuple[str, str]:
    """(if from a pod, if not from a pod) as iptables matches; ("", "") without a detector."""
    if match is None:
        return "", ""
    if match.kind is PodMatchKind.CIDR:
        return f"-s {match.value}", f"! -s {match.value}"
    name = match.value + ("+" if match.kind is PodMatchKind.INTERFACE_PREFIX else "")
    return f"-i {name}", f"! -i {name}"


# ---- Step 2: categorise every port and name its chains (all names hashed in one batch).


@dataclass(slots=True)
class _Port:
    """One service port on its way to rules: its routing, chain names and shared comments."""

    svc: ServicePort
    routing: Routing
    name: str
    pm: str  # the protocol match, `-m tcp -p tcp`
    addrs: list[str]  # reachable endpoints' addresses in routing.reachable order, if seps
    seps: list[str] | None  # their KUBE-SEP chains; None when this render writes no chains
    svc_chain: str = ""
    svl_chain: str = ""
    ext_chain: str = ""
    fw_chain: str = ""
    cip_comment: str = ""
    lb_ips: Sequence[str] = ()
    lb_comment: str = ""

    @property
    def internal_chain(self) -> str:
        return self.svl_chain if self.svc.internal_policy_local else self.svc_chain

    @property
    def lb_chain(self) -> str:
        return self.fw_chain if self.routing.uses_firewall else self.ext_chain


def _name_ports(
    ports: list[tuple[ServicePort, tuple[Endpoint, ...]]],
    node: NodeConfig,
    only: Collection[ServicePortKey] | None,
) -> list[_Port]:
    """Categorise every port and give it its chain names, hashing all names at once (_hash16_many).

    Endpoint chains are named only for the ports whose chains this render writes (`only`).
    """
    out: list[_Port] = []
    texts: list[str] = []
    for svc, eps in ports:
        routing = categorize(svc, eps, node)
        name = str(svc.name)
        proto = svc.name.protocol.lower
        base = name + proto
        texts.append(base)
        if only is None or svc.key in only:
            addrs = [ep.address for ep in routing.reachable]
            texts.extend([base + addr for addr in addrs])
            seps: list[str] | None = []
        else:
            addrs, seps = [], None
        out.append(_Port(svc, routing, name, f"-m {proto} -p {proto}", addrs, seps))
    hashes = _hash16_many(texts)
    next_hash = 0
    for port in out:
        suffix = hashes[next_hash]
        next_hash += 1
        if port.seps is not None:
            port.seps = ["KUBE-SEP-" + h for h in hashes[next_hash : next_hash + len(port.addrs)]]
            next_hash += len(port.addrs)
        port.svc_chain = "KUBE-SVC-" + suffix
        port.svl_chain = "KUBE-SVL-" + suffix
        port.ext_chain = "KUBE-EXT-" + suffix
        port.fw_chain = "KUBE-FW-" + suffix
    return out


# ---- Step 3: each port's rules in the top-level chains.


@dataclass(slots=True)
class _TopLevel:
    """The top-level chains' rules as they accumulate: `f_` filter, `n_` nat."""

    f_services: list[str] = field(default_factory=list)
    f_external: list[str] = field(default_factory=list)
    f_nodeports: list[str] = field(default_factory=list)
    f_firewall: list[str] = field(default_factory=list)
    n_services: list[str] = field(default_factory=list)
    n_nodeports: list[str] = field(default_factory=list)


def _capture(port: _Port, top: _TopLevel, family: IPFamily) -> None:
    """Capture the port's addresses, in kube-proxy's order: cluster IP, external IPs, load
    balancer, node port, health-check node port."""
    routing = port.routing
    external_verdict = routing.external_no_endpoints
    if external_verdict is None:
        ext_target = ext_comment = ""
    elif external_verdict is NoEndpoints.REJECT:
        ext_target, ext_comment = "REJECT", quote_comment(f"{port.name} has no endpoints")
    else:
        ext_target, ext_comment = "DROP", quote_comment(f"{port.name} has no local endpoints")
    _capture_cluster_ip(port, top)
    _capture_external_ips(port, top, family, ext_target, ext_comment)
    _capture_load_balancer(port, top, family, ext_target, ext_comment)
    _capture_node_port(port, top, ext_target, ext_comment)
    _capture_health_check(port, top)


def _capture_cluster_ip(port: _Port, top: _TopLevel) -> None:
    svc, name, pm = port.svc, port.name, port.pm
    port.cip_comment = cip_comment = quote_comment(name + " cluster IP")
    internal_verdict = port.routing.internal_no_endpoints
    if internal_verdict is None:
        top.n_services.append(
            f"-A KUBE-SERVICES -m comment --comment {cip_comment}"
            f" {pm} -d {svc.cluster_ip} --dport {svc.port} -j {port.internal_chain}"
        )
        return
    if internal_verdict is NoEndpoints.REJECT:
        target, comment = "REJECT", f"{name} has no endpoints"
    else:
        target, comment = "DROP", f"{name} has no local endpoints"
    top.f_services.append(
        f"-A KUBE-SERVICES -m comment --comment {quote_comment(comment)}"
        f" {pm} -d {svc.cluster_ip} --dport {svc.port} -j {target}"
    )


def _capture_external_ips(
    port: _Port, top: _TopLevel, family: IPFamily, ext_target: str, ext_comment: str
) -> None:
    svc, pm = port.svc, port.pm
    for eip in svc.external_ips:
        if _family_of(eip) is not family:
            continue
        if port.routing.has_endpoints:
            top.n_services.append(
                f"-A KUBE-SERVICES -m comment --comment {quote_comment(port.name + ' external IP')}"
                f" {pm} -d {eip} --dport {svc.port} -j {port.ext_chain}"
            )
        if ext_target:
            top.f_external.append(
                f"-A KUBE-EXTERNAL-SERVICES -m comment --comment {ext_comment}"
                f" {pm} -d {eip} --dport {svc.port} -j {ext_target}"
            )


def _capture_load_balancer(
    port: _Port, top: _TopLevel, family: IPFamily, ext_target: str, ext_comment: str
) -> None:
    svc, pm, routing = port.svc, port.pm, port.routing
    lb_ips = (
        [ip for ip in svc.load_balancer_ips if _family_of(ip) is family]
        if svc.load_balancer_ips
        else ()
    )
    port.lb_ips = lb_ips
    port.lb_comment = lb_comment = quote_comment(port.name + " loadbalancer IP") if lb_ips else ""
    uses_fw = routing.uses_firewall
    for lbip in lb_ips:
        if routing.has_endpoints:
            top.n_services.append(
                f"-A KUBE-SERVICES -m comment --comment {lb_comment}"
                f" {pm} -d {lbip} --dport {svc.port} -j {port.lb_chain}"
            )
        if uses_fw:
            comment = quote_comment(f"{port.name} traffic not accepted by {port.fw_chain}")
            top.f_firewall.append(
                f"-A KUBE-PROXY-FIREWALL -m comment --comment {comment}"
                f" {pm} -d {lbip} --dport {svc.port} -j DROP"
            )
    if ext_target:
        for lbip in lb_ips:
            top.f_external.append(
                f"-A KUBE-EXTERNAL-SERVICES -m comment --comment {ext_comment}"
                f" {pm} -d {lbip} --dport {svc.port} -j {ext_target}"
            )


def _capture_node_port(port: _Port, top: _TopLevel, ext_target: str, ext_comment: str) -> None:
    """Node ports are not subject to loadBalancerSourceRanges, as in kube-proxy."""
    svc, pm = port.svc, port.pm
    if not svc.node_port:
        return
    if port.routing.has_endpoints:
        top.n_nodeports.append(
            f"-A KUBE-NODEPORTS -m comment --comment {quote_comment(port.name)}"
            f" {pm} --dport {svc.node_port} -j {port.ext_chain}"
        )
    if ext_target:
        top.f_external.append(
            f"-A KUBE-EXTERNAL-SERVICES -m comment --comment {ext_comment}"
            f" -m addrtype --dst-type LOCAL {pm} --dport {svc.node_port} -j {ext_target}"
        )


def _capture_health_check(port: _Port, top: _TopLevel) -> None:
    """Accepted whether or not there are local endpoints: the load balancer must be able to ask,
    and hear "503"."""
    hc = port.svc.health_check_node_port
    if hc:
        comment = quote_comment(f"{port.name} health check node port")
        top.f_nodeports.append(
            f"-A KUBE-NODEPORTS -m comment --comment {comment} -m tcp -p tcp --dport {hc} -j ACCEPT"
        )


# ---- Step 4: each port's own chains, in kube-proxy's declaration and rule order.


def _service_chains(port: _Port, ctx: _Context) -> ServiceChains:
    routing = port.routing
    seps = port.seps or []
    chains: list[str] = []
    rules: list[str] = []
    if routing.uses_external_chain:
        chains.append(port.ext_chain)
    if routing.uses_firewall:
        chains.append(port.fw_chain)
    if routing.cluster:
        chains.append(port.svc_chain)
    if routing.local:
        chains.append(port.svl_chain)
    _masquerade_rule(port, ctx, rules)
    if routing.uses_external_chain:
        _external_chain(port, ctx, rules)
    if routing.uses_firewall:
        _firewall_chain(port, ctx, rules)
    chains.extend(seps)
    _cascades(port, ctx, rules)
    _endpoint_chains(port, ctx, rules)
    return ServiceChains(chains, rules)


def _masquerade_rule(port: _Port, ctx: _Context, rules: list[str]) -> None:
    """Internal traffic: masquerade off-cluster sources (or everything with masquerade-all)."""
    svc = port.svc
    if port.routing.internal_no_endpoints is None and ctx.masq_match is not None:
        rules.append(
            f"-A {port.internal_chain} -m comment --comment {port.cip_comment}"
            f" {port.pm} -d {svc.cluster_ip} --dport {svc.port}{ctx.masq_match} -j KUBE-MARK-MASQ"
        )


def _external_chain(port: _Port, ctx: _Context, rules: list[str]) -> None:
    svc, name, ext_chain, svc_chain = port.svc, port.name, port.ext_chain, port.svc_chain
    if not svc.external_policy_local:
        comment = quote_comment(f"masquerade traffic for {name} external destinations")
        rules.append(f"-A {ext_chain} -m comment --comment {comment} -j KUBE-MARK-MASQ")
    else:
        # Short-circuits: pod and host traffic to an external address is treated as if
        # it had gone out to the load balancer and come back, i.e. by Cluster policy.
        # The SVC chain exists: an externally accessible port with endpoints always has
        # Cluster endpoints (ServicePort.uses_cluster_endpoints).
        if ctx.from_pod:
            comment = quote_comment(f"pod traffic for {name} external destinations")
            rules.append(
                f"-A {ext_chain} -m comment --comment {comment} {ctx.from_pod} -j {svc_chain}"
            )
        comment = quote_comment(f"masquerade LOCAL traffic for {name} external destinations")
        rules.append(
            f"-A {ext_chain} -m comment --comment {comment}"
            " -m addrtype --src-type LOCAL -j KUBE-MARK-MASQ"
        )
        comment = quote_comment(f"route LOCAL traffic for {name} external destinations")
        rules.append(
            f"-A {ext_chain} -m comment --comment {comment}"
            f" -m addrtype --src-type LOCAL -j {svc_chain}"
        )
    if port.routing.external_no_endpoints is None:
        policy_chain = port.svl_chain if svc.external_policy_local else svc_chain
        rules.append(f"-A {ext_chain} -j {policy_chain}")


def _firewall_chain(port: _Port, ctx: _Context, rules: list[str]) -> None:
    fw_chain, ext_chain = port.fw_chain, port.ext_chain
    head = f"-A {fw_chain} -m comment --comment {port.lb_comment}"
    for source in firewall_sources(port.svc, ctx.node):
        rules.append(f"{head} -s {source} -j {ext_chain}")
    comment = quote_comment(f"other traffic to {port.name} will be dropped by KUBE-PROXY-FIREWALL")
    rules.append(f"-A {fw_chain} -m comment --comment {comment}")


def _cascades(port: _Port, ctx: _Context, rules: list[str]) -> None:
    """The SVC (Cluster policy) and SVL (Local policy) load-balancing chains."""
    routing, names, addrs = port.routing, port.seps or [], port.addrs
    name, affinity, large = port.name, port.svc.affinity_timeout, ctx.large
    reachable = routing.reachable
    for chain, subset in ((port.svc_chain, routing.cluster), (port.svl_chain, routing.local)):
        if not subset:
            continue
        if weighted(subset):
            _weighted_cascade(rules, chain, names, addrs, subset, reachable, name, affinity, large)
        elif subset is reachable:
            _cascade(rules, chain, names, addrs, name, affinity, large)
        else:
            _cascade(rules, chain, *_select(names, addrs, subset), name, affinity, large)


def _endpoint_chains(port: _Port, ctx: _Context, rules: list[str]) -> None:
    """Each endpoint chain: hairpin masquerade, record affinity, DNAT."""
    sep_comment = "" if ctx.large else f" -m comment --comment {quote_comment(port.name)}"
    dnat = f" {port.pm} -j DNAT --to-destination "
    affinity = port.svc.affinity_timeout
    for ep, sep, addr in zip(port.routing.reachable, port.seps or [], port.addrs):
        rules.append(f"-A {sep}{sep_comment} -s {ep.ip} -j KUBE-MARK-MASQ")
        if affinity:
            rules.append(f"-A {sep}{sep_comment} -m recent --name {sep} --set{dnat}{addr}")
        else:
            rules.append(f"-A {sep}{sep_comment}{dnat}{addr}")


# ---- Step 5: the fixed rules.


def _nodeports_tail(localhost: bool, cidrs: tuple[str, ...], v6: bool) -> list[str]:
    """The tail-call to KUBE-NODEPORTS. IPv4 loopback takes node ports only with
    localhost node ports on (kube-proxy's default, which needs route_localnet); IPv6 never."""
    out: list[str] = []
    if v6:
        not_loopback = " ! -d ::1/128"
    else:
        not_loopback = "" if localhost else " ! -d 127.0.0.0/8"
    if not cidrs:
        out.append(
            f"-A KUBE-SERVICES -m comment --comment {_NODEPORTS_COMMENT}"
            f" -m addrtype --dst-type LOCAL{not_loopback} -j KUBE-NODEPORTS"
        )
        return out
    # One rule takes one -d: iptables-restore refuses "-d CIDR ! -d 127.0.0.0/8". Loopback is
    # excluded by a RETURN in front when some CIDR reaches into it, else it cannot match.
    loopback = ipaddress.ip_network("::1/128" if v6 else "127.0.0.0/8")
    if not_loopback and any(ipaddress.ip_network(c, strict=False).overlaps(loopback) for c in cidrs):
        out.append(f"-A KUBE-SERVICES -d {loopback} -j RETURN")
    for cidr in cidrs:
        out.append(
            f"-A KUBE-SERVICES -m comment --comment {_NODEPORTS_COMMENT}"
            f" -d {cidr} -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS"
        )
    return out


def _localnet_guard(on: bool) -> list[str]:
    """Localhost node ports need route_localnet=1, which lets packets from outside reach
    127.0.0.0/8 (kubernetes#90259, CVE-2020-8558): kube-proxy drops those unless they are
    replies or DNATed, in kubelet's KUBE-FIREWALL, and so do we. Empty when localhost node
    ports are off or for IPv6 (no route_localnet)."""
    if not on:
        return []
    return ['-A KUBE-FIREWALL -m comment --comment "block incoming localnet connections" -d 127.0.0.0/8'
            ' ! -s 127.0.0.0/8 -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP']


def _forward_rules(drop_invalid: bool, mark: str) -> list[str]:
    """KUBE-FORWARD. The INVALID drop is counted by an nfacct object (created by the kernel
    layer before the restore) and left out when nf_conntrack_tcp_be_liberal is set, as
    kube-proxy does."""
    rules = []
    if drop_invalid:
        rules.append(
            "-A KUBE-FORWARD -m conntrack --ctstate INVALID"
            f" -m nfacct --nfacct-name {INVALID_DROP_COUNTER} -j DROP"
        )
    rules.append(
        f'-A KUBE-FORWARD -m comment --comment "kubernetes forwarding rules"'
        f" -m mark --mark {mark}/{mark} -j ACCEPT"
    )
    rules.append(
        '-A KUBE-FORWARD -m comment --comment "kubernetes forwarding conntrack rule"'
        " -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT"
    )
    return rules


def _postrouting_rules(mark: str) -> list[str]:
    return [
        f"-A KUBE-POSTROUTING -m mark ! --mark {mark}/{mark} -j RETURN",
        # Clear the mark so a packet that re-traverses the stack is not masqueraded twice.
        f"-A KUBE-POSTROUTING -j MARK --xor-mark {mark}",
        '-A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring SNAT"'
        " -j MASQUERADE --random-fully",
    ]


def _weighted_cascade(
    rules: list[str],
    chain: str,
    names: list[str],
    addrs: list[str],
    subset: tuple[Endpoint, ...],
    reachable: tuple[Endpoint, ...],
    svc_name: str,
    affinity: int,
    large: bool,
) -> None:
    """The generalised cascade: rule i fires with w_i / (w_i + ... + w_{n-1}), printed as
    kube-proxy prints probabilities, in core.categorize.cascade_order (heaviest first)."""
    sep_names, sep_addrs = (names, addrs) if subset is reachable else _select(names, addrs, subset)
    order, probs = _weighted_plan(tuple([ep.weight for ep in subset]))
    _cascade(rules, chain, [sep_names[i] for i in order], [sep_addrs[i] for i in order],
             svc_name, affinity, large, probs)


@functools.lru_cache(maxsize=4096)
def _weighted_plan(weights: tuple[int, ...]) -> tuple[tuple[int, ...], list[str]]:
    """(cascade order, printed probabilities indexed as `_cascade` reads them: rule i at n-i).
    Cached: services share weight patterns (every port of a slice has its weights), and the
    order and text are all a 10 000-service sync would otherwise recompute per service.
    w / rest prints as kube-proxy would print it: Go's float64 division and Python's round
    alike, and so do %0.10f and Go's fmt."""
    order = cascade_order(list(weights))
    n = len(weights)
    probs = ["<bad value>"] * (n + 1)
    for i, (w, rest) in enumerate(cascade_probabilities([weights[k] for k in order])):
        probs[n - i] = "%0.10f" % (w / rest)
    return tuple(order), probs


def _select(
    names: list[str], addrs: list[str], subset: tuple[Endpoint, ...]
) -> tuple[list[str], list[str]]:
    """The SEP names and addresses of a subset of the reachable endpoints, in address order."""
    wanted = {ep.address for ep in subset}
    picked = [(n, a) for n, a in zip(names, addrs) if a in wanted]
    return [n for n, _ in picked], [a for _, a in picked]


def _cascade(
    rules: list[str],
    chain: str,
    names: list[str],
    addrs: list[str],
    svc_name: str,
    affinity: int,
    large: bool,
    weighted_probs: list[str] | None = None,
) -> None:
    """Affinity lookups first (a known client keeps its endpoint), then the random cascade.

    Rule i of n matches with probability 1/(n-i) of what reaches it, so each endpoint gets 1/n;
    the last rule has no statistic match and takes whatever is left. `weighted_probs` (rule
    i's printed probability at [n - i], never written to) replaces 1/(n-i) when weighted.
    """
    n = len(names)
    last = n - 1
    if weighted_probs is None:
        probability(n)
        probs = _probabilities
    else:
        probs = weighted_probs
    if large:
        head = f"-A {chain}"
        if affinity:
            rules.extend(
                [
                    f"{head} -m recent --name {sep} --rcheck --seconds {affinity} --reap -j {sep}"
                    for sep in names
                ]
            )
        pick = f"{head} -m statistic --mode random --probability "
        rules.extend([f"{pick}{probs[n - i]} -j {sep}" for i, sep in enumerate(names[:last])])
        rules.append(f"{head} -j {names[last]}")
        return
    heads = [
        f"-A {chain} -m comment --comment {quote_comment(f'{svc_name} -> {addr}')}"
        for addr in addrs
    ]
    if affinity:
        rules.extend(
            [
                f"{head} -m recent --name {sep} --rcheck --seconds {affinity} --reap -j {sep}"
                for head, sep in zip(heads, names)
            ]
        )
    rules.extend(
        [
            f"{heads[i]} -m statistic --mode random --probability {probs[n - i]} -j {names[i]}"
            for i in range(last)
        ]
    )
    rules.append(f"{heads[last]} -j {names[last]}")

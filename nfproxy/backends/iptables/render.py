"""The kube-proxy-compatible iptables backend: ClusterState -> `iptables-restore --noflush` text.

The output follows kube-proxy's iptables proxier (v1.30-era layout) rule for rule, so that a node
switched between kube-proxy and nfproxy keeps the same chain names, the same conntrack-visible
behaviour, and an `iptables-save` that people already know how to read. Deliberate differences:

- every `--comment` is double-quoted (kube-proxy leaves one-word comments bare); iptables-save
  prints both the same way, and one quoting rule is easier to keep safe (see quote_comment);
- `nodeport_addresses` CIDRs are matched in the kernel (`-d CIDR -m addrtype --dst-type LOCAL`)
  instead of being resolved to node IPs at sync time;
- what kube-proxy decides from the host comes in through NodeConfig (`drop_invalid`: no
  conntrack-INVALID drop when nf_conntrack_tcp_be_liberal is set) or is fixed here:
  `MASQUERADE --random-fully` is always used, and there is no KUBE-FIREWALL localnet rule or
  KUBE-PROXY-CANARY chain (kubelet's and the flush monitor's business, not the model's);
- built-in-chain jumps are data (`JUMPS`), not `iptables -C/-I` calls: the kernel layer owns that.

Pure: no I/O. Lines are built as f-strings straight into lists because a 10 000-service cluster is
about 300 000 rule lines, and per-rule objects would dominate the sync time.
"""

from __future__ import annotations

import hashlib
import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from nfproxy.backends import gc_paused
from nfproxy.core.categorize import (
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
    """The only way text reaches a `--comment`: checked, then double-quoted.

    iptables-restore splits on whitespace and honours double quotes, so one `"` or newline in a
    service name would change the meaning of the whole atomic payload. Names are validated
    upstream, but this renderer must be safe on its own: anything but printable ASCII without `"`
    and `\\` is refused rather than escaped (there is no escaping that every iptables version
    reads back the same way). xt_comment stores at most 255 bytes.
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
    return f'"{text}"'


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
JUMPS: tuple[JumpRule, ...] = (
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

    Every rule is a complete `-A CHAIN ...` line. Nothing is mutated after `render` returns.
    """

    family: IPFamily
    filter: Mapping[str, list[str]]
    nat: Mapping[str, list[str]]
    service_chains: Mapping[ServicePortKey, ServiceChains]
    jumps: tuple[JumpRule, ...] = JUMPS

    def nat_chain_names(self) -> list[str]:
        """Every nat chain this rendering declares: what a stale-chain sweep must keep."""
        names = list(self.nat)
        for group in self.service_chains.values():
            names.extend(group.chains)
        return names

    def restore_text(
        self,
        with_jumps: bool = True,
        *,
        services: Iterable[ServicePortKey] | None = None,
        delete_chains: Iterable[str] = (),
    ) -> str:
        """The `iptables-restore --noflush` payload (one atomic restore of both tables).

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
            out.extend([j.line for j in self.jumps if j.table == "filter"])
        for rules in self.filter.values():
            out.extend(rules)
        out.append("COMMIT")

        out.append("*nat")
        out.extend([f":{name} - [0:0]" for name in self.nat])
        for group in groups:
            out.extend([f":{name} - [0:0]" for name in group.chains])
        out.extend([f":{name} - [0:0]" for name in stale])
        if with_jumps:
            out.extend([j.line for j in self.jumps if j.table == "nat"])
        for rules in self.nat.values():
            out.extend(rules)
        for group in groups:
            out.extend(group.rules)
        out.extend([f"-X {name}" for name in stale])
        out.append("COMMIT")
        out.append("")
        return "\n".join(out)


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


def render(state: ClusterState, family: IPFamily) -> IptablesRules:
    """Render one family's rules: kube-proxy's syncProxyRules minus the kernel calls.

    "From a pod" is core's `pod_match` (kube-proxy's local detector: the first pod CIDR of the
    family, or an interface). With no detector and no masquerade-all, no masquerade rule is
    written and the eTP=Local pod short-circuit is omitted, as kube-proxy does.

    Node ports: with no node-port CIDRs for the family, KUBE-SERVICES ends with kube-proxy's
    `-m addrtype --dst-type LOCAL` jump; IPv6 loopback is always excluded, IPv4 loopback only
    with `localhost_nodeports` off (kube-proxy's `--iptables-localhost-nodeports`, default on).
    With CIDRs, kube-proxy resolves them to node IPs at sync time; nfproxy instead writes one
    `-d CIDR -m addrtype --dst-type LOCAL` rule per CIDR, so the kernel does the resolving and an
    address change needs no resync.
    """
    with gc_paused():
        return _render(state, family)


def _pod_matches(match: PodMatch | None) -> tuple[str, str]:
    """(if from a pod, if not from a pod) as iptables matches; ("", "") without a detector."""
    if match is None:
        return "", ""
    if match.kind is PodMatchKind.CIDR:
        return f"-s {match.value}", f"! -s {match.value}"
    name = match.value + ("+" if match.kind is PodMatchKind.INTERFACE_PREFIX else "")
    return f"-i {name}", f"! -i {name}"


def _render(state: ClusterState, family: IPFamily) -> IptablesRules:
    node = state.node
    v6 = family is IPFamily.V6
    from_pod, not_from_pod = _pod_matches(pod_match(node, family))
    if node.masquerade_all:
        masq_match: str | None = ""
    elif not_from_pod:
        masq_match = f" {not_from_pod}"
    else:
        masq_match = None
    mark = f"{node.masquerade_mark:#x}"

    # Same order as ClusterState.service_ports, but sorted on plain strings: the dataclass
    # comparison it uses costs more than the rest of a 10 000-service sort.
    keys = sorted(
        (k for k in state.services if k[1] is family),
        key=lambda k: (k[0].namespace, k[0].name, k[0].port, k[0].protocol),
    )
    services = state.services
    endpoints = state.endpoints
    ports = [(services[k], endpoints.get(k, ())) for k in keys]
    large = sum(len(eps) for _, eps in ports) > LARGE_CLUSTER_ENDPOINTS

    # Pass 1: categorise every service and collect every name to hash, so that all chain names
    # of the sync are computed in one batch (see _hash16_many).
    plan: list[tuple[ServicePort, Routing, str, str, list[str]]] = []
    texts: list[str] = []
    for svc, eps in ports:
        routing = categorize(svc, eps, node)
        name = str(svc.name)
        proto = svc.name.protocol.lower
        base = name + proto
        addrs = [ep.address for ep in routing.reachable]
        texts.append(base)
        texts.extend([base + addr for addr in addrs])
        plan.append((svc, routing, name, proto, addrs))
    hashes = _hash16_many(texts)
    next_hash = 0

    f_services: list[str] = []
    f_external: list[str] = []
    f_forward: list[str] = []
    f_nodeports: list[str] = []
    f_firewall: list[str] = []
    n_services: list[str] = []
    n_nodeports: list[str] = []
    service_chains: dict[ServicePortKey, ServiceChains] = {}

    # Pass 2: the rules.
    for svc, routing, name, proto, addrs in plan:
        suffix = hashes[next_hash]
        names = ["KUBE-SEP-" + h for h in hashes[next_hash + 1 : next_hash + 1 + len(addrs)]]
        next_hash += 1 + len(addrs)
        svc_chain = "KUBE-SVC-" + suffix
        svl_chain = "KUBE-SVL-" + suffix
        ext_chain = "KUBE-EXT-" + suffix
        fw_chain = "KUBE-FW-" + suffix
        pm = f"-m {proto} -p {proto}"
        port = svc.port
        cluster = routing.cluster
        local = routing.local
        has_endpoints = routing.has_endpoints
        internal_verdict = routing.internal_no_endpoints
        external_verdict = routing.external_no_endpoints
        internal_chain = svl_chain if svc.internal_policy_local else svc_chain
        uses_fw = routing.uses_firewall
        lb_chain = fw_chain if uses_fw else ext_chain
        if external_verdict is not None:
            ext_target = "REJECT" if external_verdict is NoEndpoints.REJECT else "DROP"
            ext_comment = quote_comment(
                f"{name} has no endpoints"
                if external_verdict is NoEndpoints.REJECT
                else f"{name} has no local endpoints"
            )

        # Capture the cluster IP.
        cip_comment = quote_comment(name + " cluster IP")
        if internal_verdict is None:
            n_services.append(
                f"-A KUBE-SERVICES -m comment --comment {cip_comment}"
                f" {pm} -d {svc.cluster_ip} --dport {port} -j {internal_chain}"
            )
        else:
            if internal_verdict is NoEndpoints.REJECT:
                target, comment = "REJECT", f"{name} has no endpoints"
            else:
                target, comment = "DROP", f"{name} has no local endpoints"
            f_services.append(
                f"-A KUBE-SERVICES -m comment --comment {quote_comment(comment)}"
                f" {pm} -d {svc.cluster_ip} --dport {port} -j {target}"
            )

        # Capture external IPs.
        for eip in svc.external_ips:
            if _family_of(eip) is not family:
                continue
            if has_endpoints:
                n_services.append(
                    f"-A KUBE-SERVICES -m comment --comment {quote_comment(name + ' external IP')}"
                    f" {pm} -d {eip} --dport {port} -j {ext_chain}"
                )
            if external_verdict is not None:
                f_external.append(
                    f"-A KUBE-EXTERNAL-SERVICES -m comment --comment {ext_comment}"
                    f" {pm} -d {eip} --dport {port} -j {ext_target}"
                )

        # Capture load-balancer ingress.
        lb_ips = (
            [ip for ip in svc.load_balancer_ips if _family_of(ip) is family]
            if svc.load_balancer_ips
            else ()
        )
        lb_comment = quote_comment(name + " loadbalancer IP") if lb_ips else ""
        for lbip in lb_ips:
            if has_endpoints:
                n_services.append(
                    f"-A KUBE-SERVICES -m comment --comment {lb_comment}"
                    f" {pm} -d {lbip} --dport {port} -j {lb_chain}"
                )
            if uses_fw:
                comment = quote_comment(f"{name} traffic not accepted by {fw_chain}")
                f_firewall.append(
                    f"-A KUBE-PROXY-FIREWALL -m comment --comment {comment}"
                    f" {pm} -d {lbip} --dport {port} -j DROP"
                )
        if external_verdict is not None:
            for lbip in lb_ips:
                f_external.append(
                    f"-A KUBE-EXTERNAL-SERVICES -m comment --comment {ext_comment}"
                    f" {pm} -d {lbip} --dport {port} -j {ext_target}"
                )

        # Capture node ports (not subject to loadBalancerSourceRanges, as in kube-proxy).
        if svc.node_port:
            if has_endpoints:
                n_nodeports.append(
                    f"-A KUBE-NODEPORTS -m comment --comment {quote_comment(name)}"
                    f" {pm} --dport {svc.node_port} -j {ext_chain}"
                )
            if external_verdict is not None:
                f_external.append(
                    f"-A KUBE-EXTERNAL-SERVICES -m comment --comment {ext_comment}"
                    f" -m addrtype --dst-type LOCAL {pm} --dport {svc.node_port} -j {ext_target}"
                )

        # Health-check node ports are accepted whether or not there are local endpoints: the
        # load balancer must be able to ask, and hear "503".
        if svc.health_check_node_port:
            comment = quote_comment(f"{name} health check node port")
            f_nodeports.append(
                f"-A KUBE-NODEPORTS -m comment --comment {comment}"
                f" -m tcp -p tcp --dport {svc.health_check_node_port} -j ACCEPT"
            )

        if not has_endpoints:
            # No nat chains at all: only the filter REJECT rules above.
            continue

        # The service's own chains, in kube-proxy's declaration and rule order.
        uses_ext = routing.uses_external_chain
        chains: list[str] = []
        rules: list[str] = []
        service_chains[svc.key] = ServiceChains(chains, rules)
        if uses_ext:
            chains.append(ext_chain)
        if uses_fw:
            chains.append(fw_chain)
        if cluster:
            chains.append(svc_chain)
        if local:
            chains.append(svl_chain)

        # Internal traffic: masquerade off-cluster sources (or everything with masquerade-all).
        if internal_verdict is None and masq_match is not None:
            rules.append(
                f"-A {internal_chain} -m comment --comment {cip_comment}"
                f" {pm} -d {svc.cluster_ip} --dport {port}{masq_match} -j KUBE-MARK-MASQ"
            )

        if uses_ext:
            if not svc.external_policy_local:
                comment = quote_comment(f"masquerade traffic for {name} external destinations")
                rules.append(f"-A {ext_chain} -m comment --comment {comment} -j KUBE-MARK-MASQ")
            else:
                # Short-circuits: pod and host traffic to an external address is treated as if
                # it had gone out to the load balancer and come back, i.e. by Cluster policy.
                # The SVC chain exists: an externally accessible port with endpoints always has
                # Cluster endpoints (ServicePort.uses_cluster_endpoints).
                if from_pod:
                    comment = quote_comment(f"pod traffic for {name} external destinations")
                    rules.append(
                        f"-A {ext_chain} -m comment --comment {comment} {from_pod} -j {svc_chain}"
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
            if external_verdict is None:
                policy_chain = svl_chain if svc.external_policy_local else svc_chain
                rules.append(f"-A {ext_chain} -j {policy_chain}")

        if uses_fw:
            head = f"-A {fw_chain} -m comment --comment {lb_comment}"
            for source in firewall_sources(svc, node):
                rules.append(f"{head} -s {source} -j {ext_chain}")
            comment = quote_comment(
                f"other traffic to {name} will be dropped by KUBE-PROXY-FIREWALL"
            )
            rules.append(f"-A {fw_chain} -m comment --comment {comment}")

        reachable = routing.reachable
        chains.extend(names)

        affinity = svc.affinity_timeout
        if cluster:
            if cluster is reachable:
                _cascade(rules, svc_chain, names, addrs, name, affinity, large)
            else:
                _cascade(rules, svc_chain, *_select(names, addrs, cluster), name, affinity, large)
        if local:
            if local is reachable:
                _cascade(rules, svl_chain, names, addrs, name, affinity, large)
            else:
                _cascade(rules, svl_chain, *_select(names, addrs, local), name, affinity, large)

        # Each endpoint chain: hairpin masquerade, record affinity, DNAT.
        sep_comment = "" if large else f" -m comment --comment {quote_comment(name)}"
        dnat = f" {pm} -j DNAT --to-destination "
        for ep, sep, addr in zip(reachable, names, addrs):
            rules.append(f"-A {sep}{sep_comment} -s {ep.ip} -j KUBE-MARK-MASQ")
            if affinity:
                rules.append(f"-A {sep}{sep_comment} -m recent --name {sep} --set{dnat}{addr}")
            else:
                rules.append(f"-A {sep}{sep_comment}{dnat}{addr}")

    # Finally the tail-call to the node ports: it must stay the last rule of KUBE-SERVICES.
    n_services.extend(_nodeports_tail(node.localhost_nodeports, nodeport_cidrs(node, family, primary_by_default=False), v6))
    f_forward.extend(_forward_rules(node.drop_invalid, mark))
    postrouting = [
        f"-A KUBE-POSTROUTING -m mark ! --mark {mark}/{mark} -j RETURN",
        # Clear the mark so a packet that re-traverses the stack is not masqueraded twice.
        f"-A KUBE-POSTROUTING -j MARK --xor-mark {mark}",
        '-A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring SNAT"'
        " -j MASQUERADE --random-fully",
    ]
    mark_masq = [f"-A KUBE-MARK-MASQ -j MARK --or-mark {mark}"]

    filter_table = {
        KUBE_SERVICES: f_services,
        KUBE_EXTERNAL_SERVICES: f_external,
        KUBE_FORWARD: f_forward,
        KUBE_NODEPORTS: f_nodeports,
        KUBE_PROXY_FIREWALL: f_firewall,
    }
    nat_table = {
        KUBE_SERVICES: n_services,
        KUBE_NODEPORTS: n_nodeports,
        KUBE_POSTROUTING: postrouting,
        KUBE_MARK_MASQ: mark_masq,
    }
    return IptablesRules(family, filter_table, nat_table, service_chains)


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
) -> None:
    """Affinity lookups first (a known client keeps its endpoint), then the random cascade.

    Rule i of n matches with probability 1/(n-i) of what reaches it, so each endpoint gets 1/n;
    the last rule has no statistic match and takes whatever is left.
    """
    n = len(names)
    probability(n)
    probs = _probabilities
    last = n - 1
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

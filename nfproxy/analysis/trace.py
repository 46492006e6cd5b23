"""`trace`: the chains one first packet walks, and how likely each ending is.

Public API: `guess_origin(ruleset, src, node_ips) -> Origin`, `pod_cidrs(ruleset)`,
`format_trace(paths, written=, weights=) -> str`, `endpoint_weights(weights)`, `parse_destination("10.96.0.10:53/udp") -> (ip, port, proto)`.
The walk itself is `interpret.trace`.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence
from fractions import Fraction

from nfproxy.analysis.index import indexes
from nfproxy.analysis.interpret import Origin, Outcome, Path
from nfproxy.analysis.ir import Field, Match, Prefix, Ruleset, SetRef
from nfproxy.analysis.nft_rule_text import readable
from nfproxy.analysis.quantize import fsum, shown


def pod_cidrs(ruleset: Ruleset) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    """Pod CIDRs as the rules reveal them: the networks whose sources are spared masquerading
    (`! -s CIDR -j KUBE-MARK-MASQ`, `ip saddr != CIDR jump mark-for-masquerade`) or sent on as
    pod traffic (`-s CIDR -j KUBE-SVC-…`), and the elements of a `cluster-cidrs` set."""
    found = []
    for table in ruleset.tables:
        for chain in table.chains.values():
            for rule in chain.rules:
                for st in rule.statements:
                    if not (isinstance(st, Match) and st.left == Field("saddr")):
                        continue
                    if isinstance(st.right, Prefix) and st.right.network.prefixlen < st.right.network.max_prefixlen:
                        if st.op == "!=" or "pod traffic" in rule.comment or "short-circuit pod" in rule.text:
                            found.append(st.right.network)
                    elif isinstance(st.right, SetRef) and "cluster-cidr" in st.right.name:
                        sdef = table.sets.get(st.right.name)
                        for el in sdef.elements if sdef else ():
                            if isinstance(el.key[0], Prefix):
                                found.append(el.key[0].network)
    return list(dict.fromkeys(found))


def guess_origin(ruleset: Ruleset, src: str, node_ips: Sequence[str]) -> Origin:
    addr = ipaddress.ip_address(src)
    if any(addr == ipaddress.ip_address(ip) for ip in node_ips) or addr.is_loopback:
        return "node"
    cidrs = indexes(ruleset).cached(("pod_cidrs",), lambda: pod_cidrs(ruleset))
    if any(addr in net for net in cidrs if net.version == addr.version):
        return "pod"
    return "outside"


def parse_destination(text: str) -> tuple[str, int, str]:
    """`IP:PORT/PROTO` or `[IP6]:PORT/PROTO`; PROTO defaults to tcp."""
    hostport, _, proto = text.partition("/")
    proto = (proto or "tcp").lower()
    if hostport.startswith("["):
        host, _, port = hostport[1:].partition("]")
        port = port.lstrip(":")
    else:
        host, _, port = hostport.rpartition(":")
    try:
        ipaddress.ip_address(host)
        number = int(port)
    except ValueError:
        raise ValueError(f"destination {text!r}: expected IP:PORT/PROTO or [IP6]:PORT/PROTO") from None
    if not 0 < number < 65536 or proto not in ("tcp", "udp", "sctp"):
        raise ValueError(f"destination {text!r}: port 1-65535 and protocol tcp, udp or sctp")
    return host, number, proto


def endpoint_weights(weights: Mapping[str, Mapping[str, int]]) -> dict[str, int]:
    """Weight per endpoint address, from analysis.weights; an address whose services disagree
    (two slices weighting it differently) is left out rather than guessed."""
    out: dict[str, int] = {}
    clash: set[str] = set()
    for per_service in weights.values():
        for address, weight in per_service.items():
            if out.setdefault(address, weight) != weight:
                clash.add(address)
    return {a: w for a, w in out.items() if a not in clash}


def format_trace(
    paths: Sequence[Path],
    limit: int = 20,
    *,
    written: Mapping[Outcome, Fraction] | None = None,
    weights: Mapping[str, int] | None = None,
) -> str:
    """Paths grouped by outcome, most likely first; the chain walk of each group's first path.

    `written`: each outcome's probability as the rules write it (ideal mode), shown when it is
    not the one printed; `weights`: the model's weight per endpoint (docs/weights.md)."""
    groups: dict[object, list[Path]] = {}
    for p in paths:
        groups.setdefault(p.outcome, []).append(p)
    # Each group's total once (quantize.fsum: an iptables cascade's shares are k / 2^(31 i)).
    totals = {outcome: fsum(p.probability for p in ps) for outcome, ps in groups.items()}
    order = sorted(groups.items(), key=lambda kv: -totals[kv[0]])
    lines = []
    picks = {p for o, p in (written or {}).items() if o.verdict == "dnat"}
    weighted = len(picks) > 1  # unequal shares as written: say what each is meant to get
    for outcome, ps in order[:limit]:
        total = totals[outcome]
        count = sum(p.count for p in ps)
        extra = ""
        if weighted and written is not None and outcome in written:
            extra += f", written {shown(written[outcome])}"
        if weights and outcome.endpoint in weights:
            extra += f", weight {weights[outcome.endpoint]}"
        # The exact fraction while it is short; a long one (a deep cascade) is shown rounded,
        # marked "≈": docs/semantics.md, "Long fractions".
        exact = shown(total)
        value = f"{exact} ≈ {float(total):.12f}" if not exact.startswith("≈") else f"{exact}"
        lines.append(f"{outcome}  p = {value}  ({count} path{'s' if count > 1 else ''}{extra})")
        first = ps[0]
        last = None
        for step in first.steps:
            if (step.table, step.chain) != last:
                lines.append(f"  {step.table} {step.chain}")
                last = (step.table, step.chain)
            where = "policy" if step.rule < 0 else f"#{step.rule + 1}"
            lines.append(f"      {where}: {readable(step.text)}")
        if first.unlisted:
            lines.append(f"  ... and {first.unlisted} more rules matched, not listed (a path lists at most {len(first.steps)})")
        if first.lookups:
            lines.append(f"  affinity lookups (a new client matches none): {', '.join(first.lookups)}")
        if first.pins:
            lines.append(f"  pins the client in: {', '.join(first.pins)}")
    if len(order) > limit:
        lines.append(f"... and {len(order) - limit} more outcomes")
    return "\n".join(lines)

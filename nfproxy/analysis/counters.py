"""New connections per endpoint, from the kernel's own counters.

Public API: `EndpointCount`, `endpoint_counts_iptables(save_text)`,
`endpoint_counts_nft(ruleset_json)`, `total_by_service(counts)`.

In the nat table only a connection's first packet is evaluated, so the packets a counter at an
endpoint's DNAT has seen are the connections that endpoint was given. iptables keeps one such
counter per `KUBE-SEP-*` DNAT rule (`iptables-save -c` prints it); nfproxy's nft layout keeps
one per element of the endpoint data maps (the maps carry the `counter` flag) and one on the
DNAT rule of each per-endpoint chain (ClientIP affinity ports).

Services and endpoints are read from the rules themselves, never from what a renderer meant
(analysis does not import backends): iptables from the `ns/name:port` comment of the SEP chain
(or the `ns/name:port -> ip:port` comments of the jumps to it), nft from the chain names
(`kind-HASH-ns/name/proto/port`). A chain name nft had to hash and truncate (240 characters,
far past any real Kubernetes name) cannot be read back and is left out.
"""

from __future__ import annotations

import bisect

import json
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from nfproxy.analysis.ir import endpoint_text
from nfproxy.core.model import IPFamily

_SEP = "KUBE-SEP-"
_NFT_SELECTORS = ("service-", "local-")
_NFT_ENDPOINT = "endpoint-"


@dataclass(frozen=True, slots=True)
class EndpointCount:
    """One endpoint of one service port and the connections the kernel sent it."""

    namespace: str
    service: str
    port: str  # the service port's name ("" for an unnamed port)
    protocol: str  # "tcp", "udp", "sctp"
    family: IPFamily
    endpoint: str  # ip:port, IPv6 bracketed (Endpoint.address)
    connections: int

    @property
    def service_port(self) -> str:
        """kube-proxy's ServicePortName spelling: `ns/name:port`, or `ns/name`."""
        base = f"{self.namespace}/{self.service}"
        return f"{base}:{self.port}" if self.port else base


def _merge(counts: Iterable[EndpointCount]) -> tuple[EndpointCount, ...]:
    """One count per (service port, protocol, family, endpoint), summed, in a stable order: an
    endpoint may sit behind several counters (nft: its slot in the cluster chain's block and in
    the local chain's)."""
    total: dict[tuple[str, str, str, str, IPFamily, str], int] = {}
    for c in counts:
        key = (c.namespace, c.service, c.port, c.protocol, c.family, c.endpoint)
        total[key] = total.get(key, 0) + c.connections
    return tuple(
        EndpointCount(ns, name, port, proto, fam, ep, n)
        for (ns, name, port, proto, fam, ep), n in sorted(total.items(), key=lambda kv: (*kv[0][:4], kv[0][4].value, kv[0][5]))
    )


def total_by_service(counts: Iterable[EndpointCount]) -> dict[str, int]:
    """Connections per service port (`ns/name:port`), all families and endpoints together."""
    out: dict[str, int] = {}
    for c in counts:
        out[c.service_port] = out.get(c.service_port, 0) + c.connections
    return out


# --------------------------------------------------------------------------------------------
# iptables


def _split_service_port(text: str) -> tuple[str, str, str] | None:
    """`ns/name:port` or `ns/name` -> (ns, name, port); None for anything else."""
    ns, slash, rest = text.partition("/")
    if not slash or not ns or not rest:
        return None
    name, _, port = rest.partition(":")
    return (ns, name, port) if name else None


def _family_of(endpoint: str) -> IPFamily:
    return IPFamily.V6 if endpoint.startswith("[") else IPFamily.V4


@dataclass(frozen=True, slots=True)
class _SepRule:
    chain: str
    packets: int
    protocol: str
    endpoint: str
    comment: str


# The few options read, found by regex in the raw line: iptables-save quotes a comment with
# spaces in double quotes (backslash-escaping any inside); every other word is bare. Splitting
# each line with shlex would do, at 20x the cost (seconds for a 10 000-service dump).
_COMMENT = re.compile(r'--comment (?:"((?:[^"\\]|\\.)*)"|(\S+))')
_TARGET = re.compile(r"(?:^| )(?:-j|--jump) (\S+)")
_DEST = re.compile(r"--to-destination (\S+)")
_PROTO = re.compile(r"(?:^| )(?:-p|--protocol) (\S+)")


def _comment(line: str) -> str:
    m = _COMMENT.search(line)
    if m is None:
        return ""
    return m.group(1).replace('\\"', '"') if m.group(1) is not None else m.group(2)


def _found(pattern: re.Pattern[str], line: str) -> str | None:
    m = pattern.search(line)
    return m.group(1) if m else None


def _nat_lines(save_text: str) -> Iterator[str]:
    """The rule lines of every nat table in the text (iptables-save of several families may
    follow each other)."""
    table = ""
    for raw in save_text.splitlines():
        line = raw.strip()
        if line.startswith("*"):
            table = line[1:].strip()
        elif table == "nat" and (line.startswith("[") or line.startswith("-A ")):
            yield line


_PER_SERVICE = ("KUBE-SVC-", "KUBE-SVL-", "KUBE-EXT-", "KUBE-FW-", "KUBE-SEP-")


def _label(comment: str) -> str:
    """The service port a rule comment names: `ns/name:port`, then maybe ` cluster IP`,
    ` -> ip:port`, ...; "" when it names none."""
    head = comment.split(" ", 1)[0]
    return head if _split_service_port(head) else ""


def _propagate(labels: dict[str, str], jumps: list[tuple[str, str]]) -> None:
    """Chains no comment names get the label of a per-service chain that jumps to them: with
    more than 1 000 endpoints kube-proxy (and nfproxy) drop the comments of the SVC and SEP
    rules, and only KUBE-SERVICES' rules still say which service a KUBE-SVC chain is."""
    changed = True
    while changed:
        changed = False
        for src, dst in jumps:
            if dst not in labels and src in labels:
                labels[dst] = labels[src]
                changed = True


def endpoint_counts_iptables(save_text: str) -> tuple[EndpointCount, ...]:
    """The packet counter of every `KUBE-SEP-*` DNAT rule of `iptables-save -c` output (one or
    both families). Text without counters counts zero. A SEP chain is named by its own
    comment, else by the comment of a rule jumping to it (or to a chain jumping to it); one no
    rule names is left out."""
    seps: list[_SepRule] = []
    labels: dict[str, str] = {}
    jumps: list[tuple[str, str]] = []
    for line in _nat_lines(save_text):
        packets = 0
        if line.startswith("["):
            head, _, line = line.partition("]")
            line = line.lstrip()
            packets = int(head[1:].split(":", 1)[0] or 0)
        if "-j KUBE-" not in line and "-j DNAT" not in line:
            continue  # neither a jump to a per-service chain nor a DNAT
        parts = line.split(" ", 2)
        if len(parts) < 2:
            continue
        chain = parts[1]
        target = _found(_TARGET, line)
        comment = _comment(line)
        label = _label(comment)
        if chain.startswith(_SEP) and target == "DNAT":
            dest = _found(_DEST, line)
            proto = (_found(_PROTO, line) or "").lower()
            if dest:
                seps.append(_SepRule(chain, packets, proto, dest, comment))
        if chain.startswith(_PER_SERVICE) and label:
            labels.setdefault(chain, label)
        if target and target.startswith(_PER_SERVICE):
            if label:
                labels.setdefault(target, label)
            if chain.startswith(_PER_SERVICE):
                jumps.append((chain, target))
    _propagate(labels, jumps)
    out: list[EndpointCount] = []
    for sep in seps:
        parts = _split_service_port(labels.get(sep.chain, ""))
        if parts is None:
            continue
        out.append(EndpointCount(*parts, sep.protocol, _family_of(sep.endpoint), sep.endpoint, sep.packets))
    return _merge(out)


# --------------------------------------------------------------------------------------------
# nft


def _nft_service_port(chain: str, prefixes: tuple[str, ...]) -> tuple[str, str, str, str] | None:
    """`kind-HASH-ns/name/proto/port[__ip/port]` -> (ns, name, port, proto)."""
    if not chain.startswith(prefixes):
        return None
    ident = chain.split("-", 2)[-1].split("__", 1)[0]
    parts = ident.split("/")
    if len(parts) != 4 or not all(parts[:3]):
        return None
    ns, name, proto, port = parts
    return ns, name, port, proto


def _packets(counter: Any, named: Mapping[str, int]) -> int | None:
    """A counter statement's packets: anonymous ({packets, bytes}) or a named counter."""
    if isinstance(counter, dict):
        return int(counter.get("packets", 0))
    if isinstance(counter, str):
        return named.get(counter)
    return None


def _documents(ruleset_json: Any) -> list[dict[str, Any]]:
    if isinstance(ruleset_json, (str, bytes)):
        ruleset_json = json.loads(ruleset_json)
    items = ruleset_json.get("nftables", []) if isinstance(ruleset_json, dict) else []
    return [i for i in items if isinstance(i, dict)]


@dataclass(frozen=True, slots=True)
class _Slots:
    table: tuple[str, str]
    chain: str
    first: int
    n: int
    map_name: str


def _selection(expr: list[Any]) -> tuple[int, int, str] | None:
    """(offset, mod, map) of `dnat to numgen random mod N offset K map @M`."""
    for stmt in expr:
        if not isinstance(stmt, dict) or "dnat" not in stmt:
            continue
        addr = stmt["dnat"].get("addr") if isinstance(stmt["dnat"], dict) else None
        m = addr.get("map") if isinstance(addr, dict) else None
        if not isinstance(m, dict):
            continue
        key, data = m.get("key"), m.get("data")
        gen = key.get("numgen") if isinstance(key, dict) else None
        if isinstance(gen, dict) and isinstance(data, str) and data.startswith("@"):
            # nft 1.0.6 prints the u32 offset as a signed 32-bit number
            return int(gen.get("offset", 0)) % (1 << 32), int(gen["mod"]), data[1:]
    return None


def _direct_dnat(expr: list[Any], named: Mapping[str, int]) -> tuple[int, str] | None:
    """(packets, endpoint) of a rule `counter ... dnat to ADDR:PORT` (a per-endpoint chain)."""
    packets: int | None = None
    for stmt in expr:
        if not isinstance(stmt, dict):
            continue
        if "counter" in stmt:
            packets = _packets(stmt["counter"], named)
        elif "dnat" in stmt and isinstance(stmt["dnat"], dict) and packets is not None:
            addr, port = stmt["dnat"].get("addr"), stmt["dnat"].get("port")
            if isinstance(addr, str) and port is not None:
                return packets, endpoint_text(addr, port)
    return None


def _element_counts(body: dict[str, Any]) -> list[tuple[int, int, int, str]]:
    """(first value, last value, packets, endpoint) of each element of an endpoint data map
    listed with its counters (a range per endpoint, or a single value), sorted."""
    out: list[tuple[int, int, int, str]] = []
    for pair in body.get("elem", ()) or ():
        if not isinstance(pair, list) or len(pair) != 2:
            continue
        key, data = pair
        if not (isinstance(key, dict) and isinstance(key.get("elem"), dict)):
            continue  # an element without a counter: nothing counted it
        elem = key["elem"]
        concat = data.get("concat") if isinstance(data, dict) else None
        if not (isinstance(concat, list) and len(concat) == 2) or "counter" not in elem:
            continue
        val = elem["val"]
        span = val.get("range") if isinstance(val, dict) else (val, val)
        if not (isinstance(span, (list, tuple)) and len(span) == 2):
            continue
        out.append((int(span[0]), int(span[1]), int(elem["counter"].get("packets", 0)), endpoint_text(*concat)))
    out.sort()
    return out


# A counted map's elements read elsewhere (over netlink: analysis/nft_elements.counted_table),
# by (family, table, map): what `_element_counts` makes of the listed ones.
ElementCounts = Mapping[tuple[str, str, str], list[tuple[int, int, int, str]]]


def endpoint_counts_nft(ruleset_json: Any, elements: ElementCounts | None = None) -> tuple[EndpointCount, ...]:
    """Per-endpoint counters of `nft -j list ruleset` (or `list table`) output, a parsed document
    or its text; `elements`, the counted maps' elements when the document (a terse listing)
    holds none. Endpoint maps without the `counter` flag and per-endpoint chains without a
    counter before their DNAT contribute nothing (an older nfproxy, or counters turned off)."""
    items = _documents(ruleset_json)
    named: dict[str, int] = {}
    maps: dict[tuple[str, str, str], list[tuple[int, int, int, str]]] = {}
    selections: list[_Slots] = []
    out: list[EndpointCount] = []
    for item in items:
        if "counter" in item and isinstance(item["counter"], dict):
            named[item["counter"].get("name", "")] = int(item["counter"].get("packets", 0))
    for item in items:
        if "map" in item and isinstance(item["map"], dict):
            body = item["map"]
            key = (body.get("family", ""), body.get("table", ""), body.get("name", ""))
            given = elements.get(key) if elements is not None and "elem" not in body else None
            maps[key] = given if given is not None else _element_counts(body)
    for item in items:
        rule = item.get("rule")
        if not isinstance(rule, dict):
            continue
        family, table, chain = rule.get("family", ""), rule.get("table", ""), rule.get("chain", "")
        expr = rule.get("expr", [])
        sel = _selection(expr) if chain.startswith(_NFT_SELECTORS) else None
        if sel is not None:
            selections.append(_Slots((family, table), chain, sel[0], sel[1], sel[2]))
            continue
        parts = _nft_service_port(chain, (_NFT_ENDPOINT,))
        hit = _direct_dnat(expr, named) if parts else None
        if parts and hit:
            ns, name, port, proto = parts
            out.append(EndpointCount(ns, name, port, proto, _family_of(hit[1]), hit[1], hit[0]))
    # An element's counter counts every lookup of it, whichever rule made it: read it once, even
    # when two rules draw from the same values (a foreign rule reusing ours, say).
    counted: set[tuple[str, str, str, int]] = set()
    for s in selections:
        parts = _nft_service_port(s.chain, _NFT_SELECTORS)
        if parts is None:
            continue
        elements = maps.get((*s.table, s.map_name), [])
        ns, name, port, proto = parts
        last = s.first + s.n - 1
        i = max(bisect.bisect_right(elements, (s.first, 1 << 64)) - 1, 0)
        for low, high, packets, ep in elements[i:]:
            if low > last:
                break
            if high < s.first or (*s.table, s.map_name, low) in counted:
                continue
            counted.add((*s.table, s.map_name, low))
            out.append(EndpointCount(ns, name, port, proto, _family_of(ep), ep, packets))
    return _merge(out)


# --------------------------------------------------------------------------------------------
# Live


def read_live_counts(backend: str, netns: str | None) -> tuple[EndpointCount, ...]:
    """The counters a backend's rules hold now in `netns` (None: this namespace), both
    families; iptables in whichever flavour (legacy, nft) holds KUBE-* rules. Reading never
    writes to the kernel."""
    from nfproxy.kernel.process import KernelError

    if backend == "nft":
        from nfproxy.analysis.nft_elements import counted_table
        from nfproxy.nftables import OFF_TABLE, TABLE

        # The counted maps' elements over netlink, not libnftables' listing of every element.
        read = [counted_table(netns, fam, table) for fam in ("ip", "ip6") for table in (TABLE, OFF_TABLE)]
        return _merge(c for doc, counted in filter(None, read) for c in endpoint_counts_nft(doc, counted))
    if backend != "iptables":
        raise ValueError(f"unknown backend {backend!r}")
    from nfproxy.kernel.iptables import Flavour, IptablesRunner

    texts: list[str] = []
    for flavour in (Flavour.LEGACY, Flavour.NFT):
        for family in IPFamily:
            try:
                text = IptablesRunner(family, netns, flavour).save("nat", counters=True)
            except KernelError:
                continue
            if "KUBE-SEP-" in text:
                texts.append(text)
    return endpoint_counts_iptables("\n".join(texts))

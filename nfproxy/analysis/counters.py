"""Per-endpoint new-connection counts read back from the kernel's rule counters.

INTERIM (task L2): the iptables half of helper L1's interface, so `nfproxy audit` can be built
and tested before L1's branch (l-counters) lands; L1's module replaces this file whole.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EndpointCount:
    namespace: str
    service: str
    port: str
    protocol: str
    family: str
    endpoint: str
    connections: int


def _rules(save_text: str) -> Iterator[tuple[int, list[str]]]:
    table = ""
    for line in save_text.splitlines():
        if line.startswith("*"):
            table = line[1:].strip()
        if table != "nat" or not line.startswith("["):
            continue
        counters, _, rest = line.partition("]")
        packets = int(counters[1:].split(":")[0])
        yield packets, shlex.split(rest)


def _option(tokens: list[str], name: str) -> str | None:
    return tokens[tokens.index(name) + 1] if name in tokens and tokens.index(name) + 1 < len(tokens) else None


def endpoint_counts_iptables(save_text: str) -> list[EndpointCount]:
    """The packet counter of each KUBE-SEP-* DNAT rule (`iptables-save -c` text, nat table)."""
    out = []
    for packets, tokens in _rules(save_text):
        chain = _option(tokens, "-A") or ""
        target = _option(tokens, "-j")
        dest = _option(tokens, "--to-destination")
        comment = _option(tokens, "--comment") or ""
        if not chain.startswith("KUBE-SEP-") or target != "DNAT" or dest is None:
            continue
        ns_name, _, port = comment.partition(":")
        ns, _, name = ns_name.partition("/")
        family = "ip6" if dest.startswith("[") else "ip"
        out.append(EndpointCount(ns, name, port, (_option(tokens, "-p") or "tcp").lower(), family, dest, packets))
    return out

"""What a dump holds: chains, rules, sets, maps and elements, counted by kind.

Read from what the kernel prints back (`iptables-save`, `nft -j list ruleset`), never from what
the renderers meant to write, so a comparison of the two proves the kernel took the rules.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

# kube-proxy's per-service and per-endpoint chain prefixes (iptables) and nft chain prefixes.
_IPT_KINDS = ("KUBE-SVC-", "KUBE-SVL-", "KUBE-EXT-", "KUBE-FW-", "KUBE-SEP-")
_NFT_KINDS = ("service-", "local-", "external-", "firewall-", "endpoint-")


@dataclass(frozen=True, slots=True)
class Inventory:
    chains: int = 0
    rules: int = 0
    sets: int = 0
    maps: int = 0
    # Per-service/per-endpoint chains by prefix, e.g. {"KUBE-SEP-": 12} or {"endpoint-": 12}.
    chain_kinds: dict[str, int] = field(default_factory=dict)
    # Elements per named set or map.
    elements: dict[str, int] = field(default_factory=dict)
    chain_names: frozenset[str] = frozenset()

    def summary(self) -> str:
        kinds = ", ".join(f"{k.rstrip('-')} {v}" for k, v in sorted(self.chain_kinds.items()))
        text = f"{self.chains} chains" + (f" ({kinds})" if kinds else "") + f", {self.rules} rules"
        if self.sets or self.maps:
            total = sum(self.elements.values())
            text += f", {self.sets} sets, {self.maps} maps, {total} elements"
        return text


_CHAIN_DECL = re.compile(r"^:(\S+) ")


def from_iptables_save(text: str, prefix: str = "KUBE-") -> Inventory:
    """Count the chains and rules whose names start with `prefix` in iptables-save output.

    Rules in built-in chains that jump to our chains count too: they are ours.
    """
    chains: set[str] = set()
    rules = 0
    for line in text.splitlines():
        m = _CHAIN_DECL.match(line)
        if m and m.group(1).startswith(prefix):
            chains.add(m.group(1))
        elif line.startswith("-A "):
            parts = line.split()
            if parts[1].startswith(prefix) or (
                "-j" in parts and parts[parts.index("-j") + 1].startswith(prefix)
            ):
                rules += 1
    kinds = Counter(k for c in chains for k in _IPT_KINDS if c.startswith(k))
    return Inventory(
        chains=len(chains), rules=rules, chain_kinds=dict(kinds), chain_names=frozenset(chains)
    )


def from_nft_json(doc: dict[str, Any], table: str = "nfproxy", *also: str) -> Inventory:
    """Count the objects of `table` and the tables `also` (every family) in `nft -j list
    ruleset/table` output. Names of objects of an `also` table carry its name and a colon (the
    off table repeats nfproxy's static names: `nfproxy-off:services`)."""
    chains: set[str] = set()
    rules = sets = maps = 0
    elements: dict[str, int] = {}
    tables = (table, *also)
    for item in doc.get("nftables", []):
        ((kind, obj),) = item.items()
        if not isinstance(obj, dict) or obj.get("table") not in tables:
            continue
        if obj["table"] != table and "name" in obj:
            obj = {**obj, "name": f"{obj['table']}:{obj['name']}"}
        if kind == "chain":
            chains.add(obj["name"])
        elif kind == "rule":
            rules += 1
        elif kind in ("set", "map"):
            if kind == "set":
                sets += 1
            else:
                maps += 1
            elements[obj["name"]] = elements.get(obj["name"], 0) + len(obj.get("elem", []))
    # Per-service chain names always hold a "/" (ns/name/proto/port); fixed ones never do.
    kinds = Counter(k for c in chains if "/" in c for k in _NFT_KINDS if c.split(":", 1)[-1].startswith(k))
    return Inventory(
        chains=len(chains),
        rules=rules,
        sets=sets,
        maps=maps,
        chain_kinds=dict(kinds),
        elements=elements,
        chain_names=frozenset(chains),
    )

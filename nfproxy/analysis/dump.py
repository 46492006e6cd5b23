"""Where rules are read from: a live network namespace or a dump file, into one Ruleset.

Public API: `read_live(backend, netns) -> Source`, `read_file(path) -> Source`,
`read_text(text) -> Source`. A `Source` carries the ruleset, the backend it was read as and a
human description ("iptables-legacy in netns X"). Reading never writes to the kernel.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from nfproxy.analysis import iptables_save, nft_json
from nfproxy.analysis.ir import Ruleset
from nfproxy.kernel.process import KernelError
from nfproxy.core.model import IPFamily

# Tables iptables-nft creates: the nft backend's check leaves them to the iptables one.
IPTABLES_TABLES = frozenset({"filter", "nat", "mangle", "raw", "security"})


@dataclass(frozen=True, slots=True)
class Source:
    ruleset: Ruleset
    backend: str  # "iptables" or "nft"
    description: str


def read_live(backend: str, netns: str | None) -> Source:
    where = f"netns {netns}" if netns else "the current namespace"
    if backend == "nft":
        from nfproxy.kernel.nft import NftSession

        doc = NftSession(netns).list_ruleset()
        rs = nft_json.parse(doc)
        rs = Ruleset(tuple(t for t in rs.tables if t.name not in IPTABLES_TABLES))
        return Source(rs, "nft", f"nft ruleset of {where}")
    if backend != "iptables":
        raise ValueError(f"unknown backend {backend!r}")
    from nfproxy.kernel.iptables import Flavour, IptablesRunner

    tables = []
    used = []
    for flavour in (Flavour.LEGACY, Flavour.NFT):
        for family in IPFamily:
            try:
                text = IptablesRunner(family, netns, flavour).save()
            except KernelError:
                continue
            if "KUBE-" in text:
                tables.extend(iptables_save.parse(text, family).tables)
                used.append(f"{'ip6' if family is IPFamily.V6 else 'ip'}tables-{flavour.value}")
    if not used:
        raise KernelError(f"no KUBE-* iptables rules in {where} (looked at iptables-legacy and iptables-nft)")
    return Source(Ruleset(tuple(tables)), "iptables", f"{', '.join(used)} in {where}")


_ADDR6 = re.compile(r"\s(?:-s|-d|--to-destination)\s+\[?[0-9a-fA-F]*:[0-9a-fA-F:]*[:\]]")


def _is_nft_script(text: str) -> bool:
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            return line.startswith(("add table ip ", "add table ip6 "))
    return False


def read_nft_script(text: str, name: str = "input") -> Source:
    """`nfproxy render --backend nft` output: parsed into transactions, applied to the in-memory
    kernel (which refuses what the real one would: dangling jumps, missing sets) and read back
    as the kernel's JSON would be."""
    from nfproxy.kernel.memory.nft import MemoryNft
    from nfproxy.kernel.process import KernelError
    from nfproxy.nftables import script

    try:
        txs = script.parse(text, name)
    except script.ScriptError as exc:
        raise nft_json.ParseError(str(exc)) from None
    objects: list[object] = []
    for tx in txs:
        kernel = MemoryNft(IPFamily.V4 if tx.family == "ip" else IPFamily.V6, table=tx.table)
        try:
            kernel.apply(tx)
        except KernelError as exc:
            raise nft_json.ParseError(f"{name}: {tx.family} {tx.table}: {exc}") from None
        objects.extend(kernel.json()["nftables"])  # type: ignore[arg-type]
    return Source(nft_json.parse({"nftables": objects}), "nft", f"nft script (nfproxy render) from {name}")


def read_text(text: str, name: str = "input") -> Source:
    """JSON is `nft -j` output; an nft script is `nfproxy render --backend nft` output; anything
    else is iptables-save/restore text (IPv6 when it holds IPv6 addresses)."""
    if _is_nft_script(text):
        return read_nft_script(text, name)
    if text.lstrip().startswith("{"):
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise nft_json.ParseError(f"{name}: not valid JSON: {exc}") from None
        return Source(nft_json.parse(doc), "nft", f"nft JSON from {name}")
    family = IPFamily.V6 if _ADDR6.search(text) else IPFamily.V4
    return Source(iptables_save.parse(text, family), "iptables", f"iptables text (IPv{family.value}) from {name}")


def read_file(path: str) -> Source:
    with open(path, encoding="utf-8") as f:
        return read_text(f.read(), path)

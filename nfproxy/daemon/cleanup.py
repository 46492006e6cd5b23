"""`nfproxy cleanup`: remove every rule nfproxy owns, in both backends, and nothing else.

Owned means: the `nfproxy` tables of the nft backend, and for the iptables backend the jump
rules it inserts into built-in chains plus the chains its renderer can create (its fixed
KUBE-* chains and the per-service KUBE-SVC/SVL/EXT/FW/SEP chains). Chains that merely start
with KUBE- but that nfproxy never writes (kubelet's KUBE-FIREWALL, KUBE-KUBELET-CANARY, …) are
left alone. Both iptables flavours are cleaned, because a node may have been switched between
them.
"""

from __future__ import annotations

import functools
import logging
import shlex
from dataclasses import dataclass

from nfproxy.backends.iptables import render as iptables_backend
from nfproxy.backends.nft import render as nft_backend
from nfproxy.daemon import logs
from nfproxy.kernel.iptables import Flavour, IptablesRunner
from nfproxy.kernel.nft import NftSession
from nfproxy.kernel.process import KernelError
from nfproxy.core.model import ClusterState, IPFamily

log = logging.getLogger("nfproxy.cleanup")
# Earlier releases learned declarations through this table, for milliseconds of a first full
# sync; one is left on a node only if such a daemon died in them.
_SCRATCH_TABLE = "nfproxy-scratch"


@dataclass(frozen=True, slots=True)
class Removed:
    what: str
    count: int


@functools.cache
def _fixed_chains(table: str) -> frozenset[str]:
    """The renderer's own fixed chains of a table: what it writes for an empty cluster."""
    static = iptables_backend.render(ClusterState(), IPFamily.V4)
    return frozenset(static.nat if table == "nat" else static.filter)


def _owned(table: str, chains: list[str]) -> list[str]:
    """nfproxy's chains but KUBE-FIREWALL: the localnet guard stays as long as route_localnet
    may (kube-proxy's CleanupLeftovers leaves it to kubelet too)."""
    fixed = _fixed_chains(table) - {iptables_backend.KUBE_FIREWALL}
    return [c for c in chains if c in fixed or c.startswith(iptables_backend.SERVICE_CHAIN_PREFIXES)]


def cleanup_iptables(netns: str | None) -> list[Removed]:
    removed: list[Removed] = []
    for flavour in Flavour:
        for family in IPFamily:
            try:
                runner = IptablesRunner(family, netns, flavour)
                existing = runner.chains()
            except KernelError as exc:
                logs.info(log, "Nothing to clean", flavour=flavour.value,
                          ipFamily=f"IPv{family.value}", reason=str(exc))
                continue
            jumps = 0
            for jump in iptables_backend.JUMPS:
                if jump.spec.endswith(iptables_backend.KUBE_FIREWALL):
                    continue  # kept with its chain
                if jump.chain in existing.get(jump.table, []) and runner.delete_rule(
                    jump.table, jump.chain, shlex.split(jump.spec)
                ):
                    jumps += 1
            payload: list[str] = []
            count = 0
            for table in ("filter", "nat"):
                owned = _owned(table, existing.get(table, []))
                if not owned:
                    continue
                count += len(owned)
                payload.append(f"*{table}")
                payload += [f":{c} - [0:0]" for c in owned]
                payload += [f"-X {c}" for c in owned]
                payload.append("COMMIT")
            if payload:
                runner.restore("\n".join(payload) + "\n")
            if jumps or count:
                removed.append(Removed(f"{runner.cmd}: jump rules", jumps))
                removed.append(Removed(f"{runner.cmd}: chains", count))
    return removed


def cleanup_nft(netns: str | None) -> list[Removed]:
    session = NftSession(netns)
    removed = []
    for family in ("ip", "ip6"):
        for table in (nft_backend.TABLE, nft_backend.OFF_TABLE, _SCRATCH_TABLE):
            if session.delete_table(family, table):
                removed.append(Removed(f"nft: table {family} {table}", 1))
    return removed


def cleanup(netns: str | None = None) -> list[Removed]:
    return cleanup_nft(netns) + cleanup_iptables(netns)

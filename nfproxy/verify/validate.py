"""`nfproxy validate`: prove the kernel accepts what each backend renders, without a node.

Each backend's full ruleset for both families is applied in its own throwaway network namespace
and read back; the summary counts what the kernel holds. The root namespace is never touched.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from nfproxy.analysis.inventory import Inventory, from_iptables_save, from_nft_json
from nfproxy.backends.iptables import render as iptables_backend
from nfproxy.backends.nft import render as nft_backend
from nfproxy.backends.registry import backend_names
from nfproxy.kernel import netns
from nfproxy.kernel.iptables import Flavour, IptablesRunner
from nfproxy.kernel.nft import NftSession
from nfproxy.core.model import ClusterState, IPFamily

BACKENDS = backend_names()


@dataclass(frozen=True, slots=True)
class Applied:
    backend: str
    family: IPFamily
    seconds: float
    inventory: Inventory
    detail: str = ""


def apply_iptables(
    state: ClusterState, ns: str, flavour: Flavour | None = None
) -> list[Applied]:
    out = []
    for family in IPFamily:
        runner = IptablesRunner(family, ns, flavour)
        payload = iptables_backend.render(state, family).restore_text(with_jumps=True)
        start = time.perf_counter()
        runner.restore(payload)
        elapsed = time.perf_counter() - start
        inv = from_iptables_save(runner.save())
        out.append(Applied("iptables", family, elapsed, inv, runner.restore_cmd))
    return out


def apply_nft(state: ClusterState, ns: str) -> list[Applied]:
    session = NftSession(ns)
    out = []
    for family in IPFamily:
        script = nft_backend.render(state, family).script()
        start = time.perf_counter()
        session.apply(script)
        elapsed = time.perf_counter() - start
        fam = "ip" if family is IPFamily.V4 else "ip6"
        docs = [session.list_table(fam, t) for t in (nft_backend.TABLE, nft_backend.OFF_TABLE)]
        doc = {"nftables": [o for d in docs if d is not None for o in d["nftables"]]}
        how = "libnftables" if session.uses_bindings else "nft -f"
        out.append(Applied("nft", family, elapsed, from_nft_json(doc, nft_backend.TABLE, nft_backend.OFF_TABLE), how))
    return out


# How each registered backend's full rendering is applied as is (iptables: with its jumps in the
# restore, in a fresh namespace) and read back.
APPLY = {"iptables": apply_iptables, "nft": apply_nft}
assert set(APPLY) == set(BACKENDS), "every registered backend needs a way to be validated"


def validate(state: ClusterState, backends: tuple[str, ...] = BACKENDS) -> list[Applied]:
    results: list[Applied] = []
    for backend in backends:
        with netns.throwaway(f"nfp-validate-{backend[:3]}") as ns:
            results.extend(APPLY[backend](state, ns))
    return results

"""`nfproxy validate`: prove the kernel accepts what each backend renders, without a node.

Each backend's full ruleset for both families is applied in its own throwaway network namespace
and read back; the summary counts what the kernel holds. The root namespace is never touched.

Bounded work: iptables-nft-restore's time grows faster than the square of the rules it is given
(seconds for 14 000 rules, most of a minute for 28 000; one Service of 20 000 ports, 140 000
rules, does not finish in minutes), where iptables-legacy-restore takes seconds for 140 000
(figures: docs/benchmarks.md, "Hostile inputs and faults, second round").
So before anything is applied, a restore of more than `IPTABLES_NFT_RULE_LIMIT` rules in the
nft flavour is refused (`TooManyRules`, naming the limit and the ways around it), as `check` and
`trace` stop a walk over their budget instead of running for ever.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from nfproxy.analysis.inventory import Inventory, from_iptables_save, from_nft_json
from nfproxy.backends.iptables import render as iptables_backend
from nfproxy.backends.nft import render as nft_backend
from nfproxy.backends.registry import backend_names
from nfproxy.kernel import netns
from nfproxy.kernel.iptables import Flavour, IptablesRunner, detect_flavour
from nfproxy.kernel.nft import NftSession
from nfproxy.core.model import ClusterState, IPFamily

BACKENDS = backend_names()

# Rules in one iptables-nft-restore (one family) above which `validate` refuses: about 25 s
# of restore here (see the module docstring).
IPTABLES_NFT_RULE_LIMIT = 25_000


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


class TooManyRules(ValueError):
    """A restore the nft flavour would not finish in reasonable time: refused before applying."""


def _fresh_flavour() -> Flavour:
    """The flavour apply_iptables picks in a fresh namespace (no rules: the host's `iptables`)."""
    with netns.throwaway("nfp-validate-flv") as ns:
        return detect_flavour(ns)


def _rules(payload: str) -> int:
    return payload.count("\n-A ") + payload.startswith("-A ")


def refuse_slow_restore(state: ClusterState, flavour: Flavour | None, limit: int) -> None:
    """TooManyRules when an iptables-nft restore of `state` would hold more than `limit` rules
    in one family (0: no limit). Renders the payloads: exact, and cheap beside the restore."""
    if not limit or (flavour or _fresh_flavour()) is not Flavour.NFT:
        return
    for family in IPFamily:
        rules = _rules(iptables_backend.render(state, family).restore_text(with_jumps=True))
        if rules > limit:
            raise TooManyRules(
                f"iptables IPv{family.value}: {rules} rules, over the limit of {limit} for "
                f"iptables-nft-restore (--iptables-nft-rule-limit), whose time grows faster than "
                f"the square of the rules; validate them with --iptables-flavour legacy, or leave "
                f"iptables out (--backends nft)"
            )


def validate(
    state: ClusterState,
    backends: tuple[str, ...] = BACKENDS,
    *,
    flavour: Flavour | None = None,
    iptables_nft_rule_limit: int = IPTABLES_NFT_RULE_LIMIT,
) -> list[Applied]:
    """Apply and read back each backend; TooManyRules before anything is applied when the
    iptables-nft restore would be over `iptables_nft_rule_limit` (0: no limit)."""
    if "iptables" in backends:
        refuse_slow_restore(state, flavour, iptables_nft_rule_limit)
    results: list[Applied] = []
    for backend in backends:
        # Only a flavour asked for is passed: the steps keep their (state, ns) call otherwise.
        extra = {"flavour": flavour} if backend == "iptables" and flavour else {}
        with netns.throwaway(f"nfp-validate-{backend[:3]}") as ns:
            results.extend(APPLY[backend](state, ns, **extra))
    return results

"""Test-only helpers for the iptables backend on a Kernel: a one-family proxier, and a dump
normaliser under which a real kernel's iptables-save and the in-memory kernel's agree."""

from __future__ import annotations

import dataclasses

from nfproxy.analysis import iptables_save
from nfproxy.analysis.ir import Match, Statistic
from nfproxy.backends.iptables.backend import IptablesBackend
from nfproxy.backends.iptables.plan import IptablesPlan
from nfproxy.core.changes import diff
from nfproxy.core.model import ClusterState, IPFamily
from nfproxy.kernel.base import Kernel
from nfproxy.kernel.memory.iptables import MemoryIptablesKernel
from nfproxy.kernel.process import KernelError


class OneFamily:
    """What the generic proxier does for one family: plan, apply, believe; forget on failure.

    Full when asked, first, after a failure or a node change; `found` is read before each full
    plan, so leftovers are removed.
    """

    def __init__(self, kernel: Kernel, family: IPFamily = IPFamily.V4) -> None:
        self.kernel = kernel
        self.family = family
        self.backend = IptablesBackend()
        self.last: ClusterState | None = None
        self.needs_full = True

    def sync(self, state: ClusterState, *, full: bool = False) -> IptablesPlan | None:
        changes = diff(self.last, state)
        full = full or self.needs_full or changes.node
        found = self.kernel.owned() if full else None
        plan = self.backend.plan(state, changes, self.family, full=full, found=found)
        if plan is not None:
            try:
                self.kernel.apply(plan.payload)
            except KernelError:
                self.backend.forget()
                self.needs_full = True
                raise
            self.backend.accepted(plan)
        self.last = state
        self.needs_full = False
        return plan


def fresh_dump(state: ClusterState, family: IPFamily = IPFamily.V4) -> str:
    """The in-memory kernel after one full sync of `state` from nothing."""
    kernel = MemoryIptablesKernel(family)
    OneFamily(kernel, family).sync(state)
    return kernel.dump()


def meaning(dump: str, family: IPFamily) -> dict[str, list[tuple]]:
    """Each chain's rules as the analysis IR reads them, spelling aside: matches as a set (their
    order in a rule is the tool's printing order), probabilities as the kernel's 31-bit value."""
    out: dict[str, list[tuple]] = {}
    for table in iptables_save.parse(dump, family).tables:
        for chain in table.chains.values():
            rules = []
            for rule in chain.rules:
                statements = [
                    dataclasses.replace(s, probability=round(float(s.probability) * 2**31))
                    if isinstance(s, Statistic)
                    else s
                    for s in rule.statements
                ]
                matches = tuple(sorted(repr(s) for s in statements if isinstance(s, Match)))
                rest = tuple(s for s in statements if not isinstance(s, Match))
                rules.append((matches, rest, rule.comment))
            out[f"{table.name}/{chain.name}"] = rules
    return out

"""iptables-restore / iptables-save, legacy or nft flavour, in a chosen namespace.

Writes go through `iptables-restore --noflush -w`: one atomic restore per table set, holding
the xtables lock, leaving every chain nfproxy does not own untouched.
"""

from __future__ import annotations

import enum
import shlex

from nfproxy.kernel.process import KernelError, find_tool, run
from nfproxy.core.model import IPFamily
from nfproxy.core.owned import Owned


class Flavour(enum.Enum):
    LEGACY = "legacy"
    NFT = "nft"


def _rule_count(flavour: Flavour, netns: str | None) -> int:
    try:
        text = run([f"iptables-{flavour.value}-save"], netns=netns)
    except KernelError:
        return -1
    return sum(1 for line in text.splitlines() if line.startswith("-A "))


_detected: dict[str | None, Flavour] = {}


def detect_flavour(netns: str | None = None) -> Flavour:
    """`_detect`, once per namespace: once nfproxy has written rules, they decide anyway."""
    found = _detected.get(netns)
    if found is None:
        found = _detected[netns] = _detect(netns)
    return found


def _detect(netns: str | None) -> Flavour:
    """Which iptables holds the host's rules, as kube-proxy's iptables-wrapper decides.

    In a container the image's `iptables --version` says nothing about the host, so the wrapper
    counts rules: kubelet and the CNI have written some in whichever flavour the host uses.
    With no rules in either (a fresh namespace), the plain `iptables` command decides.
    """
    legacy, nft = _rule_count(Flavour.LEGACY, netns), _rule_count(Flavour.NFT, netns)
    if legacy != nft and max(legacy, nft) > 0:
        return Flavour.LEGACY if legacy > nft else Flavour.NFT
    try:
        version = run(["iptables", "--version"])
    except KernelError:
        return Flavour.NFT
    return Flavour.LEGACY if "legacy" in version else Flavour.NFT


class IptablesRunner:
    def __init__(
        self, family: IPFamily, netns: str | None = None, flavour: Flavour | None = None
    ) -> None:
        self.family = family
        self.netns = netns
        self.flavour = flavour or detect_flavour(netns)
        stem = "iptables" if family is IPFamily.V4 else "ip6tables"
        self.restore_cmd = f"{stem}-{self.flavour.value}-restore"
        self.save_cmd = f"{stem}-{self.flavour.value}-save"
        self.cmd = f"{stem}-{self.flavour.value}"
        find_tool(self.restore_cmd)

    def restore(self, payload: str, *, noflush: bool = True) -> None:
        argv = [self.restore_cmd, "-w", "5"]
        if noflush:
            argv.append("--noflush")
        run(argv, netns=self.netns, stdin=payload)

    def save(self, table: str | None = None) -> str:
        argv = [self.save_cmd] + (["-t", table] if table else [])
        return run(argv, netns=self.netns)

    def chains(self, table: str | None = None) -> dict[str, list[str]]:
        """Chain names per table (one table, or all), from `iptables-save`'s declarations."""
        out: dict[str, list[str]] = {}
        current = ""
        for line in self.save(table).splitlines():
            if line.startswith("*"):
                current = line[1:]
                out[current] = []
            elif line.startswith(":") and current:
                out[current].append(line[1:].split(" ", 1)[0])
        return out

    def ensure_rule(self, table: str, chain: str, spec: list[str]) -> bool:
        """Insert `spec` at the top of a built-in chain unless an identical rule is there.

        The jumps from built-in chains are shared with every other user of the host's
        firewall, so they are never written by a restore (which would duplicate or reorder
        them) but checked and inserted one by one, as kube-proxy's EnsureRule does. True when
        the rule had to be inserted.
        """
        base = [self.cmd, "-w", "5", "-t", table]
        try:
            run([*base, "-C", chain, *spec], netns=self.netns)
            return False
        except KernelError:
            run([*base, "-I", chain, "1", *spec], netns=self.netns)
            return True

    def delete_rule(self, table: str, chain: str, spec: list[str]) -> bool:
        """Delete every copy of `spec` from `chain`; True when at least one was there."""
        base = [self.cmd, "-w", "5", "-t", table]
        deleted = False
        while True:
            try:
                run([*base, "-D", chain, *spec], netns=self.netns)
                deleted = True
            except KernelError:
                return deleted


class IptablesKernel:
    """The iptables Kernel (kernel/base.py) of one family in one namespace.

    Applies a restore payload: anything with `text` (an `iptables-restore --noflush` input, one
    atomic restore) and `jumps` (rules in built-in chains, with `table`, `chain` and `spec`,
    ensured one by one after the restore).
    """

    def __init__(self, family: IPFamily, *, netns: str | None = None, flavour: Flavour | None = None, **_: object) -> None:
        self.runner = IptablesRunner(family, netns, flavour)
        self.last: object = None

    def owned(self) -> Owned:
        chains = self.runner.chains()
        return Owned(frozenset(chains.get("nat", ())) | frozenset(chains.get("filter", ())))

    def apply(self, payload: object) -> None:
        text = getattr(payload, "text", None)
        if not isinstance(text, str):
            raise TypeError(f"an iptables kernel applies restore payloads, not {type(payload).__name__}")
        self.last = payload
        self.runner.restore(text)
        for jump in getattr(payload, "jumps", ()):
            self.runner.ensure_rule(jump.table, jump.chain, shlex.split(jump.spec))

    def dump(self) -> str:
        return self.runner.save("nat") + self.runner.save("filter")

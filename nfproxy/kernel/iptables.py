"""iptables-restore / iptables-save, legacy or nft flavour, in a chosen namespace.

Writes go through `iptables-restore --noflush -w`: one atomic restore per table set, holding
the xtables lock, leaving every chain nfproxy does not own untouched.
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import os
import shlex
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol

from nfproxy.core.model import IPFamily
from nfproxy.core.owned import Owned
from nfproxy.kernel.lock import LOCK_DIR
from nfproxy.kernel.nfacct import Nfacct
from nfproxy.kernel.process import KernelError, feed, find_tool, lines, run, slices

# The tables an iptables backend writes, and their built-in chains (never owned by anybody).
TABLES = ("filter", "nat")
BUILTIN_CHAINS = {
    "filter": ("INPUT", "FORWARD", "OUTPUT"),
    "nat": ("PREROUTING", "INPUT", "OUTPUT", "POSTROUTING"),
}


JUMP_LOCK = os.path.join(LOCK_DIR, "jumps.lock")


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


_NFACCT = "--nfacct-name"


def _nfacct_names(payload: str) -> list[str]:
    """The counters a payload's rules name. str.find, not a regex over the whole text: a large
    cluster's payload is tens of megabytes and names a counter once."""
    names: set[str] = set()
    pos = payload.find(_NFACCT)
    while pos >= 0:
        rest = payload[pos + len(_NFACCT) : pos + len(_NFACCT) + 64].split(None, 1)
        if rest:
            names.add(rest[0])
        pos = payload.find(_NFACCT, pos + 1)
    return sorted(names)


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

    def restore(self, payload: str | Callable[[], Iterable[str]], *, noflush: bool = True) -> None:
        """Restore `payload` (a text, or a function giving it in pieces of whole lines, read
        twice), creating first the nfacct counters its rules name (a rule naming a missing
        counter fails the whole restore). Without `noflush` the tables it names are replaced
        whole (the lab's feature probes in a fresh namespace). Pieces are streamed to the tool:
        the text is never held whole."""
        pieces = (lambda: (payload,)) if isinstance(payload, str) else payload
        names = sorted({name for piece in pieces() for name in _nfacct_names(piece)})
        if names:
            counters = Nfacct(self.netns)
            for name in names:
                counters.ensure(name)
        argv = [self.restore_cmd, "-w", "5"] + (["--noflush"] if noflush else [])
        feed(argv, (part for piece in pieces() for part in slices(piece)), netns=self.netns)

    def save(self, table: str | None = None, *, counters: bool = False) -> str:
        """`iptables-save` (`counters`: with `-c`, each rule's [packets:bytes] before it)."""
        argv = [self.save_cmd] + (["-c"] if counters else []) + (["-t", table] if table else [])
        return run(argv, netns=self.netns)

    def save_lines(self, table: str | None = None) -> Iterator[str]:
        """`iptables-save`, line by line as it writes them (see `process.lines`)."""
        return lines([self.save_cmd] + (["-t", table] if table else []), netns=self.netns)

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

        The built-in chains are shared with every other user of the host's firewall, so a
        jump that may be there already (its chain reaches our chain somehow) is checked and
        inserted on its own, as kube-proxy's EnsureRule does; one that cannot be goes in with
        the restore (`IptablesKernel.apply`), as the same `-I CHAIN 1`. Check and
        insert are two commands: two appliers racing both find the rule missing and both
        insert it (issue J.4). So they run under a lock of ours (JUMP_LOCK): two nfproxy
        appliers, in one namespace or not, never interleave them. (No listing after an insert to
        undo a writer outside the lock: it would add a command per jump to every first sync.)
        True when the rule had to be inserted.
        """
        base = [self.cmd, "-w", "5", "-t", table]
        with _jump_lock():
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


@contextlib.contextmanager
def _jump_lock() -> Iterator[None]:
    """An flock serialising nfproxy's built-in-chain jump checks and inserts. One file for the
    host, as the xtables lock is (a file per namespace would pile up in /run with throwaway
    namespaces; the jumps take milliseconds). Not the xtables lock itself: the iptables commands
    run inside take that one. Without a writable lock directory (where the owner lock refuses
    to run a daemon anyway) the jumps go unlocked."""
    try:
        os.makedirs(LOCK_DIR, mode=0o755, exist_ok=True)
        fd = os.open(JUMP_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the flock


# --------------------------------------------------------------------------------------------
# The Kernel of the iptables backend


class JumpLike(Protocol):
    """A rule in a built-in chain (the backend's JumpRule), read by shape: the kernel may not
    import backends."""

    table: str
    chain: str
    spec: str


class RestorePayloadLike(Protocol):
    """The backend's RestorePayload, read by shape."""

    @property
    def text(self) -> str: ...

    @property
    def jumps(self) -> Sequence[JumpLike]: ...

    def pieces(self, inserts: Mapping[str, Sequence[str]] | None = None) -> Iterator[str]: ...


class IptablesKernel:
    """One family's iptables in one namespace, as the proxier's Kernel.

    `apply` is one `iptables-restore --noflush` (atomic for both tables) followed by
    kube-proxy's check-then-insert of each built-in-chain jump. The jumps are not part of the
    atomic restore: were one insert to fail, the restore stays and the next (full) plan
    ensures the jumps again, as kube-proxy's next sync would.
    """

    def __init__(
        self, family: IPFamily, netns: str | None = None, flavour: Flavour | None = None
    ) -> None:
        self.runner = IptablesRunner(family, netns, flavour)
        self.family = family
        self._listed: set[tuple[str, str]] | None = None  # built-in-chain rules owned() saw
        self._info: Any = None  # what generation() asks: an ElementReader or an XtablesInfo

    def generation(self) -> Hashable:
        """iptables-nft: nf_tables' generation; legacy: each table's entry count, size and hook
        offsets. Never a listing: `iptables-save` of a large nat table costs a second."""
        if self.runner.flavour is Flavour.NFT:
            if self._info is None:
                from nfproxy.kernel.nft_elements import ElementReader

                self._info = ElementReader(self.runner.netns)
            return self._info.generation()
        if self._info is None:
            from nfproxy.kernel.xtables_info import XtablesInfo

            self._info = XtablesInfo(self.family, self.runner.netns)
        return tuple(self._info.table(t) for t in TABLES)

    def owned(self) -> Owned:
        """Every non-built-in chain of nat and filter: the backend picks the ones it owns.

        The same `iptables-save` also tells which built-in-chain rules exist, so the `apply`
        that follows (a full sync's) checks only the jumps the listing did not show: none on
        a steady node's resync, instead of one `iptables -C` process per jump and family.
        """
        names: set[str] = set()
        listed: set[tuple[str, str]] = set()
        table = ""
        for line in self.runner.save().splitlines():
            if line.startswith("*"):
                table = line[1:]
            elif table not in BUILTIN_CHAINS:
                continue
            elif line.startswith(":"):
                chain = line[1:].split(" ", 1)[0]
                if chain not in BUILTIN_CHAINS[table]:
                    names.add(chain)
            elif line.startswith("-A ") and line.split(" ", 2)[1] in BUILTIN_CHAINS[table]:
                listed.add((table, line))
        self._listed = listed
        return Owned(frozenset(names), frozenset())

    def apply(self, payload: RestorePayloadLike) -> None:
        """Partial plans carry no jumps: only a full sync (after `owned`) ensures them, from
        the listing `owned` just made: a jump whose exact line it showed is there. A jump to a
        chain no rule of that built-in chain reaches is certainly missing: it is inserted at the
        top by the restore itself, in the same commit. (Each `iptables -C` or `-I` loads the
        whole table: ~300 MiB and a second per command at 10 000 x 10, and a first sync would run
        twelve.) Any other is checked (another spelling of the same rule is not
        duplicated), then inserted, as kube-proxy's EnsureRule does."""
        listed, self._listed = self._listed or set(), None
        inserts: dict[str, list[str]] = {}
        checks = []
        for jump in payload.jumps:
            line = f"-A {jump.chain} {jump.spec}"
            if (jump.table, line) in listed:
                continue
            if _reaches(listed, jump):
                checks.append(jump)
            else:
                inserts.setdefault(jump.table, []).append(f"-I {jump.chain} 1 {jump.spec}")
        with _jump_lock() if inserts else contextlib.nullcontext():
            self.runner.restore(lambda: payload.pieces(inserts))
        for jump in checks:
            self.runner.ensure_rule(jump.table, jump.chain, shlex.split(jump.spec))

    def dump(self) -> str:
        return canonical_save(self.runner.save("filter") + self.runner.save("nat"))

    def close(self) -> None:
        """Every call runs a tool; only generation()'s socket is held open."""
        info, self._info = self._info, None
        if info is not None:
            info.close()

    def counted_dump(self) -> str:
        """The nat table with every rule's packet and byte counters (`iptables-save -c`): the
        KUBE-SEP DNAT rules' packets are the connections each endpoint got
        (analysis/counters.py)."""
        return self.runner.save("nat", counters=True)


def _reaches(listed: set[tuple[str, str]], jump: JumpLike) -> bool:
    """Whether some listed rule of the jump's built-in chain jumps to the jump's target."""
    target = jump.spec.split()[-1]
    head = f"-A {jump.chain} "
    for table, line in listed:
        if table == jump.table and line.startswith(head):
            words = line.split()
            if any(words[i] in ("-j", "--jump") and words[i + 1] == target for i in range(len(words) - 1)):
                return True
    return False


def canonical_save(text: str) -> str:
    """`iptables-save` text of filter and nat in one order, whatever wrote it.

    Comments and counters are dropped; each table is printed even when the kernel does not have
    it yet (as its empty built-in chains), built-in chains first, then the other chains by
    name, each chain's rules in kernel order. Rules keep their spelling: iptables-save's and
    iptables-restore's differ (option order, `/32`), so comparing a dump with restore input
    goes through `analysis.iptables_save.parse`.
    """
    policies: dict[str, dict[str, str]] = {t: {c: "ACCEPT" for c in BUILTIN_CHAINS[t]} for t in TABLES}
    rules: dict[str, dict[str, list[str]]] = {t: {} for t in TABLES}
    table = ""
    for line in text.splitlines():
        if line.startswith("*"):
            table = line[1:].strip()
        elif table not in policies or not line or line.startswith("#") or line == "COMMIT":
            continue
        elif line.startswith(":"):
            name, policy = line[1:].split()[:2]
            policies[table][name] = policy
        elif line.startswith("-A "):
            chain = line.split(" ", 2)[1]
            rules[table].setdefault(chain, []).append(line)
    out: list[str] = []
    for t in TABLES:
        builtins = sorted(c for c in policies[t] if policies[t][c] != "-")
        chains = builtins + sorted(c for c in policies[t] if policies[t][c] == "-")
        out.append(f"*{t}")
        out.extend(f":{c} {policies[t][c]} [0:0]" for c in chains)
        for c in chains:
            out.extend(rules[t].get(c, ()))
        out.append("COMMIT")
    return "\n".join(out) + "\n"

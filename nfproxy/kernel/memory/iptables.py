"""An in-memory iptables (filter and nat of one family) with the kernel's existence rules.

What it refuses is what iptables-restore --noflush refuses, checked against iptables 1.8.9, both
legacy and nft flavours (tests/test_iptables_kernel.py keeps the two in step):

- `:CHAIN - [0:0]` creates a chain or flushes an existing one; `-N` fails on an existing chain;
- `-A`/`-I`/`-D`/`-F` need the chain to exist *at that line*, `-D` an identical rule;
- every `-j`/`-g` target must be a chain that exists at that line, or a target extension
  (NAT targets only in nat, REJECT not in nat);
- `-X` needs a user chain that is empty (in practice: declared, i.e. flushed, earlier in the same
  restore) and that no rule of the table still jumps to;
- each table's COMMIT is all or nothing; a failing line fails the restore, and the table it is
  in keeps what it had. Tables committed earlier in the same restore stay committed, as in the
  real kernel (both flavours commit per table).

Rules keep the spelling they were written in; `dump` therefore matches a real kernel's dump
only after both are read by `analysis.iptables_save.parse`.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from nfproxy.core.model import IPFamily
from nfproxy.kernel.base import Owned
from nfproxy.kernel.iptables import BUILTIN_CHAINS, TABLES, RestorePayloadLike, canonical_save
from nfproxy.kernel.process import KernelError

_STANDARD_TARGETS = frozenset({"ACCEPT", "DROP", "RETURN", "QUEUE"})
_NAT_TARGETS = frozenset({"DNAT", "SNAT", "MASQUERADE", "REDIRECT", "NETMAP"})
_OTHER_TARGETS = frozenset(
    {"REJECT", "MARK", "CONNMARK", "LOG", "NFLOG", "NOTRACK", "CT", "TRACE", "TCPMSS", "AUDIT",
     "CLASSIFY", "DSCP", "TOS", "TTL", "HL", "NFQUEUE", "SET", "CHECKSUM", "TEE"}
)
_TOKEN = re.compile(r'"((?:[^"\\]|\\.)*)"|([^\s"]+)')
_UNESCAPE = re.compile(r"\\(.)")
_NEEDS_QUOTES = re.compile(r'[\s"]')


@dataclass(slots=True)
class _Table:
    """One table: its chains in creation order, each a list of (rule spec, jump target)."""

    name: str
    chains: dict[str, list[tuple[str, str]]] = field(default_factory=dict)
    policies: dict[str, str] = field(default_factory=dict)
    refs: Counter[str] = field(default_factory=Counter)  # rules jumping to each target

    @classmethod
    def fresh(cls, name: str) -> _Table:
        builtins = BUILTIN_CHAINS[name]
        return cls(name, {c: [] for c in builtins}, {c: "ACCEPT" for c in builtins})

    def copy(self) -> _Table:
        chains = {c: list(r) for c, r in self.chains.items()}
        return _Table(self.name, chains, dict(self.policies), Counter(self.refs))

    def add(self, chain: str, position: int | None, tokens: list[str]) -> None:
        rule = (_spec(tokens), _target(self, tokens))
        rules = self.chains[chain]
        if position is None:
            rules.append(rule)
        else:
            rules.insert(position, rule)
        self.refs[rule[1]] += 1

    def flush(self, chain: str) -> None:
        for _, target in self.chains[chain]:
            self.refs[target] -= 1
        self.chains[chain] = []


class MemoryIptablesKernel:
    """The Kernel of the iptables backend, without a kernel. `last` is the last payload applied
    (accepted or not), so that a test can assert how small a sync was."""

    def __init__(self, family: IPFamily = IPFamily.V4) -> None:
        self.family = family
        self.tables = {t: _Table.fresh(t) for t in TABLES}
        self.last: RestorePayloadLike | None = None
        self.applied = 0  # payloads accepted
        self.commits = 0  # tables committed and rules inserted, by anyone: the generation

    # -- the Kernel interface

    def owned(self) -> Owned:
        names = {c for t in self.tables.values() for c in t.chains if c not in t.policies}
        return Owned(frozenset(names), frozenset())

    def apply(self, payload: RestorePayloadLike) -> None:
        self.last = payload
        self.restore(payload.text)
        for jump in payload.jumps:
            self.ensure_rule(jump.table, jump.chain, jump.spec)
        self.applied += 1

    def generation(self) -> int:
        """Every commit moves it, as every write moves a real table's entry count or size."""
        return self.commits

    def dump(self) -> str:
        return canonical_save(self.save())

    def close(self) -> None:
        """Nothing held open."""

    # -- what the real tools do

    def save(self) -> str:
        """`iptables-save` of filter and nat (rules in the spelling they were written in)."""
        out: list[str] = []
        for table in self.tables.values():
            out.append(f"*{table.name}")
            out.extend(f":{c} {table.policies.get(c, '-')} [0:0]" for c in table.chains)
            for chain, rules in table.chains.items():
                out.extend(f"-A {chain} {spec}" for spec, _ in rules)
            out.append("COMMIT")
        return "\n".join(out) + "\n"

    def restore(self, text: str) -> None:
        """`iptables-restore --noflush`; raises KernelError naming the line that failed."""
        work: _Table | None = None
        for number, raw in enumerate(text.splitlines(), 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            try:
                work = self._line(work, line)
            except KernelError as exc:
                raise KernelError(f"iptables-restore: line {number} failed: {exc}") from None
        if work is not None:
            raise KernelError(f"iptables-restore: table {work.name} has no COMMIT")

    def ensure_rule(self, table: str, chain: str, spec: str) -> bool:
        """`iptables -C` then `-I chain 1`: True when the rule had to be inserted."""
        t = self.tables[table]
        if chain not in t.chains:
            raise KernelError(f"iptables: chain {chain} does not exist in {table}")
        if any(s == spec for s, _ in t.chains[chain]):
            return False
        work = t.copy()
        work.add(chain, 0, _split(spec))
        self.tables[table] = work
        self.commits += 1
        return True

    # -- one restore line

    def _line(self, work: _Table | None, line: str) -> _Table | None:
        if line.startswith("*"):
            name = line[1:].strip()
            if work is not None:
                raise KernelError(f"table {name} starts before {work.name} is committed")
            if name not in self.tables:
                raise KernelError(f"table {name!r} is not modelled (only {', '.join(TABLES)})")
            return self.tables[name].copy()
        if work is None:
            raise KernelError(f"{line!r} outside a *table ... COMMIT block")
        if line == "COMMIT":
            self.tables[work.name] = work
            self.commits += 1
            return None
        if line.startswith(":"):
            _declare(work, line[1:].split())
            return work
        _command(work, _split(line))
        return work


def _declare(work: _Table, parts: Sequence[str]) -> None:
    if len(parts) < 2:
        raise KernelError(f"bad chain declaration {' '.join(parts)!r}")
    name, policy = parts[0], parts[1]
    if name not in work.policies and policy != "-":
        raise KernelError(f"a user chain has no policy: {name} {policy}")
    if name in work.chains:
        work.flush(name)  # declaring an existing chain flushes it
    else:
        work.chains[name] = []
    if policy != "-":
        work.policies[name] = policy


def _command(work: _Table, tokens: list[str]) -> None:
    op, args = tokens[0], tokens[1:]
    if not args:
        raise KernelError(f"{op} needs a chain")
    chain = args[0]
    if op in ("-N", "--new-chain"):
        if chain in work.chains:
            raise KernelError(f"chain {chain} already exists")
        work.chains[chain] = []
        return
    if chain not in work.chains:
        raise KernelError(f"no chain {chain} in {work.name}")
    rules = work.chains[chain]
    if op in ("-F", "--flush"):
        work.flush(chain)
    elif op in ("-X", "--delete-chain"):
        _delete_chain(work, chain)
    elif op in ("-A", "--append"):
        work.add(chain, None, args[1:])
    elif op in ("-I", "--insert"):
        rest = args[1:]
        position = int(rest.pop(0)) - 1 if rest and rest[0].isdigit() else 0
        if not 0 <= position <= len(rules):
            raise KernelError(f"index of insertion too big in {chain}")
        work.add(chain, position, rest)
    elif op in ("-D", "--delete"):
        spec = _spec(args[1:])
        for i, (s, target) in enumerate(rules):
            if s == spec:
                del rules[i]
                work.refs[target] -= 1
                return
        raise KernelError(f"no rule {spec!r} in {chain} to delete")
    else:
        raise KernelError(f"unknown command {op!r}")


def _delete_chain(work: _Table, chain: str) -> None:
    if chain in work.policies:
        raise KernelError(f"cannot delete built-in chain {chain}")
    if work.chains[chain]:
        raise KernelError(f"chain {chain} is not empty")
    if work.refs[chain] > 0:
        raise KernelError(f"chain {chain} is still referenced ({work.refs[chain]} rules jump to it)")
    del work.chains[chain]


def _spec(tokens: list[str]) -> str:
    """The rule as iptables-restore would re-read it: tokens joined, quoted where needed."""
    if not tokens:
        raise KernelError("empty rule")
    plain = " ".join(tokens)
    if '"' not in plain and len(plain.split()) == len(tokens):
        return plain  # no token holds a blank or a quote
    return " ".join(_quote(t) for t in tokens)


def _quote(token: str) -> str:
    return f'"{token}"' if not token or _NEEDS_QUOTES.search(token) else token


def _target(work: _Table, tokens: list[str]) -> str:
    """The rule's -j/-g target, checked: a chain of this table or a target extension."""
    target = verb = ""
    for i, tok in enumerate(tokens[:-1]):
        if tok in ("-j", "--jump", "-g", "--goto"):
            verb, target = tok, tokens[i + 1]
    if not target:
        return ""
    if target in work.chains:
        if verb in ("-g", "--goto") and target in work.policies:
            raise KernelError(f"cannot goto the built-in chain {target}")
        return target
    if target in _STANDARD_TARGETS or target in _OTHER_TARGETS:
        if target == "REJECT" and work.name == "nat":
            raise KernelError("REJECT is not valid in the nat table")
        return target
    if target in _NAT_TARGETS and work.name == "nat":
        return target
    raise KernelError(f"Couldn't load target `{target}': no such chain or target in {work.name}")


def _split(line: str) -> list[str]:
    """Whitespace-separated tokens; a double-quoted token may hold blanks (and `\\"`)."""
    if '"' not in line:
        return line.split()
    tokens = []
    for m in _TOKEN.finditer(line):
        quoted = m.group(1)
        tokens.append(_UNESCAPE.sub(r"\1", quoted) if quoted is not None else m.group(2))
    if _TOKEN.sub("", line).strip():  # a `"` no token took
        raise KernelError(f"unbalanced quotes in {line!r}")
    return tokens

"""Plans for the iptables kernel: which chains one `iptables-restore --noflush` must write.

A full plan writes every chain and removes the service chains the kernel holds but the state no
longer has (leftovers of a crash, a failed sync, kube-proxy). A partial plan follows kube-proxy:
the top-level chains are always rewritten whole (a restore that declares a chain flushes it),
the service chains only of the service ports in `Changes`, and the chains those ports no longer
have are deleted in the same restore. Unlike kube-proxy, only the changed ports are rendered:
their endpoint chains are most of the work of a sync.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace

from nfproxy.backends.base import Owned, Plan
from nfproxy.backends.iptables.render import (
    SERVICE_CHAIN_PREFIXES,
    IptablesRules,
    JumpRule,
    ServiceChains,
    render,
)
from nfproxy.core.model import ClusterState, IPFamily, ServicePortKey


@dataclass(frozen=True, slots=True)
class RestorePayload:
    """What the iptables kernel applies: one restore (both tables, `--noflush`), then the rules
    in built-in chains to ensure (shared with the host's other users: never flushed).

    Kept compressed, table by table, in chunks of whole lines: a full sync's text is 32 MB at
    10 000 x 10, which the daemon would otherwise hold for the whole restore beside the
    restore's own 212 MiB (docs/benchmarks.md); zlib at level 1 keeps it in a few MB, and
    `pieces` gives it back a chunk at a time as the restore reads it."""

    tables: tuple[tuple[str, tuple[bytes, ...]], ...] = ()  # (table, its lines' chunks, compressed)
    jumps: tuple[JumpRule, ...] = ()
    lines: int = 0  # of the text, `*table` and `COMMIT` included

    @classmethod
    def of(cls, text_lines: Iterable[str], jumps: tuple[JumpRule, ...] = ()) -> RestorePayload:
        """The payload of restore-format lines (`*table`, its lines, `COMMIT`, per table)."""
        tables: list[tuple[str, tuple[bytes, ...]]] = []
        body: list[str] = []
        chunks: list[bytes] = []
        count = 0
        name = ""
        for line in text_lines:
            if not line:
                continue
            count += 1
            if line.startswith("*") and not name:
                name = line[1:]
            elif line == "COMMIT" and name:
                chunks.extend(_packed(body))
                tables.append((name, tuple(chunks)))
                name, body, chunks = "", [], []
            else:
                body.append(line)
                if len(body) == _CHUNK_LINES:
                    chunks.extend(_packed(body))
                    body = []
        if name:
            raise ValueError(f"restore text ends inside *{name}: no COMMIT")
        return cls(tuple(tables), jumps, count)

    def pieces(self, inserts: Mapping[str, Sequence[str]] | None = None) -> Iterator[str]:
        """The text, a chunk of whole lines at a time; `inserts` are lines for a table, written
        just before its COMMIT (a table the payload lacks gets a block of its own)."""
        extra = dict(inserts or {})
        for name, chunks in self.tables:
            yield f"*{name}\n"
            for chunk in chunks:
                yield zlib.decompress(chunk).decode()
            yield "".join(f"{line}\n" for line in extra.pop(name, ())) + "COMMIT\n"
        for name, lines in extra.items():
            if lines:
                yield f"*{name}\n" + "".join(f"{line}\n" for line in lines) + "COMMIT\n"

    @property
    def text(self) -> str:
        return "".join(self.pieces())


_CHUNK_LINES = 4096


def _packed(lines: list[str]) -> list[bytes]:
    return [zlib.compress(("\n".join(lines) + "\n").encode(), 1)] if lines else []


@dataclass(frozen=True, slots=True)
class HeldChains:
    """What a belief keeps of one service port's chains: their names (to delete the ones a change
    leaves behind), how many rules they hold (metrics) and a digest of those rules (to see
    whether a new render differs). Not the rules themselves: at 10 000 services x 10 endpoints
    their text is ~50 MiB that no sync reads again."""

    chains: tuple[str, ...]
    rules: int
    digest: bytes


def held(chains: ServiceChains) -> HeldChains:
    """BLAKE2b-128 over the chain names and rules: two renders that differ collide with
    probability 2^-128, so a changed port is never taken for an unchanged one."""
    text = "\0".join(chains.chains) + "\1" + "\n".join(chains.rules)
    digest = hashlib.blake2b(text.encode(), digest_size=16).digest()
    return HeldChains(tuple(chains.chains), len(chains.rules), digest)


@dataclass(frozen=True, slots=True)
class Belief:
    """What one family's kernel holds after an accepted plan: the top-level chains (`rules`,
    without service chains), and what is kept of the chains of every service port (needed to
    know which chains a change leaves behind)."""

    rules: IptablesRules
    services: Mapping[ServicePortKey, HeldChains]


@dataclass(frozen=True, slots=True, kw_only=True)
class IptablesPlan(Plan):
    belief: Belief | None  # None: nothing was written, the family is still untouched


def holds_nothing(state: ClusterState, family: IPFamily, found: Owned | None) -> bool:
    """True when a family needs no pass at all: the state has no service of it, and its kernel
    holds no KUBE chain (`found`; None when the proxier did not list it because the family is
    already synced, which for a family without belief means it was found empty before).

    A single-stack cluster on a dual-stack node thus costs one ip6tables listing per full sync
    rather than a restore and twelve jump checks; a family that ever held rules is still
    synced, so its chains are cleaned when its services go away.
    """
    if any(svc.family is family for svc in state.services.values()):
        return False
    return found is None or not any(c.startswith("KUBE-") for c in found.chains)


def full_plan(state: ClusterState, family: IPFamily, found: Owned | None) -> IptablesPlan:
    """Everything, plus the removal of the service chains in `found` the state does not have."""
    new = render(state, family)
    wanted = {c for group in new.service_chains.values() for c in group.chains}
    stale = sorted(
        c for c in (found.chains if found else ()) if c.startswith(SERVICE_CHAIN_PREFIXES) and c not in wanted
    )
    payload = RestorePayload.of(new.restore_lines(with_jumps=False, delete_chains=stale), new.jumps)
    services = {key: held(chains) for key, chains in new.service_chains.items()}
    return IptablesPlan(
        family=family, full=True, operations=payload.lines, payload=payload,
        belief=Belief(_top_level(new), services),
    )


def _top_level(rules: IptablesRules) -> IptablesRules:
    return replace(rules, service_chains={}) if rules.service_chains else rules


def partial_plan(
    state: ClusterState, keys: Collection[ServicePortKey], family: IPFamily, belief: Belief
) -> IptablesPlan | None:
    """The changed ports' chains and the top-level chains; None when the kernel already has it."""
    if not keys:
        return None
    new = render(state, family, only=keys)
    if new.large != belief.rules.large:
        # Endpoint comments come or go everywhere: every port's chains change.
        new = render(state, family)
        keys = set(new.service_chains) | set(belief.services)
    old = belief.services
    services = dict(old)
    changed: list[ServicePortKey] = []
    gone: set[str] = set()
    for key in keys:
        before, rendered = old.get(key), new.service_chains.get(key)
        after = held(rendered) if rendered is not None else None
        if before == after:
            continue
        if before is not None:
            gone.update(before.chains)
            del services[key]
        if after is not None:
            changed.append(key)
            services[key] = after
            gone.difference_update(after.chains)
    if not changed and not gone and new.nat == belief.rules.nat and new.filter == belief.rules.filter:
        return None
    order = {key: i for i, key in enumerate(new.service_chains)}
    changed.sort(key=order.__getitem__)
    payload = RestorePayload.of(new.restore_lines(with_jumps=False, services=changed, delete_chains=sorted(gone)))
    return IptablesPlan(
        family=family, full=False, operations=payload.lines, payload=payload,
        belief=Belief(_top_level(new), services),
    )

"""The proxier: keeps one namespace's kernel rules in step with the service model.

`Proxier.sync(state)` is one sync: it works out what changed since the last *successful* sync,
asks the backend to express just that to the kernel (a partial sync) or everything (a full
sync: the first one, after a failure, after the node changed, and periodically), applies it
as atomic transactions and only then remembers the new state. A failed apply therefore leaves
the kernel with the previous rules (the transaction was refused as a whole) and the proxier
with the previous state, and it forces the next sync to be full, as kube-proxy does.

`SyncLoop` is the imperative shell around it: it listens to a source, coalesces changes into
syncs no more often than `min_sync_period`, runs a full resync every `sync_period`, and retries
failures with exponential backoff.
"""

from __future__ import annotations

import contextlib
import logging
import shlex
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal, Protocol

from nfproxy.backends.iptables import render as iptables_backend
from nfproxy.backends.nft import render as nft_backend
from nfproxy.core.changes import Changes, diff
from nfproxy.kernel.iptables import Flavour, IptablesRunner
from nfproxy.kernel.nft import NftSession
from nfproxy.kernel.nft_netlink import NetlinkNft, Unsupported
from nfproxy.core.model import ClusterState, IPFamily
from nfproxy.daemon import logs

if TYPE_CHECKING:
    from nfproxy.sources import Source

log = logging.getLogger("nfproxy.proxier")

SyncKind = Literal["full", "partial", "noop"]
BACKENDS = ("iptables", "nft")


@dataclass(frozen=True, slots=True)
class FamilySync:
    """What one family's sync did: kube-proxy syncs each family on its own, and its metrics and
    sync lines are per family, so ours come from this and never from the whole sync."""

    kind: SyncKind
    operations: int
    seconds: float
    # Stale objects could not be deleted (the rest of the sync went through; retried next time).
    cleanup_failed: bool = False


@dataclass(frozen=True, slots=True)
class SyncResult:
    """One sync: its kind, the changes it wrote, kernel operations and duration.

    `changes` lets whatever runs after a sync (metrics, health checks, conntrack cleanup) work on
    the changed service ports only, instead of walking the whole state again. `families` holds
    each family's own part (a family the backend does not sync is absent).
    """

    kind: SyncKind
    changes: Changes
    operations: int
    seconds: float
    reason: str = ""
    families: Mapping[IPFamily, FamilySync] = field(default_factory=dict)

    @property
    def services_changed(self) -> int:
        return len(self.changes.services)

    @property
    def endpoints_changed(self) -> int:
        return len(self.changes.endpoints)

    def log_line(self) -> str:
        """The whole sync in one logfmt-clean line (`run --once` prints it)."""
        reason = f" reason={logs.quote(self.reason)}" if self.reason else ""
        return (
            f"kind={self.kind} servicesChanged={self.services_changed} "
            f"endpointsChanged={self.endpoints_changed} operations={self.operations} "
            f"elapsed={logs.go_duration(self.seconds)}{reason}"
        )

    def log(self, logger: logging.Logger, backend: str) -> None:
        """kube-proxy's sync line, at V(2), once per family, with that family's own figures."""
        mode = "nftables" if backend == "nft" else backend
        for family, part in sorted(self.families.items()):
            if part.kind == "noop":
                continue
            keys = self.changes.of(family)
            logs.info(
                logger, f"Syncing {mode} rules", level=2,
                ipFamily=f"IPv{family.value}", kind=part.kind,
                servicesChanged=sum(1 for k in self.changes.services if k in keys),
                endpointsChanged=sum(1 for k in self.changes.endpoints if k in keys),
                operations=part.operations, elapsed=logs.Duration(part.seconds),
                **({"reason": self.reason} if self.reason and part.kind == "full" else {}),
            )


@dataclass(frozen=True, slots=True)
class FailedSync:
    """Which family's kernel refused which kind of sync: attached to the exception a failed
    sync raises (as `failed_sync`), so metrics count the failure where it happened."""

    family: IPFamily
    partial: bool


@contextlib.contextmanager
def failing(family: IPFamily, *, partial: bool) -> Iterator[None]:
    try:
        yield
    except Exception as exc:
        if getattr(exc, "failed_sync", None) is None:
            with contextlib.suppress(AttributeError):
                exc.failed_sync = FailedSync(family, partial)  # type: ignore[attr-defined]
        raise


class BackendSync(Protocol):
    """What a backend's kernel side must do; `sync` returns (kind, kernel operations)."""

    name: str

    def sync(self, state: ClusterState, changes: Changes, full: bool) -> dict[IPFamily, FamilySync]: ...

    def forget(self) -> None:
        """Drop what is believed to be in the kernel: the next sync will be full."""

    def pending(self) -> bool:
        """True when work is left over from the last sync (stale objects to delete)."""

    def rule_counts(self) -> dict[IPFamily, dict[str, int]]: ...


# --------------------------------------------------------------------------------------------
# nftables


class NftSync:
    """Per family: the ruleset the kernel holds, and stale objects waiting to be deleted."""

    name = "nft"

    def __init__(self, netns: str | None, families: Sequence[IPFamily], *, fast: bool = True) -> None:
        self.session = NftSession(netns)
        # Partial syncs as nfnetlink batches (no libnftables cache dump: docs/nft-layouts.md);
        # None sends everything through libnftables.
        self.fast: NetlinkNft | None = NetlinkNft(netns) if fast else None
        self.families = tuple(families)
        self.applied: dict[IPFamily, nft_backend.NftRuleset] = {}
        self.stale: dict[IPFamily, tuple[tuple[str, ...], tuple[str, ...]]] = {}
        # Per family: chains, rules and affinity sets of all service ports, kept up to date by
        # partial syncs so that counting them for metrics never walks 10 000 services.
        self._owned: dict[IPFamily, tuple[int, int, int]] = {}

    def forget(self) -> None:
        self.applied.clear()
        self.stale.clear()
        self._owned.clear()

    def pending(self) -> bool:
        return any(chains or sets for chains, sets in self.stale.values())

    def sync(self, state: ClusterState, changes: Changes, full: bool) -> dict[IPFamily, FamilySync]:
        done: dict[IPFamily, FamilySync] = {}
        for family in self.families:
            start = time.perf_counter()
            previous = self.applied.get(family)
            if not full and previous is not None:
                try:
                    with failing(family, partial=True):
                        n, cleanup_failed = self._partial(family, previous, state, changes)
                    seconds = time.perf_counter() - start
                    done[family] = FamilySync("partial" if n else "noop", n, seconds, cleanup_failed)
                    continue
                except nft_backend.NeedsFullSync as exc:
                    logs.info(log, "Partial sync impossible: full sync", ipFamily=f"IPv{family.value}", reason=str(exc))
            with failing(family, partial=False):
                n = self._full(family, state)
            done[family] = FamilySync("full", n, time.perf_counter() - start)
        return done

    def _partial(
        self, family: IPFamily, previous: nft_backend.NftRuleset, state: ClusterState, changes: Changes
    ) -> tuple[int, bool]:
        """Kernel operations, and whether deleting stale objects failed."""
        keys = changes.of(family)
        stale_chains, stale_sets = self.stale.get(family, ((), ()))
        if not keys and not stale_chains and not stale_sets:
            return 0, False
        new = nft_backend.render_update(previous, state, keys)
        d = nft_backend.delta(previous, new, keys, delete_chains=stale_chains, delete_sets=stale_sets)
        cleanup_failed = False
        if d.commands:
            _dump_rules("nftables", family, d.script)
            try:
                self._apply_delta(new, d)
            except Exception as exc:
                if not (stale_chains or stale_sets):
                    raise
                # As kube-proxy: a stale object that cannot go (someone else jumps to it) is a
                # cleanup failure, not a failed sync. The changes go through without the
                # deletions, which wait for the next sync.
                logs.error(log, "Failed to delete stale nftables objects", exc,
                           ipFamily=f"IPv{family.value}", chains=len(stale_chains), sets=len(stale_sets))
                d = nft_backend.delta(previous, new, keys)
                if d.commands:
                    self._apply_delta(new, d)
                live_chains = {c for svc in new.services.values() for c in svc.chains}
                live_sets = {a for svc in new.services.values() for a in svc.affinity_sets}
                d = replace(
                    d,
                    stale_chains=tuple(sorted({*stale_chains, *d.stale_chains} - live_chains)),
                    stale_sets=tuple(sorted({*stale_sets, *d.stale_sets} - live_sets - set(new.shard_users))),
                )
                cleanup_failed = True
        self.applied[family] = new
        self.stale[family] = (d.stale_chains, d.stale_sets)
        chains, rules, sets = self._owned[family]
        for key in keys:
            if (old := previous.services.get(key)) is not None:
                c, r, a = _objects_of(old)
                chains, rules, sets = chains - c, rules - r, sets - a
            if (cur := new.services.get(key)) is not None:
                c, r, a = _objects_of(cur)
                chains, rules, sets = chains + c, rules + r, sets + a
        self._owned[family] = (chains, rules, sets)
        return len(d.commands), cleanup_failed

    def _apply_delta(self, new: nft_backend.NftRuleset, d: nft_backend.NftDelta) -> None:
        if self.fast is not None:
            try:
                # The script's lines, not d.commands: one text is what either path sends.
                self.fast.apply(new.nft_family, new.table, d.script().splitlines())
                return
            except Unsupported as exc:
                logs.info(log, "Partial sync through libnftables", level=4, reason=str(exc))
        self.session.apply(d.script())

    def _full(self, family: IPFamily, state: ClusterState) -> int:
        new = nft_backend.render(state, family)
        script = new.script()
        # Objects of services that vanished while nobody was watching (a restart, a failed
        # sync, someone else's edits): emptied now, deleted by the next sync, like the
        # stale chains of a partial sync.
        stray_chains: list[str] = []
        stray_sets: list[str] = []
        found = self.session.object_names(new.nft_family, new.table)
        if found is not None:
            chains, sets = found
            wanted_chains = {name for svc in new.services.values() for name in svc.chains}
            wanted_sets = {name for svc in new.services.values() for name in svc.affinity_sets}
            stray_chains = sorted(c for c in chains if "/" in c and c not in wanted_chains)
            wanted_sets |= set(new.shard_users)
            stray_sets = sorted(
                s
                for s in sets
                if s.startswith((nft_backend.AFFINITY_PREFIX, nft_backend.SHARD_PREFIX)) and s not in wanted_sets
            )
        t = f"{new.nft_family} {new.table}"
        if stray_chains:
            script += "".join(f"flush chain {t} {name}\n" for name in stray_chains)
        _dump_rules("nftables", family, lambda: script)
        self.session.apply(script)
        if self.fast is not None:
            self.fast.forget()  # set declarations may have changed with the table
        self.applied[family] = new
        self.stale[family] = (tuple(stray_chains), tuple(stray_sets))
        owned = [_objects_of(svc) for svc in new.services.values()]
        self._owned[family] = (sum(o[0] for o in owned), sum(o[1] for o in owned), sum(o[2] for o in owned))
        return script.count("\n")

    def rule_counts(self) -> dict[IPFamily, dict[str, int]]:
        """What the kernel holds after the last sync, per family (metrics' nft object kinds)."""
        counts: dict[IPFamily, dict[str, int]] = {}
        for family, rs in self.applied.items():
            chains, rules, affinity_sets = self._owned[family]
            counts[family] = {
                "chains": len(rs.chains) + chains,
                "rules": sum(len(r) for r in rs.chains.values()) + rules,
                "sets": sum(1 for d in rs.sets.values() if d.kind == "set") + affinity_sets,
                "maps": sum(1 for d in rs.sets.values() if d.kind == "map") + len(rs.shard_users),
                "elements": sum(len(e) for e in rs.elements.values()) + len(rs.hairpin_refs),
            }
        return counts


def _objects_of(svc: nft_backend.ServiceRules) -> tuple[int, int, int]:
    """Chains, rules and affinity sets one service port owns."""
    return len(svc.chains), sum(len(r) for r in svc.chains.values()), len(svc.affinity_sets)


# --------------------------------------------------------------------------------------------
# iptables


class IptablesSync:
    """kube-proxy's iptables sync: every sync re-renders, but only changed chains are restored."""

    name = "iptables"

    def __init__(
        self, netns: str | None, families: Sequence[IPFamily], flavour: Flavour | None = None
    ) -> None:
        self.families = tuple(families)
        self.runners = {f: IptablesRunner(f, netns, flavour) for f in self.families}
        self.applied: dict[IPFamily, iptables_backend.IptablesRules] = {}

    def forget(self) -> None:
        self.applied.clear()

    def pending(self) -> bool:
        return False

    def sync(self, state: ClusterState, changes: Changes, full: bool) -> dict[IPFamily, FamilySync]:
        done: dict[IPFamily, FamilySync] = {}
        for family in self.families:
            start = time.perf_counter()
            kind: SyncKind = "noop"
            previous = self.applied.get(family)
            runner = self.runners[family]
            if not full and previous is not None and not changes.of(family):
                done[family] = FamilySync("noop", 0, time.perf_counter() - start)
                continue
            new = iptables_backend.render(state, family)
            if full or previous is None:
                existing = runner.chains("nat").get("nat", [])
                wanted = set(new.nat) | {c for g in new.service_chains.values() for c in g.chains}
                stale = sorted(
                    c for c in existing if c.startswith(iptables_backend.SERVICE_CHAIN_PREFIXES) and c not in wanted
                )
                payload = new.restore_text(with_jumps=False, delete_chains=stale)
                _dump_rules("iptables", family, lambda: payload)
                with failing(family, partial=False):
                    runner.restore(payload)
                    for jump in new.jumps:
                        runner.ensure_rule(jump.table, jump.chain, shlex.split(jump.spec))
                kind = "full"
            else:
                changed = [
                    k for k, g in new.service_chains.items() if previous.service_chains.get(k) != g
                ]
                old_chains = {c for g in previous.service_chains.values() for c in g.chains}
                new_chains = {c for g in new.service_chains.values() for c in g.chains}
                gone = sorted(old_chains - new_chains)
                if not changed and not gone and previous.nat == new.nat and previous.filter == new.filter:
                    self.applied[family] = new
                    done[family] = FamilySync("noop", 0, time.perf_counter() - start)
                    continue
                payload = new.restore_text(with_jumps=False, services=changed, delete_chains=gone)
                _dump_rules("iptables", family, lambda: payload)
                with failing(family, partial=True):
                    runner.restore(payload)
                kind = "partial"
            self.applied[family] = new
            done[family] = FamilySync(kind, payload.count("\n"), time.perf_counter() - start)
        return done

    def rule_counts(self) -> dict[IPFamily, dict[str, int]]:
        """Rules per table after the last sync, per family (metrics' iptables tables)."""
        counts: dict[IPFamily, dict[str, int]] = {}
        for family, rules in self.applied.items():
            nat = sum(len(r) for r in rules.nat.values()) + sum(
                len(g.rules) for g in rules.service_chains.values()
            )
            counts[family] = {"nat": nat, "filter": sum(len(r) for r in rules.filter.values())}
        return counts


# --------------------------------------------------------------------------------------------
# The proxier


@dataclass(slots=True)
class Hooks:
    """Callbacks into the servers and conntrack cleanup; all optional, all called after a sync."""

    on_synced: list[Callable[[ClusterState | None, ClusterState, SyncResult], None]] = field(
        default_factory=list
    )
    on_failed: list[Callable[[BaseException], None]] = field(default_factory=list)


class Proxier:
    def __init__(
        self,
        backend: str,
        *,
        netns: str | None = None,
        families: Sequence[IPFamily] = tuple(IPFamily),
        flavour: Flavour | None = None,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r} (choose from {', '.join(BACKENDS)})")
        self.backend_name = backend
        self.netns = netns
        self.backend: BackendSync = (
            NftSync(netns, families) if backend == "nft" else IptablesSync(netns, families, flavour)
        )
        self.hooks = Hooks()
        self._last: ClusterState | None = None
        self._needs_full = True
        self._lock = threading.Lock()
        self.last_result: SyncResult | None = None

    @property
    def state(self) -> ClusterState | None:
        """The state of the last successful sync."""
        return self._last

    def force_full(self) -> None:
        self._needs_full = True

    def sync(self, state: ClusterState, *, full: bool = False) -> SyncResult:
        """One sync; raises (KernelError, ValueError) when the kernel refused the transaction."""
        with self._lock:
            start = time.perf_counter()
            changes = diff(self._last, state)
            do_full = full or self._needs_full or changes.node
            reason = "requested" if full else ("after failure or start" if self._needs_full else "node changed" if changes.node else "")
            if not do_full and changes.empty and not self.backend.pending():
                result = SyncResult("noop", changes, 0, time.perf_counter() - start)
                self.last_result = result
                for hook in self.hooks.on_synced:
                    hook(self._last, state, result)
                return result
            try:
                families = self.backend.sync(state, changes, do_full)
            except BaseException as exc:
                # The transaction was atomic: the kernel still holds what it held. Our belief
                # about it may not (a partial family may have gone through): start over.
                self._needs_full = True
                self.backend.forget()
                logs.error(log, "Sync failed; the next sync will be full", exc, backend=self.backend_name)
                for hook in self.hooks.on_failed:
                    hook(exc)
                raise
            previous = self._last
            self._last = state
            self._needs_full = False
            kind = _overall_kind(families.values())
            result = SyncResult(
                kind,
                changes,
                sum(f.operations for f in families.values()),
                time.perf_counter() - start,
                reason if kind == "full" else "",
                families,
            )
            self.last_result = result
            result.log(log, self.backend_name)
            for hook in self.hooks.on_synced:
                hook(previous, state, result)
            return result


def _dump_rules(mode: str, family: IPFamily, text: Callable[[], str]) -> None:
    """kube-proxy's V(9) habit: the rules about to be written, built only when they show."""
    if logs.enabled(9):
        logs.info(log, f"Writing {mode} rules", level=9, ipFamily=f"IPv{family.value}", rules=text())


def _overall_kind(families: Iterable[FamilySync]) -> SyncKind:
    kinds = {f.kind for f in families}
    return "full" if "full" in kinds else "partial" if "partial" in kinds else "noop"


# --------------------------------------------------------------------------------------------
# The loop


class SyncLoop:
    """Bounded-frequency sync runner around a Source and a Proxier.

    Changes are coalesced: however many arrive, syncs start at least `min_sync_period` apart.
    A full resync runs every `sync_period` to repair rules someone else changed. After a
    failure the sync is retried after `min_sync_period`, doubling up to `max_backoff`.
    """

    def __init__(
        self,
        source: Source,
        proxier: Proxier,
        *,
        min_sync_period: float = 1.0,
        sync_period: float = 3600.0,
        max_backoff: float = 60.0,
    ) -> None:
        if min_sync_period < 0 or sync_period <= 0:
            raise ValueError("sync periods must be positive")
        self.source = source
        self.proxier = proxier
        self.min_sync_period = min_sync_period
        self.sync_period = sync_period
        self.max_backoff = max(max_backoff, min_sync_period)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._cond = threading.Condition()
        self._generation = 0  # notifications seen
        self._synced_generation = -1  # notifications covered by the last successful sync
        self._thread: threading.Thread | None = None
        self.failures = 0
        self.on_queued: list[Callable[[], None]] = []

    def notify(self) -> None:
        with self._cond:
            self._generation += 1
        for hook in self.on_queued:
            hook()
        self._wake.set()

    def start(self) -> None:
        self.source.start(self.notify)
        self._thread = threading.Thread(target=self._run, name="nfproxy-sync", daemon=True)
        self._thread.start()
        self.notify()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self.source.stop()
        if self._thread is not None:
            self._thread.join(timeout)

    def wait_synced(self, timeout: float) -> bool:
        """Wait until a sync has covered every change notified so far."""
        deadline = time.monotonic() + timeout
        with self._cond:
            target = self._generation
            while self._synced_generation < target:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def run_once(self) -> SyncResult:
        """One full sync of the source's current state (`--once`)."""
        snap = self.source.snapshot()
        return self.proxier.sync(snap.state, full=True)

    def _run(self) -> None:
        last_start = -1e18
        last_full = time.monotonic()
        retry_at: float | None = None
        backoff = max(self.min_sync_period, 0.1)
        while not self._stop.is_set():
            now = time.monotonic()
            due_full = now - last_full >= self.sync_period
            wait = self.sync_period - (now - last_full)
            if retry_at is not None:
                wait = min(wait, retry_at - now)
            if not self._wake.is_set() and not due_full and (retry_at is None or now < retry_at):
                self._wake.wait(max(wait, 0.0))
                continue
            # Bounded frequency: never two sync starts closer than min_sync_period.
            gap = last_start + self.min_sync_period - time.monotonic()
            if gap > 0:
                self._stop.wait(gap)
                continue
            if not self.source.ready():
                self._wake.clear()
                self._wake.wait(0.1)
                self._wake.set()
                continue
            self._wake.clear()
            with self._cond:
                generation = self._generation
            last_start = time.monotonic()
            full = due_full
            try:
                snap = self.source.snapshot()
                self.proxier.sync(snap.state, full=full)
            except Exception as exc:  # noqa: BLE001 - any failure is retried, never fatal
                self.failures += 1
                retry_at = time.monotonic() + backoff
                logs.warning(log, "Sync failed, retrying", err=exc, retryIn=logs.Duration(backoff))
                backoff = min(backoff * 2, self.max_backoff)
                continue
            retry_at = None
            backoff = max(self.min_sync_period, 0.1)
            if full:
                last_full = time.monotonic()
            with self._cond:
                self._synced_generation = generation
                self._cond.notify_all()

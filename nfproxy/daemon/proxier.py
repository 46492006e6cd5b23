"""The proxier: keeps one namespace's kernel rules in step with the service model.

`Proxier.sync(state, touched=...)` is one sync: it works out what changed since the last
*successful* sync (from the keys the source says it touched, checked one by one; a whole-state
diff only for full syncs and when the chain of touched keys is broken), asks the backend to express just that to the kernel (a partial sync) or everything (a full
sync: the first one, after a failure, after the node changed, and periodically), applies it
as atomic transactions and only then remembers the new state. A failed apply therefore leaves
the kernel with the previous rules (the transaction was refused as a whole) and the proxier
with the previous state, and it forces the next sync to be full, as kube-proxy does.

Between its own writes the proxier trusts the kernel as long as the kernel's generation
(`Kernel.generation`: nf_tables' ruleset generation, or each legacy x_tables table's entry count
and size) is the one read after its last write. A sync asked to `check` (the loop's periodic
one) that finds it moved, or found it moved at any sync since, is full: it repairs what
someone else deleted, as kube-proxy's canary chain makes its next sync full.

`SyncLoop` is the imperative shell around it: it listens to a source, coalesces changes into
syncs no more often than `min_sync_period`, checks the kernel every `sync_period`, forces a
full resync every `FULL_SYNC_PERIOD`, and retries failures with exponential backoff, which
neither changes nor the periodic syncs cut short.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from nfproxy.backends import registry as backend_registry
from nfproxy.backends.iptables.render import LARGE_CLUSTER_ENDPOINTS
from nfproxy.backends.base import Backend, Plan
from nfproxy.core.changes import Changes, ChangeTracker, Touched, diff
from nfproxy.core.model import ClusterState, IPFamily
from nfproxy.daemon import heap, logs
from nfproxy.daemon.empty_start import EmptyStartHold
from nfproxy.kernel.base import Kernel, KernelFactory
from nfproxy.kernel.iptables import Flavour
from nfproxy.kernel.registry import KERNELS

if TYPE_CHECKING:
    from nfproxy.sources import Source
    from nfproxy.sources.manifests import LoadResult

log = logging.getLogger("nfproxy.proxier")

SyncKind = Literal["full", "partial", "noop"]

# kube-proxy's proxyutil.FullSyncPeriod: a constant there too (no flag sets it). Every
# --sync-period only checks that the kernel holds what was written; this often it rewrites all,
# except an iptables family in large cluster mode (`Proxier.resync_skipped`).
FULL_SYNC_PERIOD = 3600.0
# The check (a generation read per family, microseconds) runs this many times per sync_period,
# so that an outside deletion is found and repaired within one sync_period, its full sync's
# seconds included, not up to a period plus a full sync later.
CHECKS_PER_PERIOD = 2


@dataclass(frozen=True, slots=True)
class FamilySync:
    """What one family's sync did: kube-proxy syncs each family on its own, and its metrics and
    sync lines are per family, so ours come from this and never from the whole sync."""

    kind: SyncKind
    operations: int
    seconds: float
    # Stale objects could not be deleted (the rest of the sync went through; retried next time).
    cleanup_failed: bool = False
    why: str = ""  # why the backend made it full itself (Plan.why)


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
    # Families whose forced (hourly) full resync was asked for and not done (large clusters).
    resync_skipped: tuple[IPFamily, ...] = ()

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
        if not logs.enabled(2):
            return
        mode = "nftables" if backend == "nft" else backend
        for family, part in sorted(self.families.items()):
            if part.kind == "noop":
                continue
            logs.info(
                logger, f"Syncing {mode} rules", level=2,
                ipFamily=f"IPv{family.value}", kind=part.kind,
                servicesChanged=sum(1 for k in self.changes.services if k[1] is family),
                endpointsChanged=sum(1 for k in self.changes.endpoints if k[1] is family),
                operations=part.operations, elapsed=logs.Duration(part.seconds),
                **({"reason": part.why or self.reason} if (part.why or self.reason) and part.kind == "full" else {}),
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
    """Generic over backends: per family, plan -> kernel.apply -> backend.accepted.

    A family is planned in full on the first sync, after a failure, when the node changed and
    when asked; otherwise the backend plans a partial sync from the changes. On a refused apply
    the backend forgets everything, so the next sync is full, as kube-proxy does.
    """

    def __init__(
        self,
        backend: str,
        *,
        netns: str | None = None,
        families: Sequence[IPFamily] = tuple(IPFamily),
        flavour: Flavour | None = None,
        kernels: KernelFactory | None = None,
    ) -> None:
        self.backend_name = backend
        self.backend: Backend = backend_registry.backend(backend)  # ValueError names the choices
        self.netns = netns
        self.families = tuple(families)
        if kernels is None:
            make = KERNELS[backend]

            def kernels(family: IPFamily) -> Kernel:
                return make(family, netns=netns, flavour=flavour)

        self.kernels: dict[IPFamily, Kernel] = {f: kernels(f) for f in self.families}
        self.hooks = Hooks()
        self._last: ClusterState | None = None
        self._tracker = ChangeTracker()
        self._needs_full = True
        self._synced: set[IPFamily] = set()  # families the backend holds a belief for
        # Each kernel's generation read after our last write, and whether one was seen to move
        # since (sticky until a full sync: a partial one in between must not hide it).
        self._seen: dict[IPFamily, Hashable] = {}
        self._drifted = False
        self._lock = threading.Lock()
        self.last_result: SyncResult | None = None

    @property
    def state(self) -> ClusterState | None:
        """The state of the last successful sync."""
        return self._last

    def service_chains(self) -> int:
        """Per-service chains the kernels hold now (nft: names with a "/", in either table;
        iptables: kube-proxy's per-service and per-endpoint chains), read from the kernels."""
        count = 0
        for kernel in self.kernels.values():
            owned = kernel.owned()
            for names in (owned.chains, owned.off.chains if owned.off is not None else ()):
                count += sum(1 for n in names if "/" in n or n.startswith(_SERVICE_CHAIN_PREFIXES))
        return count

    def close(self) -> None:
        """Close the kernels' sockets (the rules stay, as kube-proxy leaves them on exit); a
        later sync opens them again. A sync still running keeps them: shutting down does not
        wait for it (its thread is a daemon thread, and the process is on its way out)."""
        if not self._lock.acquire(blocking=False):
            return
        try:
            for kernel in self.kernels.values():
                kernel.close()
        finally:
            self._lock.release()

    def __enter__(self) -> Proxier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def resync_skipped(self) -> tuple[IPFamily, ...]:
        """The families the forced hourly full resync leaves alone: kube-proxy 1.37's iptables
        mode does no periodic full sync in large cluster mode (kubernetes#138571), judged, as
        there, on the state of the last sync. Drift and failures still make a sync full."""
        if self.backend_name != "iptables" or self._last is None:
            return ()
        return tuple(f for f in self.families if _large_cluster(self._last, f))

    def sync(
        self, state: ClusterState, *, full: bool = False, touched: Touched | None = None,
        check: bool = False, resync: bool = False,
    ) -> SyncResult:
        """One sync; raises (KernelError, ValueError) when the kernel refused the transaction.

        `touched` is what the source says may differ from the snapshot it handed over before
        (`Source.snapshot_changes`); without it the whole state is diffed. `check`: full if
        someone else wrote to the kernel since our last write (the periodic sync); without it
        such a write is only noted, so that a change's sync stays partial. `resync`: the forced
        full resync (hourly), full but for the families `resync_skipped` names.
        """
        with self._lock:
            start = time.perf_counter()
            skipped = self.resync_skipped() if resync and not full else ()
            full_families = frozenset(f for f in self.families if f not in skipped) if resync else frozenset()
            full = full or (resync and len(full_families) == len(self.families))
            self._tracker.add(state, touched)
            if not (full or self._needs_full):
                self._note_drift()
            drifted = check and self._drifted
            if full or self._needs_full or drifted or full_families:
                changes = diff(self._last, state)  # the fallback: full syncs never trust hints
            else:
                changes = self._tracker.changes(self._last, state)
                if changes.node and self._tracker.tracking:
                    changes = diff(self._last, state)  # a full sync: its hooks see every key
            do_full = full or self._needs_full or drifted or changes.node
            reason = _reason(full=full or bool(full_families), start=self._needs_full, drifted=drifted, node=changes.node)
            if not (do_full or full_families) and changes.empty and not self.backend.pending():
                # Equal in all the rules read: the new snapshot stands for the old from now on
                # (touched keys then count from it, and the old one can be freed).
                previous, self._last = self._last, state
                self._tracker.synced(state)
                result = SyncResult("noop", changes, 0, time.perf_counter() - start, resync_skipped=skipped)
                self.last_result = result
                for hook in self.hooks.on_synced:
                    hook(previous, state, result)
                return result
            try:
                families = self._apply(state, changes, do_full, full_families)
            except BaseException as exc:
                # The transaction was atomic: the kernel still holds what it held. Our belief
                # about it may not (a partial family may have gone through): start over.
                self._needs_full = True
                self._synced.clear()
                self.backend.forget()
                logs.error(log, "Sync failed; the next sync will be full", exc, backend=self.backend_name)
                for hook in self.hooks.on_failed:
                    hook(exc)
                raise
            previous = self._last
            self._last = state
            self._tracker.synced(state)
            self._needs_full = False
            kind = _overall_kind(families.values())
            self._written(families, full=do_full)
            result = SyncResult(
                kind,
                changes,
                sum(f.operations for f in families.values()),
                time.perf_counter() - start,
                (reason or next((f.why for f in families.values() if f.why), "")) if kind == "full" else "",
                families,
                skipped,
            )
            self.last_result = result
            result.log(log, self.backend_name)
            for hook in self.hooks.on_synced:
                hook(previous, state, result)
            if kind == "full":
                # The full sync's hundreds of MiB, back to the system. No collection first:
                # what a sync frees is acyclic (178 cyclic objects, 2.4 MiB, at 10 000 x 10),
                # and a collection walks the whole model (0.16 s of a 5 s cold start).
                heap.release(collect=False)
            return result

    def _note_drift(self) -> None:
        """Whether a kernel's generation moved since our last write: someone else wrote. One
        netlink round trip or getsockopt per family; a kernel that cannot say counts as moved."""
        if self._drifted:
            return
        for family in self.families:
            now = _generation(self.kernels[family])
            if now is None or now != self._seen.get(family):
                self._drifted = True
                logs.info(log, "Rules changed outside nfproxy; the next periodic sync is full", level=2,
                          ipFamily=f"IPv{family.value}")
                return

    def _written(self, families: Mapping[IPFamily, FamilySync], *, full: bool) -> None:
        """Remember the generations our writes left. Read after every family's write, not each
        after its own: nf_tables has one generation for both families. A sync that wrote
        nothing leaves them: reading them again would take someone else's write for ours."""
        if full:
            self._drifted = False
        elif all(f.operations == 0 for f in families.values()):
            return
        self._seen = {}
        for family in self.families:
            now = _generation(self.kernels[family])
            if now is not None:
                self._seen[family] = now

    def _apply(
        self, state: ClusterState, changes: Changes, full: bool, full_families: frozenset[IPFamily] = frozenset()
    ) -> dict[IPFamily, FamilySync]:
        done: dict[IPFamily, FamilySync] = {}
        for family in self.families:
            started = time.perf_counter()
            kernel = self.kernels[family]
            family_full = full or family in full_families or family not in self._synced
            found = kernel.owned() if family_full else None
            plan = self.backend.plan(state, changes, family, full=family_full, found=found)
            if plan is None:
                done[family] = FamilySync("noop", 0, time.perf_counter() - started)
                continue
            with failing(family, partial=not plan.full):
                plan, cleanup_failed = self._write(kernel, plan)
            self.backend.accepted(plan)
            self._synced.add(family)
            kind: SyncKind = "full" if plan.full else ("partial" if plan.operations else "noop")
            done[family] = FamilySync(kind, plan.operations, time.perf_counter() - started, cleanup_failed, plan.why)
        return done

    def _write(self, kernel: Kernel, plan: Plan) -> tuple[Plan, bool]:
        """Apply `plan`; when only its stale-object deletions are refused, apply it without them
        (a cleanup failure, counted; the deletions wait for the next sync)."""
        if not plan.operations:
            return plan, False
        mode = "nftables" if self.backend_name == "nft" else self.backend_name
        _dump_rules(mode, plan.family, lambda: _payload_text(plan.payload))
        if plan.full:
            # What rendering freed goes back before libnftables or iptables-restore needs its
            # own few hundred MiB: the peak is then the payload's, not payload plus render.
            heap.release(collect=False)
        try:
            kernel.apply(plan.payload)
            return plan, False
        except Exception as exc:
            fallback = plan.without_cleanup
            if fallback is None:
                raise
            logs.error(log, f"Failed to delete stale {mode} objects", exc,
                       ipFamily=f"IPv{plan.family.value}")
        if fallback.operations:
            kernel.apply(fallback.payload)
        return fallback, True


def _generation(kernel: Kernel) -> Hashable | None:
    """The kernel's generation, or None when it cannot be read (then nothing is trusted)."""
    read = getattr(kernel, "generation", None)
    if read is None:
        return None
    try:
        return read()  # type: ignore[no-any-return]
    except Exception as exc:  # noqa: BLE001 - an unreadable generation only costs a full sync
        logs.warning(log, "Cannot read the ruleset generation", err=exc)
        return None


def _large_cluster(state: ClusterState, family: IPFamily) -> bool:
    """kube-proxy's iptables largeClusterMode: more endpoints (any condition) than
    LARGE_CLUSTER_ENDPOINTS over the family's service ports, the count its renderer uses."""
    endpoints = state.endpoints
    total = sum(len(endpoints.get(k, ())) for k in state.services if k[1] is family)
    return total > LARGE_CLUSTER_ENDPOINTS


def _reason(*, full: bool, start: bool, drifted: bool, node: bool) -> str:
    """Why a sync is full, as its sync line says (empty: it is not)."""
    if full:
        return "requested"
    if start:
        return "after failure or start"
    if drifted:
        return "rules changed outside nfproxy"
    return "node changed" if node else ""


def _payload_text(payload: object) -> str:
    """What a payload writes, as text (only built for --v=9)."""
    from nfproxy.nftables import Transaction
    from nfproxy.nftables.text import script

    if isinstance(payload, Transaction):
        return script(payload)
    if isinstance(payload, tuple):  # nft: nfproxy's and the off table's, in order
        return "".join(_payload_text(p) for p in payload)
    return str(getattr(payload, "text", payload))


def _dump_rules(mode: str, family: IPFamily, text: Callable[[], str]) -> None:
    """kube-proxy's V(9) habit: the rules about to be written, built only when they show."""
    if logs.enabled(9):
        logs.info(log, f"Writing {mode} rules", level=9, ipFamily=f"IPv{family.value}", rules=text())


def _cleanup_due(proxier: Proxier, result: SyncResult) -> bool:
    """Whether stale objects (emptied by the sync just done) wait for a sync of their own.

    Without one they would stay until the next change or full resync, maybe an hour; after a
    refused deletion (someone else's rule names the chain) they wait for that instead, so a
    cleanup that keeps failing does not turn into a sync every min_sync_period."""
    if any(f.cleanup_failed for f in result.families.values()):
        return False
    return proxier.backend.pending()


_SERVICE_CHAIN_PREFIXES = ("KUBE-SVC-", "KUBE-SVL-", "KUBE-EXT-", "KUBE-FW-", "KUBE-SEP-")


def _take(source: Source) -> tuple[LoadResult, Touched | None]:
    """The source's snapshot, with the keys it touched when the source tracks them."""
    take = getattr(source, "snapshot_changes", None)
    if take is None:
        return source.snapshot(), None
    return take()


def _overall_kind(families: Iterable[FamilySync]) -> SyncKind:
    kinds = {f.kind for f in families}
    return "full" if "full" in kinds else "partial" if "partial" in kinds else "noop"


# --------------------------------------------------------------------------------------------
# The loop


@dataclass(slots=True)
class SyncSchedule:
    """When the loop may start its next sync, whether that one is the periodic check (every
    sync_period) and whether it is the forced full sync (every full_period).

    Apart from the loop's thread and events so it can be driven by a fake clock. After a failure
    nothing starts a sync before the retry time, neither a periodic sync nor a change:
    a failing full sync of 10 000 services is seconds of rendering, and once the failures
    outlast sync_period the periodic one would otherwise run every min_sync_period, while the
    log announces a backoff doubling to max_backoff.
    """

    min_sync_period: float
    sync_period: float
    max_backoff: float
    last_full: float = 0.0  # the last successful full sync (or the loop's start)
    last_start: float = float("-inf")
    retry_at: float | None = None  # set while the last sync failed
    full_period: float = FULL_SYNC_PERIOD
    last_check: float = field(init=False)  # the last successful periodic or full sync
    backoff: float = field(init=False)

    def __post_init__(self) -> None:
        self.backoff = self._first_backoff()
        self.last_check = self.last_full

    def _first_backoff(self) -> float:
        return max(self.min_sync_period, 0.1)

    def periodic_due(self, now: float) -> bool:
        return now - self.last_check >= self.sync_period

    def full_due(self, now: float) -> bool:
        return now - self.last_full >= self.full_period

    def delay(self, now: float, *, woken: bool) -> float:
        """Seconds until a sync may start (0: now); `woken` says a change is waiting."""
        earliest = self.last_start + self.min_sync_period
        if self.retry_at is not None:
            return max(self.retry_at, earliest) - now
        if woken or self.periodic_due(now):
            return max(earliest - now, 0.0)
        return self.last_check + self.sync_period - now

    def started(self, now: float) -> None:
        self.last_start = now

    def failed(self, now: float) -> float:
        """Schedule the retry; returns how far off it is (what the log announces)."""
        retry_in = self.backoff
        self.retry_at = now + retry_in
        self.backoff = min(self.backoff * 2, self.max_backoff)
        return retry_in

    def succeeded(self, now: float, *, full: bool, periodic: bool = False) -> None:
        """A full sync restarts both clocks (it checked everything); a periodic one the check's."""
        self.retry_at = None
        self.backoff = self._first_backoff()
        if full:
            self.last_full = now
        if full or periodic:
            self.last_check = now


class SyncLoop:
    """Bounded-frequency sync runner around a Source and a Proxier.

    Changes are coalesced: however many arrive, syncs start at least `min_sync_period` apart.
    Twice every `sync_period` a sync checks the kernel's generation and is full only when
    someone else wrote (to repair what they changed); every `full_period` one is full regardless, as
    kube-proxy's hourly resync. After a failure the sync is retried after `min_sync_period`,
    doubling up to `max_backoff`; until then nothing else starts one (`SyncSchedule`).
    """

    def __init__(
        self,
        source: Source,
        proxier: Proxier,
        *,
        min_sync_period: float = 1.0,
        sync_period: float = 3600.0,
        max_backoff: float = 60.0,
        empty_grace: float = 0.0,
        full_period: float = FULL_SYNC_PERIOD,
    ) -> None:
        if min_sync_period < 0 or sync_period <= 0 or full_period <= 0:
            raise ValueError("sync periods must be positive")
        self.full_period = full_period
        # The first sync of an empty state waits while the kernel serves services (empty_start.py).
        self.empty_start = EmptyStartHold(empty_grace)
        self.on_empty_held: list[Callable[[], None]] = []
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
        snap, touched = _take(self.source)
        return self.proxier.sync(snap.state, full=True, touched=touched)

    def _empty_held(self) -> bool:
        hold = self.empty_start
        if hold.done:
            return False
        first = hold.since is None
        held = hold.held(self.source.snapshot().state, time.monotonic(), self.proxier.service_chains)
        if held and first:
            for hook in self.on_empty_held:
                hook()
        return held

    def _run(self) -> None:
        schedule = SyncSchedule(
            self.min_sync_period, self.sync_period / CHECKS_PER_PERIOD, self.max_backoff,
            last_full=time.monotonic(), full_period=self.full_period,
        )
        while not self._stop.is_set():
            delay = schedule.delay(time.monotonic(), woken=self._wake.is_set())
            if delay > 0:
                # A notification ends only the idle wait; the min-sync-period gap and a failure's
                # backoff hold it back (it stays set, and the sync after the wait covers it).
                (self._stop if self._wake.is_set() else self._wake).wait(delay)
                continue
            if not self.source.ready():
                self._wake.clear()
                self._wake.wait(0.1)
                self._wake.set()
                continue
            if self._empty_held():
                self._wake.clear()
                self._wake.wait(1.0)
                self._wake.set()
                continue
            self._wake.clear()
            with self._cond:
                generation = self._generation
            now = time.monotonic()
            full, periodic = schedule.full_due(now), schedule.periodic_due(now)
            schedule.started(now)
            try:
                snap, touched = _take(self.source)
                result = self.proxier.sync(snap.state, resync=full, touched=touched, check=periodic)
            except Exception as exc:  # noqa: BLE001 - any failure is retried, never fatal
                self.failures += 1
                retry_in = schedule.failed(time.monotonic())
                logs.warning(log, "Sync failed, retrying", err=exc, retryIn=logs.Duration(retry_in))
                continue
            # A resync skipped in every family leaves the clock due: each next sync asks again, so
            # the first one after the cluster leaves large cluster mode is full, as kube-proxy's.
            resynced = full and len(result.resync_skipped) < len(self.proxier.families)
            schedule.succeeded(time.monotonic(), full=resynced or result.kind == "full", periodic=periodic)
            self.empty_start.done = True
            if _cleanup_due(self.proxier, result):
                self._wake.set()  # stale objects wait: the next sync (min_sync_period on) deletes them
            with self._cond:
                self._synced_generation = generation
                self._cond.notify_all()

"""What changed between the state of the last successful sync and the state now.

Sources hand over whole snapshots, and with each one the keys that may differ from the one they
handed over before (`Touched`), as kube-proxy's change trackers record which services and
endpoint slices an event touched. `ChangeTracker` accumulates those between syncs and checks
only them (`verify`): a partial sync costs what changed, not the size of the cluster, and a key
rebuilt equal (a watch event that changes nothing the rules read) drops out, so an equal but
newly built snapshot is a no-op. Model values are frozen, so identity is checked before
equality.

`diff` compares two whole snapshots: the correctness fallback for full syncs, restarts and any
snapshot whose chain of touched keys is broken (a caller without a tracked source).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from nfproxy.core.model import ClusterState, IPFamily, ServicePortKey


@dataclass(frozen=True, slots=True)
class Changes:
    """Keys of service ports whose definition or endpoints differ, per the model's families.

    `node` is set when the node's configuration differs: everything depends on it (pod CIDRs,
    node IPs, zone), so it forces a full sync.
    """

    services: frozenset[ServicePortKey]
    endpoints: frozenset[ServicePortKey]
    node: bool

    @property
    def keys(self) -> frozenset[ServicePortKey]:
        return self.services | self.endpoints

    def of(self, family: IPFamily) -> frozenset[ServicePortKey]:
        return frozenset(k for k in self.keys if k[1] is family)

    @property
    def empty(self) -> bool:
        return not (self.services or self.endpoints or self.node)


NO_CHANGES = Changes(frozenset(), frozenset(), False)


def diff(old: ClusterState | None, new: ClusterState) -> Changes:
    """Changes from `old` (None: nothing was synced yet, everything is new) to `new`."""
    if old is None:
        return Changes(frozenset(new.services), frozenset(new.endpoints), True)
    if old is new:
        return NO_CHANGES
    node = old.node != new.node
    services: set[ServicePortKey] = set()
    old_svcs, new_svcs = old.services, new.services
    if old_svcs is not new_svcs:
        for key, svc in new_svcs.items():
            prev = old_svcs.get(key)
            if prev is not svc and prev != svc:
                services.add(key)
        services.update(key for key in old_svcs if key not in new_svcs)
    endpoints: set[ServicePortKey] = set()
    old_eps, new_eps = old.endpoints, new.endpoints
    if old_eps is not new_eps:
        empty: tuple[()] = ()
        for key, eps in new_eps.items():
            prev = old_eps.get(key, empty)
            if prev is not eps and prev != eps:
                endpoints.add(key)
        endpoints.update(key for key, eps in old_eps.items() if eps and key not in new_eps)
    return Changes(frozenset(services), frozenset(endpoints), node)


@dataclass(frozen=True, slots=True)
class Touched:
    """Keys that may differ between `base` (the snapshot a source handed over before) and the
    snapshot this comes with; a superset is fine (equal keys drop out), a missing key is a bug.

    The node is not listed: it is one small value, compared on every sync.
    """

    base: ClusterState | None
    keys: frozenset[ServicePortKey]


def verify(old: ClusterState, new: ClusterState, keys: Iterable[ServicePortKey]) -> Changes:
    """Changes from `old` to `new`, looking only at `keys`: what `diff` finds, in O(len(keys)),
    provided nothing outside `keys` differs."""
    services: set[ServicePortKey] = set()
    endpoints: set[ServicePortKey] = set()
    old_svcs, new_svcs = old.services, new.services
    old_eps, new_eps = old.endpoints, new.endpoints
    empty: tuple[()] = ()
    for key in keys:
        prev, svc = old_svcs.get(key), new_svcs.get(key)
        if prev is not svc and prev != svc:
            services.add(key)
        prev_eps, eps = old_eps.get(key, empty), new_eps.get(key, empty)
        if prev_eps is not eps and prev_eps != eps:
            endpoints.add(key)
    node = old.node is not new.node and old.node != new.node
    if not (services or endpoints or node):
        return NO_CHANGES
    return Changes(frozenset(services), frozenset(endpoints), node)


class ChangeTracker:
    """Touched keys accumulated since the last successful sync (kube-proxy's change trackers).

    Each snapshot is added with its `Touched`; the chain must be unbroken from the state last
    synced to the state now (each `Touched.base` is the snapshot added before it). When it is
    not (no `Touched`, a snapshot skipped, a state from elsewhere), `changes` falls back to
    `diff`, so the tracker can make a sync slow but never wrong.
    """

    __slots__ = ("_synced", "_end", "_keys", "_broken")

    def __init__(self) -> None:
        self._synced: ClusterState | None = None
        self._end: ClusterState | None = None
        self._keys: set[ServicePortKey] = set()
        self._broken = True

    def add(self, state: ClusterState, touched: Touched | None) -> None:
        """One more snapshot, with what its source says it touched (None: unknown)."""
        if state is self._end:
            return
        if touched is None or touched.base is not self._end:
            self._broken = True
            self._keys.clear()
        elif not self._broken:
            self._keys.update(touched.keys)
        self._end = state

    def changes(self, old: ClusterState | None, new: ClusterState) -> Changes:
        """Changes from `old` (the state last synced) to `new` (the snapshot last added)."""
        if old is new:
            return NO_CHANGES
        if old is None or self._broken or old is not self._synced or new is not self._end:
            return diff(old, new)
        return verify(old, new, self._keys)

    @property
    def tracking(self) -> bool:
        """Whether the next `changes` can be verified from touched keys (not a full diff)."""
        return not self._broken

    def synced(self, state: ClusterState) -> None:
        """`state` is in the kernel now: changes count from it."""
        self._synced = self._end = state
        self._keys = set()
        self._broken = False

"""What changed between the state of the last successful sync and the state now.

kube-proxy tracks changes event by event; nfproxy's sources hand over whole snapshots instead,
so the tracker compares snapshots. That is cheap because model values are frozen: an unchanged
service usually is the very same object (identity is checked first), and equality is only
computed for the rest. The result drives partial syncs: only the service ports named here are
re-rendered and rewritten in the kernel.
"""

from __future__ import annotations

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

"""The Kubernetes API source: list and watch Services, EndpointSlices, ServiceCIDRs and our own
Node.

Four reflectors (one thread each) keep a local copy of what the API server holds, the way
client-go's informers do for kube-proxy:

- **list** gives a snapshot and the resourceVersion it was taken at. As client-go's reflector,
  the first asks for resourceVersion "0" (the API server's watch cache, which ignores `limit`)
  and a relist after 410 for none (a consistent read, paginated);
- **watch** from that resourceVersion streams ADDED / MODIFIED / DELETED events, and BOOKMARKs
  that move the resourceVersion on without an object change (so a reconnect after a quiet hour
  does not start from a version the server has already forgotten);
- a watch that ends (server timeout, dropped connection, API server restart) is **resumed from
  the last resourceVersion**: no relist, no change, no sync. Failures back off exponentially with
  jitter, so a thousand nodes do not hammer a recovering API server in step;
- only **410 Gone** (the server no longer has the history we need) forces a relist; the relisted
  objects replace the copy, and only a real difference is reported as a change.

While the API server is unreachable the copy stays as it was: the rules in the kernel keep
serving the last known state, which is what kube-proxy does too.

Responses are read as JSON (`_preload_content=False`), never through the client's models,
which drop fields they do not know and cost more than the parse itself. A Service or an
EndpointSlice is parsed as it arrives (`manifests.parse_objects`, the same validation the
manifest files get) and only that parse is kept (`_Record`), not the decoded JSON: at 10 000
services x 10 endpoints the dicts would be ~170 MiB of the daemon's RSS, and their parse shares its
endpoints with the state anyway (docs/design.md, "The API source's memory"). Snapshot cost
matters at 10 000 services, so the state is assembled per *service group* (a Service with the
EndpointSlices labelled for it, `manifests.assemble`): an event re-assembles only its group.
That decomposition is exact because slices only ever merge into their own service. The merged
state is patched per re-assembled group, and the keys of those groups (before and after) are
what `snapshot_changes` reports as touched: the proxier checks them and no others, as
kube-proxy's change trackers record the services and slices an event touched.

Only the proxy's own Node is watched (field selector `metadata.name=<node>`). Heartbeats change
a Node every few seconds; only what the proxy reads from it (labels, addresses, pod CIDRs) counts
as a change. A changed Node changes `ClusterState.node`, which every rule may depend on (zone
hints, node IPs, the masquerade CIDR), so the sync loop must treat it as a full sync. A Node
that disappears leaves its last facts in force (see `ObjectCache._set_node`).

ServiceCIDRs are optional (`_Kind.fallback`): a server that does not serve them (404, before
Kubernetes 1.33) or may not show them to us (403) counts as having none, and
--service-cluster-ip-range decides, as in kube-proxy without its MultiCIDRServiceAllocator gate.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import socket
import datetime
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import yaml
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException
from kubernetes.config import ConfigException, incluster_config, load_incluster_config
from kubernetes.config import load_kube_config
from kubernetes.watch.watch import iter_resp_lines

from nfproxy.core.changes import Touched
from nfproxy.core.model import (
    ClusterState,
    Endpoint,
    LocalMode,
    NodeConfig,
    ServicePort,
    ServicePortKey,
    shared,
)
from nfproxy.sources.manifests import (
    SERVICE_NAME_LABEL,
    Entry,
    LoadResult,
    ObjectError,
    assemble,
    load_objects,
    parse_objects,
)
from nfproxy.sources.validation import show

log = logging.getLogger(__name__)

USER_AGENT = "nfproxy/0.1"
GONE = 410


@dataclass(frozen=True, slots=True)
class WatchSettings:
    """Timing of the list/watch protocol. Defaults suit a real cluster; tests shrink them.

    `watch_timeout` is the server-side `timeoutSeconds` of one watch request (client-go picks
    5-10 minutes at random; we add up to 50 % jitter to spread reconnects). A watch's read
    timeout is its own timeoutSeconds plus `watch_read_margin`: only a server that has vanished
    without closing the socket trips it (TCP keepalive, on for every connection, usually notices
    a dead peer much sooner).
    """

    watch_timeout: int = 300
    connect_timeout: float = 10.0
    watch_read_margin: float = 60.0
    list_timeout: float = 120.0
    page_size: int = 500
    backoff_initial: float = 0.8
    backoff_max: float = 30.0
    backoff_factor: float = 2.0
    jitter: float = 0.2
    # A watch that ends this soon with nothing delivered counts as a failure (backs off), so a
    # server that closes watches at once cannot drive us into a tight reconnect loop.
    min_watch_seconds: float = 1.0
    # A relist that finds none of a kind the copy holds (an API server back from an outage with
    # an empty or restored store) is believed only after it has stayed empty this long.
    empty_grace: float = 30.0
    # A kind the server does not serve (404) or we may not read (403), for kinds that have a
    # fallback (ServiceCIDRs): listed again this often, in case an upgrade or an RBAC fix
    # brings it. Rare: a server without the API answers the same for months.
    absent_relist: float = 300.0
    # How long `stop` waits for the reflector threads. A list in flight to a server that
    # accepts but never answers cannot be interrupted; its (daemon) thread is left behind.
    stop_timeout: float = 1.0

    def backoff(self, failures: int, rng: random.Random) -> float:
        """Delay before attempt `failures + 1`: exponential, capped, with +-jitter."""
        base = min(self.backoff_max, self.backoff_initial * self.backoff_factor ** max(failures - 1, 0))
        return base * (1 + self.jitter * (2 * rng.random() - 1))


@dataclass(frozen=True, slots=True)
class _Kind:
    kind: str
    api_version: str
    plural: str
    # For a kind the proxy can do without: what stands in for it when the server does not serve
    # it (404) or RBAC forbids it (403). Such a kind then counts as listed, and empty.
    fallback: str = ""

    @property
    def resource(self) -> str:
        """plural.group, as RBAC rules and the API server's messages name it."""
        group = self.api_version.rpartition("/")[0]
        return f"{self.plural}.{group}" if group else self.plural


SERVICES = _Kind("Service", "v1", "services")
ENDPOINT_SLICES = _Kind("EndpointSlice", "discovery.k8s.io/v1", "endpointslices")
NODES = _Kind("Node", "v1", "nodes")
# Cluster-scoped; they only feed the node configuration (ClusterState.node.service_cidrs).
# Served from Kubernetes 1.33 (beta before, off by default); kube-proxy reads them only with
# its MultiCIDRServiceAllocator gate on and otherwise uses --service-cluster-ip-range.
SERVICE_CIDRS = _Kind(
    "ServiceCIDR", "networking.k8s.io/v1", "servicecidrs",
    fallback="--service-cluster-ip-range is used for the service ranges",
)

ObjectKey = tuple[str, str, str]  # (kind, namespace, name)
GroupKey = tuple[str, str, str]  # ("service", namespace, service name) or ("orphan", ns, name)


class _Gone(Exception):
    """The server no longer has the history we asked for: relist."""


class _StreamError(Exception):
    """The watch stream said something we cannot follow (an ERROR event, a malformed line)."""


class _EmptyRelistHeld(Exception):
    """A relist came back empty while the copy holds objects: kept, and listed again later."""


class _NotServed(Exception):
    """The list of a kind with a fallback was answered 404 (not served) or 403 (forbidden)."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


class _Stopped(Exception):
    """A response arrived after `stop`: it must change nothing."""


# --------------------------------------------------------------------------------------------
# The local copy


def _meta(obj: dict[str, Any]) -> dict[str, Any]:
    meta = obj.get("metadata")
    return meta if isinstance(meta, dict) else {}


def _object_key(kind: _Kind, obj: dict[str, Any]) -> ObjectKey | None:
    meta = _meta(obj)
    name, namespace = meta.get("name"), meta.get("namespace") or ""
    if not isinstance(name, str) or not name or not isinstance(namespace, str):
        return None
    # Interned: a Service's namespace and name come again in its slices' keys and groups.
    return (kind.kind, shared(namespace), shared(name))


def _group_of(key: ObjectKey, obj: dict[str, Any]) -> GroupKey:
    """Which service group an object's parse belongs to (see the module docstring)."""
    kind, namespace, name = key
    namespace = namespace or "default"
    if kind == SERVICES.kind:
        return ("service", namespace, name)
    labels = _meta(obj).get("labels")
    service = labels.get(SERVICE_NAME_LABEL) if isinstance(labels, dict) else None
    if isinstance(service, str):
        return ("service", namespace, shared(service))
    return ("orphan", namespace, name)  # load_objects reports the missing label


TRIGGER_TIME = "endpoints.kubernetes.io/last-change-trigger-time"


def _trigger_time(obj: dict[str, Any]) -> tuple[str, float] | None:
    """An EndpointSlice's (addressType, last-change-trigger-time); None if bad or absent."""
    annotations = _meta(obj).get("annotations")
    text = annotations.get(TRIGGER_TIME) if isinstance(annotations, dict) else None
    family = obj.get("addressType")
    if not isinstance(text, str) or family not in ("IPv4", "IPv6"):
        return None
    try:
        return family, datetime.datetime.fromisoformat(text).timestamp()
    except ValueError:
        return None


def _trigger_times(records: Iterable[_Record]) -> dict[str, float]:
    """The newest trigger time per addressType among a group's EndpointSlices."""
    newest: dict[str, float] = {}
    for record in records:
        if record.trigger is not None:
            family, when = record.trigger
            newest[family] = max(when, newest.get(family, when))
    return newest


@dataclass(frozen=True, slots=True)
class _Record:
    """What the cache keeps of a Service or an EndpointSlice: its group, its parse (problems
    included) and a slice's trigger time. Equal records mean no change the proxy can see, so a
    status or resourceVersion-only update is not one."""

    group: GroupKey
    entries: tuple[Entry, ...]
    trigger: tuple[str, float] | None = None


def _record(kind: _Kind, key: ObjectKey, obj: dict[str, Any]) -> _Record:
    trigger = _trigger_time(obj) if kind is ENDPOINT_SLICES else None
    return _Record(_group_of(key, obj), parse_objects((obj,)), trigger)


def _node_facts(obj: dict[str, Any] | None) -> object:
    """The parts of a Node the proxy reads (for rules, and for /healthz: being deleted, the
    autoscaler's deletion taint); a heartbeat leaves them alone."""
    if obj is None:
        return None
    spec = obj.get("spec") if isinstance(obj.get("spec"), dict) else {}
    status = obj.get("status") if isinstance(obj.get("status"), dict) else {}
    return (
        _meta(obj).get("labels"),
        _meta(obj).get("deletionTimestamp"),
        spec.get("taints"),
        spec.get("podCIDR"),
        spec.get("podCIDRs"),
        status.get("addresses"),
    )


def _has_pod_cidr(obj: dict[str, Any] | None) -> bool:
    """Whether a Node object names any pod CIDR."""
    spec = obj.get("spec") if isinstance(obj, dict) and isinstance(obj.get("spec"), dict) else {}
    return bool(spec.get("podCIDRs") or spec.get("podCIDR"))


def _stored(obj: dict[str, Any]) -> dict[str, Any]:
    """The object as the cache keeps it: without `metadata.managedFields`, which no rule reads
    and which is often the largest part of an object from a server-side-applying client
    (kube-proxy's informers drop it too)."""
    meta = obj.get("metadata")
    if isinstance(meta, dict) and "managedFields" in meta:
        return {**obj, "metadata": {k: v for k, v in meta.items() if k != "managedFields"}}
    return obj


class ObjectCache:
    """The objects the reflectors have seen, and the parsed state cached per service group.

    Written by the reflector threads, read by `snapshot()` on the sync loop's thread. Records
    are immutable, so a snapshot can assemble them outside the lock.
    """

    def __init__(self, node: NodeConfig) -> None:
        self._node_config = node
        self._lock = threading.Lock()
        self._snapshot_lock = threading.Lock()
        self._objects: dict[ObjectKey, _Record] = {}
        # Each group's members, sorted (a Service and its one or two slices: tuples, not sets).
        self._groups: dict[GroupKey, tuple[ObjectKey, ...]] = {}
        self._dirty: set[GroupKey] = set()
        self._node: dict[str, Any] | None = None
        # The last Node seen, kept when it disappears: its addresses, pod CIDRs and zone keep
        # feeding the rules (see `_set_node`).
        self._known_node: dict[str, Any] | None = None
        self._no_pod_cidr_said = False
        self._cidrs: dict[str, dict[str, Any]] = {}  # ServiceCIDRs by name
        self._cidrs_dirty = False
        # The service-port keys each group's last assembly gave (its endpoints' are among them).
        self._parsed: dict[GroupKey, tuple[ServicePortKey, ...]] = {}
        # The merged state of every parsed group (patched per re-parsed group), and the errors
        # of the groups that have some.
        self._services: dict[ServicePortKey, ServicePort] = {}
        self._endpoints: dict[ServicePortKey, tuple[Endpoint, ...]] = {}
        self._errors: dict[GroupKey, tuple[ObjectError, ...]] = {}
        self._last: tuple[dict[str, Any] | None, LoadResult] | None = None
        # Keys re-parsed since the last `snapshot_changes`, and the state that call returned.
        self._touched: set[ServicePortKey] = set()
        self._taken: ClusterState | None = None
        # Per service, per address type: the newest last-change-trigger-time of its
        # EndpointSlices as of the last snapshot (network programming latency).
        self._triggers: dict[tuple[str, str], dict[str, float]] = {}

    # Writers (reflector threads)

    def replace(self, kind: _Kind, objects: Iterable[dict[str, Any]]) -> bool:
        """A fresh list of every object of `kind`; True when anything differs from before."""
        fresh: dict[ObjectKey, Any] = {}
        for obj in objects:
            self.prepare(kind, obj, fresh)
        return self.install(kind, fresh)

    def prepare(self, kind: _Kind, obj: dict[str, Any], into: dict[ObjectKey, Any]) -> None:
        """One listed object as the cache keeps it, into `into` (for `install`); parsed here,
        outside the lock, as the list is read."""
        key = _object_key(kind, obj)
        if key is None:
            log.warning("%s without a name in a list response: ignored", kind.kind)
            return
        into[key] = _stored(obj) if kind is NODES or kind is SERVICE_CIDRS else _record(kind, key, obj)

    def install(self, kind: _Kind, fresh: dict[ObjectKey, Any]) -> bool:
        """`prepare`d objects as every object of `kind`; True when anything differs."""
        with self._lock:
            if kind is NODES:
                return self._set_node(next(iter(fresh.values()), None))
            if kind is SERVICE_CIDRS:
                return self._set_cidrs({key[2]: obj for key, obj in fresh.items()})
            changed = False
            for key in [k for k in self._objects if k[0] == kind.kind and k not in fresh]:
                self._remove(key)
                changed = True
            for key, obj in fresh.items():
                if self._objects.get(key) != obj:
                    self._put(key, obj)
                    changed = True
            return changed

    def apply(self, kind: _Kind, event: str, obj: dict[str, Any]) -> bool:
        """One watch event; True when the stored state changed."""
        key = _object_key(kind, obj)
        if key is None:
            raise _StreamError(f"{event} event for a {kind.kind} without a name")
        obj = _stored(obj)
        record = None
        if kind is not NODES and kind is not SERVICE_CIDRS and event != "DELETED":
            record = _record(kind, key, obj)
        with self._lock:
            if kind is NODES:
                return self._set_node(None if event == "DELETED" else obj)
            if kind is SERVICE_CIDRS:
                cidrs = dict(self._cidrs)
                if event == "DELETED":
                    cidrs.pop(key[2], None)
                else:
                    cidrs[key[2]] = obj
                return self._set_cidrs(cidrs)
            if event == "DELETED":
                if key not in self._objects:
                    return False
                self._remove(key)
                return True
            assert record is not None
            if self._objects.get(key) == record:
                return False
            self._put(key, record)
            return True

    def _set_node(self, obj: dict[str, Any] | None) -> bool:
        """Our Node as the server has it now; True when anything the proxy reads changed.

        A Node that disappears (deleted, or missing from a relist) leaves its last facts in
        force: dropping them would drop the NodeCIDR local-traffic rule and the NodePort
        addresses (NodePorts would then answer on every local address). kube-proxy too fixes
        them at start and only logs that the Node is being deleted. `node_object()` does say
        it is gone, for /healthz.
        """
        old = self._node
        self._node = obj
        if obj is not None:
            self._known_node = obj
        elif old is not None:
            log.warning(
                "Node %s is gone from the API server: keeping its last addresses, pod CIDRs and "
                "labels for the rules until it is back",
                show(self._node_config.name),
            )
        return _node_facts(old) != _node_facts(obj)

    def _set_cidrs(self, cidrs: dict[str, dict[str, Any]]) -> bool:
        """Only the spec counts: status conditions and resourceVersions change no rule."""
        def specs(objs: dict[str, dict[str, Any]]) -> dict[str, object]:
            return {name: obj.get("spec") for name, obj in objs.items()}

        changed = specs(cidrs) != specs(self._cidrs)
        self._cidrs = cidrs
        self._cidrs_dirty = self._cidrs_dirty or changed
        return changed

    def _put(self, key: ObjectKey, record: _Record) -> None:
        if key in self._objects:
            self._remove(key)
        group = record.group
        self._objects[key] = record
        self._groups[group] = tuple(sorted((*self._groups.get(group, ()), key)))
        self._dirty.add(group)

    def _remove(self, key: ObjectKey) -> None:
        group = self._objects.pop(key).group
        members = tuple(k for k in self._groups[group] if k != key)
        if members:
            self._groups[group] = members
        else:
            del self._groups[group]
        self._dirty.add(group)

    # Reader (the sync loop)

    def snapshot(self) -> LoadResult:
        with self._snapshot_lock:
            return self._snapshot()

    def snapshot_changes(self) -> tuple[LoadResult, Touched]:
        """The snapshot, and the keys of the service groups re-parsed since the previous call:
        what the sync loop hands the proxier, so it checks those keys and no others."""
        with self._snapshot_lock:
            result = self._snapshot()
            touched = Touched(self._taken, frozenset(self._touched))
            self._touched = set()
            self._taken = result.state
            return result, touched

    def _snapshot(self) -> LoadResult:
        """Re-parse the dirty groups only, and patch the merged state with their keys."""
        with self._lock:
            dirty, self._dirty = self._dirty, set()
            work = {
                group: [self._objects[k] for k in self._groups.get(group, ())]
                for group in dirty
            }
            node_obj = self._known_node
            cidr_objs = [self._cidrs[name] for name in sorted(self._cidrs)]
            cidrs_dirty, self._cidrs_dirty = self._cidrs_dirty, False
        if (
            not work
            and not cidrs_dirty
            and self._last is not None
            and _node_facts(self._last[0]) == _node_facts(node_obj)
        ):
            # Nothing changed: the very same state, so the sync loop's diff is O(1).
            return self._last[1]
        for group, objects in work.items():
            self._reparse(group, objects)
        node_result = load_objects(([node_obj] if node_obj else []) + cidr_objs, self._node_config)
        self._say_no_pod_cidr(node_result.state.node, node_obj)
        errors = list(node_result.errors)
        for group_errors in self._errors.values():
            errors.extend(group_errors)
        # Copies (C-speed, no hashing) so the states already handed out stay as they were.
        state = ClusterState(node_result.state.node, dict(self._services), dict(self._endpoints))
        result = LoadResult(state, tuple(errors))
        self._last = (node_obj, result)
        return result

    def _say_no_pod_cidr(self, node: NodeConfig, node_obj: dict[str, Any] | None) -> None:
        """--detect-local-mode=NodeCIDR reads the Node's pod CIDRs; until it has one, traffic
        from local pods cannot be told from the rest. Said once per such stretch."""
        if self._node_config.detect_local_mode is not LocalMode.NODE_CIDR:
            return
        missing = not _has_pod_cidr(node_obj)
        if missing and not self._no_pod_cidr_said:
            fallback = node.cluster_cidrs
            log.warning(
                "--detect-local-mode=NodeCIDR: Node %s has no podCIDR yet: %s until it has one",
                show(self._node_config.name),
                f"--cluster-cidr {','.join(fallback)} is used" if fallback
                else "traffic from local pods cannot be detected",
            )
        self._no_pod_cidr_said = missing

    def _reparse(self, group: GroupKey, records: list[_Record]) -> None:
        """One group's records assembled again; its old keys leave the merged state, its new
        ones enter, and all of them count as touched."""
        for key in self._parsed.pop(group, ()):
            self._services.pop(key, None)
            self._endpoints.pop(key, None)
            self._touched.add(key)
        self._errors.pop(group, None)
        if records:
            parsed = assemble((e for record in records for e in record.entries), self._node_config)
            self._parsed[group] = tuple(parsed.state.services)
            self._services.update(parsed.state.services)
            self._endpoints.update(parsed.state.endpoints)
            self._touched.update(parsed.state.services)
            self._touched.update(parsed.state.endpoints)
            if parsed.errors:
                self._errors[group] = parsed.errors
            # Once per change of the group, as the file source logs a changed file's.
            for err in parsed.errors:
                log.warning("skipped: %s", err)
        if group[0] == "service":
            times = _trigger_times(records)
            if times:
                self._triggers[group[1:]] = times
            else:
                self._triggers.pop(group[1:], None)

    def trigger_times(self, namespace: str, service: str) -> dict[str, float]:
        """{"IPv4"|"IPv6": epoch seconds} from the service's EndpointSlices in the last snapshot."""
        return dict(self._triggers.get((namespace, service), {}))

    def node_object(self) -> dict[str, Any] | None:
        """Our Node as the API server last sent it (None before the list, or if it is gone)."""
        with self._lock:
            return self._node

    def counts(self) -> dict[str, int]:
        with self._lock:
            out = {
                SERVICES.kind: 0,
                ENDPOINT_SLICES.kind: 0,
                NODES.kind: int(self._node is not None),
                SERVICE_CIDRS.kind: len(self._cidrs),
            }
            for kind, _, _ in self._objects:
                out[kind] += 1
            return out


# --------------------------------------------------------------------------------------------
# One list+watch loop per kind


_SPACE = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()
_ITEM = "items[]"


def _members(text: str) -> Iterator[tuple[str, Any]]:
    """A JSON object's members as (key, value) in order, except that each entry of an `items`
    array comes as (`_ITEM`, entry) the moment it is decoded. Every key and value is decoded by
    `json`; only the object's and the array's own punctuation is read here.

    Why not `json.loads`: a list of 10 000 EndpointSlices decodes to ~100 MB of dicts held at
    once; the records made of them are a fraction of that, but land among the freed dicts, and
    CPython returns an arena to the system only when every object in it is gone. Decoding one
    item at a time lets each item's dicts reuse the last one's memory (docs/design.md, "The API
    source's memory"). Raises ValueError on anything but one JSON object.
    """
    pos = _open(text, _SPACE.match(text).end(), "{")  # type: ignore[union-attr]
    if text.startswith("}", pos):
        return _end(text, pos + 1)
    while True:
        key, pos = _DECODER.raw_decode(text, pos)
        if not isinstance(key, str):
            raise ValueError(f"a key that is no string at {pos}")
        pos = _SPACE.match(text, pos).end()  # type: ignore[union-attr]
        pos = _open(text, pos, ":")
        if key == "items" and text.startswith("[", pos):
            pos = _open(text, pos, "[")
            more = not text.startswith("]", pos)
            pos = pos if more else pos + 1
            while more:
                item, pos = _DECODER.raw_decode(text, pos)
                yield _ITEM, item
                del item
                pos, more = _next(text, pos, "]")
        else:
            value, pos = _DECODER.raw_decode(text, pos)
            yield key, value
            del value
        pos, more = _next(text, pos, "}")
        if not more:
            return _end(text, pos)


def _open(text: str, pos: int, char: str) -> int:
    """Past `char` at `pos` and the white space after it."""
    if not text.startswith(char, pos):
        raise ValueError(f"expected {char!r} at {pos}")
    return _SPACE.match(text, pos + 1).end()  # type: ignore[union-attr]


def _next(text: str, pos: int, close: str) -> tuple[int, bool]:
    """Past the `,` (True: another member follows) or the `close` (False) after a value."""
    pos = _SPACE.match(text, pos).end()  # type: ignore[union-attr]
    if text.startswith(",", pos):
        return _SPACE.match(text, pos + 1).end(), True  # type: ignore[union-attr]
    if text.startswith(close, pos):
        return pos + 1, False
    raise ValueError(f"expected ',' or {close!r} at {pos}")


def _end(text: str, pos: int) -> None:
    if _SPACE.match(text, pos).end() != len(text):  # type: ignore[union-attr]
        raise ValueError(f"extra data at {pos}")


class _Reflector:
    def __init__(
        self,
        kind: _Kind,
        call: Callable[..., Any],
        cache: ObjectCache,
        settings: WatchSettings,
        on_change: Callable[[], None],
        stopping: threading.Event,
        field_selector: str | None = None,
    ) -> None:
        self.kind = kind
        self._call = call
        self._cache = cache
        self._settings = settings
        self._on_change = on_change
        self._stopping = stopping
        self._field_selector = field_selector
        self._rng = random.Random()
        self._response: Any = None
        self._response_lock = threading.Lock()
        self.synced = threading.Event()
        # Where the next watch resumes; None means list first. Advanced by every event and
        # bookmark as it arrives, so a stream cut mid-way resumes after the last one seen.
        self.version: str | None = None
        # The resourceVersion a list asks for, as client-go's reflector: "0" at first (served
        # from the API server's watch cache, cheap when a thousand nodes start together), ""
        # after a 410 (a consistent read: a relist never goes back in time).
        self._list_from = "0"
        # 404 or 403 while the kind is not served / not allowed (kinds with a fallback only).
        self._absent: int | None = None
        self._progress = False
        self._empty_since: float | None = None
        self.on_error: list[Callable[[str], None]] = []
        self.lists = 0
        self.watches = 0
        self.thread = threading.Thread(
            target=self._run, name=f"nfproxy-watch-{kind.plural}", daemon=True
        )

    def _run(self) -> None:
        failures = 0  # consecutive failed requests
        relists = 0  # consecutive 410s
        while not self._stopping.is_set():
            self._progress = False
            try:
                if self.version is None:
                    self.version = self._list()
                if self._watch():
                    failures = relists = 0
                    continue
                failures += 1
                delay = self._settings.backoff(failures, self._rng)
                log.info("%s watch ended at once; retrying in %.1fs", self.kind.plural, delay)
            except _Stopped:
                break
            except _NotServed as exc:
                self.version = None
                self._fall_back(exc.status)
                delay = self._settings.absent_relist * (
                    1 + self._settings.jitter * (2 * self._rng.random() - 1)
                )
            except _Gone as exc:
                self.version = None
                self._list_from = ""
                relists += 1
                if relists == 1:
                    # The server is up, our version is just old: relist right away.
                    log.info("%s: %s; relisting", self.kind.plural, exc)
                    continue
                delay = self._settings.backoff(relists - 1, self._rng)
                log.warning("%s: %s again; relisting in %.1fs", self.kind.plural, exc, delay)
            except Exception as exc:  # noqa: BLE001 - the loop must survive any client error
                if self._stopping.is_set():
                    break
                if self._progress:
                    failures = 0  # a stream that worked for a while, then broke
                failures += 1
                delay = self._settings.backoff(failures, self._rng)
                log.warning(
                    "%s %s failed (%s); retrying in %.1fs",
                    self.kind.plural,
                    "list" if self.version is None else "watch",
                    _describe(exc),
                    delay,
                    exc_info=log.isEnabledFor(logging.DEBUG),
                )
                if _not_served(self.kind, exc):
                    self.version = None  # the list says whether the kind is still there
            self._stopping.wait(delay)

    def _selector(self) -> dict[str, Any]:
        return {"field_selector": self._field_selector} if self._field_selector else {}

    def _fall_back(self, status: int) -> None:
        """The kind is not served (404) or not allowed (403): none of it, and synced, so the
        proxy runs on its fallback. Said once per status, not at every relist."""
        if status != self._absent:
            self._absent = status
            if status == 404:
                log.info(
                    "%s are not served by this API server: %s (listing again every %gs in case "
                    "an upgrade brings them)",
                    self.kind.kind + "s", self.kind.fallback, self._settings.absent_relist,
                )
            else:
                log.warning(
                    "not allowed to list %s (HTTP 403): %s. Grant the proxy's account list and "
                    "watch on %s (listing again every %gs)",
                    self.kind.resource, self.kind.fallback, self.kind.resource,
                    self._settings.absent_relist,
                )
        changed = self._cache.replace(self.kind, [])
        if changed or not self.synced.is_set():
            self._on_change()
        self.synced.set()

    def _list_page(self, token: str | None) -> Any:
        """One page. A continuation carries no resourceVersion: the API server refuses both
        (the token holds the snapshot's version)."""
        s = self._settings
        version = {"resource_version": self._list_from} if self._list_from and not token else {}
        try:
            return self._call(
                limit=s.page_size,
                _continue=token,
                _preload_content=False,
                _request_timeout=(s.connect_timeout, s.list_timeout),
                **version,
                **self._selector(),
            )
        except ApiException as exc:
            if exc.status == GONE:
                raise _Gone("list continuation expired") from None
            if token is None and _not_served(self.kind, exc):
                raise _NotServed(exc.status) from None
            raise

    def _list(self) -> str:
        """Every object (page by page, one consistent snapshot); returns its resourceVersion.

        With resourceVersion "0" the API server answers from its watch cache and ignores
        `limit`: one page, however many objects. client-go sends the limit anyway (it matters
        when the watch cache is off), and so do we."""
        fresh: dict[ObjectKey, Any] = {}
        version: str | None = None
        token: str | None = None
        while True:
            meta = self._read_page(token, fresh)
            if version is None:
                version = meta.get("resourceVersion")
            token = meta.get("continue") or None
            if token is None:
                break
        if not isinstance(version, str) or not version:
            raise _StreamError(f"{self.kind.plural} list response has no resourceVersion")
        if self._stopping.is_set():
            raise _Stopped()
        self._guard_empty_relist(fresh)
        changed = self._cache.install(self.kind, fresh)
        self.lists += 1
        first = not self.synced.is_set()
        if self._absent is not None:
            log.info("%s are served now", self.kind.resource)
            self._absent = None
        log.info("listed %d %s at resourceVersion %s", len(fresh), self.kind.plural, version)
        # Notify before saying synced: whoever waits for readiness then never sees this list's
        # notice arrive after it (a sync loop woken early just finds the source not ready yet).
        if changed or first:
            self._on_change()
        self.synced.set()
        return version

    def _read_page(self, token: str | None, fresh: dict[ObjectKey, Any]) -> dict[str, Any]:
        """One page's items into `fresh`, each parsed as soon as it is decoded (`_members`);
        returns the page's list metadata."""
        response = self._list_page(token)
        try:
            text = response.data.decode("utf-8-sig")  # as json.loads reads bytes: a BOM is no error
        except UnicodeDecodeError:
            raise _StreamError(f"{self.kind.plural} list response is not UTF-8") from None
        finally:
            response.release_conn()
        del response
        meta: dict[str, Any] = {}
        try:
            for key, value in _members(text):
                if key == _ITEM:
                    if isinstance(value, dict):
                        # List items carry neither kind nor apiVersion; watch events do.
                        typed = {**value, "kind": self.kind.kind, "apiVersion": self.kind.api_version}
                        del value
                        self._cache.prepare(self.kind, typed, fresh)
                elif key == "metadata" and isinstance(value, dict):
                    meta = value
                elif key == "items" and value is not None:
                    raise _StreamError(f"{self.kind.plural} list response is not a list")
        except ValueError as exc:
            raise _StreamError(f"{self.kind.plural} list response is not JSON ({exc})") from None
        return meta

    def _guard_empty_relist(self, objects: dict[ObjectKey, Any]) -> None:
        """Raise _EmptyRelistHeld (a failed list: retried with backoff, the copy kept) until an
        empty relist of a kind we hold has stayed empty for `empty_grace`."""
        held = self._cache.counts()[self.kind.kind]
        if objects or self.kind is NODES or not self.synced.is_set() or not held:
            self._empty_since = None
            return
        now = time.monotonic()
        if self._empty_since is None:
            self._empty_since = now
            for hook in self.on_error:
                hook("api")
        waited = now - self._empty_since
        if waited < self._settings.empty_grace:
            raise _EmptyRelistHeld(
                f"relist found no {self.kind.plural} where {held} were: keeping them until it "
                f"stays so for {self._settings.empty_grace:g}s ({waited:.0f}s so far)"
            )
        log.warning("%s: the relist has been empty for %.0fs: removing all %d", self.kind.plural, waited, held)
        self._empty_since = None

    def _watch(self) -> bool:
        """Follow one watch request from `self.version`; True if the request was worth it
        (delivered something, or lasted a while)."""
        s = self._settings
        timeout = int(s.watch_timeout * (1 + self._rng.random() * 0.5)) or 1
        started = time.monotonic()
        try:
            response = self._call(
                watch=True,
                resource_version=self.version,
                allow_watch_bookmarks=True,
                timeout_seconds=timeout,
                _preload_content=False,
                _request_timeout=(s.connect_timeout, timeout + s.watch_read_margin),
                **self._selector(),
            )
        except ApiException as exc:
            if exc.status == GONE:
                raise _Gone(f"resourceVersion {self.version} is too old") from None
            raise
        self.watches += 1
        delivered = 0
        with self._response_lock:
            self._response = response
        try:
            if self._stopping.is_set():
                return True
            for line in iter_resp_lines(response):
                if not line.strip():
                    continue
                self._event(line)
                delivered += 1
                if self._stopping.is_set():
                    break
        finally:
            with self._response_lock:
                self._response = None
            response.close()
            response.release_conn()
        return bool(delivered) or time.monotonic() - started >= s.min_watch_seconds

    def _event(self, line: str) -> None:
        try:
            event = json.loads(line)
        except json.JSONDecodeError as exc:
            raise _StreamError(f"undecodable watch event ({exc.msg})") from None
        if not isinstance(event, dict) or not isinstance(event.get("object"), dict):
            raise _StreamError("watch event without an object")
        kind, obj = event.get("type"), event["object"]
        if kind == "ERROR":
            code, message = obj.get("code"), obj.get("message")
            if code == GONE:
                raise _Gone(f"watch expired: {show(message)}")
            raise _StreamError(f"watch error {show(code)}: {show(message)}")
        new_version = _meta(obj).get("resourceVersion")
        if not isinstance(new_version, str) or not new_version:
            raise _StreamError(f"{show(kind)} event without a resourceVersion")
        if kind == "BOOKMARK":
            self.version = new_version
            self._progress = True
            return
        if kind not in ("ADDED", "MODIFIED", "DELETED"):
            raise _StreamError(f"unknown watch event type {show(kind)}")
        obj = {**obj, "kind": self.kind.kind, "apiVersion": self.kind.api_version}
        changed = self._cache.apply(self.kind, kind, obj)
        self.version = new_version
        self._progress = True
        if changed:
            self._on_change()

    def interrupt(self) -> None:
        """Unblock a thread waiting on the watch stream (called from `stop`)."""
        with self._response_lock:
            response = self._response
        if response is None:
            return
        try:
            sock = getattr(getattr(response, "connection", None), "sock", None)
            if sock is not None:
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _not_served(kind: _Kind, exc: BaseException) -> bool:
    """A 404 (not served) or 403 (forbidden) for a kind the proxy can do without."""
    return bool(kind.fallback) and isinstance(exc, ApiException) and exc.status in (403, 404)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, ApiException):
        return f"HTTP {exc.status} {exc.reason}"
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:200]}"


# --------------------------------------------------------------------------------------------
# Requests


# The query parameters of a list or watch, as the generated client names its keywords.
_QUERY = {
    "allow_watch_bookmarks": "allowWatchBookmarks",
    "_continue": "continue",
    "field_selector": "fieldSelector",
    "limit": "limit",
    "resource_version": "resourceVersion",
    "timeout_seconds": "timeoutSeconds",
    "watch": "watch",
}


class _Lister:
    """A kind's list (or watch, `watch=True`) request, made as the generated
    `list_*(..., _preload_content=False)` methods make it: `ApiClient.param_serialize` (the
    server, credentials and token refresh of the configuration), `ApiClient.call_api`, and an
    `ApiException` for any status but 2xx; the raw urllib3 response is returned for the caller
    to read. The generated API classes are not used: CoreV1Api, DiscoveryV1Api and
    NetworkingV1Api import some 260 pydantic model modules for their signatures (~23 MiB of
    the daemon's RSS) to list three kinds nobody deserializes here.
    """

    def __init__(self, api_client: k8s.ApiClient, kind: _Kind) -> None:
        self._client = api_client
        group, _, version = kind.api_version.rpartition("/")
        self.path = f"/apis/{group}/{version}/{kind.plural}" if group else f"/api/{version}/{kind.plural}"

    def __call__(self, *, _preload_content: bool = False, _request_timeout: Any = None,
                 **params: Any) -> Any:
        if _preload_content:
            raise ValueError("the API source reads responses raw")
        query = [(_QUERY[name], value) for name, value in params.items() if value is not None]
        request = self._client.param_serialize(
            method="GET", resource_path=self.path, query_params=query,
            header_params={"Accept": "application/json"}, auth_settings=["BearerToken"],
        )
        response = self._client.call_api(*request, _request_timeout=_request_timeout)
        if not 200 <= response.status <= 299:
            response.read()
            raise ApiException.from_response(http_resp=response, body=None, data=None)
        return response.response


# --------------------------------------------------------------------------------------------
# The source


class KubeSource:
    """`nfproxy.sources.Source` backed by the Kubernetes API (see the module docstring)."""

    def __init__(
        self,
        api_client: k8s.ApiClient,
        node: NodeConfig,
        settings: WatchSettings = WatchSettings(),
    ) -> None:
        if not node.name:
            raise ValueError("the API source needs the node name (to watch our own Node)")
        self.node = node
        self.settings = settings
        self._api_client = api_client
        self.cache = ObjectCache(node)
        self._stopping = threading.Event()
        self._notify: Callable[[], None] = lambda: None
        self.reflectors = (
            self._reflector(SERVICES, _Lister(api_client, SERVICES)),
            self._reflector(ENDPOINT_SLICES, _Lister(api_client, ENDPOINT_SLICES)),
            self._reflector(NODES, _Lister(api_client, NODES), f"metadata.name={node.name}"),
            self._reflector(SERVICE_CIDRS, _Lister(api_client, SERVICE_CIDRS)),
        )
        self._started = False
        # The daemon counts held empty relists (nfproxy_source_errors_total{source="api"}).
        self.on_error: list[Callable[[str], None]] = []
        for reflector in self.reflectors:
            reflector.on_error = self.on_error

    def _reflector(
        self, kind: _Kind, call: Callable[..., Any], field_selector: str | None = None
    ) -> _Reflector:
        return _Reflector(
            kind, call, self.cache, self.settings, self._changed, self._stopping, field_selector
        )

    def _changed(self) -> None:
        self._notify()

    def start(self, notify: Callable[[], None]) -> None:
        if self._started:
            raise RuntimeError("KubeSource.start called twice")
        self._started = True
        self._notify = notify
        for reflector in self.reflectors:
            reflector.thread.start()

    def snapshot(self) -> LoadResult:
        return self.cache.snapshot()

    def snapshot_changes(self) -> tuple[LoadResult, Touched]:
        return self.cache.snapshot_changes()

    def ready(self) -> bool:
        return all(r.synced.is_set() for r in self.reflectors)

    def wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        for reflector in self.reflectors:
            if not reflector.synced.wait(max(0.0, deadline - time.monotonic())):
                return False
        return True

    def stop(self) -> None:
        """Prompt: watches are interrupted; a list in flight cannot be (the client gives no
        handle on its socket before the answer), so its thread, a daemon thread that changes
        nothing once stopping, is waited for `stop_timeout` in all and then left behind."""
        self._stopping.set()
        for reflector in self.reflectors:
            reflector.interrupt()
        deadline = time.monotonic() + self.settings.stop_timeout
        for reflector in self.reflectors:
            if reflector.thread.is_alive():
                reflector.thread.join(timeout=max(0.0, deadline - time.monotonic()))
        busy = [r.kind.plural for r in self.reflectors if r.thread.is_alive()]
        if busy:
            log.info("stopped without waiting for the %s request(s) in flight", ", ".join(busy))
        self._api_client.close()

    def node_object(self) -> dict[str, Any] | None:
        """Our own Node object, raw: for /healthz's node eligibility (`server.node_eligible`)."""
        return self.cache.node_object()

    def trigger_times(self, namespace: str, service: str) -> dict[str, float]:
        """When the change now in the snapshot was triggered, per address type (for
        kubeproxy_network_programming_duration_seconds)."""
        return self.cache.trigger_times(namespace, service)

    def stats(self) -> dict[str, dict[str, int]]:
        """Lists and watch requests made per resource (for logs and tests)."""
        return {r.kind.plural: {"lists": r.lists, "watches": r.watches} for r in self.reflectors}


# --------------------------------------------------------------------------------------------
# Configuration


class ConnectionConfigError(ValueError):
    """How to reach the API server is wrongly given; the message names the flag at fault.

    The command line turns it into its flag error (exit status 2); the source knows no argparse.
    """


# How often a kubeconfig `tokenFile` is read again: client-go caches it for a minute.
TOKEN_FILE_PERIOD = 60.0


def api_client(
    kubeconfig: str | None = None,
    master: str | None = None,
    *,
    token_period: float = TOKEN_FILE_PERIOD,
) -> k8s.ApiClient:
    """A client for the API server, configured as kube-proxy is.

    `--kubeconfig` gives server and credentials; `--master` overrides the server (alone, it
    means an unauthenticated connection, as for kube-proxy). With neither, the pod's service
    account is used. Raises ConnectionConfigError naming the flag at fault.
    """
    configuration = k8s.Configuration()
    if kubeconfig:
        path = os.path.expanduser(kubeconfig)
        if not os.path.isfile(path):
            raise ConnectionConfigError(f"--kubeconfig: {show(kubeconfig)}: no such file")
        try:
            load_kube_config(
                config_file=path, client_configuration=configuration, persist_config=False
            )
        except (ConfigException, OSError, ValueError, TypeError, KeyError) as exc:
            raise ConnectionConfigError(f"--kubeconfig {show(kubeconfig)}: {_one_line(exc)}") from None
        token_file = _token_file(path)
        if token_file is not None:
            configuration.refresh_api_key_hook = _TokenFile(
                token_file, configuration.api_key.get("BearerToken", ""), token_period
            )
    elif not master:
        if not os.path.exists(incluster_config.SERVICE_TOKEN_FILENAME):
            raise ConnectionConfigError(
                "no API server: give --kubeconfig or --master (or --manifests), or run in a pod "
                f"with a service account ({incluster_config.SERVICE_TOKEN_FILENAME} is missing)"
            )
        try:
            load_incluster_config(client_configuration=configuration)
        except ConfigException as exc:
            raise ConnectionConfigError(f"in-cluster configuration: {_one_line(exc)}") from None
    if master:
        configuration.host = _master_url(master)
    # Retries are ours (with backoff and relist logic); urllib3's would hide failures.
    configuration.retries = 0
    # client-go's TCP keepalive timings: a watch through a dead peer or an idle-killing load
    # balancer fails in about a minute instead of hanging until its read timeout.
    configuration.keep_alive = True
    client = k8s.ApiClient(configuration)
    client.user_agent = USER_AGENT
    return client


def _token_file(kubeconfig: str) -> str | None:
    """The current user's `tokenFile` (relative to the kubeconfig's directory, as both clients
    resolve it), when it is what authenticates: no `token`, exec plugin or auth provider
    (those come first in the client's order)."""
    try:
        with open(kubeconfig, encoding="utf-8") as f:
            doc = yaml.safe_load(f)
        context_name = doc["current-context"]
        context = next(c["context"] for c in doc["contexts"] if c["name"] == context_name)
        user = next(u["user"] for u in doc["users"] if u["name"] == context["user"])
    except (OSError, yaml.YAMLError, KeyError, TypeError, StopIteration):
        return None  # the client loaded it, so whatever is odd here is no token file of ours
    if not isinstance(user, dict) or not isinstance(user.get("tokenFile"), str):
        return None
    if user.get("token") or user.get("exec") or user.get("auth-provider"):
        return None
    return os.path.join(os.path.dirname(os.path.abspath(kubeconfig)), user["tokenFile"])


class _TokenFile:
    """The client's `refresh_api_key_hook` for a kubeconfig `tokenFile`.

    The Python client reads the file once; a projected service account token (kubeadm's
    kube-proxy kubeconfig points at one) is rotated by the kubelet and the old one expires.
    client-go reads the file again when its cached copy is a minute old; so do we, on the
    request that finds it so. An unreadable or empty file keeps the last token (said once).
    """

    def __init__(self, path: str, header: str, period: float) -> None:
        self.path = path
        self.period = period
        self._header = header
        self._read_at = time.monotonic()
        self._failing = False
        self._lock = threading.Lock()

    def __call__(self, configuration: k8s.Configuration) -> None:
        with self._lock:
            if time.monotonic() - self._read_at >= self.period:
                self._read_at = time.monotonic()
                self._reread()
            configuration.api_key["BearerToken"] = self._header

    def _reread(self) -> None:
        try:
            with open(self.path, encoding="utf-8") as f:
                token = f.read().strip()
        except (OSError, UnicodeDecodeError) as exc:
            token, problem = "", _one_line(exc)
        else:
            problem = "the file is empty"
        if token:
            self._header = f"Bearer {token}"
            self._failing = False
        elif not self._failing:
            self._failing = True
            log.warning("tokenFile %s: %s; keeping the last token", show(self.path), problem)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 300 else text[:297] + "..."


def _master_url(master: str) -> str:
    parsed = urlparse(master)
    try:
        port = parsed.port
    except ValueError:
        port = -1
    if parsed.scheme not in ("http", "https") or not parsed.hostname or port == -1:
        raise ConnectionConfigError(f"--master: {show(master)} is not an http(s)://host[:port] URL")
    if parsed.query or parsed.fragment or any(c.isspace() for c in master):
        raise ConnectionConfigError(f"--master: {show(master)} is not an http(s)://host[:port] URL")
    return master.rstrip("/")


def default_node_name() -> str:
    """The node name when --hostname-override is not given: the host name, as kube-proxy."""
    return socket.gethostname().strip().lower()

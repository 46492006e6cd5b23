"""A small Kubernetes API server for tests: list and watch, faithful enough for the real client.

The real kube-apiserver runs in the tests too (`scripts/kube`, tests/test_real_apiserver.py,
which also holds this server to it: the same stored objects give the same model). This one stays
for the faults the real server cannot be made to show on demand: a watch cut mid-stream, a
paused or slow watch cache, chosen error statuses, a resource not served, a relist that comes
back empty, pagination tokens that expire. It speaks the wire protocol the official client (and so
`nfproxy.sources.kube`) talks, for Services, EndpointSlices (discovery.k8s.io/v1), Nodes and
ServiceCIDRs (networking.k8s.io/v1, cluster-scoped):

- **list**: `GET /api/v1/services`, `/api/v1/namespaces/NS/services`,
  `/apis/discovery.k8s.io/v1/[namespaces/NS/]endpointslices`, `/api/v1/nodes`,
  `/apis/networking.k8s.io/v1/servicecidrs`; a `*List` with
  `metadata.resourceVersion`, items without `kind`/`apiVersion` (as the real server sends them),
  `limit`/`continue` pagination over one consistent snapshot (an expired token is 410 Expired),
  `fieldSelector` (metadata.name, metadata.namespace) and equality `labelSelector`s.
  `resourceVersion` as the real server reads it: unset is a consistent read (paginated);
  "0" is served from the watch cache, which **ignores `limit`** (one page, no `continue`); a
  version newer than the server's is 504 "Too large resource version"; a `continue` together
  with a `resourceVersion` is 400.
- **watch** (`watch=true`): a chunked HTTP/1.1 stream, one JSON event per line and per chunk;
  `resourceVersion` unset or "0" starts with synthetic ADDED events for what exists; a
  resourceVersion older than the compacted history gets an ERROR event with a 410 Status (as
  the real server does: status 200, then the error in the stream); `allowWatchBookmarks` gets a
  BOOKMARK every `bookmark_interval`; `timeoutSeconds` ends the stream cleanly.
- **faults**, driven by the test: `drop_watches()` cuts every watch connection mid-stream (no
  terminating chunk, as when a load balancer resets it); `stop()` / `start()` take the whole
  server away and bring it back on the same port; `compact()` forgets history (410 for anyone
  behind); `paused()` holds event delivery (a slow watch cache); `delay` slows every response;
  `fail(...)` answers the next matching requests with an error Status.
- **not served / forbidden**: a plural in `not_served` is answered as the real server answers a
  resource it does not have (404 NotFound Status; ServiceCIDRs before Kubernetes 1.33); one in
  `forbidden` as RBAC refuses it (403 Forbidden, naming user, verb and resource).

Objects are changed from the test with `apply()` and `delete()`, which assign resourceVersions
from one counter (etcd's revision) and record watch events. Every request is logged in
`requests`, so a test can tell a resumed watch from a relist.
"""

from __future__ import annotations

import base64
import bisect
import copy
import json
import re
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl, urlsplit


@dataclass(frozen=True, slots=True)
class Resource:
    plural: str
    kind: str
    api_version: str
    prefix: str
    namespaced: bool


RESOURCES = {
    r.plural: r
    for r in (
        Resource("services", "Service", "v1", "/api/v1", True),
        Resource("endpointslices", "EndpointSlice", "discovery.k8s.io/v1",
                 "/apis/discovery.k8s.io/v1", True),
        Resource("nodes", "Node", "v1", "/api/v1", False),
        Resource("servicecidrs", "ServiceCIDR", "networking.k8s.io/v1",
                 "/apis/networking.k8s.io/v1", False),
    )
}
_BY_KIND = {r.kind: r for r in RESOURCES.values()}
_ROUTE = re.compile(
    r"^(?P<prefix>/api/v1|/apis/discovery\.k8s\.io/v1|/apis/networking\.k8s\.io/v1)"
    r"(?:/namespaces/(?P<namespace>[a-z0-9][-a-z0-9]*))?/(?P<plural>[a-z]+)/?$"
)
# How long a watch without timeoutSeconds may run (the real server picks a random 30-60 min).
_MAX_WATCH = 1800.0

ObjectKey = tuple[str, str, str]  # (plural, namespace, name)


@dataclass(slots=True)
class Request:
    """One request as the server saw it (logged on arrival; `status` set when answered)."""

    path: str
    query: dict[str, str]
    plural: str
    watch: bool
    status: int = 200
    authorization: str = ""
    user_agent: str = ""

    @property
    def is_list(self) -> bool:
        return not self.watch


@dataclass(frozen=True, slots=True)
class _Event:
    rv: int
    type: str
    plural: str
    obj: dict[str, Any]


@dataclass(slots=True)
class _Failure:
    status: int
    count: int
    plural: str | None
    watch: bool | None


@dataclass(slots=True)
class _Selector:
    fields: list[tuple[str, str, bool]] = field(default_factory=list)  # (path, value, equal)
    labels: list[tuple[str, str | None, bool]] = field(default_factory=list)

    def matches(self, obj: dict[str, Any]) -> bool:
        meta = obj.get("metadata") or {}
        for path, value, equal in self.fields:
            actual = meta.get(path.split(".", 1)[1]) or ""
            if (actual == value) != equal:
                return False
        labels = meta.get("labels") or {}
        for key, value, equal in self.labels:
            if value is None:
                if (key in labels) != equal:
                    return False
            elif (labels.get(key) == value) != equal:
                return False
        return True


class _BadRequest(Exception):
    pass


class _Gone(Exception):
    """Answer 410 Expired."""


class _TooLarge(Exception):
    """Answer 504: the version asked for is newer than any the server has (yet)."""


class _Dropped(Exception):
    """The connection is to be cut without a proper end (a fault the test asked for)."""


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


_REASONS = {400: "BadRequest", 403: "Forbidden", 404: "NotFound", 410: "Expired", 429: "TooManyRequests",
            500: "InternalError", 503: "ServiceUnavailable", 504: "Timeout"}


def _parse_selector(field_selector: str, label_selector: str) -> _Selector:
    selector = _Selector()
    for term in filter(None, (t.strip() for t in field_selector.split(","))):
        m = re.fullmatch(r"(metadata\.name|metadata\.namespace)\s*(==|=|!=)\s*([^=!]*)", term)
        if not m:
            raise _BadRequest(f'field label not supported: "{term}"')
        selector.fields.append((m.group(1), m.group(3), m.group(2) != "!="))
    for term in filter(None, (t.strip() for t in label_selector.split(","))):
        m = re.fullmatch(r"(!?)([A-Za-z0-9./_-]+)(?:\s*(==|=|!=)\s*([A-Za-z0-9._-]*))?", term)
        if not m:
            raise _BadRequest(f'unable to parse requirement: "{term}"')
        if m.group(3) is None:
            selector.labels.append((m.group(2), None, m.group(1) != "!"))
        else:
            selector.labels.append((m.group(2), m.group(4), m.group(3) != "!="))
    return selector


class FakeApiServer:
    """See the module docstring. Use as a context manager, or `start()` / `close()`."""

    def __init__(self, *, bookmark_interval: float = 0.5, host: str = "127.0.0.1") -> None:
        self.bookmark_interval = bookmark_interval
        self.host = host
        self.port = 0
        self.delay = 0.0
        self.requests: list[Request] = []
        self._cond = threading.Condition()
        self._objects: dict[ObjectKey, dict[str, Any]] = {}
        self._history: list[_Event] = []
        self._rv = 1000
        self._floor = self._rv
        self._pages: dict[str, tuple[int, list[dict[str, Any]]]] = {}
        self._failures: list[_Failure] = []
        self._paused = False
        self._epoch = 0  # bumped to cut every open watch
        self._running = False
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._sockets: set[socket.socket] = set()
        self._watching: list[str] = []  # plural of each open watch stream
        # Resources this server does not have (404), and those RBAC refuses the client (403).
        self.not_served: set[str] = set()
        self.forbidden: set[str] = set()

    # ----------------------------------------------------------------------------------------
    # Lifecycle

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> None:
        """Listen (again, on the same port after a `stop()`)."""
        handler = type("Handler", (_Handler,), {"api": self})
        httpd = ThreadingHTTPServer((self.host, self.port), handler)
        httpd.daemon_threads = True
        self.port = httpd.server_address[1]
        with self._cond:
            self._running = True
        self._httpd = httpd
        self._thread = threading.Thread(
            target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True,
            name="fake-apiserver",
        )
        self._thread.start()

    def stop(self) -> None:
        """Go away: stop listening and cut every connection, idle or streaming."""
        with self._cond:
            self._running = False
            self._epoch += 1
            self._cond.notify_all()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        self._cut_sockets()

    def close(self) -> None:
        self.stop()

    def __enter__(self) -> FakeApiServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _cut_sockets(self) -> None:
        with self._cond:
            sockets = list(self._sockets)
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    # ----------------------------------------------------------------------------------------
    # Faults

    def drop_watches(self) -> None:
        """Cut every open watch stream mid-way (no terminating chunk)."""
        with self._cond:
            self._epoch += 1
            self._cond.notify_all()

    def compact(self) -> None:
        """Forget history, as etcd compaction does: watching from before now gets 410 Gone,
        and so does continuing a paginated list begun before now."""
        with self._cond:
            self._floor = self._rv
            self._history.clear()
            self._pages.clear()
            self._cond.notify_all()

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Hold event delivery to watchers (changes still happen and are listed)."""
        with self._cond:
            self._paused = True
        try:
            yield
        finally:
            with self._cond:
                self._paused = False
                self._cond.notify_all()

    def fail(
        self,
        status: int,
        count: int = 1,
        *,
        plural: str | None = None,
        watch: bool | None = None,
    ) -> None:
        """Answer the next `count` matching requests with an error Status."""
        with self._cond:
            self._failures.append(_Failure(status, count, plural, watch))

    # ----------------------------------------------------------------------------------------
    # Objects (from the test)

    @property
    def resource_version(self) -> int:
        with self._cond:
            return self._rv

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Create or replace an object (ADDED or MODIFIED); returns the stored copy."""
        resource = _BY_KIND[obj["kind"]]
        stored = copy.deepcopy(obj)
        stored["apiVersion"] = resource.api_version
        meta = stored.setdefault("metadata", {})
        if resource.namespaced:
            meta.setdefault("namespace", "default")
        else:
            meta.pop("namespace", None)
        key = (resource.plural, meta.get("namespace", ""), meta["name"])
        with self._cond:
            old = self._objects.get(key)
            self._rv += 1
            meta["resourceVersion"] = str(self._rv)
            if old is None:
                meta["uid"] = str(uuid.uuid4())
                meta["creationTimestamp"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            else:
                meta["uid"] = old["metadata"]["uid"]
                meta["creationTimestamp"] = old["metadata"]["creationTimestamp"]
            self._objects[key] = stored
            self._record("ADDED" if old is None else "MODIFIED", resource.plural, stored)
            return copy.deepcopy(stored)

    def delete(self, kind: str, namespace: str, name: str) -> None:
        resource = _BY_KIND[kind]
        key = (resource.plural, namespace if resource.namespaced else "", name)
        with self._cond:
            gone = self._objects.pop(key)
            self._rv += 1
            final = copy.deepcopy(gone)
            final["metadata"]["resourceVersion"] = str(self._rv)
            self._record("DELETED", resource.plural, final)

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any]:
        resource = _BY_KIND[kind]
        with self._cond:
            return copy.deepcopy(
                self._objects[(resource.plural, namespace if resource.namespaced else "", name)]
            )

    def _record(self, kind: str, plural: str, obj: dict[str, Any]) -> None:
        self._history.append(_Event(self._rv, kind, plural, obj))
        self._cond.notify_all()

    # ----------------------------------------------------------------------------------------
    # Request log

    def count(self, plural: str, *, watch: bool) -> int:
        with self._cond:
            return sum(1 for r in self.requests if r.plural == plural and r.watch == watch)

    def wait_for(self, predicate: Any, timeout: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return True
            time.sleep(0.02)
        return bool(predicate())

    def open_watches(self, plural: str | None = None) -> int:
        with self._cond:
            return sum(1 for p in self._watching if plural is None or p == plural)

    # ----------------------------------------------------------------------------------------
    # Serving (called from the handler threads)

    def _take_failure(self, plural: str, watch: bool) -> int | None:
        with self._cond:
            for failure in self._failures:
                if failure.count > 0 and failure.plural in (None, plural) and failure.watch in (
                    None,
                    watch,
                ):
                    failure.count -= 1
                    return failure.status
            return None

    def _list(
        self, resource: Resource, namespace: str | None, selector: _Selector, query: dict[str, str]
    ) -> dict[str, Any]:
        limit = int(query["limit"]) if query.get("limit") else 0
        if limit < 0:
            raise _BadRequest("limit must not be negative")
        token = query.get("continue")
        raw_rv = query.get("resourceVersion", "")
        if token and raw_rv:
            raise _BadRequest("specifying resource version is not allowed when using continue")
        if raw_rv == "0":
            limit = 0  # served from the watch cache, which does not paginate
        elif raw_rv:
            try:
                asked = int(raw_rv)
            except ValueError:
                raise _BadRequest(f"invalid resourceVersion {raw_rv!r}") from None
            if asked > self.resource_version:
                raise _TooLarge(f"Too large resource version: {asked}, current: {self.resource_version}")
        with self._cond:
            if token:
                try:
                    page_id, start = json.loads(base64.urlsafe_b64decode(token.encode()))
                except (ValueError, TypeError):
                    raise _BadRequest("continue key is not valid") from None
                if page_id not in self._pages:
                    raise _Gone("The provided continue parameter is too old to display a "
                                "consistent list result. You can start a new list without "
                                "the continue parameter.")
                rv, items = self._pages[page_id]
            else:
                rv, start = self._rv, 0
                items = [
                    obj
                    for (plural, ns, _), obj in sorted(self._objects.items())
                    if plural == resource.plural
                    and (namespace is None or ns == namespace)
                    and selector.matches(obj)
                ]
            end = len(items) if not limit else min(len(items), start + limit)
            meta: dict[str, Any] = {"resourceVersion": str(rv)}
            if end < len(items):
                page_id = token and json.loads(base64.urlsafe_b64decode(token.encode()))[0]
                if not page_id:
                    page_id = uuid.uuid4().hex
                    self._pages[page_id] = (rv, items)
                meta["continue"] = base64.urlsafe_b64encode(
                    json.dumps([page_id, end]).encode()
                ).decode()
                meta["remainingItemCount"] = len(items) - end
            page = []
            for obj in items[start:end]:
                item = copy.deepcopy(obj)
                item.pop("kind", None)
                item.pop("apiVersion", None)
                page.append(item)
        return {
            "kind": f"{resource.kind}List",
            "apiVersion": resource.api_version,
            "metadata": meta,
            "items": page,
        }

    def _watch(
        self,
        handler: _Handler,
        resource: Resource,
        namespace: str | None,
        selector: _Selector,
        query: dict[str, str],
    ) -> None:
        raw_rv = query.get("resourceVersion", "")
        timeout = float(query["timeoutSeconds"]) if query.get("timeoutSeconds") else _MAX_WATCH
        bookmarks = query.get("allowWatchBookmarks", "").lower() in ("true", "1")
        deadline = time.monotonic() + min(timeout, _MAX_WATCH)

        def wanted(plural: str, obj: dict[str, Any]) -> bool:
            ns = (obj.get("metadata") or {}).get("namespace", "")
            return (
                plural == resource.plural
                and (namespace is None or ns == namespace)
                and selector.matches(obj)
            )

        initial: list[dict[str, Any]] = []
        with self._cond:
            epoch = self._epoch
            if raw_rv in ("", "0"):
                pos = self._rv
                initial = [
                    {"type": "ADDED", "object": copy.deepcopy(obj)}
                    for (plural, _, _), obj in sorted(self._objects.items())
                    if wanted(plural, obj)
                ]
            else:
                try:
                    pos = int(raw_rv)
                except ValueError:
                    raise _BadRequest(f"invalid resourceVersion {raw_rv!r}") from None
            self._watching.append(resource.plural)
        try:
            handler.start_stream()
            for event in initial:
                handler.send_chunk(event)
            next_bookmark = time.monotonic() + self.bookmark_interval
            while True:
                with self._cond:
                    while True:
                        if self._epoch != epoch or not self._running:
                            raise _Dropped()
                        if pos < self._floor:
                            gone = _status(410, "Expired",
                                           f"too old resource version: {pos} ({self._floor})")
                            events: list[dict[str, Any]] = [{"type": "ERROR", "object": gone}]
                            break
                        now = time.monotonic()
                        if not self._paused:
                            start = bisect.bisect_right(self._history, pos, key=lambda e: e.rv)
                            fresh = self._history[start:]
                            if fresh:
                                pos = fresh[-1].rv
                                events = [
                                    {"type": e.type, "object": copy.deepcopy(e.obj)}
                                    for e in fresh
                                    if wanted(e.plural, e.obj)
                                ]
                                if events:
                                    break
                                continue
                            pos = max(pos, self._rv)
                            if bookmarks and now >= next_bookmark:
                                events = [{"type": "BOOKMARK", "object": {
                                    "kind": resource.kind,
                                    "apiVersion": resource.api_version,
                                    "metadata": {"resourceVersion": str(pos)},
                                }}]
                                next_bookmark = now + self.bookmark_interval
                                break
                        if now >= deadline:
                            events = []
                            break
                        wake = deadline if not bookmarks else min(deadline, next_bookmark)
                        self._cond.wait(max(0.005, wake - now))
                for event in events:
                    handler.send_chunk(event)
                if not events or events[0]["type"] == "ERROR":
                    handler.end_stream()
                    return
        finally:
            with self._cond:
                self._watching.remove(resource.plural)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    api: FakeApiServer

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass

    def handle(self) -> None:
        # A client closing its pooled keep-alive connection with a reset is normal, not news.
        try:
            super().handle()
        except (ConnectionResetError, BrokenPipeError):
            self.close_connection = True

    def setup(self) -> None:
        super().setup()
        with self.api._cond:
            self.api._sockets.add(self.connection)

    def finish(self) -> None:
        with self.api._cond:
            self.api._sockets.discard(self.connection)
        try:
            super().finish()
        except OSError:
            pass

    # Responses

    def _send_json(self, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body, separators=(",", ":")).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _send_status(self, code: int, message: str) -> None:
        self._send_json(code, _status(code, _REASONS.get(code, "Unknown"), message))

    def start_stream(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.wfile.flush()

    def send_chunk(self, event: dict[str, Any]) -> None:
        data = json.dumps(event, separators=(",", ":")).encode() + b"\n"
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def end_stream(self) -> None:
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    # Requests

    def do_GET(self) -> None:  # noqa: N802 - stdlib name
        api = self.api
        parts = urlsplit(self.path)
        query = dict(parse_qsl(parts.query, keep_blank_values=True))
        watch = query.get("watch", "").lower() in ("true", "1")
        route = _ROUTE.match(parts.path)
        plural = route.group("plural") if route else ""
        resource = RESOURCES.get(plural)
        record = Request(
            parts.path,
            query,
            plural,
            watch,
            200,
            self.headers.get("Authorization", ""),
            self.headers.get("User-Agent", ""),
        )
        with api._cond:
            api.requests.append(record)
        try:
            if resource is None or route is None or route.group("prefix") != resource.prefix:
                record.status = 404
                self._send_status(404, f"the server could not find the requested resource ({parts.path})")
                return
            namespace = route.group("namespace")
            if namespace is not None and not resource.namespaced:
                record.status = 404
                self._send_status(404, f"{plural} is not namespaced")
                return
            if plural in api.not_served:
                record.status = 404
                self._send_status(404, "the server could not find the requested resource")
                return
            if plural in api.forbidden:
                record.status = 403
                group = resource.api_version.rpartition("/")[0]
                self._send_status(403, (
                    f'{plural}{"." + group if group else ""} is forbidden: User '
                    f'"system:serviceaccount:kube-system:kube-proxy" cannot '
                    f'{"watch" if watch else "list"} resource "{plural}" in API group "{group}" '
                    f'at the cluster scope'
                ))
                return
            injected = api._take_failure(plural, watch)
            if api.delay:
                time.sleep(api.delay)
            if injected is not None:
                record.status = injected
                self._send_status(injected, "injected failure")
                return
            try:
                selector = _parse_selector(
                    query.get("fieldSelector", ""), query.get("labelSelector", "")
                )
                if watch:
                    api._watch(self, resource, namespace, selector, query)
                else:
                    self._send_json(200, api._list(resource, namespace, selector, query))
            except _BadRequest as exc:
                record.status = 400
                self._send_status(400, str(exc))
            except _Gone as exc:
                record.status = 410
                self._send_status(410, str(exc))
            except _TooLarge as exc:
                record.status = 504
                self._send_status(504, str(exc))
        except _Dropped:
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True


# --------------------------------------------------------------------------------------------
# Object builders for tests


def service(
    name: str,
    cluster_ip: str,
    ports: list[tuple[str, int, str]] | None = None,
    *,
    namespace: str = "default",
    **spec: Any,
) -> dict[str, Any]:
    """A ClusterIP Service; `ports` are (name, port, protocol)."""
    ports = ports if ports is not None else [("http", 80, "TCP")]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "type": "ClusterIP",
            "clusterIP": cluster_ip,
            "clusterIPs": [cluster_ip],
            "ports": [
                {"name": n, "port": p, "protocol": proto, "targetPort": p} for n, p, proto in ports
            ],
            **spec,
        },
    }


def endpoint_slice(
    name: str,
    service_name: str,
    addresses: list[str],
    ports: list[tuple[str, int, str]] | None = None,
    *,
    namespace: str = "default",
    node_name: str = "",
    ready: bool = True,
    zone_hints: list[str] | None = None,
) -> dict[str, Any]:
    ports = ports if ports is not None else [("http", 8080, "TCP")]
    endpoints = []
    for address in addresses:
        endpoint: dict[str, Any] = {"addresses": [address], "conditions": {"ready": ready}}
        if node_name:
            endpoint["nodeName"] = node_name
        if zone_hints is not None:
            endpoint["hints"] = {"forZones": [{"name": z} for z in zone_hints]}
        endpoints.append(endpoint)
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {"kubernetes.io/service-name": service_name},
        },
        "addressType": "IPv6" if ":" in (addresses[0] if addresses else "") else "IPv4",
        "ports": [{"name": n, "port": p, "protocol": proto} for n, p, proto in ports],
        "endpoints": endpoints,
    }


def node(name: str, *, zone: str = "", ips: list[str] | None = None,
         pod_cidr: str = "") -> dict[str, Any]:
    labels = {"kubernetes.io/hostname": name}
    if zone:
        labels["topology.kubernetes.io/zone"] = zone
    obj: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": labels},
        "spec": {},
        "status": {"addresses": [{"type": "InternalIP", "address": ip} for ip in ips or []]},
    }
    if pod_cidr:
        obj["spec"] = {"podCIDR": pod_cidr, "podCIDRs": [pod_cidr]}
    return obj


def service_cidr(name: str, cidrs: list[str]) -> dict[str, Any]:
    """A ServiceCIDR (networking.k8s.io/v1): cluster-scoped, spec.cidrs one per family."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "ServiceCIDR",
        "metadata": {"name": name},
        "spec": {"cidrs": list(cidrs)},
        "status": {"conditions": [{"type": "Ready", "status": "True"}]},
    }

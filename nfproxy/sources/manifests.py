"""Kubernetes objects (Service, EndpointSlice, Node) -> ClusterState, read as kube-proxy reads them.

Two doors lead in: `load` reads manifest files (what `nfproxy render/compare/lab` and
`--manifests` use) and `load_objects` takes already-decoded objects (what the API source feeds
from list/watch). Both end in the same validation, so a watched object cannot reach the renderers
through a path the files never exercised.

Validation granularity, chosen so a mistake never widens what the rules allow:

- A problem in a field that applies to the whole object (metadata, type, cluster IPs, external
  IPs, source ranges, affinity, traffic policies, LB status; a slice's service label, address type
  or ports list; anything in a Node) skips the whole object. Dropping only, say, a malformed
  `loadBalancerSourceRanges` entry would open the load balancer wider than its author meant.
- A problem in one entry of `spec.ports` skips that service port; a problem in one slice port or
  one slice endpoint skips just that entry. Each skip fails closed: the port or backend is absent.
- Every problem is reported as an `ObjectError` naming the field path; nothing raises except
  `load` on a path that does not exist or from which nothing at all could be read.

Semantics follow upstream kube-proxy (pkg/proxy/endpointslicecache.go, serviceport.go and
pkg/api/v1/service/util.go) rather than the API documentation where they differ; each such choice
is noted where it is made. One of them: the address fields kube-proxy parses with netutils'
sloppy parser (Service cluster IPs, external IPs, load-balancer ingress IPs and source ranges,
EndpointSlice addresses, a Node's addresses and pod CIDRs) accept the leading zeros objects
stored before strict validation may hold (KEP-4858), read as decimal (`validation.sloppy_ip`);
ServiceCIDRs, validated strictly since they exist, and our own annotations stay strict.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import stat
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import yaml

from nfproxy.core.model import (
    DEFAULT_AFFINITY_TIMEOUT,
    ClusterState,
    Endpoint,
    IPFamily,
    LocalMode,
    NodeConfig,
    Protocol,
    ServicePort,
    ServicePortKey,
    ServicePortName,
    ServiceType,
    hint_set,
    shared,
    sort_endpoints,
)
from nfproxy.sources import validation as v
from nfproxy.sources.validation import FieldError, got, show, type_name

log = logging.getLogger(__name__)

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
# Opt-in endpoint weights, on the EndpointSlice: a JSON object {address: weight} (docs/weights.md).
WEIGHTS_ANNOTATION = "nfproxy.io/endpoint-weights"
ZONE_LABEL = "topology.kubernetes.io/zone"
# kube-proxy's informers select `!service-proxy-name,!headless` for Services and EndpointSlices:
# the first hands an object to another proxy (any value), the second marks a headless service's
# slices. Objects carrying either are not ours, whatever else is in them.
SERVICE_PROXY_NAME_LABEL = "service.kubernetes.io/service-proxy-name"
HEADLESS_LABEL = "service.kubernetes.io/headless"
_NOT_OURS_LABELS = (SERVICE_PROXY_NAME_LABEL, HEADLESS_LABEL)
MANIFEST_SUFFIXES = (".yaml", ".yml", ".json")
# No real manifest set comes near this; a symlink to a huge file must not exhaust memory.
DEFAULT_MAX_BYTES = 16 * 2**20

_SERVICE = ("v1", "Service")
_SLICE = ("discovery.k8s.io/v1", "EndpointSlice")
_NODE = ("v1", "Node")
_SERVICE_CIDR = ("networking.k8s.io/v1", "ServiceCIDR")
_GROUPS = {"Service": "", "EndpointSlice": "discovery.k8s.io", "Node": "", "ServiceCIDR": "networking.k8s.io"}
_CLUSTER_SCOPED = ("Node", "ServiceCIDR", "")
_PROTOCOLS = tuple(p.value for p in Protocol)
_SERVICE_TYPES = ("ClusterIP", "NodePort", "LoadBalancer", "ExternalName")
_POLICIES = ("Cluster", "Local")
# The API server accepts at most 100 addresses per endpoint; only the first is ever used.
_MAX_ADDRESSES = 100

_BaseLoader: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_NUMBERS = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")


def _no_colon(regexp: re.Pattern[str]) -> re.Pattern[str]:
    """`regexp`, refusing any value with a colon (only base-60 numbers had one)."""
    return re.compile(r"(?=[^:]*$)" + regexp.pattern, regexp.flags)


class _Loader(_BaseLoader):  # type: ignore[misc, valid-type]
    """YAML as kubectl reads it: without YAML 1.1's base-60 numbers. PyYAML reads `port: 1:20`
    as 80; go-yaml (sigs.k8s.io/yaml) reads a string, which the API server refuses."""

    yaml_implicit_resolvers = {
        first: [(tag, _no_colon(regexp) if tag in _NUMBERS else regexp) for tag, regexp in resolvers]
        for first, resolvers in _BaseLoader.yaml_implicit_resolvers.items()
    }


T = TypeVar("T")


class ManifestError(Exception):
    """Nothing usable could be read: the path is missing, or every file in it is unreadable."""


class UnsafeFile(ManifestError):
    """A manifest path that must not be read at all: a FIFO (reading blocks forever), a device
    (`/dev/zero` never ends), a symlink loop, or a file over the size cap."""


class NoObjects(ManifestError):
    """Every file read holds no Kubernetes object at all (empty, comments or `---` only): for a
    command that shows rules, as for the daemon's `--once`, that is a file not yet written or
    the wrong path, not a cluster without services."""


@dataclass(frozen=True, slots=True)
class ObjectError:
    """One problem in one object, located by field path (and by file and line when known).

    `kind`, `namespace` and `name` are display forms: an invalid name is shown quoted and
    truncated, so printing an error can never forge log lines.
    """

    kind: str
    namespace: str
    name: str
    field: str
    message: str
    source: str = ""

    def __str__(self) -> str:
        parts = []
        if self.source:
            parts.append(self.source)
        if self.kind:
            ident = f"{self.namespace}/{self.name}" if self.namespace else self.name
            parts.append(f"{self.kind} {ident}".rstrip())
        if self.field:
            parts.append(self.field)
        parts.append(self.message)
        return ": ".join(parts)


@dataclass(frozen=True, slots=True)
class LoadResult:
    state: ClusterState
    errors: tuple[ObjectError, ...] = ()


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """What a Node object tells the proxy about itself, before the command line has its say."""

    name: str
    zone: str = ""
    ips: tuple[str, ...] = ()
    pod_cidrs: tuple[str, ...] = ()


def merge_node(given: NodeConfig | None, found: NodeInfo | None) -> NodeConfig:
    """The caller's settings (flags) win field by field; the Node object fills in the rest.

    The pod CIDRs become `cluster_cidrs` only when none were given: that is kube-proxy's NodeCIDR
    local-traffic detection, which needs no cluster-wide flag.
    """
    given = given if given is not None else NodeConfig()
    if found is None:
        return given
    return replace(
        given,
        name=given.name or found.name,
        zone=given.zone or found.zone,
        ips=given.ips or found.ips,
        cluster_cidrs=_pod_cidrs(given, found),
    )


def _pod_cidrs(given: NodeConfig, found: NodeInfo) -> tuple[str, ...]:
    """--detect-local-mode=NodeCIDR means the Node's own pod CIDRs, even over --cluster-cidr."""
    if given.detect_local_mode is LocalMode.NODE_CIDR:
        return found.pod_cidrs or given.cluster_cidrs
    return given.cluster_cidrs or found.pod_cidrs


# --------------------------------------------------------------------------------------------
# Reading files


@dataclass(frozen=True, slots=True)
class _Document:
    obj: object
    source: str = ""
    # Line of each `items` entry of a List document, for error locations.
    item_sources: tuple[str, ...] = ()


class FileProblem(Exception):
    """One file cannot be used as a whole; `unsafe` when it must not even be opened."""

    def __init__(self, path: Path, message: str, line: int | None = None, *, unsafe: bool = False):
        super().__init__(message)
        self.path = path
        self.line = line
        self.unsafe = unsafe

    @property
    def source(self) -> str:
        return f"{self.path}:{self.line}" if self.line else str(self.path)

    def error(self) -> ObjectError:
        return ObjectError("", "", "", "", str(self), self.source)


@dataclass(frozen=True, slots=True)
class ManifestFile:
    """One file's objects, each validated on its own, in file order; `build` joins files.

    Parsed as soon as read rather than kept as decoded documents: a source that keeps every
    file's last good contents (sources/files.py) would otherwise hold the whole cluster twice,
    and decoded JSON or YAML is several times the size of the model built from it.
    """

    path: Path
    parsed: tuple[_Parsed | ObjectError, ...]
    # Objects: top-level mappings, a List's items; 0 for an empty, comment-only or scalar file.
    objects: int = 0


def load(
    path: str | os.PathLike[str],
    node: NodeConfig | None = None,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    require_objects: bool = False,
) -> LoadResult:
    """Read a manifest file or a directory tree of them.

    A file that cannot be read or parsed is reported and left out as a whole (a half-read file
    could hold a Service without its EndpointSlices); the other files are still used. A path that
    must not be read at all (`UnsafeFile`: a FIFO, a device, a symlink loop, over `max_bytes`)
    stops the load: a command must fail naming it rather than hang or render half a cluster.
    `require_objects`: raise NoObjects when no file read holds any object, the files source's
    "not ready" (sources/files.py), which `--once` refuses.
    """
    root = Path(path)
    try:
        os.stat(root)
    except FileNotFoundError:
        raise ManifestError(f"{root}: no such file or directory") from None
    except OSError as exc:
        raise UnsafeFile(f"{root}: {_open_failure(exc)}") from None
    files: tuple[Path, ...] = (root,)
    if root.is_dir():
        listing = list_manifests(root)
        if listing.unlisted:
            where, why = listing.unlisted[0]
            raise UnsafeFile(f"{where}: {why}")
        files = listing.files
    if not files:
        raise ManifestError(f"{root}: no *.yaml, *.yml or *.json files found")
    read: list[ManifestFile] = []
    file_errors: list[ObjectError] = []
    for file in files:
        try:
            read.append(read_manifest(file, max_bytes))
        except FileProblem as exc:
            if exc.unsafe:
                raise UnsafeFile(f"{exc.source}: {exc}") from None
            file_errors.append(exc.error())
    if not read:
        raise ManifestError("nothing could be read: " + "; ".join(map(str, file_errors)))
    if require_objects and not any(f.objects for f in read):
        raise NoObjects(f"{root}: no valid Service, EndpointSlice or Node read (no file holds "
                        "a Kubernetes object)")
    result = build(read, node)
    return LoadResult(result.state, tuple(file_errors) + result.errors)


def build(files: Iterable[ManifestFile], node: NodeConfig | None = None) -> LoadResult:
    """Join the objects of files already read (in the order given) into one state."""
    return _assemble((entry for f in files for entry in f.parsed), node)


def load_objects(objects: Iterable[Any], node: NodeConfig | None = None) -> LoadResult:
    """Build the state from decoded objects (camelCase JSON form, as `kubectl get -o json`).

    Each object needs `apiVersion` and `kind`. The API leaves them out of list items, so the
    API source sets them; `kind: *List` objects here fill them in from the list's own kind.
    """
    return _assemble(_parse(_Document(obj) for obj in objects), node)


def parse_objects(objects: Iterable[Any]) -> tuple[Entry, ...]:
    """Each object parsed on its own, its problems first: the half of `load_objects` that needs
    no other object. The API source keeps this per object instead of the decoded JSON, and
    joins a service's with `assemble` (docs/design.md, "The API source's memory")."""
    return tuple(_parse(_Document(obj) for obj in objects))


def assemble(entries: Iterable[Entry], node: NodeConfig | None = None) -> LoadResult:
    """The state of parsed objects: `load_objects(objs, node)` is
    `assemble(parse_objects(objs), node)`."""
    return _assemble(entries, node)


@dataclass(frozen=True, slots=True)
class Listing:
    """The manifest files below a root, and the directories that could not be listed, with why:
    a file below one of those may well exist, so its absence from `files` says nothing."""

    files: tuple[Path, ...]
    unlisted: tuple[tuple[Path, str], ...] = ()


def list_manifests(root: Path) -> Listing:
    """Manifest files below `root`, sorted, skipping hidden entries.

    Hidden entries are skipped so editor swap files and `.git` are not read, and so a ConfigMap
    volume (whose `..data` directory holds the same files as the visible symlinks) is read once.
    os.walk drops a directory it cannot list (no permission, no file descriptor left) without a
    word; here it is reported, because "no files" read from it would remove its services.
    """
    found: list[Path] = []
    unlisted: list[tuple[Path, str]] = []

    def failed(exc: OSError) -> None:
        where = Path(exc.filename) if exc.filename else root
        unlisted.append((where, f"cannot list: {exc.strerror or exc}"))

    for dirpath, dirnames, filenames in os.walk(root, onerror=failed):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for filename in filenames:
            if not filename.startswith(".") and filename.endswith(MANIFEST_SUFFIXES):
                found.append(Path(dirpath) / filename)
    return Listing(tuple(sorted(found)), tuple(sorted(unlisted)))


def _one_line(text: str, limit: int = 200) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def file_type(mode: int) -> str:
    """What a path that is not a regular file is, as every "not a regular file" error names it."""
    for test, name in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a directory"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _open_failure(exc: OSError) -> str:
    if exc.errno == errno.ELOOP:
        return "symlink loop (too many levels of symbolic links)"
    return f"cannot read: {exc.strerror}"


def read_bytes(path: Path, max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
    """The contents of a regular file of at most `max_bytes`, following symlinks.

    The type is checked before opening (opening some devices has side effects) and again on the
    open descriptor (the path may be swapped in between); O_NONBLOCK makes even that open of a
    FIFO return at once instead of waiting for a writer.
    """
    try:
        before = os.stat(path)
    except OSError as exc:
        raise FileProblem(path, _open_failure(exc), unsafe=exc.errno == errno.ELOOP) from None
    if not stat.S_ISREG(before.st_mode):
        raise FileProblem(path, f"{file_type(before.st_mode)}, not a regular file: not read", unsafe=True)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        raise FileProblem(path, _open_failure(exc), unsafe=exc.errno == errno.ELOOP) from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FileProblem(path, f"{file_type(st.st_mode)}, not a regular file: not read", unsafe=True)
        try:
            data = f.read(max_bytes + 1) if st.st_size <= max_bytes else b""
        except OSError as exc:
            raise FileProblem(path, _open_failure(exc)) from None
    if st.st_size > max_bytes or len(data) > max_bytes:
        raise FileProblem(
            path, f"larger than the {max_bytes}-byte limit (--max-manifest-bytes): not read", unsafe=True
        )
    return data


def read_manifest(path: Path, max_bytes: int = DEFAULT_MAX_BYTES) -> ManifestFile:
    """One file's documents; raises FileProblem naming the file (and line) when it cannot be."""
    try:
        documents = _read_file(path, read_bytes(path, max_bytes))
    except _FileError as exc:
        raise FileProblem(path, str(exc), exc.line) from None
    return ManifestFile(path, tuple(_parse(documents)), sum(map(_object_count, documents)))


def _object_count(doc: _Document) -> int:
    """Objects a document holds: a mapping is one, a `kind: List` its items (an empty List, as
    a tool writes one before filling it, holds none, like an empty file)."""
    obj = doc.obj
    if not isinstance(obj, dict):
        return 0
    kind, items = obj.get("kind"), obj.get("items")
    if isinstance(kind, str) and kind.endswith("List") and isinstance(items, list):
        return len(items)
    return 1


class _FileError(Exception):
    def __init__(self, message: str, line: int | None = None):
        super().__init__(message)
        self.line = line


def _read_file(path: Path, data: bytes) -> list[_Document]:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _FileError(f"not UTF-8 text (byte {exc.start})") from None
    try:
        if path.suffix == ".json":
            return [_Document(json.loads(text), f"{path}:1")]
        return _read_yaml(text, path)
    except json.JSONDecodeError as exc:
        raise _FileError(f"invalid JSON: {exc.msg}", exc.lineno) from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        problem = exc.problem or exc.context or "syntax error"
        line = mark.line + 1 if mark is not None else None
        raise _FileError(f"invalid YAML: {_one_line(problem)}", line) from None
    except yaml.YAMLError as exc:
        raise _FileError(f"invalid YAML: {_one_line(str(exc))}") from None
    except RecursionError:
        raise _FileError("nested too deeply to be a Kubernetes object") from None
    except (ValueError, OverflowError) as exc:
        # Scalars the YAML resolver accepts but Python cannot build: a 5000-digit integer, a
        # timestamp on February 30th.
        raise _FileError(f"a value cannot be read: {_one_line(str(exc))}") from None


def _read_yaml(text: str, path: Path) -> list[_Document]:
    """Every document of a YAML stream, each with the line it starts on."""
    documents = []
    loader = _Loader(text)
    try:
        while loader.check_node():
            node = loader.get_node()
            if node is None:
                continue
            obj = loader.construct_document(node)
            documents.append(
                _Document(obj, f"{path}:{node.start_mark.line + 1}", _item_sources(node, path))
            )
    finally:
        loader.dispose()
    return documents


def _item_sources(node: yaml.Node, path: Path) -> tuple[str, ...]:
    if not isinstance(node, yaml.MappingNode):
        return ()
    for key, value in node.value:
        if key.value == "items" and isinstance(value, yaml.SequenceNode):
            return tuple(f"{path}:{item.start_mark.line + 1}" for item in value.value)
    return ()


# --------------------------------------------------------------------------------------------
# Per-object problem collection


class _Report:
    """The problems found in one object, reported under that object's identity."""

    def __init__(self, kind: str, obj: dict[str, Any], source: str, errors: list[ObjectError]):
        meta = obj.get("metadata")
        meta = meta if isinstance(meta, dict) else {}
        self.kind = kind
        namespaced = kind not in _CLUSTER_SCOPED and not kind.endswith("List")
        self.namespace = show(meta.get("namespace") or "default") if namespaced else ""
        self.name = show(meta["name"]) if meta.get("name") is not None else "<unnamed>"
        self.source = source
        self._errors = errors
        self.count = 0

    def add(self, path: str, message: str) -> None:
        self.count += 1
        self.note(path, message)

    def note(self, path: str, message: str) -> None:
        """Reported as a problem, without costing the entry it is in (`count` stays): for what
        the API server accepts and kube-proxy works around."""
        self._errors.append(
            ObjectError(self.kind, self.namespace, self.name, path, message, self.source)
        )

    def check(self, path: str, validator: Callable[..., T], value: object, *args: Any) -> T | None:
        try:
            return validator(value, *args)
        except FieldError as exc:
            self.add(path, str(exc))
            return None

    def get(
        self, parent: dict[str, Any], key: str, path: str, kind: type, required: bool = False
    ) -> Any:
        """`parent[key]` if it has type `kind`; None (and a problem) if it has another type.

        Absent and null are the same (JSON from the API spells unset as null); both are
        reported only when `required`.
        """
        value = parent.get(key)
        if value is None:
            if required:
                self.add(path, "required field is missing")
            return None
        if not isinstance(value, kind):
            self.add(path, f"expected a {type_name(kind())}, got {got(value)}")
            return None
        return value

    def items(
        self, parent: dict[str, Any], key: str, path: str, required: bool = False
    ) -> Iterator[tuple[str, Any]]:
        """(path, entry) for each entry of a list field."""
        entries = self.get(parent, key, path, list, required)
        for i, entry in enumerate(entries or ()):
            yield f"{path}[{i}]", entry

    def mappings(
        self, parent: dict[str, Any], key: str, path: str, required: bool = False
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        """(path, entry) for each mapping entry of a list field; other entries are problems."""
        for entry_path, entry in self.items(parent, key, path, required):
            if isinstance(entry, dict):
                yield entry_path, entry
            else:
                self.add(entry_path, f"expected a mapping, got {got(entry)}")


def _metadata(
    obj: dict[str, Any], r: _Report, name_validator: Callable[[object], str], namespaced: bool
) -> tuple[str, str, dict[str, Any] | None]:
    """(namespace, name, labels); namespace defaults to `default` as kubectl apply does.

    Labels are None when `metadata.labels` is not a mapping (already reported).
    """
    meta = r.get(obj, "metadata", "metadata", dict)
    if meta is None:
        if obj.get("metadata") is None:
            r.add("metadata.name", "required field is missing")
        return "", "", None
    name = None
    if meta.get("name") is None:
        r.add("metadata.name", "required field is missing")
    else:
        name = r.check("metadata.name", name_validator, meta["name"])
    namespace = ""
    if namespaced:
        raw = meta.get("namespace")
        namespace = (
            r.check("metadata.namespace", v.dns_label, raw) if raw is not None else "default"
        )
    labels = r.get(meta, "labels", "metadata.labels", dict)
    if labels is None and meta.get("labels") is None:
        labels = {}
    return shared(namespace or ""), shared(name or ""), labels


def _optional(parent: dict[str, Any], key: str, default: T) -> Any:
    value = parent.get(key)
    return default if value is None else value


# --------------------------------------------------------------------------------------------
# Services


def _service(
    obj: dict[str, Any], r: _Report
) -> tuple[tuple[str, str], tuple[ServicePort, ...]] | None:
    """The service's ports in each family it has a cluster IP for; None if it is skipped."""
    namespace, name, _ = _metadata(obj, r, v.service_name, namespaced=True)
    spec = r.get(obj, "spec", "spec", dict, required=True)
    if spec is None or r.count:
        return None
    svc_type = r.check("spec.type", v.one_of, _optional(spec, "type", "ClusterIP"), _SERVICE_TYPES)
    if svc_type == "ExternalName":
        log.debug("Service %s/%s: type ExternalName is not proxied", namespace, name)
        return None

    cluster_ips = _cluster_ips(spec, r)
    if cluster_ips is None:
        return None  # headless
    external_ips = [
        ip
        for path, raw in r.items(spec, "externalIPs", "spec.externalIPs")
        if (ip := r.check(path, v.sloppy_endpoint_address, raw)) is not None
    ]
    source_ranges = [
        c
        for path, raw in r.items(spec, "loadBalancerSourceRanges", "spec.loadBalancerSourceRanges")
        # Upstream trims whitespace here because API validation once let padding through.
        if (c := r.check(path, v.sloppy_cidr, raw.strip() if isinstance(raw, str) else raw)) is not None
    ]
    affinity_timeout = _affinity(spec, r)
    etp = r.check(
        "spec.externalTrafficPolicy",
        v.one_of,
        _optional(spec, "externalTrafficPolicy", "Cluster"),
        _POLICIES,
    )
    itp = r.check(
        "spec.internalTrafficPolicy",
        v.one_of,
        _optional(spec, "internalTrafficPolicy", "Cluster"),
        _POLICIES,
    )
    health_port = None
    if spec.get("healthCheckNodePort") is not None:
        health_port = r.check("spec.healthCheckNodePort", v.port, spec["healthCheckNodePort"])
    lb_ips = _load_balancer_ips(obj, r) if svc_type == "LoadBalancer" else []
    service_level = r.count
    ports = _service_ports(spec, r, svc_type or "ClusterIP")
    if service_level or svc_type is None:
        return None
    if not cluster_ips:
        log.info(
            "Service %s/%s has no cluster IP (not allocated yet?): not proxied", namespace, name
        )
        return None

    # pkg/api/v1/service/util.go ExternalPolicyLocal: a ClusterIP service with external IPs is
    # externally accessible too, so its eTP: Local counts.
    externally_accessible = svc_type in ("NodePort", "LoadBalancer") or bool(external_ips)
    external_local = externally_accessible and etp == "Local"
    health_check_node_port = 0
    if svc_type == "LoadBalancer" and external_local:
        if health_port is None:
            log.warning("Service %s/%s has no healthCheckNodePort", namespace, name)
        health_check_node_port = health_port or 0

    result = []
    for family, cluster_ip in sorted(cluster_ips.items()):
        for port_name, protocol, port, node_port in ports:
            result.append(
                ServicePort(
                    name=ServicePortName(namespace, name, port_name, protocol),
                    family=family,
                    type=ServiceType(svc_type),
                    cluster_ip=cluster_ip,
                    port=port,
                    node_port=node_port,
                    external_ips=_of_family(external_ips, family),
                    load_balancer_ips=_of_family(lb_ips, family),
                    load_balancer_source_ranges=_of_family(source_ranges, family),
                    affinity_timeout=affinity_timeout or 0,
                    external_policy_local=external_local,
                    internal_policy_local=itp == "Local",
                    health_check_node_port=health_check_node_port,
                )
            )
    return (namespace, name), tuple(result)


def _port_label(name: str) -> str:
    return show(name) if name else "(unnamed)"


def _of_family(addresses: list[str], family: IPFamily) -> tuple[str, ...]:
    return tuple(a for a in addresses if v.family_of(a) is family)


def _cluster_ips(spec: dict[str, Any], r: _Report) -> dict[IPFamily, str] | None:
    """Cluster IP by family ({} if none is allocated); None for a headless service.

    Pairs `clusterIPs[i]` with `ipFamilies[i]` as GetClusterIPByFamily does, falling back to
    `clusterIP` for manifests written before dual-stack.
    """
    single = spec.get("clusterIP")
    listed = r.get(spec, "clusterIPs", "spec.clusterIPs", list)
    if single == "None" or (listed and listed[0] == "None"):
        return None
    if listed:
        raw = [(f"spec.clusterIPs[{i}]", ip) for i, ip in enumerate(listed)]
    elif single is not None and single != "":
        raw = [("spec.clusterIP", single)]
    else:
        raw = []
    ips = [(path, r.check(path, v.sloppy_ip, ip)) for path, ip in raw]
    if listed and single not in (None, ""):
        first = r.check("spec.clusterIP", v.sloppy_ip, single)
        if first is not None and ips[0][1] is not None and first != ips[0][1]:
            r.add("spec.clusterIP", f"{show(single)} differs from spec.clusterIPs[0] {ips[0][1]}")
    if len(ips) > 2:
        r.add("spec.clusterIPs", f"at most 2 cluster IPs (one per family), got {len(ips)}")

    families = []
    for path, raw_family in r.items(spec, "ipFamilies", "spec.ipFamilies"):
        family = r.check(path, v.ip_family, raw_family)
        if family is not None and family in families:
            r.add(path, f"duplicate IP family {raw_family}")
        families.append(family)

    by_family: dict[IPFamily, str] = {}
    for i, (path, ip) in enumerate(ips):
        if ip is None:
            continue
        family = v.family_of(ip)
        if families:
            if i >= len(families):
                r.add(path, f"{ip} has no matching spec.ipFamilies[{i}] entry")
                continue
            if families[i] is not None and families[i] is not family:
                want = "IPv6" if families[i] is IPFamily.V6 else "IPv4"
                r.add(path, f"{ip} is not an {want} address (spec.ipFamilies[{i}] is {want})")
                continue
        if family in by_family:
            r.add(path, f"{ip} is a second cluster IP of the same family")
            continue
        by_family[family] = ip
    return by_family


def _affinity(spec: dict[str, Any], r: _Report) -> int | None:
    """ClientIP timeout in seconds, 0 without affinity (the API server defaults the timeout)."""
    mode = r.check(
        "spec.sessionAffinity",
        v.one_of,
        _optional(spec, "sessionAffinity", "None"),
        ("None", "ClientIP"),
    )
    if mode != "ClientIP":
        return 0
    timeout: object = DEFAULT_AFFINITY_TIMEOUT
    config = r.get(spec, "sessionAffinityConfig", "spec.sessionAffinityConfig", dict)
    client_ip = r.get(config or {}, "clientIP", "spec.sessionAffinityConfig.clientIP", dict)
    if client_ip and client_ip.get("timeoutSeconds") is not None:
        timeout = client_ip["timeoutSeconds"]
    return r.check(
        "spec.sessionAffinityConfig.clientIP.timeoutSeconds",
        v.integer,
        timeout,
        v.MIN_AFFINITY_TIMEOUT,
        v.MAX_AFFINITY_TIMEOUT,
        "affinity timeout",
    )


def _load_balancer_ips(obj: dict[str, Any], r: _Report) -> list[str]:
    """VIP-mode ingress IPs. `ipMode: Proxy` ones are skipped: that LB does not preserve the
    destination, so kube-proxy installs no rules for it. Only LoadBalancer services are read,
    so a stale status left on a service whose type changed cannot open anything."""
    status = r.get(obj, "status", "status", dict) or {}
    balancer = r.get(status, "loadBalancer", "status.loadBalancer", dict) or {}
    ips = []
    for path, ingress in r.mappings(balancer, "ingress", "status.loadBalancer.ingress"):
        mode = r.check(
            f"{path}.ipMode", v.one_of, _optional(ingress, "ipMode", "VIP"), ("VIP", "Proxy")
        )
        if ingress.get("ip") in (None, ""):
            continue  # hostname-only ingress: nothing for a proxy to match
        ip = r.check(f"{path}.ip", v.sloppy_ip, ingress["ip"])
        if ip is not None and mode == "VIP":
            ips.append(ip)
    return ips


def _port_identity(entry: dict[str, Any], path: str, r: _Report) -> tuple[str | None, str | None]:
    """A port's name ("" when unnamed) and protocol (default TCP): the pair that matches a
    slice port to a service port. None for a part that is invalid (and reported)."""
    name = r.check(f"{path}.name", v.string, _optional(entry, "name", ""))
    if name:
        name = r.check(f"{path}.name", v.dns_label, name)
        name = shared(name) if name is not None else None
    protocol = r.check(
        f"{path}.protocol", v.one_of, _optional(entry, "protocol", "TCP"), _PROTOCOLS
    )
    return name, protocol


def _service_ports(
    spec: dict[str, Any], r: _Report, svc_type: str
) -> list[tuple[str, Protocol, int, int]]:
    """(name, protocol, port, nodePort) of each valid port; a bad or duplicate entry is skipped."""
    ports: list[tuple[str, Protocol, int, int]] = []
    seen_names: dict[str, str] = {}
    seen_ports: dict[tuple[int, Protocol], str] = {}
    seen_node_ports: dict[tuple[int, Protocol], str] = {}
    entries = list(r.mappings(spec, "ports", "spec.ports", required=True))
    if not entries and isinstance(spec.get("ports"), list) and not spec["ports"]:
        r.add("spec.ports", "at least one port is required")
    for path, entry in entries:
        before = r.count
        name, protocol = _port_identity(entry, path, r)
        if entry.get("port") is None:
            r.add(f"{path}.port", "required field is missing")
            number = None
        else:
            number = r.check(f"{path}.port", v.port, entry["port"])
        node_port = 0
        if entry.get("nodePort") is not None:
            if svc_type == "ClusterIP":
                r.add(f"{path}.nodePort", "may not be set when spec.type is ClusterIP")
            else:
                node_port = r.check(f"{path}.nodePort", v.port, entry["nodePort"]) or 0
        if r.count > before or name is None or protocol is None or number is None:
            continue
        proto = Protocol(protocol)
        if name in seen_names:
            r.add(
                f"{path}.name",
                f"duplicate port name {_port_label(name)} (also {seen_names[name]})",
            )
            continue
        if (number, proto) in seen_ports:
            r.add(
                f"{path}.port",
                f"duplicate port {number}/{protocol} (also {seen_ports[number, proto]})",
            )
            continue
        if node_port and (node_port, proto) in seen_node_ports:
            r.add(
                f"{path}.nodePort",
                f"duplicate node port {node_port}/{protocol}"
                f" (also {seen_node_ports[node_port, proto]})",
            )
            continue
        seen_names[name] = path
        seen_ports[number, proto] = path
        if node_port:
            seen_node_ports[node_port, proto] = path
        ports.append((name, proto, number, node_port))
    return ports


# --------------------------------------------------------------------------------------------
# EndpointSlices


@dataclass(frozen=True, slots=True)
class _Slice:
    namespace: str
    service: str
    family: IPFamily
    ports: tuple[tuple[str, Protocol, int], ...]
    # The endpoints once per port, with that port's number (the state shares these objects).
    endpoints: tuple[tuple[Endpoint, ...], ...]


def _slice(obj: dict[str, Any], r: _Report) -> tuple[tuple[str, str], _Slice] | None:
    """The slice's usable ports and endpoints; None if it is skipped (FQDN, or invalid)."""
    namespace, name, labels = _metadata(obj, r, v.dns_subdomain, namespaced=True)
    label_path = f"metadata.labels[{SERVICE_NAME_LABEL}]"
    service = None
    if labels is not None and labels.get(SERVICE_NAME_LABEL) is None:
        r.add(label_path, "required label is missing: the slice belongs to no service")
    elif labels is not None:
        service = r.check(label_path, v.service_name, labels[SERVICE_NAME_LABEL])
    address_type = None
    if obj.get("addressType") is None:
        r.add("addressType", "required field is missing")
    else:
        address_type = r.check(
            "addressType", v.one_of, obj["addressType"], ("IPv4", "IPv6", "FQDN")
        )
    if address_type == "FQDN":
        log.debug("EndpointSlice %s/%s: FQDN slices are not proxied", namespace, name)
        return None
    # The lists themselves are slice-level; a bad entry in them is not.
    r.get(obj, "ports", "ports", list)
    r.get(obj, "endpoints", "endpoints", list)
    if r.count or address_type is None or service is None:
        return None
    port_entries = list(r.mappings(obj, "ports", "ports"))
    endpoint_entries = list(r.mappings(obj, "endpoints", "endpoints"))
    family = IPFamily.V6 if address_type == "IPv6" else IPFamily.V4

    ports: list[tuple[str, Protocol, int]] = []
    seen: dict[tuple[str, Protocol], str] = {}
    for path, entry in port_entries:
        before = r.count
        # Upstream skips a slice port whose name is nil; the EndpointSlice controller always
        # sets one ("" for an unnamed service port), so a missing name means the unnamed port.
        port_name, protocol = _port_identity(entry, path, r)
        number = None
        if entry.get("port") is not None:
            number = r.check(f"{path}.port", v.port, entry["port"])
        if r.count > before or port_name is None or protocol is None:
            continue
        if number is None:
            # The API server accepts a null port (it would mean "all ports"; nothing implements
            # that) and kube-proxy logs "Ignoring invalid endpoint port": say what it costs.
            r.note(f"{path}.port", f"no port number: port {_port_label(port_name)}/{protocol} gets no "
                   "endpoints from this slice (as in kube-proxy, which ignores such a port)")
            continue
        key = (port_name, Protocol(protocol))
        if key in seen:
            r.add(
                f"{path}.name",
                f"duplicate port {_port_label(port_name)}/{protocol} (also {seen[key]})",
            )
            continue
        seen[key] = path
        ports.append((port_name, Protocol(protocol), number))

    templates = []
    for path, entry in endpoint_entries:
        endpoint = _endpoint(entry, path, family, r)
        if endpoint is not None:
            templates.append(endpoint)
    weights = _weights(obj, family, {ep.ip for ep in templates}, r)
    if weights:
        templates = [replace(ep, weight=weights.get(ep.ip, ep.weight)) for ep in templates]
    per_port = tuple(tuple(replace(t, port=number) for t in templates) for _, _, number in ports)
    return (namespace, name), _Slice(
        namespace, shared(service), family, tuple(ports), per_port
    )


def _weights(obj: dict[str, Any], family: IPFamily, addresses: set[str], r: _Report) -> dict[str, int]:
    """The slice's endpoint weights by canonical address. Each bad entry is reported and left
    out (that endpoint keeps weight 1); a value that is no JSON object is reported whole."""
    meta = obj.get("metadata")
    annotations = meta.get("annotations") if isinstance(meta, dict) else None
    raw = annotations.get(WEIGHTS_ANNOTATION) if isinstance(annotations, dict) else None
    if raw is None:
        return {}
    path = f"metadata.annotations[{WEIGHTS_ANNOTATION}]"
    if not isinstance(raw, str):
        r.add(path, f"expected a string, got {got(raw)}")
        return {}
    try:
        parsed = json.loads(raw, object_pairs_hook=_JsonObject.of)
    except ValueError as exc:
        r.add(path, f"not JSON: {show(str(exc))}")
        return {}
    except RecursionError:
        r.add(path, "not JSON: nested too deeply")
        return {}
    if not isinstance(parsed, dict):
        r.add(path, f'expected a JSON object {{"ADDRESS": WEIGHT, ...}}, got {got(parsed)}')
        return {}
    named: dict[str, list[tuple[str, Any]]] = {}  # address -> (key, value) of each key naming it
    for key, value in parsed.items():
        entry = f"{path}[{show(key)}]"  # a key is the user's text: it must not forge lines
        address = r.check(entry, v.ip_address, key, family)
        if address is None:
            continue
        if address not in addresses:
            r.add(entry, "no endpoint of this slice has this address")
            continue
        named.setdefault(address, []).append((key, value))
    weights: dict[str, int] = {}
    for address, given in named.items():
        entry = f"{path}[{show(given[0][0])}]"
        times = sum(parsed.repeated.get(key, 1) for key, _ in given)
        if times > 1:
            # Which one was meant cannot be known (json would silently keep the last): none is.
            spellings = f" (as {', '.join(show(key) for key, _ in given)})" if len(given) > 1 else ""
            r.add(entry, f"given {times} times{spellings}: all ignored, the endpoint keeps weight 1")
            continue
        weight = r.check(entry, v.weight, given[0][1])
        if weight is not None:
            weights[address] = weight
    return weights


class _JsonObject(dict[str, Any]):
    """A decoded JSON object that remembers the keys it was given more than once: a dict alone
    keeps the last value of a repeated key without a word."""

    repeated: dict[str, int]
    """Key -> how many times it was given, for the keys given more than once."""

    @classmethod
    def of(cls, pairs: list[tuple[str, Any]]) -> _JsonObject:
        obj = cls(pairs)
        if len(obj) == len(pairs):
            obj.repeated = {}
            return obj
        counts: dict[str, int] = {}
        for key, _ in pairs:
            counts[key] = counts.get(key, 0) + 1
        obj.repeated = {key: n for key, n in counts.items() if n > 1}
        return obj


def _endpoint(entry: dict[str, Any], path: str, family: IPFamily, r: _Report) -> Endpoint | None:
    """One slice endpoint, or None (reported) if any of its fields is invalid.

    Conditions follow upstream's cache: `ready` and `serving` default to true when unset (the
    API docs suggest serving should default to ready's value; kube-proxy does not do that),
    `terminating` is true only when set.
    """
    before = r.count
    addresses = []
    for address_path, raw in r.items(entry, "addresses", f"{path}.addresses", required=True):
        # Another family's address: upstream ignores it silently; we skip it too, but say so,
        # since the API server would have refused the slice.
        addresses.append(r.check(address_path, v.sloppy_endpoint_address, raw, family))
    if isinstance(entry.get("addresses"), list):
        if not entry["addresses"]:
            r.add(f"{path}.addresses", "at least one address is required")
        elif len(entry["addresses"]) > _MAX_ADDRESSES:
            r.add(
                f"{path}.addresses",
                f"at most {_MAX_ADDRESSES} addresses, got {len(entry['addresses'])}",
            )
    conditions = r.get(entry, "conditions", f"{path}.conditions", dict) or {}
    flags = {}
    for condition, default in (("ready", True), ("serving", True), ("terminating", False)):
        raw = conditions.get(condition)
        flags[condition] = (
            default if raw is None else r.check(f"{path}.conditions.{condition}", v.boolean, raw)
        )
    node_name = ""
    if entry.get("nodeName") is not None:
        node_name = r.check(f"{path}.nodeName", v.dns_subdomain, entry["nodeName"])
    zone = ""
    if entry.get("zone") is not None:
        try:
            zone = v.label_value(entry["zone"])
        except FieldError as exc:
            # The API server does not validate it, and kube-proxy keeps the endpoint: so does
            # nfproxy, without the zone (only a valid label value reaches the model).
            r.note(f"{path}.zone", f"{exc}: ignored, the endpoint is kept")
    hints = r.get(entry, "hints", f"{path}.hints", dict) or {}
    zone_hints = [
        r.check(f"{hint_path}.name", v.label_value, hint.get("name"))
        for hint_path, hint in r.mappings(hints, "forZones", f"{path}.hints.forZones")
    ]
    node_hints = [
        r.check(f"{hint_path}.name", v.dns_subdomain, hint.get("name"))
        for hint_path, hint in r.mappings(hints, "forNodes", f"{path}.hints.forNodes")
    ]
    if r.count > before:
        return None
    return Endpoint(
        ip=addresses[0],
        port=0,
        ready=flags["ready"],
        serving=flags["serving"],
        terminating=flags["terminating"],
        node_name=shared(node_name or ""),
        zone=shared(zone or ""),
        zone_hints=hint_set(h for h in zone_hints if h),
        node_hints=hint_set(h for h in node_hints if h),
    )


# --------------------------------------------------------------------------------------------
# Nodes


def _node(obj: dict[str, Any], r: _Report) -> tuple[str, NodeInfo] | None:
    """The Node's zone, IPs and pod CIDRs; any problem skips the Node (we would rather not guess
    our own addresses)."""
    _, name, labels = _metadata(obj, r, v.dns_subdomain, namespaced=False)
    labels = labels or {}
    zone = ""
    if labels.get(ZONE_LABEL) is not None:
        zone = r.check(f"metadata.labels[{ZONE_LABEL}]", v.label_value, labels[ZONE_LABEL]) or ""
    status = r.get(obj, "status", "status", dict) or {}
    by_type: dict[str, list[str]] = {"InternalIP": [], "ExternalIP": []}
    for path, address in r.mappings(status, "addresses", "status.addresses"):
        kind = r.check(f"{path}.type", v.string, address.get("type"))
        if kind in by_type:
            ip = r.check(f"{path}.address", v.sloppy_ip, address.get("address"))
            if ip is not None:
                by_type[kind].append(ip)
    spec = r.get(obj, "spec", "spec", dict) or {}
    cidrs = [r.check(path, v.sloppy_cidr, raw) for path, raw in r.items(spec, "podCIDRs", "spec.podCIDRs")]
    if not cidrs and spec.get("podCIDR") not in (None, ""):
        cidrs = [r.check("spec.podCIDR", v.sloppy_cidr, spec["podCIDR"])]
    for family in IPFamily:
        # As the API server: at most one per family. Both backends then agree on the one
        # CIDR that decides masquerading (iptables cannot negate a list of sources in one rule).
        of = [c for c in cidrs if c and v.family_of(c.split("/")[0]) is family]
        if len(of) > 1:
            r.add("spec.podCIDRs", f"more than one IPv{family.value} CIDR: {', '.join(of)}")
    if r.count:
        return None
    ips = _node_ips(by_type["InternalIP"] + by_type["ExternalIP"])
    return name, NodeInfo(name, zone, ips, tuple(c for c in cidrs if c))


def _node_ips(candidates: list[str]) -> tuple[str, ...]:
    """The primary IP and the first of the other family, as GetNodeHostIPs picks them
    (InternalIPs before ExternalIPs)."""
    if not candidates:
        return ()
    primary = candidates[0]
    other = next((ip for ip in candidates if v.family_of(ip) is not v.family_of(primary)), None)
    return (primary,) if other is None else (primary, other)


# --------------------------------------------------------------------------------------------
# Service CIDRs


def _service_cidr(obj: dict[str, Any], r: _Report) -> tuple[str, tuple[str, ...]] | None:
    """A ServiceCIDR's spec.cidrs: at most two, one per family (as the API server checks)."""
    _, name, _ = _metadata(obj, r, v.dns_subdomain, namespaced=False)
    spec = r.get(obj, "spec", "spec", dict) or {}
    cidrs = [r.check(path, v.cidr, raw) for path, raw in r.items(spec, "cidrs", "spec.cidrs")]
    for family in IPFamily:
        of = [c for c in cidrs if c and v.family_of(c.split("/")[0]) is family]
        if len(of) > 1:
            r.add("spec.cidrs", f"more than one IPv{family.value} CIDR: {', '.join(of)}")
    if r.count:
        return None
    return name, tuple(c for c in cidrs if c)


# --------------------------------------------------------------------------------------------
# Putting it together


@dataclass(slots=True)
class _Collected:
    services: dict[tuple[str, str], tuple[ServicePort, ...]] = field(default_factory=dict)
    slices: dict[tuple[str, str], _Slice] = field(default_factory=dict)
    nodes: dict[str, NodeInfo] = field(default_factory=dict)
    service_cidrs: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # Where each kept object came from, to point at the first of two duplicates.
    sources: dict[tuple[str, Any], str] = field(default_factory=dict)
    errors: list[ObjectError] = field(default_factory=list)


def _objects(
    documents: Iterable[_Document], errors: list[ObjectError]
) -> Iterator[tuple[dict[str, Any], str]]:
    """Each object with its source, `kind: List` (and `*List`) documents opened one level."""
    for doc in documents:
        obj = doc.obj
        if obj is None:
            continue  # an empty YAML document
        if not isinstance(obj, dict):
            errors.append(
                ObjectError(
                    "",
                    "",
                    "",
                    "",
                    f"expected a Kubernetes object (a mapping), got {type_name(obj)}",
                    doc.source,
                )
            )
            continue
        kind = obj.get("kind")
        if not (isinstance(kind, str) and kind.endswith("List") and "items" in obj):
            yield obj, doc.source
            continue
        items = obj.get("items")
        if items is None:
            continue
        if not isinstance(items, list):
            errors.append(
                ObjectError(
                    show(kind),
                    "",
                    "",
                    "items",
                    f"expected a list, got {type_name(items)}",
                    doc.source,
                )
            )
            continue
        # `ServiceList` from the raw API has items without kind and apiVersion: imply them.
        item_kind = kind[: -len("List")]
        for i, item in enumerate(items):
            source = doc.item_sources[i] if i < len(doc.item_sources) else doc.source
            if not isinstance(item, dict):
                errors.append(
                    ObjectError(
                        show(kind),
                        "",
                        "",
                        f"items[{i}]",
                        f"expected a Kubernetes object (a mapping), got {type_name(item)}",
                        source,
                    )
                )
                continue
            if item_kind and "kind" not in item:
                item = {**item, "kind": item_kind, "apiVersion": obj.get("apiVersion")}
            nested = item.get("kind")
            if isinstance(nested, str) and nested.endswith("List") and "items" in item:
                errors.append(
                    ObjectError(
                        show(nested),
                        "",
                        "",
                        f"items[{i}]",
                        "a List inside a List is not supported",
                        source,
                    )
                )
                continue
            yield item, source


def _not_ours(obj: dict[str, Any]) -> str | None:
    """The label (of `_NOT_OURS_LABELS`) that excludes the object, as a label selector would."""
    meta = obj.get("metadata")
    labels = meta.get("labels") if isinstance(meta, dict) else None
    if not isinstance(labels, dict):
        return None
    return next((label for label in _NOT_OURS_LABELS if label in labels), None)


@dataclass(frozen=True, slots=True)
class _Parsed:
    """One valid object, parsed on its own: what `_assemble` joins with the others."""

    kind: str
    identity: Any
    value: Any
    source: str


Entry = _Parsed | ObjectError
"""One object's parse (`_Parsed`) or one of its problems: what `parse_objects` returns."""


def _parse(documents: Iterable[_Document]) -> Iterator[_Parsed | ObjectError]:
    """Each object's problems, then the object itself if it is usable, in document order (so
    problems are reported in the order the documents hold them)."""
    out: list[_Parsed | ObjectError] = []
    for obj, source in _objects(documents, out):  # type: ignore[arg-type]
        parsed = _parse_object(obj, source, out)
        if parsed is not None:
            out.append(parsed)
        yield from out
        out.clear()
    yield from out


def _parse_object(obj: dict[str, Any], source: str, errors: list[Any]) -> _Parsed | None:
    kind, api_version = obj.get("kind"), obj.get("apiVersion")
    if kind is None:
        errors.append(ObjectError("", "", "", "kind", "required field is missing", source))
        return None
    if not isinstance(kind, str) or kind not in _GROUPS:
        log.debug("%s: ignoring object of kind %s", source or "object", show(kind))
        return None
    if kind != "Node" and (label := _not_ours(obj)) is not None:
        log.debug("%s: %s labelled %s: left to another proxy", source or "object", kind, label)
        return None
    r = _Report(kind, obj, source, errors)
    if (api_version, kind) not in (_SERVICE, _SLICE, _NODE, _SERVICE_CIDR):
        # Same group, other version: ours, but a schema we would misread. Another group
        # (a Knative Service, say): not ours at all.
        if not isinstance(api_version, str):
            r.add(
                "apiVersion",
                "required field is missing"
                if api_version is None
                else f"expected a string, got {type_name(api_version)}",
            )
        elif api_version.rpartition("/")[0] == _GROUPS[kind]:
            r.add("apiVersion", f"{show(api_version)} is not supported for {kind}")
        else:
            log.debug(
                "%s: ignoring %s of apiVersion %s", source or "object", kind, show(api_version)
            )
        return None

    parsed: tuple[Any, Any] | None
    if kind == "Service":
        parsed = _service(obj, r)
    elif kind == "EndpointSlice":
        parsed = _slice(obj, r)
    elif kind == "ServiceCIDR":
        parsed = _service_cidr(obj, r)
    else:
        parsed = _node(obj, r)
    if parsed is None:
        return None
    return _Parsed(kind, parsed[0], parsed[1], source)


def _collect(parsed: _Parsed, into: _Collected) -> None:
    """Keep `parsed` unless an object of its kind and identity was kept before."""
    table: dict[Any, Any] = {
        "Service": into.services,
        "EndpointSlice": into.slices,
        "ServiceCIDR": into.service_cidrs,
        "Node": into.nodes,
    }[parsed.kind]
    kind, identity = parsed.kind, parsed.identity
    if identity in table:
        first = into.sources[kind, identity]
        where = f" at {first}" if first else ""
        namespace, name = identity if isinstance(identity, tuple) else ("", identity)
        into.errors.append(ObjectError(
            kind, show(namespace), show(name), "metadata.name",
            f"duplicate {kind}: already defined{where}", parsed.source,
        ))
        return
    table[identity] = parsed.value
    into.sources[kind, identity] = parsed.source


def _pick_node(given: NodeConfig | None, nodes: dict[str, NodeInfo]) -> NodeInfo | None:
    if given is not None and given.name:
        return nodes.get(given.name)
    if len(nodes) == 1:
        return next(iter(nodes.values()))
    if nodes:
        log.info(
            "%d Node objects and no node name given: node settings not taken from any", len(nodes)
        )
    return None


def _endpoints(
    collected: _Collected,
    services: dict[ServicePortKey, ServicePort],
) -> dict[ServicePortKey, tuple[Endpoint, ...]]:
    """Merge every slice's endpoints per service port, as the EndpointSliceCache does.

    Slices are matched by port name and protocol. A duplicate `ip:port` is replaced by a later
    one unless the later one is terminating, as upstream since kubernetes#135593: a pod IP the
    network reused while the old pod is still Terminating must reach the live pod, not the ghost. Upstream walks slices in map (random) order; walking
    them by name makes the winner reproducible. A duplicate whose slices give it different
    weights keeps weight 1, as for any bad weight, whichever slice wins: a weight must not
    depend on slice names (reported to `collected.errors`).
    """
    merged: dict[ServicePortKey, dict[str, Endpoint]] = {}
    weighed = _WeightsSeen(collected)
    # Keyed by the services' own key objects: one ServicePortName per port in the whole state.
    keys = {key: key for key in services}
    for identity, sl in sorted(collected.slices.items()):
        for (port_name, protocol, _number), endpoints in zip(sl.ports, sl.endpoints):
            key = keys.get((ServicePortName(sl.namespace, sl.service, port_name, protocol), sl.family))
            if key is None:
                continue
            bucket = merged.setdefault(key, {})
            for endpoint in endpoints:
                weighed.see(key, endpoint, identity)
                if not endpoint.terminating or endpoint.address not in bucket:
                    bucket[endpoint.address] = endpoint
    for key, address in weighed.conflicting:
        merged[key][address] = replace(merged[key][address], weight=1)
    return {key: sort_endpoints(list(bucket.values())) for key, bucket in merged.items() if bucket}


class _WeightsSeen:
    """The first weight each service port's endpoint was given, and the slices that disagree."""

    def __init__(self, collected: _Collected) -> None:
        self.collected = collected
        self.first: dict[tuple[ServicePortKey, str], tuple[int, tuple[str, str]]] = {}
        self.conflicting: dict[tuple[ServicePortKey, str], None] = {}
        self.reported: set[tuple[tuple[str, str], tuple[str, str], str]] = set()

    def see(self, key: ServicePortKey, endpoint: Endpoint, identity: tuple[str, str]) -> None:
        weight, first = self.first.setdefault((key, endpoint.address), (endpoint.weight, identity))
        if weight == endpoint.weight or first == identity:
            return
        self.conflicting[(key, endpoint.address)] = None
        if (first, identity, endpoint.ip) not in self.reported:  # once, not once per port
            self.reported.add((first, identity, endpoint.ip))
            self._report(endpoint, weight, first, identity)

    def _report(self, endpoint: Endpoint, weight: int, first: tuple[str, str], identity: tuple[str, str]) -> None:
        sources = self.collected.sources
        where = sources.get(("EndpointSlice", first), "")
        self.collected.errors.append(ObjectError(
            "EndpointSlice", show(identity[0]), show(identity[1]),
            f"metadata.annotations[{WEIGHTS_ANNOTATION}][{endpoint.ip}]",
            f"conflicting weights: {endpoint.weight} here, {weight} in EndpointSlice "
            f"{show(first[0])}/{show(first[1])}{f' ({where})' if where else ''}; the endpoint keeps weight 1",
            sources.get(("EndpointSlice", identity), ""),
        ))


def _assemble(entries: Iterable[_Parsed | ObjectError], given: NodeConfig | None) -> LoadResult:
    collected = _Collected()
    for entry in entries:
        if isinstance(entry, ObjectError):
            collected.errors.append(entry)
        else:
            _collect(entry, collected)
    node = merge_node(given, _pick_node(given, collected.nodes))
    if collected.service_cidrs:
        # ServiceCIDR objects, where the cluster has them, win over --service-cluster-ip-range.
        found = (c for name in sorted(collected.service_cidrs) for c in collected.service_cidrs[name])
        node = replace(node, service_cidrs=tuple(dict.fromkeys(found)))
    services = {sp.key: sp for ports in collected.services.values() for sp in ports}
    endpoints = _endpoints(collected, services)
    return LoadResult(ClusterState(node, services, endpoints), tuple(collected.errors))

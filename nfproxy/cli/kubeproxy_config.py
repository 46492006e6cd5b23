"""kube-proxy's configuration file (`KubeProxyConfiguration`, kubeproxy.config.k8s.io/v1alpha1).

The file is read as kubeadm writes it into the `kube-proxy` ConfigMap (`config.conf`), every
field listed, most at Go's zero value. As in kube-proxy, a zero value means "the default": the
file sets the command line's defaults, by argparse dest name, and flags given on the command line
win over it. Each field is either honoured (it sets a dest), or accepted and warned about in one
line when it is set to something nfproxy cannot do (IPVS, Windows, profiling, ...), or rejected
with an error naming file, line, field and value. An unknown field or a key given twice is what
kube-proxy's strict decoding refuses and its lenient fallback then accepts (options.go, loadConfig:
"Using lenient decoding as strict decoding failed"): each is warned about, naming file and line,
the unknown field is ignored and the last of a key's values is used, as there.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from nfproxy.cli import duration as go_duration
from nfproxy.cli.config import HEALTHZ_PORT, METRICS_PORT
from nfproxy.cli.flag_types import INT32_MAX, display

API_VERSION = "kubeproxy.config.k8s.io/v1alpha1"
KIND = "KubeProxyConfiguration"
MODES = ("iptables", "nftables")
DETECT_LOCAL_MODES = ("ClusterCIDR", "NodeCIDR", "BridgeInterface", "InterfaceNamePrefix")
LOGGING_FORMATS = ("text", "json")
_Loader: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
# kubeadm's file is about 2 KB; a config file is never near this, and nothing larger is read
# (`--config /dev/zero` must not read until memory runs out).
MAX_BYTES = 2**20
# A field path or map key printed as it is; anything else is shown quoted, escaped and cut.
_PLAIN_PATH = re.compile(r"[A-Za-z0-9_.-]{1,120}")


def _field(path: str) -> str:
    """A field path (or map key) for a message: a hostile key cannot forge a line or flood it."""
    return path if _PLAIN_PATH.fullmatch(path) else display(path)


class ConfigFileError(ValueError):
    """The file cannot be used; the message is `FILE:LINE: KubeProxyConfiguration: field: why`."""


@dataclass(frozen=True, slots=True)
class LoadedConfig:
    """What a file sets: argparse defaults by dest, and one warning line per ignored setting."""

    defaults: Mapping[str, object]
    warnings: tuple[str, ...]


class _Bad(ValueError):
    """A field's value is wrong; carries the message without the location, and the key inside
    the field's map when the fault is there (a feature gate)."""

    def __init__(self, message: str, key: str = "") -> None:
        super().__init__(message)
        self.key = key


# ---- value checks: each takes the YAML value and returns the dest's value, or None for "unset"


def _string(v: object) -> str | None:
    if v is None:
        return None
    if not isinstance(v, str):
        raise _Bad(f"{display(v)}: must be a string")
    return v or None


def _bool(v: object) -> bool | None:
    if v is None:
        return None
    if not isinstance(v, bool):
        raise _Bad(f"{display(v)}: must be true or false")
    return v


def _int32(low: int, high: int) -> Callable[[object], int | None]:
    def check(v: object) -> int | None:
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int):
            raise _Bad(f"{display(v)}: must be an integer")
        if not low <= v <= high:
            raise _Bad(f"{v}: must be from {low} to {high}")
        return v

    return check


def _duration(zero_is_default: bool) -> Callable[[object], str | None]:
    def check(v: object) -> str | None:
        if v is None:
            return None
        if not isinstance(v, str):
            raise _Bad(f"{display(v)}: must be a duration string such as 30s or 1h0m0s")
        try:
            ns = go_duration.parse(v)
        except go_duration.DurationError as exc:
            raise _Bad(f"{display(v)}: {exc}") from None
        if ns < 0:
            raise _Bad(f"{display(v)}: must not be negative")
        return None if ns == 0 and zero_is_default else v

    return check


def _strings(v: object) -> list[str] | None:
    if v is None:
        return None
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise _Bad(f"{display(v)}: must be a list of strings")
    return list(v) or None


# The checks below are the flags' own (nfproxy.cli.config): a value the file sets must fail
# here, named by file, line and field, never later as if a flag had been given.


def _cidrs(v: object) -> list[str] | None:
    """clusterCIDR: one CIDR, or a comma-separated dual-stack pair (one per family)."""
    from nfproxy.cli.config import one_per_family, split_list
    from nfproxy.sources.validation import FieldError, cidr

    text = _string(v)
    if text is None:
        return None
    try:
        one_per_family(tuple(cidr(part) for part in split_list(text)))
    except FieldError as exc:
        raise _Bad(str(exc)) from None
    return [text]


def _nodeport_addresses(v: object) -> list[str] | None:
    """nodePortAddresses: a list, each item one CIDR or keyword (no commas inside an item),
    checked as the flag is (cli.config.nodeport_addresses)."""
    from nfproxy.cli.config import nodeport_addresses
    from nfproxy.sources.validation import FieldError

    values = _strings(v)
    try:
        nodeport_addresses(values or [])
    except FieldError as exc:
        raise _Bad(str(exc)) from None
    return values


def _checked(v: object, check: Callable[[str], object]) -> str | None:
    """A string field that must pass one of the flags' own checks: its FieldError is then the
    field's, named by file and line."""
    from nfproxy.sources.validation import FieldError

    text = _string(v)
    if text is not None:
        try:
            check(text)
        except FieldError as exc:
            raise _Bad(str(exc)) from None
    return text


def _ip(v: object) -> str | None:
    from nfproxy.sources.validation import ip_address

    return _checked(v, ip_address)


def _interface(v: object) -> str | None:
    """detectLocal.bridgeInterface / interfaceNamePrefix: an interface name, whatever the mode,
    as the flags take it (it is written back by --write-config-to and into rules)."""
    from nfproxy.cli.config import interface_name

    return _checked(v, interface_name)




def _host_port(default_port: int) -> Callable[[object], str | None]:
    """healthzBindAddress / metricsBindAddress: `ip` or `ip:port`, the default port appended to a
    bare IP; port 0 refused, as kube-proxy's validateHostPort refuses it (1-65535)."""

    def check(v: object) -> str | None:
        text = _string(v)
        if text is None:
            return None
        from nfproxy.cli.config import FlagError, append_port_if_needed, bind_address

        text = append_port_if_needed(text, default_port)

        try:
            bind_address("", text)
        except FlagError as exc:
            raise _Bad(str(exc).lstrip(": ")) from None
        if text.rpartition(":")[2].lstrip("0") == "":
            raise _Bad(f"{display(text)}: port must be from 1 to 65535")
        return text

    return check


# Go's float32 range: kube-proxy reads clientConnection.qps (and --kube-api-qps) as a float32.
FLOAT32_MAX = 3.4028234663852886e38


def _float32(v: object) -> int | float | None:
    """clientConnection.qps: a finite number within float32's range (a string, a bool or `.nan`
    is what kube-proxy's decoding refuses too)."""
    import math

    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _Bad(f"{display(v)}: must be a number")
    if not math.isfinite(v) or abs(v) > FLOAT32_MAX:
        raise _Bad(f"{display(v)}: must be a finite float32")
    return v


def _zero_is_default(check: Callable[[object], object]) -> Callable[[object], object]:
    """A field kube-proxy's defaulting fills in when 0 (clientConnection.qps and burst)."""

    def checked(v: object) -> object:
        value = check(v)
        return None if value == 0 else value

    return checked


def _cidr_list(v: object) -> list[str] | None:
    """ipvs.excludeCIDRs: a list of CIDRs (kept as written, for --write-config-to)."""
    from nfproxy.sources.validation import FieldError, cidr

    values = _strings(v)
    for item in values or ():
        try:
            cidr(item)
        except FieldError as exc:
            raise _Bad(str(exc)) from None
    return values


def _flush_frequency(v: object) -> str | None:
    """logging.flushFrequency: a Go duration, or nanoseconds as an integer (kube-proxy's
    TimeOrMetaDuration takes both); kept as a duration string, 0 meaning the default."""
    if isinstance(v, int) and not isinstance(v, bool):
        if v < 0:
            raise _Bad(f"{v}: must not be negative")
        return go_duration.format(v) if v else None
    return _duration(True)(v)


_VMODULE_KEYS = {"filePattern", "verbosity"}


def _vmodule(v: object) -> list[dict[str, object]] | None:
    """logging.vmodule: `{filePattern, verbosity}` items, as logsapi's Validate checks them."""
    if v is None:
        return None
    if not isinstance(v, list):
        raise _Bad(f"{display(v)}: must be a list of filePattern and verbosity")
    for item in v:
        if not isinstance(item, dict) or not set(item) <= _VMODULE_KEYS:
            raise _Bad(f"{display(item)}: must be a map of filePattern and verbosity")
        pattern, level = item.get("filePattern"), item.get("verbosity", 0)
        if not isinstance(pattern, str) or not pattern or any(c in pattern for c in "=,"):
            raise _Bad(f"{display(pattern)}: file pattern must be a non-empty string without = or ,")
        _int32(0, INT32_MAX)(level)
    return list(v) or None


def _choice(choices: tuple[str, ...]) -> Callable[[object], str | None]:
    def check(v: object) -> str | None:
        text = _string(v)
        if text is not None and text not in choices:
            raise _Bad(f"{display(text)}: must be one of {', '.join(choices)}")
        return text

    return check


def _mode(v: object) -> str | None:
    text = _string(v)
    if text is None:
        return None
    if text not in MODES:
        raise _Bad(f"{display(text)}: nfproxy has the iptables and nftables modes only")
    return text


def _node_name(v: object) -> str | None:
    text = _string(v)
    if text is not None:
        from nfproxy.sources.validation import FieldError, dns_subdomain

        try:
            dns_subdomain(text)
        except FieldError as exc:
            raise _Bad(str(exc)) from None
    return text


_GATE = re.compile(r"[A-Z][A-Za-z0-9]*")


def _gates(v: object) -> str | None:
    from nfproxy.cli.feature_gates import aggregate, dependency_errors, refusal

    if v is None:
        return None
    if not isinstance(v, dict):
        raise _Bad(f"{display(v)}: must be a map of gate names to true or false")
    for name, value in v.items():
        if not isinstance(name, str) or not _GATE.fullmatch(name):
            raise _Bad(f"{display(name)}: not a feature gate name", str(name))
        if not isinstance(value, bool):
            raise _Bad(f"{display(value)}: must be true or false", name)
        refused = refusal(name, value)
        if refused:
            raise _Bad(refused, name)
    errors = dependency_errors(v)
    if errors:
        raise _Bad(aggregate(errors))
    return ",".join(f"{k}={str(val).lower()}" for k, val in sorted(v.items())) or None


def _anything(v: object) -> object:
    return v


# ---- the fields


@dataclass(frozen=True, slots=True)
class Field:
    path: str
    check: Callable[[object], object]
    # The argparse dest it sets; None: accepted, and warned about when set (`why` says why).
    dest: str | None = None
    why: str = ""
    # Only for this mode's file (kube-proxy reads iptables.* or nftables.* by `mode`).
    mode: str | None = None
    # Values of a warned field that are kube-proxy's own defaults: files written with every
    # default filled in (older kubeadm, `kube-proxy --write-config-to`) are not warned about.
    quiet: tuple[object, ...] = ()


def _warned(path: str, why: str, check: Callable[[object], object] = _anything,
            quiet: tuple[object, ...] = (), dest: str | None = None) -> Field:
    """A setting nfproxy cannot honour: warned about when set; with a `dest` (the flag's), its
    value is still kept, so --write-config-to and /configz show what was asked for."""
    return Field(path, check, dest, why, quiet=quiet)


_NO_IPVS = "nfproxy has no IPVS mode"
PROTOBUF = "application/vnd.kubernetes.protobuf"  # clientConnection.contentType's default
LOGGING_OPTIONS_WHY = "klog's buffering options do not apply: lines are written unbuffered"
_NO_WINDOWS = "nfproxy runs on Linux only"

FIELDS: tuple[Field, ...] = (
    Field("apiVersion", _string),
    Field("kind", _string),
    Field("bindAddress", _ip, "bind_address"),
    Field("bindAddressHardFail", _bool, "bind_address_hard_fail"),
    Field("clientConnection.kubeconfig", _string, "kubeconfig"),
    _warned("clientConnection.acceptContentTypes", "the API client always asks for JSON", _string),
    _warned("clientConnection.contentType", "the API client always sends JSON", _string,
            (PROTOBUF,), "kube_api_content_type"),
    _warned("clientConnection.qps", "nfproxy only lists and watches, without client-side rate limits",
            _zero_is_default(_float32), (5,), "kube_api_qps"),
    _warned("clientConnection.burst", "nfproxy only lists and watches, without client-side rate limits",
            _zero_is_default(_int32(0, INT32_MAX)), (10,), "kube_api_burst"),
    Field("clusterCIDR", _cidrs, "cluster_cidr"),
    _warned("configSyncPeriod", "nfproxy's watches never resync from their cache", _duration(True),
            ("15m0s", "15m"), "config_sync_period"),
    Field("conntrack.maxPerCore", _int32(0, INT32_MAX), "conntrack_max_per_core"),
    Field("conntrack.min", _int32(0, INT32_MAX), "conntrack_min"),
    Field("conntrack.tcpBeLiberal", _bool, "conntrack_tcp_be_liberal"),
    Field("conntrack.tcpCloseWaitTimeout", _duration(False), "conntrack_tcp_timeout_close_wait"),
    Field("conntrack.tcpEstablishedTimeout", _duration(False), "conntrack_tcp_timeout_established"),
    Field("conntrack.udpStreamTimeout", _duration(False), "conntrack_udp_timeout_stream"),
    Field("conntrack.udpTimeout", _duration(False), "conntrack_udp_timeout"),
    Field("detectLocal.bridgeInterface", _interface, "pod_bridge_interface"),
    Field("detectLocal.interfaceNamePrefix", _interface, "pod_interface_name_prefix"),
    Field("detectLocalMode", _choice(DETECT_LOCAL_MODES), "detect_local_mode"),
    _warned("enableProfiling", "nfproxy serves no /debug/pprof", _bool, dest="profiling"),
    Field("featureGates", _gates, "feature_gates"),
    Field("healthzBindAddress", _host_port(HEALTHZ_PORT), "healthz_bind_address"),
    Field("hostnameOverride", _node_name, "node_name"),
    Field("iptables.localhostNodePorts", _bool, "localhost_nodeports"),
    Field("iptables.masqueradeAll", _bool, "masquerade_all", mode="iptables"),
    Field("iptables.masqueradeBit", _int32(0, 31), "masquerade_bit", mode="iptables"),
    Field("iptables.minSyncPeriod", _duration(True), "iptables_min_sync_period"),
    Field("iptables.syncPeriod", _duration(True), "iptables_sync_period"),
    _warned("ipvs.excludeCIDRs", _NO_IPVS, _cidr_list, dest="ipvs_exclude_cidrs"),
    _warned("ipvs.minSyncPeriod", _NO_IPVS, _duration(True), dest="ipvs_min_sync_period"),
    _warned("ipvs.scheduler", _NO_IPVS, _string, dest="ipvs_scheduler"),
    _warned("ipvs.strictARP", _NO_IPVS, _bool, dest="ipvs_strict_arp"),
    _warned("ipvs.syncPeriod", _NO_IPVS, _duration(True), ("30s",), "ipvs_sync_period"),
    _warned("ipvs.tcpFinTimeout", _NO_IPVS, _duration(True), dest="ipvs_tcpfin_timeout"),
    _warned("ipvs.tcpTimeout", _NO_IPVS, _duration(True), dest="ipvs_tcp_timeout"),
    _warned("ipvs.udpTimeout", _NO_IPVS, _duration(True), dest="ipvs_udp_timeout"),
    Field("logging.format", _choice(LOGGING_FORMATS), "logging_format"),
    _warned("logging.flushFrequency", "nfproxy's log lines are written unbuffered", _flush_frequency,
            ("5s", 5_000_000_000), "log_flush_frequency"),
    _warned("logging.options", LOGGING_OPTIONS_WHY),
    Field("logging.verbosity", _int32(0, INT32_MAX), "verbosity"),
    _warned("logging.vmodule", "per-file verbosity is not supported", _vmodule, dest="vmodule"),
    Field("metricsBindAddress", _host_port(METRICS_PORT), "metrics_bind_address"),
    Field("mode", _mode, "backend"),
    Field("nftables.masqueradeAll", _bool, "masquerade_all", mode="nftables"),
    Field("nftables.masqueradeBit", _int32(0, 31), "masquerade_bit", mode="nftables"),
    Field("nftables.minSyncPeriod", _duration(True), "nftables_min_sync_period"),
    Field("nftables.syncPeriod", _duration(True), "nftables_sync_period"),
    Field("nodePortAddresses", _nodeport_addresses, "nodeport_addresses"),
    _warned("oomScoreAdj", "nfproxy leaves its OOM score to the container runtime",
            _int32(-1000, 1000), (-999,), "oom_score_adj"),
    _warned("portRange", "kube-proxy's userspace mode is gone", _string),
    _warned("showHiddenMetricsForVersion", "nfproxy has no hidden metrics", _string,
            dest="show_hidden_metrics_for_version"),
    _warned("windowsRunAsService", _NO_WINDOWS, _bool),
    _warned("winkernel.enableDSR", _NO_WINDOWS, _bool),
    _warned("winkernel.forwardHealthCheckVip", _NO_WINDOWS, _bool),
    _warned("winkernel.networkName", _NO_WINDOWS, _string),
    _warned("winkernel.rootHnsEndpointName", _NO_WINDOWS, _string),
    _warned("winkernel.sourceVip", _NO_WINDOWS, _string),
)
_BY_PATH = {f.path: f for f in FIELDS}
_SECTIONS = {f.path.split(".")[0] for f in FIELDS if "." in f.path}
# Maps whose keys are data, not field names.
_OPAQUE = {"featureGates", "logging.options", "logging.vmodule", "ipvs.excludeCIDRs"}


def _zero(v: object) -> bool:
    """Go's zero value, as kubeadm writes the fields it leaves to kube-proxy's defaults."""
    if isinstance(v, dict):
        return all(_zero(x) for x in v.values())
    if isinstance(v, list):
        return not v
    if isinstance(v, str):
        return v in ("", "0", "0s")
    return v in (None, False, 0)


def quiet(f: Field, value: object) -> bool:
    """A warned field's value that says nothing: Go's zero value or kube-proxy's own default."""
    return _zero(value) or value in f.quiet


def flag_setting(path: str, flag: str, value: object) -> tuple[object, str | None]:
    """What kube-proxy's flag for the field `path` sets, checked as the field is, and the
    field's warning, worded for the flag, when nfproxy cannot honour a value that says something.
    Raises FlagError naming the flag."""
    from nfproxy.cli.config import FlagError

    f = _BY_PATH[path]
    try:
        checked = f.check(value)
    except _Bad as exc:
        raise FlagError(f"{flag}: {exc}") from None
    if not f.why or quiet(f, value):
        return checked, None
    return checked, f"{flag}: {display(value)}: ignored, {f.why}"


# ---- reading


def _located(text: str) -> tuple[Any, dict[str, int], list[tuple[str, int]]]:
    """The document, the line (1-based) of every key path in it, and every key given again.

    PyYAML keeps a key's last value, as the YAML decoder of kube-proxy's lenient fallback does
    (its strict decoding refuses the file): a path's line is its last occurrence's.
    """
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        try:
            doc = loader.construct_document(node) if node is not None else None
        except (ValueError, OverflowError) as exc:
            assert node is not None
            raise _unreadable(node, exc) from None
    finally:
        loader.dispose()
    lines: dict[str, int] = {}
    duplicate: list[tuple[str, int]] = []

    def walk(n: yaml.Node, prefix: str) -> None:
        if isinstance(n, yaml.MappingNode):
            for key, value in n.value:
                path = f"{prefix}.{key.value}" if prefix else str(key.value)
                if path in lines:
                    duplicate.append((path, key.start_mark.line + 1))
                lines[path] = key.start_mark.line + 1
                walk(value, path)

    if node is not None:
        walk(node, "")
    return doc, lines, duplicate


class _Unreadable(Exception):
    """A scalar YAML resolves but Python cannot build (a 5000-digit integer, February 30th)."""

    def __init__(self, field: str, line: int, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.line = line


def _unreadable(root: yaml.Node, exc: Exception) -> Exception:
    """The first scalar under `root` that cannot be built, with its key path and line, found by
    building each scalar alone; `exc` itself when none can be singled out."""
    builder = _Loader("")
    stack: list[tuple[yaml.Node, str]] = [(root, "")]
    try:
        while stack:
            n, path = stack.pop()
            if isinstance(n, yaml.ScalarNode):
                try:
                    builder.construct_object(n, deep=True)
                except (ValueError, OverflowError) as err:
                    # Python's own advice (sys.set_int_max_str_digits) means nothing to a user.
                    why = ("an integer with too many digits" if "integer string conversion" in str(err)
                           else str(err))
                    return _Unreadable(path, n.start_mark.line + 1, why)
            elif isinstance(n, yaml.MappingNode):
                for key, value in reversed(n.value):
                    name = f"{path}.{key.value}" if path else str(key.value)
                    stack.extend([(value, name), (key, name)])
            elif isinstance(n, yaml.SequenceNode):
                stack.extend((item, path) for item in reversed(n.value))
    finally:
        builder.dispose()
    return exc


def _one_line(text: str, limit: int = 200) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def _read(path: str) -> str:
    """The file's text, read as the manifest reader reads a file: never a FIFO (which would
    hang), a device (`/dev/zero` never ends) or more than MAX_BYTES; UTF-8 only."""
    from nfproxy.sources.manifests import FileProblem, read_bytes

    try:
        data = read_bytes(Path(path), MAX_BYTES)
    except FileProblem as exc:
        # The reader names the manifests' flag for its size limit; a config file has its own.
        message = str(exc).replace(f"the {MAX_BYTES}-byte limit (--max-manifest-bytes)",
                                   f"the {MAX_BYTES}-byte limit of a configuration file")
        raise ConfigFileError(f"{path}: cannot read: {message}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigFileError(f"{path}: {KIND}: not UTF-8 text (byte {exc.start})") from None


def load(path: str, given: Collection[str] = ()) -> LoadedConfig:
    """The file's settings; raises ConfigFileError naming file, line and field on any fault.

    `given`: the dests the command line sets, which win over the file; a check between fields
    (detectLocalMode and the interface it needs) is made on what the two together mean.
    """
    text = _read(path)
    try:
        doc, lines, duplicates = _located(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{path}:{mark.line + 1}" if mark is not None else path
        problem = exc.problem or exc.context or "syntax error"
        raise ConfigFileError(f"{where}: {KIND}: invalid YAML: {_one_line(problem)}") from None
    except yaml.YAMLError as exc:
        raise ConfigFileError(f"{path}: {KIND}: invalid YAML: {_one_line(str(exc))}") from None
    except RecursionError:
        raise ConfigFileError(f"{path}: {KIND}: nested too deeply to be a configuration") from None
    except _Unreadable as exc:
        raise ConfigFileError(f"{path}:{exc.line}: {KIND}: {_field(exc.field)}: "
                              f"a value cannot be read: {_one_line(str(exc))}") from None
    except (ValueError, OverflowError) as exc:
        # Scalars the YAML resolver accepts but Python cannot build: a 5000-digit integer, a
        # timestamp on February 30th. The YAML loader does not say where; the message does.
        raise ConfigFileError(f"{path}: {KIND}: a value cannot be read: {_one_line(str(exc))}") from None
    try:
        loaded = _settings(path, doc, lines, duplicates)
    except RecursionError:  # a warned field's value nested ~1000 deep, walked by _zero
        raise ConfigFileError(f"{path}: {KIND}: nested too deeply to be a configuration") from None
    _check_local_mode(path, lines, loaded.defaults, given)
    return loaded


def _check_local_mode(path: str, lines: dict[str, int], defaults: Mapping[str, object],
                      given: Collection[str]) -> None:
    """detectLocalMode BridgeInterface / InterfaceNamePrefix from the file needs its interface,
    from the file or the command line; else the flag's error would blame a flag never given."""
    if "detect_local_mode" in given:
        return  # the command line's mode; its flags' own check applies
    for mode, dest, field in (("BridgeInterface", "pod_bridge_interface", "detectLocal.bridgeInterface"),
                              ("InterfaceNamePrefix", "pod_interface_name_prefix",
                               "detectLocal.interfaceNamePrefix")):
        if defaults.get("detect_local_mode") == mode and not defaults.get(dest) and dest not in given:
            line = lines.get("detectLocalMode")
            raise ConfigFileError(f"{path}:{line}: {KIND}: detectLocalMode: {mode}: needs {field}")


def _settings(path: str, doc: Any, lines: dict[str, int],
              duplicates: list[tuple[str, int]]) -> LoadedConfig:
    """What the decoded document sets, every field checked."""

    def fail(field: str, message: str) -> ConfigFileError:
        line = lines.get(field)
        shown = _field(field)
        return ConfigFileError(f"{path}:{line}: {KIND}: {shown}: {message}" if line
                               else f"{path}: {KIND}: {shown}: {message}")

    if not isinstance(doc, dict):
        raise ConfigFileError(f"{path}: {KIND}: the file must hold one {KIND} object")
    lenient = [f"{path}:{line}: {KIND}: {_field(key)}: given twice, the last value is used "
               f"({_LENIENT})" for key, line in duplicates]
    if doc.get("apiVersion") != API_VERSION:
        raise fail("apiVersion", f"{display(doc.get('apiVersion'))}: must be {API_VERSION}")
    if doc.get("kind") != KIND:
        raise fail("kind", f"{display(doc.get('kind'))}: must be {KIND}")
    values, unknown = _flatten(doc, fail)
    lenient += [f"{path}:{lines.get(field_path)}: {KIND}: {_field(field_path)}: unknown field, "
                f"ignored ({_LENIENT})" for field_path in unknown]
    mode = values.get("mode") or ""
    mode_name = mode if mode else "iptables"
    defaults: dict[str, object] = {}
    warnings: list[str] = sorted(lenient, key=_line_of)
    for field_path, value in values.items():
        if field_path in ("apiVersion", "kind"):
            continue  # checked above
        f = _BY_PATH[field_path]
        try:
            checked = f.check(value)
        except _Bad as exc:
            if exc.key:
                key = exc.key if _GATE.fullmatch(exc.key) and len(exc.key) <= 120 else display(exc.key)
                line = lines.get(f"{field_path}.{exc.key}") or lines.get(field_path)
                raise ConfigFileError(f"{path}:{line}: {KIND}: {field_path}.{key}: {exc}") from None
            raise fail(field_path, str(exc)) from None
        if f.why and not quiet(f, value):
            line = lines.get(field_path)
            warnings.append(f"{path}:{line}: {KIND}: {field_path}: {display(value)}: ignored, {f.why}")
        if f.dest is None:
            continue
        if f.mode is not None and f.mode != mode_name:
            continue
        if checked is not None:
            defaults[f.dest] = checked
    _default_addresses(defaults)
    _check_sync_periods(mode_name, defaults, fail)
    return LoadedConfig(defaults, tuple(warnings))


# kube-proxy's words when it falls back to lenient decoding, so a search for them finds ours.
_LENIENT = "kube-proxy: Using lenient decoding as strict decoding failed"


def _line_of(warning: str) -> int:
    """A warning's line number, to list them in the file's order."""
    _, _, rest = warning.partition(":")
    number = rest.partition(":")[0]
    return int(number) if number.isdigit() else 0


def _default_addresses(defaults: dict[str, object]) -> None:
    """kube-proxy's getDefaultAddresses (v1alpha1 defaults.go): with an IPv6 bindAddress in the
    file, the servers' defaults are `[::]:10256` and `[::1]:10249` rather than IPv4's."""
    import ipaddress

    bind = defaults.get("bind_address")
    if not isinstance(bind, str):
        return
    ip = ipaddress.ip_address(bind)  # checked by its field
    if ip.version == 4 or (ip.version == 6 and ip.ipv4_mapped is not None):
        return
    defaults.setdefault("healthz_bind_address", f"[::]:{HEALTHZ_PORT}")
    defaults.setdefault("metrics_bind_address", f"[::1]:{METRICS_PORT}")


def _check_sync_periods(mode: str, defaults: Mapping[str, object],
                        fail: Callable[[str, str], ConfigFileError]) -> None:
    """kube-proxy's Validate: the mode's minSyncPeriod must not exceed its syncPeriod (both
    after defaulting: 1s and 30s)."""
    min_text = str(defaults.get(f"{mode}_min_sync_period") or "1s")
    text = str(defaults.get(f"{mode}_sync_period") or "30s")
    if go_duration.parse(min_text) > go_duration.parse(text):
        given_min = f"{mode}_min_sync_period" in defaults
        raise fail(f"{mode}.minSyncPeriod" if given_min else f"{mode}.syncPeriod",
                   f"{display(min_text)}: must not be greater than {mode}.syncPeriod ({display(text)})")


def _flatten(doc: dict[str, Any],
             fail: Callable[[str, str], ConfigFileError]) -> tuple[dict[str, Any], list[str]]:
    """Field path -> value, and the paths of fields kube-proxy does not know (ignored, as its
    lenient decoding ignores them)."""
    out: dict[str, Any] = {}
    unknown: list[str] = []

    def walk(obj: dict[str, Any], prefix: str) -> None:
        for key, value in obj.items():
            field_path = f"{prefix}.{key}" if prefix else str(key)
            if field_path in _BY_PATH:
                out[field_path] = value
            elif field_path in _SECTIONS or field_path == "logging":
                if value is None:
                    continue
                if not isinstance(value, dict):
                    raise fail(field_path, f"{display(value)}: must be a map")
                walk(value, field_path)
            else:
                unknown.append(field_path)

    walk(doc, "")
    return out, unknown


# ---- writing


def effective(args: argparse.Namespace) -> dict[str, Any]:
    """The configuration the daemon runs with, every default filled in, in kubeadm's layout."""

    def get(dest: str, default: object) -> Any:
        value = getattr(args, dest, None)
        return default if value is None else value

    def cidrs(values: list[str]) -> list[str]:
        return [v.strip() for raw in values for v in raw.split(",") if v.strip()]

    masquerade_all = bool(get("masquerade_all", False))
    masquerade_bit = int(get("masquerade_bit", 14))
    mode = "nftables" if args.backend in ("nft", "nftables") else "iptables"
    gates = {}
    for item in (get("feature_gates", "") or "").split(","):
        if item.strip():
            name, _, value = item.partition("=")
            gates[name.strip()] = value.strip().lower() == "true"
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "bindAddress": get("bind_address", "0.0.0.0"),
        "bindAddressHardFail": bool(get("bind_address_hard_fail", False)),
        "clientConnection": {
            "burst": int(get("kube_api_burst", 10)),
            "contentType": get("kube_api_content_type", PROTOBUF),
            "kubeconfig": get("kubeconfig", ""),
            "qps": get("kube_api_qps", 5),
        },
        "clusterCIDR": ",".join(cidrs(get("cluster_cidr", []))),
        "configSyncPeriod": _canonical(get("config_sync_period", "15m")),
        "conntrack": {
            "maxPerCore": int(get("conntrack_max_per_core", 32768)),
            "min": int(get("conntrack_min", 131072)),
            "tcpBeLiberal": bool(get("conntrack_tcp_be_liberal", False)),
            "tcpCloseWaitTimeout": _canonical(get("conntrack_tcp_timeout_close_wait", "1h")),
            "tcpEstablishedTimeout": _canonical(get("conntrack_tcp_timeout_established", "24h")),
            "udpStreamTimeout": _canonical(get("conntrack_udp_timeout_stream", "0s")),
            "udpTimeout": _canonical(get("conntrack_udp_timeout", "0s")),
        },
        "detectLocal": {
            "bridgeInterface": get("pod_bridge_interface", ""),
            "interfaceNamePrefix": get("pod_interface_name_prefix", ""),
        },
        "detectLocalMode": get("detect_local_mode", ""),
        "enableProfiling": bool(get("profiling", False)),
        "featureGates": gates,
        "healthzBindAddress": get("healthz_bind_address", "0.0.0.0:10256"),
        "hostnameOverride": get("node_name", ""),
        "iptables": {
            "localhostNodePorts": bool(get("localhost_nodeports", True)),
            "masqueradeAll": masquerade_all,
            "masqueradeBit": masquerade_bit,
            "minSyncPeriod": _canonical(get("iptables_min_sync_period", "1s")),
            "syncPeriod": _canonical(get("iptables_sync_period", "30s")),
        },
        "ipvs": _ipvs(get),
        "logging": _logging(args, get),
        "metricsBindAddress": get("metrics_bind_address", "127.0.0.1:10249"),
        "mode": mode,
        "nftables": {
            "masqueradeAll": masquerade_all,
            "masqueradeBit": masquerade_bit,
            "minSyncPeriod": _canonical(get("nftables_min_sync_period", "1s")),
            "syncPeriod": _canonical(get("nftables_sync_period", "30s")),
        },
        "nodePortAddresses": cidrs(get("nodeport_addresses", [])),
        "oomScoreAdj": int(get("oom_score_adj", -999)),
        "showHiddenMetricsForVersion": get("show_hidden_metrics_for_version", ""),
    }


def _ipvs(get: Callable[[str, object], Any]) -> dict[str, Any]:
    """The ipvs section as kube-proxy writes it (no IPVS mode here: only kept and shown)."""
    return {
        "excludeCIDRs": list(get("ipvs_exclude_cidrs", [])) or None,
        "minSyncPeriod": _canonical(get("ipvs_min_sync_period", "0s")),
        "scheduler": get("ipvs_scheduler", ""),
        "strictARP": bool(get("ipvs_strict_arp", False)),
        "syncPeriod": _canonical(get("ipvs_sync_period", "30s")),
        "tcpFinTimeout": _canonical(get("ipvs_tcpfin_timeout", "0s")),
        "tcpTimeout": _canonical(get("ipvs_tcp_timeout", "0s")),
        "udpTimeout": _canonical(get("ipvs_udp_timeout", "0s")),
    }


# The logging flags of `logging.options`: (format, option) -> dest. The file's own
# logging.options is only warned about; what these flags set is written back.
LOGGING_OPTION_DESTS = {
    ("text", "splitStream"): "log_text_split_stream",
    ("text", "infoBufferSize"): "log_text_info_buffer_size",
    ("json", "splitStream"): "log_json_split_stream",
    ("json", "infoBufferSize"): "log_json_info_buffer_size",
}


def _logging(args: argparse.Namespace, get: Callable[[str, object], Any]) -> dict[str, Any]:
    """The logging section; vmodule and options only when set, as kube-proxy omits them empty."""
    out: dict[str, Any] = {
        "flushFrequency": _canonical(get("log_flush_frequency", "5s")),
        "format": get("logging_format", "text"),
        "verbosity": int(get("verbosity", 0)),
    }
    if vmodule := get("vmodule", []):
        out["vmodule"] = list(vmodule)
    options: dict[str, dict[str, Any]] = {}
    for (fmt, option), dest in LOGGING_OPTION_DESTS.items():
        value = getattr(args, dest, None)
        if value is not None and not _zero(value):
            options.setdefault(fmt, {})[option] = value
    if options:
        out["options"] = options
    return out


def _canonical(text: str) -> str:
    return go_duration.format(go_duration.parse(text))


def write(args: argparse.Namespace, path: str) -> None:
    text = yaml.safe_dump(effective(args), sort_keys=True, default_flow_style=False, allow_unicode=True)
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as exc:
        from nfproxy.cli.config import FlagError

        raise FlagError(f"--write-config-to: {path}: cannot write: {exc.strerror}") from None

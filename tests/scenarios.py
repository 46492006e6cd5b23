"""The compat corpus: scenarios that say, per packet, what kube-proxy would do with it.

Each file under `compat/` is a small cluster (a node, Kubernetes objects) and probes: a packet
(source, destination, port, protocol) and the outcome kube-proxy's documented behaviour gives it
(a uniform choice among endpoints, with or without masquerade; reject; drop; accept untouched).
The expectations are written by hand from the semantics, never generated from our renderers, so
the corpus can catch both backends agreeing on the same mistake. Two runners consume it: the
exact interpreter (rules read back and walked symbolically) and the kernel runner
(`tests.compat_kernel`: real packets in a sandbox).

A scenario file is user input like any manifest: every field is checked, and every problem is
reported with the file, the probe index and the field path, all at once.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml

from nfproxy.core.model import ClusterState, NodeConfig
from nfproxy.sources import validation as v
from nfproxy.sources.manifests import load_objects
from nfproxy.sources.validation import FieldError, show, type_name
from nfproxy.verify.probe import Expect, Probe, Verdict, origin_of
from nfproxy.verify.sandbox import NODE, endpoint_label

COMPAT_DIR = Path(__file__).resolve().parent.parent / "compat"

VERDICTS: tuple[Verdict, ...] = ("dnat", "reject", "drop", "accept")
PROTOS = ("tcp", "udp", "sctp")

_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_TOP_KEYS = {"name", "description", "node", "objects", "probes"}
_NODE_KEYS = {"name", "ips", "clusterCIDR", "zone", "masqueradeAll", "nodePortAddresses"}
_PROBE_KEYS = {"src", "dst", "port", "proto", "expect", "expectIptables", "exactOnly", "note"}
_EXPECT_KEYS = {"uniform", "verdict", "masquerade"}
_ENDPOINT = re.compile(r"(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<v4>[0-9.]+)):(?P<port>[0-9]{1,5})")

T = TypeVar("T")


class ScenarioError(ValueError):
    """A scenario file is malformed; the message lists every problem with file and field path."""


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    description: str
    path: Path
    state: ClusterState
    probes: tuple[Probe, ...]


def load_all(directory: str | Path = COMPAT_DIR) -> list[Scenario]:
    """Every `*.yaml` scenario in `directory`, by file name; all files' errors reported together."""
    root = Path(directory)
    files = sorted(root.glob("*.yaml"))
    if not files:
        raise ScenarioError(f"{root}: no *.yaml scenario files")
    scenarios: list[Scenario] = []
    problems: list[str] = []
    for path in files:
        try:
            scenarios.append(load(path))
        except ScenarioError as exc:
            problems.append(str(exc))
    if problems:
        raise ScenarioError("\n".join(problems))
    return scenarios


def load(path: str | Path) -> Scenario:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ScenarioError(f"{path}: cannot read: {exc}") from None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ScenarioError(f"{path}: not valid YAML: {exc}") from None
    return _Reader(path).scenario(doc)


class _Reader:
    """Walks one scenario document, collecting every problem with its field path."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.errors: list[str] = []

    def add(self, field: str, message: str) -> None:
        self.errors.append(f"{self.path}: {field}: {message}")

    def check(self, field: str, validate: Callable[[Any], T], value: Any) -> T | None:
        try:
            return validate(value)
        except FieldError as exc:
            self.add(field, str(exc))
            return None

    def mapping(self, field: str, value: Any, allowed: set[str], required: set[str]) -> dict:
        if not isinstance(value, dict):
            self.add(field, f"expected a mapping, got {type_name(value)}")
            return {}
        for key in value:
            if key not in allowed:
                self.add(f"{field}.{show(key)}" if field else show(key),
                         f"unknown field (expected one of {', '.join(sorted(allowed))})")
        for key in sorted(required - set(value)):
            self.add(f"{field}.{key}" if field else key, "required field is missing")
        return value

    def fail_if_any(self) -> None:
        if self.errors:
            raise ScenarioError("\n".join(self.errors))

    # ---- the document

    def scenario(self, doc: Any) -> Scenario:
        top = self.mapping("", doc, _TOP_KEYS, _TOP_KEYS)
        name = self.check("name", _matching_name, top.get("name")) if "name" in top else None
        if name is not None and name != self.path.stem:
            self.add("name", f"{name} does not match the file name {self.path.stem}")
        description = top.get("description")
        if "description" in top and (not isinstance(description, str) or not description.strip()):
            self.add("description", "expected a non-empty string saying why the scenario exists")
        node = self.node(top.get("node", {})) if "node" in top else None
        objects = top.get("objects")
        if "objects" in top and not (isinstance(objects, list) and objects):
            self.add("objects", "expected a non-empty list of Kubernetes objects")
        raw_probes = top.get("probes")
        if "probes" in top and not (isinstance(raw_probes, list) and raw_probes):
            self.add("probes", "expected a non-empty list of probes")
        self.fail_if_any()
        assert node is not None and isinstance(objects, list) and isinstance(raw_probes, list)

        result = load_objects(objects, node)
        for err in result.errors:
            self.add("objects", str(err))
        self.fail_if_any()
        state = result.state
        if not state.services:
            self.add("objects", "no Service port was loaded")
        endpoints = {e.address for eps in state.endpoints.values() for e in eps}
        probes = []
        for i, raw in enumerate(raw_probes):
            probe = self.probe(f"probes[{i}]", raw, state.node, endpoints)
            if probe is not None:
                probes.append(probe)
        self.fail_if_any()
        return Scenario(str(name), str(description).strip(), self.path, state, tuple(probes))

    def node(self, raw: Any) -> NodeConfig:
        node = self.mapping("node", raw, _NODE_KEYS, {"name", "ips"})
        name = self.check("node.name", v.dns_subdomain, node.get("name", "")) or ""
        ips = tuple(
            ip for i, x in enumerate(self.strings("node.ips", node.get("ips", [])))
            if (ip := self.check(f"node.ips[{i}]", v.ip_address, x))
        )
        if "ips" in node and not ips:
            self.add("node.ips", "at least one node IP is needed")
        cidrs = self.strings("node.clusterCIDR", node.get("clusterCIDR", []), one_allowed=True)
        cluster_cidrs = tuple(
            c for i, x in enumerate(cidrs) if (c := self.check(f"node.clusterCIDR[{i}]", v.cidr, x))
        )
        addresses = tuple(
            c for i, x in enumerate(self.strings("node.nodePortAddresses", node.get("nodePortAddresses", [])))
            if (c := self.check(f"node.nodePortAddresses[{i}]", v.cidr, x))
        )
        for field, values in (("node.ips", ips), ("node.clusterCIDR", cluster_cidrs)):
            for family in (4, 6):
                of = [x for x in values if (":" in x) == (family == 6)]
                if len(of) > 1:
                    self.add(field, f"more than one IPv{family} value: {', '.join(of)}")
        zone = self.check("node.zone", v.label_value, node.get("zone", "")) or ""
        masquerade_all = self.check("node.masqueradeAll", v.boolean, node.get("masqueradeAll", False))
        return NodeConfig(
            name=name, ips=ips, cluster_cidrs=cluster_cidrs, masquerade_all=bool(masquerade_all),
            zone=zone, nodeport_addresses=addresses,
        )

    def strings(self, field: str, value: Any, one_allowed: bool = False) -> list[Any]:
        if one_allowed and isinstance(value, str):
            return [value]
        if not isinstance(value, list):
            self.add(field, f"expected a list, got {type_name(value)}")
            return []
        return value

    def probe(self, field: str, raw: Any, node: NodeConfig, endpoints: set[str]) -> Probe | None:
        before = len(self.errors)
        p = self.mapping(field, raw, _PROBE_KEYS, {"src", "dst", "port", "proto", "expect"})
        src_raw = p.get("src")
        src: str | None
        if src_raw == NODE:
            src = NODE
        else:
            src = self.check(f"{field}.src", v.ip_address, src_raw) if "src" in p else None
            if src is not None and src in node.ips:
                self.add(f"{field}.src", f"{src} is a node IP: write src: node for the node's own traffic")
        dst = self.check(f"{field}.dst", v.ip_address, p.get("dst")) if "dst" in p else None
        port = self.check(f"{field}.port", v.port, p.get("port")) if "port" in p else None
        proto_raw = p.get("proto")
        proto = None
        if "proto" in p:
            if isinstance(proto_raw, str) and proto_raw.lower() in PROTOS:
                proto = proto_raw.lower()
            else:
                self.add(f"{field}.proto", f"{show(proto_raw)} is not one of {', '.join(PROTOS)}")
        exact_only = p.get("exactOnly", "")
        if not isinstance(exact_only, str) or ("exactOnly" in p and not exact_only.strip()):
            self.add(f"{field}.exactOnly", "expected a non-empty string saying why the kernel cannot send it")
            exact_only = ""
        if "note" in p and not isinstance(p["note"], str):
            self.add(f"{field}.note", f"expected a string, got {type_name(p['note'])}")
        if dst is not None and src is not None:
            family = 6 if ":" in dst else 4
            if src == NODE:
                if not any((":" in ip) == (family == 6) for ip in node.ips):
                    self.add(f"{field}.src", f"the node has no IPv{family} address to reach {dst} from")
            elif (":" in src) != (family == 6):
                self.add(f"{field}.src", f"{src} and {dst} are of different IP families")
        expect = self.expect(f"{field}.expect", p.get("expect"), endpoints) if "expect" in p else None
        expect_iptables = (
            self.expect(f"{field}.expectIptables", p.get("expectIptables"), endpoints)
            if "expectIptables" in p
            else None
        )
        if len(self.errors) > before:
            return None
        assert src is not None and dst is not None and port is not None and proto is not None
        assert expect is not None
        return Probe(src, dst, port, proto, origin_of(src, node), expect=expect,
                     exact_only=exact_only.strip(), expect_iptables=expect_iptables)

    def expect(self, field: str, raw: Any, endpoints: set[str]) -> Expect | None:
        e = self.mapping(field, raw, _EXPECT_KEYS, set())
        if not e:
            if isinstance(raw, dict):
                self.add(field, "give uniform (endpoints) or a verdict")
            return None
        uniform: tuple[str, ...] | None = None
        if "uniform" in e:
            items = e["uniform"]
            if not isinstance(items, list) or not items:
                self.add(f"{field}.uniform", "expected a non-empty list of ip:port endpoints")
            else:
                seen: list[str] = []
                for i, item in enumerate(items):
                    label = self.endpoint(f"{field}.uniform[{i}]", item)
                    if label is None:
                        continue
                    if label in seen:
                        self.add(f"{field}.uniform[{i}]", f"{label} is listed twice")
                    elif label not in endpoints:
                        self.add(f"{field}.uniform[{i}]", f"{label} is no endpoint of any service here")
                    seen.append(label)
                uniform = tuple(seen)
        verdict_raw = e.get("verdict", "dnat" if "uniform" in e else None)
        verdict = self.check(f"{field}.verdict", lambda x: v.one_of(x, VERDICTS), verdict_raw)
        if "verdict" not in e and "uniform" not in e:
            self.add(field, "give uniform (endpoints) or a verdict")
        if verdict == "dnat" and "uniform" not in e:
            self.add(f"{field}.uniform", "a dnat verdict needs the endpoints it spreads over")
        if verdict is not None and verdict != "dnat" and "uniform" in e:
            self.add(f"{field}.uniform", f"endpoints make no sense with verdict {verdict}")
        masquerade = None
        if "masquerade" in e:
            masquerade = self.check(f"{field}.masquerade", v.boolean, e["masquerade"])
            if verdict in ("reject", "drop"):
                self.add(f"{field}.masquerade", f"nothing is delivered under verdict {verdict}")
        elif verdict == "dnat":
            self.add(f"{field}.masquerade", "required with uniform: say whether the source is rewritten")
        if verdict is None:
            return None
        return Expect(uniform, verdict, masquerade)  # type: ignore[arg-type]

    def endpoint(self, field: str, raw: Any) -> str | None:
        m = _ENDPOINT.fullmatch(raw) if isinstance(raw, str) else None
        if m is None:
            self.add(field, f"{show(raw)} is not ip:port ([ip]:port for IPv6)")
            return None
        ip_text = m.group("v6") or m.group("v4")
        ip = self.check(field, v.ip_address, ip_text)
        port = self.check(field, v.port, int(m.group("port")))
        if ip is None or port is None:
            return None
        if (m.group("v6") is not None) != (":" in ip):
            self.add(field, f"{show(raw)}: IPv6 endpoints are bracketed, IPv4 ones are not")
            return None
        return endpoint_label(ip, port)


def _matching_name(value: Any) -> str:
    text = v.string(value)
    if len(text) > 63 or not _NAME.fullmatch(text):
        raise FieldError(f"{show(text)} is not a valid scenario name (lower-case DNS label)")
    return text

"""kube-proxy's `--feature-gates` / `featureGates`, judged as kube-proxy judges them.

kube-proxy registers every Kubernetes feature gate (component-base's featuregate) and refuses a
gate it does not know, a locked gate set to the other value, a pre-alpha gate, and an enabled gate
whose dependencies are off; it accepts the rest, logging a GA or deprecated one. nfproxy answers
the same, from the list the real kube-proxy's gate set gives (`kube_feature_gates.json`, written
by `scripts/kube feature-gates` from `k8s.io/kubernetes`; a test holds the two equal), so a
command line or file either works on both or fails on both with the same message.

One gate changes what nfproxy does: `KubeProxyNFTablesLocalhostNodePorts` (alpha in 1.37, off
by default): TCP node ports on 127.0.0.1/::1 through a userspace proxy in nftables mode
(daemon/localhost_proxy.py). Every other gate given is warned about once, naming it, so nobody
believes it did something here.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

from nfproxy.cli.flag_types import display
from nfproxy.core.flags import FlagError
from nfproxy.daemon import logs

LOCALHOST_NODEPORTS = "KubeProxyNFTablesLocalhostNodePorts"
# What the gates nfproxy's own behaviour answers to mean here (any other: "not read by nfproxy").
_MEANING: dict[str, str] = {
    "NFTablesProxyMode": "nfproxy always has the nftables mode",
    "PreferSameTrafficDistribution": "nfproxy always implements PreferSameNode and PreferSameZone",
    "MultiCIDRServiceAllocator": "nfproxy reads ServiceCIDRs as kube-proxy does",
    "NFTablesNetlink": "nfproxy writes nftables through netlink in its own way (docs/design.md)",
    "WinDSR": "Windows only",
    "WinOverlay": "Windows only",
}
_NAME = re.compile(r"[A-Z][A-Za-z0-9]*")
# Longest gate name printed as it is (Kubernetes' are under 60 characters): an unknown longer
# one is refused with its name cut, so one flag cannot write a 100 KB line.
_SHOWN_NAME = 60
_SPECIAL = {"AllAlpha": "ALPHA", "AllBeta": "BETA"}  # component-base's gates that set a stage


@dataclass(frozen=True, slots=True)
class Gate:
    name: str
    stage: str  # ALPHA, BETA, GA, DEPRECATED or PREALPHA, at kube-proxy's own version
    default: bool
    locked: bool
    depends_on: tuple[str, ...]


@functools.cache
def known() -> dict[str, Gate]:
    """kube-proxy's gates (kube_feature_gates.json, shipped with nfproxy)."""
    data = json.loads((Path(__file__).parent / "kube_feature_gates.json").read_text())
    return {g["name"]: Gate(g["name"], g["stage"], g["default"], g["locked"], tuple(g.get("dependsOn", ())))
            for g in data["gates"]}


def kube_proxy_version() -> str:
    return json.loads((Path(__file__).parent / "kube_feature_gates.json").read_text())["kubeProxy"]


def _name(name: str) -> str:
    return name if len(name) <= _SHOWN_NAME else display(name)


def refusal(name: str, on: bool) -> str | None:
    """kube-proxy's error for setting gate `name` to `on` alone; None when it may be set."""
    gate = known().get(name)
    if gate is None:
        return f"unrecognized feature gate: {_name(name)}"
    if gate.locked and gate.default != on:
        return f"cannot set feature gate {name} to {str(on).lower()}, feature is locked to {str(gate.default).lower()}"
    if gate.stage == "PREALPHA":
        return f"cannot set feature gate {name} to {str(on).lower()}, feature is PreAlpha"
    return None


def _enabled(name: str, given: dict[str, bool]) -> bool:
    """A gate's value with `given` applied: itself, else AllAlpha/AllBeta for its stage, else its
    default (component-base's featureEnabled)."""
    if name in given:
        return given[name]
    gate = known().get(name)
    if gate is None:
        return False
    for special, stage in _SPECIAL.items():
        if gate.stage == stage and special in given and not gate.locked:
            return given[special]
    return gate.default


def dependency_errors(given: dict[str, bool]) -> list[str]:
    """component-base's check after a set: an enabled gate whose dependencies are off."""
    errors = []
    for gate in known().values():
        if gate.depends_on and _enabled(gate.name, given):
            off = [d for d in gate.depends_on if not _enabled(d, given)]
            if off:
                errors.append(f"{gate.name} is enabled, but depends on features that are disabled: [{' '.join(off)}]")
    return errors


def check(given: dict[str, bool]) -> None:
    """Every refusal kube-proxy would make for `given`, as one FlagError (its first, as kube-proxy
    stops at an unknown gate)."""
    for name, on in given.items():
        error = refusal(name, on)
        if error:
            raise FlagError(f"--feature-gates: {error}")
    errors = dependency_errors(given)
    if errors:
        raise FlagError(f"--feature-gates: {aggregate(errors)}")


def aggregate(errors: list[str]) -> str:
    """apimachinery's error aggregate, as kube-proxy prints it: one error as it is, several in
    brackets (kube-proxy's order follows a Go map's, so it varies; here it is sorted)."""
    return errors[0] if len(errors) == 1 else f"[{', '.join(sorted(errors))}]"


def gates(text: str) -> dict[str, bool]:
    """`Name=true,Other=false` -> {Name: True, ...}, refused as kube-proxy refuses it (bad syntax,
    unknown, locked, pre-alpha, dependencies). Logs nothing (see `parse_feature_gates`)."""
    out: dict[str, bool] = {}
    for item in (text or "").split(","):
        item = item.strip()
        if not item:
            continue
        name, sep, value = item.partition("=")
        name, value = name.strip(), value.strip()
        if not sep or not _NAME.fullmatch(name):
            raise FlagError(f"--feature-gates: {display(item)} is not Name=true|false")
        if value.lower() not in ("true", "false"):
            raise FlagError(f"--feature-gates: {_name(name)}: {display(value)} must be true or false")
        out[name] = value.lower() == "true"
    check(out)
    return out


def enabled(text: str, name: str) -> bool:
    """Whether gate `name` is on, with kube-proxy's default when not given."""
    return _enabled(name, gates(text))


def parse_feature_gates(text: str, log: logging.Logger, mode: str = "nftables") -> dict[str, bool]:
    """`gates`, each gate given logged once: a GA or deprecated gate gets kube-proxy's own line;
    an unlocked gate without effect here is warned about; the effective gate is named when the
    proxy mode does not read it."""
    parsed = gates(text)
    for name, on in parsed.items():
        stage = known()[name].stage
        if stage in ("GA", "DEPRECATED"):  # kube-proxy's own line (component-base featuregate), at info
            word = "GA" if stage == "GA" else "deprecated"
            logs.info(log, f"Warning: setting {word} feature gate. It will be removed in a future release.",
                      featureGate=name, value=on)
        if known()[name].locked:
            continue  # given its only possible value: kube-proxy's line says all there is
        if name == LOCALHOST_NODEPORTS:
            if mode not in ("nft", "nftables"):
                log.warning("feature gate %s=%s: no effect in %s mode (nftables mode only)",
                            name, str(on).lower(), mode)
        else:
            why = _MEANING.get(name, "not read by nfproxy")
            log.warning("feature gate %s=%s: accepted, no effect: %s", name, str(on).lower(), why)
    return parsed

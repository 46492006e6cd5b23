"""kube-proxy's `--feature-gates` / `featureGates`: accepted so its command lines and files work.

One gate changes what nfproxy does: `KubeProxyNFTablesLocalhostNodePorts` (alpha in kube-proxy
1.37, off by default), which serves TCP node ports on 127.0.0.1/::1 in nftables mode through a
userspace proxy (daemon/localhost_proxy.py) and rejects and counts the rest. The others are for
behaviour nfproxy always has (or never can, on Windows): each one given is warned about once,
naming it, so nobody believes a gate did something here. A gate kube-proxy has locked to its
default (GA) refuses the other value as kube-proxy's feature-gate parser does.
"""

from __future__ import annotations

import logging
import re

from nfproxy.cli.flag_types import display
from nfproxy.core.flags import FlagError
from nfproxy.daemon import logs

LOCALHOST_NODEPORTS = "KubeProxyNFTablesLocalhostNodePorts"

_ALWAYS = "nfproxy always behaves as with it enabled"
KNOWN: dict[str, str] = {
    "NFTablesProxyMode": "nfproxy always has the nftables mode",
    "KubeProxyDrainingTerminatingNodes": _ALWAYS,
    "TopologyAwareHints": _ALWAYS,
    "ServiceTrafficDistribution": _ALWAYS,
    "MultiCIDRServiceAllocator": "not read by nfproxy",
    "WinDSR": "Windows only",
    "WinOverlay": "Windows only",
    "AllAlpha": "nfproxy has no alpha features",
    "AllBeta": "nfproxy has no beta features",
}
# GA gates nfproxy implements, locked to their default as in kube-proxy 1.37 (kube_features.go):
# the default is accepted with kube-proxy's GA warning, the other value is an error.
LOCKED: dict[str, bool] = {
    "PreferSameTrafficDistribution": True,  # GA and locked since 1.35; core/categorize.py
}
# Gates that change what nfproxy does, with kube-proxy 1.37's default.
EFFECTIVE: dict[str, bool] = {
    LOCALHOST_NODEPORTS: False,  # alpha since 1.37
}
_NAME = re.compile(r"[A-Z][A-Za-z0-9]*")
# Longest gate name printed as it is (Kubernetes' are under 50 characters); a longer one is
# still accepted, as any unknown gate is, but shown cut so one flag cannot write a 100 KB line.
_SHOWN_NAME = 60


def _name(name: str) -> str:
    return name if len(name) <= _SHOWN_NAME else display(name)


def locked_error(name: str, on: bool) -> str | None:
    """kube-proxy's error for a locked gate set to the other value; None when it may be set."""
    locked = LOCKED.get(name)
    if locked is None or locked == on:
        return None
    return (f"cannot set feature gate {name} to {str(on).lower()}, "
            f"feature is locked to {str(locked).lower()}")


def gates(text: str) -> dict[str, bool]:
    """`Name=true,Other=false` -> {Name: True, ...}; bad syntax or a locked gate set the other
    way is a FlagError naming the gate. Logs nothing (see `parse_feature_gates`)."""
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
        error = locked_error(name, out[name])
        if error:
            raise FlagError(f"--feature-gates: {error}")
    return out


def enabled(text: str, name: str) -> bool:
    """Whether gate `name` is on, with kube-proxy's default when not given."""
    return gates(text).get(name, EFFECTIVE.get(name, LOCKED.get(name, False)))


def parse_feature_gates(text: str, log: logging.Logger, mode: str = "nftables") -> dict[str, bool]:
    """`gates`, each gate given logged once: a gate without effect here is warned about; a
    locked GA gate gets kube-proxy's own warning; an effective gate is named when the proxy
    mode given does not read it."""
    parsed = gates(text)
    for name, on in parsed.items():
        if name in LOCKED:  # kube-proxy's own line (component-base featuregate), at info
            logs.info(log, "Warning: setting GA feature gate. It will be removed in a future release.",
                      featureGate=name, value=on)
        elif name == LOCALHOST_NODEPORTS:
            if mode not in ("nft", "nftables"):
                log.warning("feature gate %s=%s: no effect in %s mode (nftables mode only)",
                            name, str(on).lower(), mode)
        else:
            why = KNOWN.get(name, "a gate nfproxy does not know")
            log.warning("feature gate %s=%s: accepted, no effect: %s", _name(name), str(on).lower(), why)
    return parsed

"""kube-proxy's `--feature-gates` / `featureGates`: accepted so its command lines and files work.

None changes what nfproxy does: the gates kube-proxy reads are for behaviour nfproxy always has
(or never can, on Windows). Each gate given is warned about once, naming it, so nobody believes a
gate did something here.
"""

from __future__ import annotations

import logging
import re

from nfproxy.cli.config import FlagError
from nfproxy.cli.flag_types import display

_ALWAYS = "nfproxy always behaves as with it enabled"
KNOWN: dict[str, str] = {
    "NFTablesProxyMode": "nfproxy always has the nftables mode",
    "KubeProxyDrainingTerminatingNodes": _ALWAYS,
    "TopologyAwareHints": _ALWAYS,
    "ServiceTrafficDistribution": _ALWAYS,
    "PreferSameTrafficDistribution": "not implemented in nfproxy",
    "MultiCIDRServiceAllocator": "not read by nfproxy",
    "WinDSR": "Windows only",
    "WinOverlay": "Windows only",
    "AllAlpha": "nfproxy has no alpha features",
    "AllBeta": "nfproxy has no beta features",
}
_NAME = re.compile(r"[A-Z][A-Za-z0-9]*")
# Longest gate name printed as it is (Kubernetes' are under 50 characters); a longer one is
# still accepted, as any unknown gate is, but shown cut so one flag cannot write a 100 KB line.
_SHOWN_NAME = 60


def _name(name: str) -> str:
    return name if len(name) <= _SHOWN_NAME else display(name)


def parse_feature_gates(text: str, log: logging.Logger) -> dict[str, bool]:
    """`Name=true,Other=false` -> {Name: True, ...}; bad syntax is a FlagError naming the gate."""
    gates: dict[str, bool] = {}
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
        gates[name] = value.lower() == "true"
    for name, on in gates.items():
        why = KNOWN.get(name, "a gate nfproxy does not know")
        log.warning("feature gate %s=%s: accepted, no effect: %s", _name(name), str(on).lower(), why)
    return gates

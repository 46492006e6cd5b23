"""`--feature-gates` judged as the real kube-proxy judges it.

nfproxy answers from `nfproxy/cli/kube_feature_gates.json`; these tests hold that list to what
`k8s.io/kubernetes` registers (`scripts/kube feature-gates`) and nfproxy's verdicts to the
verdicts of the real kube-proxy binary (`scripts/kube build`), gate string by gate string: refused
with the same message, or accepted by both. kube-proxy is given a kubeconfig that does not exist:
it judges its flags first, so an accepted gate ends on the missing file instead.
"""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from nfproxy.cli import feature_gates
from nfproxy.core.flags import FlagError
from tests.realkube import ROOT

pytestmark = pytest.mark.apiserver

KUBE = ROOT / "scripts" / "kube"
CASES = [
    "WinDSR=false", "WinDSR=true", "NFTablesProxyMode=false", "NFTablesProxyMode=true",
    "PreferSameTrafficDistribution=false", "PreferSameTrafficDistribution=true",
    "TopologyAwareHints=true", "ServiceTrafficDistribution=true", "KubeProxyDrainingTerminatingNodes=true",
    "FooBar=true", "NFTablesNetlink=false", "KubeProxyNFTablesLocalhostNodePorts=true",
    "AllBeta=false", "AllAlpha=false", "AllAlpha=true", "AllBeta=true", "AllAlpha=true,AllBeta=true", "AggregatedDiscoveryRemoveBetaType=false",
    "GracefulNodeShutdown=false", "GracefulNodeShutdown=false,GracefulNodeShutdownBasedOnPodPriority=false",
    "ContextualLogging=true,NFTablesNetlink=true,Foo=true",
]
_REFUSED = re.compile(r'"command failed" err="failed complete: (.*)"$', re.M)


def kube_proxy_verdict(gates: str) -> str | None:
    """kube-proxy's refusal of `gates`, or None when it went on to read its kubeconfig."""
    proxy = subprocess.run([str(KUBE), "path", "kube-proxy"], capture_output=True, text=True, check=True).stdout.strip()
    done = subprocess.run([proxy, f"--feature-gates={gates}", "--kubeconfig", "/nonexistent/kubeconfig"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0, done.stderr[-1000:]
    found = _REFUSED.search(done.stderr)
    if found:
        return found.group(1)
    assert "/nonexistent/kubeconfig" in done.stderr, done.stderr[-1000:]
    return None


def nfproxy_verdict(gates: str) -> str | None:
    try:
        feature_gates.gates(gates)
    except FlagError as exc:
        return str(exc).removeprefix("--feature-gates: ")
    return None


def test_the_list_is_kube_proxys_own() -> None:
    done = subprocess.run([str(KUBE), "feature-gates"], capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-2000:]
    shipped = json.loads((ROOT / "nfproxy" / "cli" / "kube_feature_gates.json").read_text())
    assert json.loads(done.stdout) == shipped, "refresh it: scripts/kube feature-gates > nfproxy/cli/kube_feature_gates.json"
    assert shipped["kubeProxy"] == feature_gates.kube_proxy_version()
    assert len(shipped["gates"]) > 100


@pytest.mark.parametrize("gates", CASES)
def test_each_gate_string_gets_kube_proxys_verdict(gates: str) -> None:
    theirs = kube_proxy_verdict(gates)
    assert _unordered(nfproxy_verdict(gates)) == _unordered(theirs)


def _unordered(verdict: str | None) -> object:
    """An aggregate of several errors as a set: kube-proxy's order follows a Go map's."""
    if verdict and verdict.startswith("[") and verdict.endswith("]]"):
        return frozenset(re.findall(r"\w+ is enabled, but depends on features that are disabled: \[[^\]]*\]", verdict))
    return verdict


def test_the_cases_cover_every_kind_of_verdict() -> None:
    """A refusal of each kind and an acceptance among the cases (so the comparison above can fail)."""
    verdicts = [nfproxy_verdict(g) for g in CASES]
    assert None in verdicts
    for kind in ("unrecognized feature gate", "is locked to", "depends on features that are disabled"):
        assert any(v and kind in v for v in verdicts), kind

"""nfproxy beside the real kube-proxy (built by `scripts/kube` from k8s.io/kubernetes v1.37.2).

kube-proxy runs in a throwaway network namespace against the real API server holding the example
cluster; `nfproxy compare --against-netns` and `--against-file` put nfproxy's rules for the same
cluster beside kube-proxy's live rules and its dump, in both modes: equal, probe by probe, down
to the kernel's arithmetic; and a difference planted in kube-proxy's dump is found and named.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.realkube import ROOT, node_addresses

pytestmark = [pytest.mark.apiserver, pytest.mark.kernel]

EXAMPLES = ROOT / "examples"
NODE, NODE_IP, CLUSTER_CIDR = "node-a", "192.168.0.2", "10.244.0.0/16"
NFPROXY = [sys.executable, "-m", "nfproxy"]


def example_cluster(plane: Any) -> None:
    """examples/ as kubectl applies it, then the status a controller would write (the
    LoadBalancer ingress IP, the Node's addresses): apply leaves status alone."""
    plane.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(EXAMPLES))
    for path in sorted(EXAMPLES.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("status") and doc["kind"] in ("Service", "Node"):
                meta = {k: v for k, v in doc["metadata"].items() if k in ("name", "namespace")}
                plane.apply_status({"apiVersion": doc["apiVersion"], "kind": doc["kind"],
                                    "metadata": meta, "status": doc["status"]})


@pytest.fixture
def kube_proxy(control_plane, netns) -> Iterator[Any]:
    """Start the real kube-proxy in `netns` in a mode; stopped (with its doors) afterwards."""
    example_cluster(control_plane)
    node_addresses(netns, f"{NODE_IP}/24")
    started: list[str] = []

    def start(mode: str) -> str:
        control_plane.start_kube_proxy(netns, mode, "--hostname-override", NODE, "--cluster-cidr", CLUSTER_CIDR)
        started.append(netns)
        return netns

    yield start
    for ns in started:
        control_plane.stop_kube_proxy(ns)


def compare(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*NFPROXY, "compare", "--cluster-cidr", CLUSTER_CIDR, *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)


def dump(netns: str, mode: str, path: Path) -> Path:
    tool = ["nft", "-j", "list", "ruleset"] if mode == "nftables" else ["iptables-save"]
    path.write_text(subprocess.run(["ip", "netns", "exec", netns, *tool], check=True,
                                   capture_output=True, text=True).stdout)
    return path


MOVED = ("10.244.1.32", "10.244.1.99")  # an endpoint of shop/storefront, planted elsewhere


@pytest.mark.parametrize("mode", ["iptables", "nftables"])
def test_nfproxy_equals_the_real_kube_proxy(control_plane, kube_proxy, mode, tmp_path):
    netns = kube_proxy(mode)
    from_manifests = compare("--against-netns", netns, str(EXAMPLES))
    assert from_manifests.returncode == 0, from_manifests.stdout + from_manifests.stderr
    assert from_manifests.stdout.rstrip().endswith("EQUAL")
    from_api = compare("--against-netns", netns, "--kubeconfig", control_plane.kubeconfig,
                       "--hostname-override", NODE, "--json")
    assert from_api.returncode == 0, from_api.stdout + from_api.stderr
    report = json.loads(from_api.stdout)
    assert report["equal"] and report["backend"] == ("nft" if mode == "nftables" else "iptables")
    assert report["probes"] > json.loads(compare("--against-netns", netns, "--json", str(EXAMPLES)).stdout)["probes"], \
        "the live API holds more than examples/ (the default kubernetes Service): more probes"

    saved = dump(netns, mode, tmp_path / "kube-proxy.dump")
    assert compare("--against-file", str(saved), str(EXAMPLES)).returncode == 0

    planted = tmp_path / "planted.dump"
    planted.write_text(saved.read_text().replace(*MOVED))
    found = compare("--against-file", str(planted), "--json", str(EXAMPLES))
    assert found.returncode == 1, found.stdout + found.stderr
    differences = json.loads(found.stdout)["differences"]
    assert differences and {d["service"] for d in differences} == {"shop/storefront:https (tcp)"}
    assert all(f"DNAT {MOVED[1]}:8443" in "".join(d["theirs"]) for d in differences)
    # storefront is externalTrafficPolicy Local: outside traffic reaches the local endpoint only,
    # so only internal traffic shows the moved remote endpoint.
    traffic = {d["traffic"] for d in differences}
    assert {"cluster IP from pod", "cluster IP from node"} <= traffic and "node port from outside" not in traffic


def test_the_mode_given_must_be_the_mode_found(control_plane, kube_proxy):
    netns = kube_proxy("iptables")
    wrong = compare("--against-netns", netns, "--proxy-mode", "nftables", str(EXAMPLES))
    assert wrong.returncode == 2
    assert "kube-proxy" in wrong.stderr or "nft" in wrong.stderr, wrong.stderr

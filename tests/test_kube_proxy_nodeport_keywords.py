"""`--nodeport-addresses` keywords (KEP-6032) beside the real kube-proxy 1.37.2: kube-proxy runs
with `localhost`, `all` or `primary` mixed with a CIDR, in each mode, and `nfproxy compare
--against-netns` with the same flag finds nfproxy's rules equal to kube-proxy's live ones, probe
by probe (the node port on the node IP among them). Also kube-proxy's nftables mode with the
KubeProxyNFTablesLocalhostNodePorts gate and `localhost`: its reject objects differ in shape
from nfproxy's (docs/running.md), the traffic they decide does not.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.realkube import node_addresses
from tests.test_kube_proxy_compare import CLUSTER_CIDR, EXAMPLES, NODE, NODE_IP, compare, example_cluster

pytestmark = [pytest.mark.apiserver, pytest.mark.kernel]
GATE = "KubeProxyNFTablesLocalhostNodePorts=true"


@pytest.fixture
def kube_proxy(control_plane, netns) -> Iterator[Any]:
    example_cluster(control_plane)
    node_addresses(netns, f"{NODE_IP}/24")
    started: list[str] = []

    def start(mode: str, *flags: str) -> str:
        control_plane.start_kube_proxy(netns, mode, "--hostname-override", NODE, "--cluster-cidr", CLUSTER_CIDR,
                                       *flags)
        started.append(netns)
        return netns

    yield start
    for ns in started:
        control_plane.stop_kube_proxy(ns)


@pytest.mark.parametrize("mode", ["iptables", "nftables"])
@pytest.mark.parametrize("addresses", ["localhost", "all", "primary,10.0.0.0/8"])
def test_keywords_mean_what_kube_proxy_means(kube_proxy, mode: str, addresses: str) -> None:
    netns = kube_proxy(mode, "--nodeport-addresses", addresses)
    done = compare("--against-netns", netns, "--nodeport-addresses", addresses, str(EXAMPLES))
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.rstrip().endswith("EQUAL")


def test_the_localhost_gate_leaves_the_other_traffic_as_kube_proxy_does(kube_proxy) -> None:
    netns = kube_proxy("nftables", "--nodeport-addresses", "localhost,primary", "--feature-gates", GATE)
    done = compare("--against-netns", netns, "--nodeport-addresses", "localhost,primary", str(EXAMPLES))
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.rstrip().endswith("EQUAL")


def test_a_different_meaning_would_be_found(kube_proxy) -> None:
    """The comparison has teeth: kube-proxy with `localhost` takes no node port on the node IP,
    nfproxy with `all` does, and compare names that traffic."""
    netns = kube_proxy("iptables", "--nodeport-addresses", "localhost")
    done = compare("--against-netns", netns, "--nodeport-addresses", "all", str(EXAMPLES))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "node port from outside" in done.stdout, done.stdout

"""The switch from kube-proxy to nfproxy, rehearsed in namespaces, as docs/install.md orders it.

kube-proxy's rules are there first: nfproxy's iptables backend writes kube-proxy's own layout and
chain names (its goldens are read against upstream's proxier tests), so it stands in for a
running kube-proxy. A client holds a connection through them. nfproxy takes over (each backend),
kube-proxy's rules are removed as `kube-proxy --cleanup` would (`nfproxy cleanup --backend
iptables`), and then: the held connection still reaches its endpoint, new connections reach
every endpoint, no KUBE- chain is left when nfproxy runs nft, and `nfproxy check` is clean.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from nfproxy.core.model import (
    ClusterState,
    Endpoint,
    IPFamily,
    NodeConfig,
    Protocol,
    ServicePort,
    ServicePortName,
    ServiceType,
    sort_endpoints,
)
from nfproxy.daemon.proxier import Proxier
from nfproxy.verify.sandbox import Sandbox, SandboxSpec

pytestmark = pytest.mark.kernel

NODE = NodeConfig(name="node-a", ips=("192.168.0.2",), cluster_cidrs=("10.244.0.0/16",))
ENDPOINTS = ("10.244.1.1", "10.244.1.2", "10.244.1.3")
VIP = "10.96.0.10"


def cluster() -> ClusterState:
    sp = ServicePort(ServicePortName("shop", "web", "http", Protocol.TCP), IPFamily.V4,
                     ServiceType.CLUSTER_IP, VIP, 80)
    eps = sort_endpoints([Endpoint(ip, 8080, node_name="node-b") for ip in ENDPOINTS])
    return ClusterState(NODE, {sp.key: sp}, {sp.key: eps})


def nfproxy(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "nfproxy.cli", *argv],
                          capture_output=True, text=True, timeout=120)


def iptables_save(ns: str) -> str:
    return subprocess.run(["ip", "netns", "exec", ns, "iptables-save"],
                          capture_output=True, text=True, check=True).stdout


@pytest.mark.parametrize("backend", ["nft", "iptables"])
def test_nfproxy_takes_over_from_kube_proxy_without_dropping_a_connection(backend: str) -> None:
    spec = SandboxSpec.of(node_ips=["192.168.0.2"], clients={"pod": "10.244.5.5"},
                          endpoints={ip: [(8080, "tcp")] for ip in ENDPOINTS})
    state = cluster()
    with Sandbox(spec) as sb:
        kube_proxy = Proxier("iptables", netns=sb.node_ns)  # kube-proxy's layout and names
        assert kube_proxy.sync(state).kind == "full"
        assert "KUBE-SVC-" in iptables_save(sb.node_ns)
        with sb.open("pod", VIP, 80, "tcp") as conn:
            first = conn.exchange()
            assert first.ok, first
            # Replace: nfproxy's first sync while kube-proxy's rules are still in place.
            assert Proxier(backend, netns=sb.node_ns).sync(state, full=True).kind == "full"
            again = conn.exchange()
            assert again.ok and again.endpoint == first.endpoint, again
            if backend == "nft":
                # kube-proxy --cleanup: its chains go, nfproxy's nft table stays.
                done = nfproxy("cleanup", "--netns", sb.node_ns, "--backend", "iptables")
                assert done.returncode == 0, done.stderr
                # All but the localnet guard, kept as kube-proxy's --cleanup keeps it.
                saved = iptables_save(sb.node_ns).splitlines()
                assert [ln for ln in saved if "KUBE-" in ln and "KUBE-FIREWALL" not in ln] == []
            after = conn.exchange()
            assert after.ok and after.endpoint == first.endpoint, after
        seen = {o.endpoint for o in sb.connect("pod", VIP, 80, "tcp", 60) if o.ok}
        assert seen == {f"{ip}:8080" for ip in ENDPOINTS}
        verdict = nfproxy("check", "--netns", sb.node_ns, "--backend", backend)
        assert verdict.returncode == 0, verdict.stdout + verdict.stderr

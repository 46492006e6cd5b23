"""KubeProxyNFTablesLocalhostNodePorts on real traffic, in throwaway namespaces: the daemon in
nftables mode, configured through the run command's own flags, with node ports on 127.0.0.1.

Gate on and `--nodeport-addresses localhost,primary`: a TCP connection to 127.0.0.1:<nodePort>
in the node's namespace reaches an endpoint through the userspace proxy, a UDP one is rejected
and counted in kubeproxy_nftables_localhost_nodeport_rejected_packets_total. Gate on without
`localhost`: TCP is rejected and counted too. Both families (127.0.0.1 and ::1). Gate off (kube-proxy's default): nothing listens
there and no rule answers, the connection is refused by the kernel as before.
"""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest

from nfproxy.cli.commands.run import _daemon_config
from nfproxy.cli.config import node_config_from_args
from nfproxy.cli.main import parse
from nfproxy.daemon.node import Daemon
from nfproxy.sources.files import ManifestSource
from nfproxy.verify.sandbox import Sandbox, SandboxSpec

pytestmark = pytest.mark.kernel

NODE_IP = "192.168.0.2"
NODE_IP6 = "fd00::2"
EP_LOCAL, EP_REMOTE = "10.244.1.1", "10.244.2.1"
EP6_LOCAL, EP6_REMOTE = "fd00:244:1::1", "fd00:244:2::1"
ENDPOINTS = {f"{EP_LOCAL}:8080", f"{EP_REMOTE}:8080"}
ENDPOINTS6 = {f"[{EP6_LOCAL}]:8080", f"[{EP6_REMOTE}]:8080"}
GATE = "KubeProxyNFTablesLocalhostNodePorts=true"

MANIFESTS = f"""
apiVersion: v1
kind: Service
metadata: {{name: web, namespace: ns1}}
spec:
  type: NodePort
  clusterIP: 10.96.0.10
  clusterIPs: [10.96.0.10]
  ports:
    - {{name: http, port: 80, protocol: TCP, targetPort: 8080, nodePort: 30080}}
    - {{name: dns, port: 53, protocol: UDP, targetPort: 8080, nodePort: 30081}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: web-1, namespace: ns1, labels: {{kubernetes.io/service-name: web}}}}
addressType: IPv4
ports: [{{name: http, port: 8080, protocol: TCP}}, {{name: dns, port: 8080, protocol: UDP}}]
endpoints:
  - {{addresses: [{EP_LOCAL}], conditions: {{ready: true}}, nodeName: node-a}}
  - {{addresses: [{EP_REMOTE}], conditions: {{ready: true}}, nodeName: node-b}}
---
apiVersion: v1
kind: Service
metadata: {{name: web6, namespace: ns1}}
spec:
  type: NodePort
  ipFamilies: [IPv6]
  clusterIP: fd00:96::10
  clusterIPs: [fd00:96::10]
  ports: [{{name: http, port: 80, protocol: TCP, targetPort: 8080, nodePort: 30082}}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: web6-1, namespace: ns1, labels: {{kubernetes.io/service-name: web6}}}}
addressType: IPv6
ports: [{{name: http, port: 8080, protocol: TCP}}]
endpoints:
  - {{addresses: ["{EP6_LOCAL}"], conditions: {{ready: true}}, nodeName: node-a}}
  - {{addresses: ["{EP6_REMOTE}"], conditions: {{ready: true}}, nodeName: node-b}}
"""


def _spec() -> SandboxSpec:
    return SandboxSpec.of(node_ips=[NODE_IP, NODE_IP6], endpoints={
        EP_LOCAL: [(8080, "tcp"), (8080, "udp")], EP_REMOTE: [(8080, "tcp"), (8080, "udp")],
        EP6_LOCAL: [(8080, "tcp")], EP6_REMOTE: [(8080, "tcp")]})


def _daemon(tmp_path: Path, ns: str, *flags: str) -> Daemon:
    """The daemon as `nfproxy run --proxy-mode nftables FLAGS` would build it."""
    manifests = tmp_path / "cluster.yaml"
    manifests.write_text(MANIFESTS)
    _, args = parse(["run", "--proxy-mode", "nftables", "--netns", ns, "--manifests", str(manifests),
                     "--node-name", "node-a", "--node-ip", NODE_IP, "--node-ip", NODE_IP6,
                     "--cluster-cidr", "10.244.0.0/16",
                     "--healthz-bind-address", "", "--metrics-bind-address", "127.0.0.1:0", *flags])
    args.backend = "nft"
    config = _daemon_config(args, 0.05, 30.0, conntrack=False)
    return Daemon(ManifestSource(str(manifests), node_config_from_args(args), poll=0.05), config)


def _metrics(daemon: Daemon) -> str:
    assert daemon.servers is not None and daemon.servers.metrics is not None
    with urllib.request.urlopen(f"http://127.0.0.1:{daemon.servers.metrics.port}/metrics", timeout=5) as resp:
        return resp.read().decode()


def _sample(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


def _run(tmp_path: Path, *flags: str):  # type: ignore[no-untyped-def]
    """(outcomes of TCP to 127.0.0.1:30080, of UDP to 127.0.0.1:30081, of TCP to the node IP,
    of TCP to [::1]:30082, the metrics text, the proxy), with the daemon synced in a fresh
    sandbox."""
    with Sandbox(_spec()) as sb:
        daemon = _daemon(tmp_path, sb.node_ns, *flags)
        daemon.start()
        try:
            assert daemon.loop.wait_synced(20)
            tcp = sb.connect("node", "127.0.0.1", 30080, "tcp", 40)
            udp = sb.connect("node", "127.0.0.1", 30081, "udp", 3)
            node_ip = sb.connect("node", NODE_IP, 30080, "tcp", 1)
            tcp6 = sb.connect("node", "::1", 30082, "tcp", 40)
            return tcp, udp, node_ip, tcp6, _metrics(daemon), daemon.localhost_proxy
        finally:
            daemon.stop()


def test_gate_on_tcp_on_localhost_reaches_an_endpoint_and_udp_is_rejected_and_counted(tmp_path: Path) -> None:
    tcp, udp, node_ip, tcp6, text, proxy = _run(tmp_path, "--feature-gates", GATE,
                                                "--nodeport-addresses", "localhost,primary")
    assert all(o.ok for o in tcp), tcp[:3]
    # Both endpoints, picked at random: 40 connections miss one with probability 2 * 2^-40.
    assert {o.endpoint for o in tcp} == ENDPOINTS, tcp[:3]
    assert all(o.ok for o in tcp6) and {o.endpoint for o in tcp6} == ENDPOINTS6, tcp6[:3]  # on ::1
    assert [o.kind for o in udp] == ["refused"] * 3, udp
    assert node_ip[0].ok  # the node IP (primary) still takes it through the rules
    assert _sample(text, 'kubeproxy_nftables_localhost_nodeport_listeners{ip_family="IPv4"}') == 1
    assert _sample(text, 'kubeproxy_nftables_localhost_nodeport_listeners{ip_family="IPv6"}') == 1
    rejected = _sample(text, 'kubeproxy_nftables_localhost_nodeport_rejected_packets_total'
                             '{ip_family="IPv4",protocol="UDP"}')
    assert rejected is not None and rejected >= 3, text
    assert _sample(text, 'kubeproxy_nftables_localhost_nodeport_rejected_packets_total'
                         '{ip_family="IPv4",protocol="TCP"}') is None  # the proxy serves TCP
    assert proxy is not None and proxy.ports == {}  # closed with the daemon


def test_gate_on_without_localhost_rejects_and_counts_tcp_too(tmp_path: Path) -> None:
    tcp, udp, node_ip, tcp6, text, proxy = _run(tmp_path, "--feature-gates", GATE)
    assert [o.kind for o in tcp[:3]] == ["refused"] * 3 and all(o.kind == "refused" for o in tcp), tcp[:3]
    assert [o.kind for o in udp] == ["refused"] * 3, udp
    assert node_ip[0].ok
    rejected = _sample(text, 'kubeproxy_nftables_localhost_nodeport_rejected_packets_total'
                             '{ip_family="IPv4",protocol="TCP"}')
    assert rejected is not None and rejected >= 40, text
    # On ::1 the kernel's ICMPv6 answer to the reject does not reach the client here (it times
    # out where IPv4 is refused); either way nothing answers and every SYN is counted.
    assert not any(o.ok for o in tcp6), tcp6[:3]
    rejected6 = _sample(text, 'kubeproxy_nftables_localhost_nodeport_rejected_packets_total'
                              '{ip_family="IPv6",protocol="TCP"}')
    assert rejected6 is not None and rejected6 >= 40, text
    assert _sample(text, 'kubeproxy_nftables_localhost_nodeport_listeners{ip_family="IPv4"}') == 0


def test_gate_off_nothing_answers_on_localhost(tmp_path: Path) -> None:
    tcp, udp, node_ip, tcp6, text, proxy = _run(tmp_path, "--nodeport-addresses", "localhost,primary")
    assert all(o.kind == "refused" for o in tcp + tcp6), (tcp + tcp6)[:3]
    assert node_ip[0].ok
    assert proxy is None
    assert "kubeproxy_nftables_localhost_nodeport" not in text


def test_the_daemon_config_takes_the_gate_from_flags_and_file(tmp_path: Path) -> None:
    _, on = parse(["run", "--proxy-mode", "nftables", "--feature-gates", GATE])
    _, off = parse(["run", "--proxy-mode", "nftables"])
    config = tmp_path / "config.conf"
    config.write_text("apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n"
                      "mode: nftables\nfeatureGates:\n  KubeProxyNFTablesLocalhostNodePorts: true\n")
    _, from_file = parse(["run", "--config", str(config)])
    assert [_daemon_config(a, 1.0, 30.0).localhost_nodeports for a in (on, off, from_file)] == [True, False, True]
    assert node_config_from_args(from_file).nft_localhost_nodeports


def test_listeners_follow_the_node_ports_and_a_taken_port_is_retried() -> None:
    """SyncNodePorts: a listener per node port given, none for one gone; a port another
    process holds is a counted failure, owed to the next sync (with or without rule changes),
    and bound then once free."""
    import socket

    from nfproxy.core.model import Endpoint, IPFamily
    from nfproxy.daemon.localhost_proxy import LocalhostProxy, NodePortSpec
    from nfproxy.kernel import netns as netns_mod

    v4 = IPFamily.V4
    spec = NodePortSpec(v4, 30080, "ns1/web:http", (Endpoint(EP_LOCAL, 8080, node_name="node-a"),))
    failures: list[IPFamily] = []
    listening: dict[IPFamily, int] = {}
    with Sandbox(_spec()) as sb:
        proxy = LocalhostProxy(sb.node_ns, on_failure=failures.append,
                               on_listeners=lambda family, n: listening.__setitem__(family, n))
        try:
            proxy.sync((spec,))
            assert proxy.ports == {v4: (30080,)} and listening[v4] == 1
            assert [o.endpoint for o in sb.connect("node", "127.0.0.1", 30080, "tcp", 3)] == [f"{EP_LOCAL}:8080"] * 3
            proxy.sync(())
            assert proxy.ports == {} and listening[v4] == 0
            assert [o.kind for o in sb.connect("node", "127.0.0.1", 30080, "tcp", 2)] == ["refused"] * 2
            with netns_mod.entered(sb.node_ns):
                squatter = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            squatter.bind(("127.0.0.1", 30080))
            squatter.listen()
            proxy.sync((spec,))
            assert proxy.ports == {} and failures == [v4] and proxy.owed  # the daemon syncs it again
            squatter.close()
            proxy.sync((spec,))
            assert proxy.ports == {v4: (30080,)} and failures == [v4] and not proxy.owed
            assert sb.connect("node", "127.0.0.1", 30080, "tcp", 1)[0].endpoint == f"{EP_LOCAL}:8080"
        finally:
            proxy.close()

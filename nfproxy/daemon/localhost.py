"""Localhost node ports: what kube-proxy does about them at start, per backend.

kube-proxy's iptables mode accepts node ports on 127.0.0.1 by default (localhostNodePorts),
which only works with `net.ipv4.conf.all.route_localnet=1` (DNAT of a loopback-addressed
packet to a pod, routed out), so it sets that sysctl, on the node it programs and nowhere else.
Its nftables mode cannot DNAT loopback traffic at all: since 1.37, behind the alpha gate
KubeProxyNFTablesLocalhostNodePorts and with `--nodeport-addresses` naming loopback, a userspace
proxy serves TCP node ports there instead (daemon/localhost_proxy.py).
"""

from __future__ import annotations

import ipaddress
import logging

from nfproxy.core.categorize import nodeport_cidrs, nodeport_loopback
from nfproxy.core.model import IPFamily, NodeConfig
from nfproxy.daemon.localhost_proxy import LOOPBACK
from nfproxy.kernel import sysctl

log = logging.getLogger("nfproxy.daemon")

ROUTE_LOCALNET = "net.ipv4.conf.all.route_localnet"
_LOOPBACK = ipaddress.ip_network("127.0.0.0/8")


def needs_route_localnet(backend: str, node: NodeConfig) -> bool:
    """iptables backend, localhost node ports on, and IPv4 loopback among the node-port addresses."""
    if backend != "iptables" or not node.localhost_nodeports:
        return False
    cidrs = nodeport_cidrs(node, IPFamily.V4, primary_by_default=False)
    return not cidrs or any(ipaddress.ip_network(c, strict=False).overlaps(_LOOPBACK) for c in cidrs)


def prepare(backend: str, node: NodeConfig, netns: str | None) -> None:
    """Once at start: set route_localnet where needed (only in the namespace programmed), or
    say once that the nft backend does not do localhost node ports."""
    if needs_route_localnet(backend, node):
        log.info(
            "Setting route_localnet=1 to allow node-ports on localhost; to change this either "
            "disable iptables.localhostNodePorts (--iptables-localhost-nodeports) or set "
            "nodePortAddresses (--nodeport-addresses) to filter loopback addresses"
        )
        try:
            sysctl.ensure(ROUTE_LOCALNET, 1, netns)
        except sysctl.ReadOnlySysctl as exc:
            # An unprivileged pod: the rules still go in, node ports on 127.0.0.1 just do not
            # answer until route_localnet is set on the node. Not worth losing every service.
            log.warning("%s: node ports on localhost will not answer until it is set on the node", exc)
    elif backend == "nft" and node.nft_localhost_nodeports:
        families = [f for f in IPFamily if nodeport_loopback(node, f, primary_by_default=True)]
        if families:
            log.info("KubeProxyNFTablesLocalhostNodePorts: TCP node ports on %s are served by a userspace "
                     "proxy; UDP and SCTP ones are rejected", " and ".join(LOOPBACK[f] for f in families))
        else:
            log.info("KubeProxyNFTablesLocalhostNodePorts: node ports on loopback are rejected; add "
                     "'localhost' to --nodeport-addresses to serve TCP ones there")
    elif backend == "nft" and node.localhost_nodeports:
        log.info(
            "--iptables-localhost-nodeports is ignored by the nft backend: localhost NodePorts are "
            "not supported in nftables mode without the KubeProxyNFTablesLocalhostNodePorts gate"
        )

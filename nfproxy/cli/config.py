"""Node flags shared by every command that renders (kube-proxy's names where they exist)."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable

from nfproxy.cli import duration as go_duration
from nfproxy.core.flags import FlagError
from nfproxy.core.model import MASQUERADE_BIT, NODEPORT_PRIMARY, IPFamily, LocalMode, NodeConfig
from nfproxy.sources.validation import FieldError, cidr, dns_subdomain, family_of, ip_address


def add_node_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("node")
    g.add_argument("--node-name", "--hostname-override", dest="node_name", metavar="NAME",
                   help="this node's name: endpoints on it are local (default: from a Node object in the manifests)")
    g.add_argument("--node-ip", action="append", default=[], metavar="IP",
                   help="a node IP (repeat for dual-stack)")
    g.add_argument("--cluster-cidr", action="append", default=[], metavar="CIDR",
                   help="pod CIDR(s), comma-separated or repeated: cluster-IP traffic from outside them is masqueraded")
    g.add_argument("--masquerade-all", action="store_true",
                   help="masquerade all traffic to cluster IPs")
    g.add_argument("--nodeport-addresses", action="append", default=[], metavar="CIDR|primary",
                   help="only local addresses in these CIDRs accept NodePort traffic; 'primary' is the "
                        "node IPs (default: all for iptables, primary for nft, as kube-proxy)")
    g.add_argument("--iptables-localhost-nodeports", dest="localhost_nodeports", type=_boolean,
                   nargs="?", const=True, default=True, metavar="BOOL",
                   help="iptables backend: accept node ports on 127.0.0.1 too (default true; "
                        "sets net.ipv4.conf.all.route_localnet=1)")
    g.add_argument("--iptables-masquerade-bit", dest="masquerade_bit", type=int, default=MASQUERADE_BIT,
                   metavar="N", help="bit of the packet mark that asks for SNAT, 0-31 (default 14)")
    g.add_argument("--detect-local-mode", dest="detect_local_mode", default=LocalMode.CLUSTER_CIDR.value,
                   choices=[m.value for m in LocalMode],
                   help="how traffic from local pods is recognised (default ClusterCIDR)")
    g.add_argument("--pod-bridge-interface", dest="pod_bridge_interface", default="", metavar="NAME",
                   help="with --detect-local-mode=BridgeInterface: the pods' bridge")
    g.add_argument("--pod-interface-name-prefix", dest="pod_interface_name_prefix", default="",
                   metavar="PREFIX", help="with --detect-local-mode=InterfaceNamePrefix: pod interfaces' prefix")
    g.add_argument("--service-cluster-ip-range", dest="service_cluster_ip_range", action="append",
                   default=[], metavar="CIDR",
                   help="service CIDR(s), for clusters without ServiceCIDR objects: the nft backend "
                        "drops traffic to unallocated addresses in them")


def _boolean(text: str) -> bool:
    """Go's strconv.ParseBool, as kube-proxy's boolean flags take `--flag=false`."""
    value = text.strip()
    if value in ("1", "t", "T", "true", "TRUE", "True"):
        return True
    if value in ("0", "f", "F", "false", "FALSE", "False"):
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {text!r} (true or false)")


_IFNAME_RE = re.compile(r"[A-Za-z0-9_.@-]{1,15}")


def _interface(flag: str, value: str) -> str:
    if _IFNAME_RE.fullmatch(value) is None:
        raise FlagError(f"{flag}: not an interface name: {value!r} (1-15 of A-Z a-z 0-9 _ . @ -)")
    return value


def _local_detection(args: argparse.Namespace) -> dict[str, object]:
    """kube-proxy's --detect-local-mode with the flag each mode needs."""
    mode = LocalMode(getattr(args, "detect_local_mode", LocalMode.CLUSTER_CIDR.value))
    bridge = getattr(args, "pod_bridge_interface", "") or ""
    prefix = getattr(args, "pod_interface_name_prefix", "") or ""
    if mode is LocalMode.BRIDGE_INTERFACE:
        if not bridge:
            raise FlagError("--pod-bridge-interface: required with --detect-local-mode=BridgeInterface")
        bridge = _interface("--pod-bridge-interface", bridge)
    if mode is LocalMode.INTERFACE_NAME_PREFIX:
        if not prefix:
            raise FlagError("--pod-interface-name-prefix: required with --detect-local-mode=InterfaceNamePrefix")
        prefix = _interface("--pod-interface-name-prefix", prefix)
    return {"detect_local_mode": mode, "pod_bridge_interface": bridge, "pod_interface_name_prefix": prefix}


def _nodeport_addresses(values: list[str]) -> tuple[str, ...]:
    out = []
    for v in _split(values):
        if v == NODEPORT_PRIMARY:
            out.append(v)
        else:
            out.extend(_each("--nodeport-addresses", [v], cidr))
    return tuple(dict.fromkeys(out))


def _split(values: list[str]) -> list[str]:
    return [v.strip() for raw in values for v in raw.split(",") if v.strip()]


def _each(flag: str, values: list[str], check: Callable[[object], str]) -> tuple[str, ...]:
    out = []
    for v in _split(values):
        try:
            out.append(check(v))
        except FieldError as exc:
            raise FlagError(f"{flag}: {exc}") from None
    return tuple(out)


def _one_per_family(flag: str, values: tuple[str, ...]) -> tuple[str, ...]:
    """kube-proxy takes at most one value per IP family for these flags (dual-stack pairs)."""
    for family in IPFamily:
        of = [v for v in values if family_of(v.split("/")[0]) is family]
        if len(of) > 1:
            raise FlagError(f"{flag}: more than one IPv{family.value} value: {', '.join(of)}")
    return values


def node_config_from_args(args: argparse.Namespace) -> NodeConfig:
    name = args.node_name or ""
    if name:
        try:
            name = dns_subdomain(name)
        except FieldError as exc:
            raise FlagError(f"--node-name: {exc}") from None
    return NodeConfig(
        name=name,
        # The run command reads nf_conntrack_tcp_be_liberal in the target namespace and sets
        # drop_invalid from it, as kube-proxy does; other commands render the drop.
        drop_invalid=bool(getattr(args, "drop_invalid", True)),
        ips=_one_per_family("--node-ip", _each("--node-ip", args.node_ip, ip_address)),
        cluster_cidrs=_one_per_family(
            "--cluster-cidr", _each("--cluster-cidr", args.cluster_cidr, cidr)
        ),
        masquerade_all=bool(args.masquerade_all),
        nodeport_addresses=_nodeport_addresses(args.nodeport_addresses),
        localhost_nodeports=bool(getattr(args, "localhost_nodeports", True)),
        masquerade_bit=_masquerade_bit(getattr(args, "masquerade_bit", MASQUERADE_BIT)),
        service_cidrs=_one_per_family(
            "--service-cluster-ip-range",
            _each("--service-cluster-ip-range", getattr(args, "service_cluster_ip_range", []), cidr),
        ),
        **_local_detection(args),  # type: ignore[arg-type]
    )


def _masquerade_bit(bit: int) -> int:
    if not 0 <= bit <= 31:
        raise FlagError(f"--iptables-masquerade-bit: must be within 0-31, got {bit}")
    return bit


def duration(flag: str, text: str) -> float:
    """A Go duration ("1s", ".5s", "1h30m"), as kube-proxy's flags take them, in seconds.

    Negative values are refused: no kube-proxy period or timeout has a meaning below zero.
    """
    try:
        nanoseconds = go_duration.parse(text)
    except go_duration.DurationError as exc:
        raise FlagError(f"{flag}: not a duration: {text!r}: {exc} (examples: 1s, 500ms, 1h30m)") from None
    if nanoseconds < 0:
        raise FlagError(f"{flag}: {text!r}: must not be negative")
    return nanoseconds / 1e9


_SIZE_RE = re.compile(r"(\d+)(Ki|Mi|Gi|k|M|G)?")
_SIZE_UNIT = {None: 1, "k": 10**3, "M": 10**6, "G": 10**9, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30}


def byte_size(flag: str, text: str) -> int:
    """A size in bytes with an optional Kubernetes quantity suffix ("16Mi", "500k", "4096")."""
    m = _SIZE_RE.fullmatch(text.strip())
    if m is None or int(m.group(1)) == 0:
        raise FlagError(f"{flag}: not a positive size: {text!r} (examples: 16Mi, 500Ki, 1048576)")
    return int(m.group(1)) * _SIZE_UNIT[m.group(2)]

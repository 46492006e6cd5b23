"""Node flags shared by every command that renders (kube-proxy's names where they exist)."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable

from nfproxy.cli import duration as go_duration
from nfproxy.cli import feature_gates
from nfproxy.cli.flag_types import INT32_MAX, add_go_bool_switch, display, integer_in
from nfproxy.core.flags import FlagError
from nfproxy.core.model import MASQUERADE_BIT, NODEPORT_KEYWORDS, IPFamily, LocalMode, NodeConfig
from nfproxy.sources.validation import FieldError, cidr, dns_subdomain, family_of, ip_address


def add_node_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("node")
    g.add_argument("--node-name", "--hostname-override", dest="node_name", metavar="NAME",
                   help="this node's name: endpoints on it are local (default: from a Node object in the manifests)")
    g.add_argument("--node-ip", action="append", default=[], metavar="IP",
                   help="a node IP (repeat for dual-stack)")
    g.add_argument("--cluster-cidr", action="append", default=[], metavar="CIDR",
                   help="pod CIDR(s), comma-separated or repeated: cluster-IP traffic from outside them is masqueraded")
    add_go_bool_switch(g, "--masquerade-all", dest="masquerade_all",
                       help="masquerade all traffic to cluster IPs (also --masquerade-all=false)")
    g.add_argument("--nodeport-addresses", action="append", default=[], metavar="CIDR|primary|localhost|all",
                   help="only local addresses in these CIDRs accept NodePort traffic; keywords: 'primary' "
                        "(the node IPs), 'localhost' (127.0.0.0/8, ::1/128), 'all' (0.0.0.0/0, ::/0), mixed "
                        "with CIDRs at will (default: all for iptables, primary for nft, as kube-proxy)")
    g.add_argument("--iptables-localhost-nodeports", dest="localhost_nodeports", type=_boolean,
                   nargs="?", const=True, default=True, metavar="BOOL",
                   help="iptables backend: accept node ports on 127.0.0.1 too (default true; "
                        "sets net.ipv4.conf.all.route_localnet=1)")
    g.add_argument("--iptables-masquerade-bit", dest="masquerade_bit",
                   type=integer_in(-INT32_MAX - 1, INT32_MAX), default=MASQUERADE_BIT,
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
    raise argparse.ArgumentTypeError(f"not a boolean: {display(text)} (true or false)")


_IFNAME_RE = re.compile(r"[A-Za-z0-9_.@-]{1,15}")


def interface_name(value: str) -> str:
    """An interface name (or prefix) as it will be printed into `-i NAME` / `iifname "NAME"`.

    Raises FieldError; shared by the flags and the config file so both refuse the same values.
    """
    if _IFNAME_RE.fullmatch(value) is None:
        raise FieldError(f"not an interface name: {display(value)} (1-15 of A-Z a-z 0-9 _ . @ -)")
    return value


def _interface(flag: str, value: str) -> str:
    try:
        return interface_name(value)
    except FieldError as exc:
        raise FlagError(f"{flag}: {exc}") from None


def _local_detection(args: argparse.Namespace) -> dict[str, object]:
    """kube-proxy's --detect-local-mode with the flag each mode needs."""
    mode = LocalMode(getattr(args, "detect_local_mode", LocalMode.CLUSTER_CIDR.value))
    bridge = getattr(args, "pod_bridge_interface", "") or ""
    prefix = getattr(args, "pod_interface_name_prefix", "") or ""
    # Checked whatever the mode: a name that is never used is still written back by
    # --write-config-to, and a bad one is a mistake to report now, not when the mode changes.
    if bridge:
        bridge = _interface("--pod-bridge-interface", bridge)
    if prefix:
        prefix = _interface("--pod-interface-name-prefix", prefix)
    if mode is LocalMode.BRIDGE_INTERFACE and not bridge:
        raise FlagError("--pod-bridge-interface: required with --detect-local-mode=BridgeInterface")
    if mode is LocalMode.INTERFACE_NAME_PREFIX and not prefix:
        raise FlagError("--pod-interface-name-prefix: required with --detect-local-mode=InterfaceNamePrefix")
    return {"detect_local_mode": mode, "pod_bridge_interface": bridge, "pod_interface_name_prefix": prefix}


_NODEPORT_WORDS = "one of the keywords 'primary', 'localhost', 'all'"


def nodeport_addresses(values: list[str]) -> tuple[str, ...]:
    """kube-proxy 1.37's validateKubeProxyNodePortAddress: each item a CIDR or a keyword
    (KEP-6032), a keyword at most once, a CIDR as often as given. Shared by the flag and the
    file. Keywords stay words: `primary` needs node IPs only known later (core.categorize).
    Raises FieldError naming the item by its index, as upstream's field path does."""
    seen: set[str] = set()
    out: list[str] = []
    for i, value in enumerate(values):
        if value in NODEPORT_KEYWORDS:
            if value in seen:
                raise FieldError(f"[{i}] {display(value)}: duplicate value (each keyword may be given once)")
            seen.add(value)
            out.append(value)
            continue
        try:
            out.append(cidr(value))
        except FieldError as exc:
            raise FieldError(f"[{i}] {exc} (nor {_NODEPORT_WORDS})") from None
    return tuple(dict.fromkeys(out))


def _nodeport_addresses(values: list[str]) -> tuple[str, ...]:
    try:
        return nodeport_addresses(_split(values, "--nodeport-addresses"))
    except FieldError as exc:
        raise FlagError(f"--nodeport-addresses: {exc}") from None


def split_list(raw: str) -> list[str]:
    """The items of one comma-separated value; "" is no item, an empty item is an error.

    kube-proxy splits `10.0.0.0/8,` into a CIDR and an empty string and refuses the latter; a
    silently dropped item could hide a typo (`--cluster-cidr ,,` meaning no CIDR at all).
    Raises FieldError.
    """
    if not raw.strip():
        return []
    items = [v.strip() for v in raw.split(",")]
    if "" in items:
        raise FieldError(f"{display(raw)}: empty item in a comma-separated list")
    return items


def _split(values: list[str], flag: str = "") -> list[str]:
    out = []
    for raw in values:
        try:
            out.extend(split_list(raw))
        except FieldError as exc:
            raise FlagError(f"{flag}: {exc}" if flag else str(exc)) from None
    return out


def _each(flag: str, values: list[str], check: Callable[[object], str]) -> tuple[str, ...]:
    out = []
    for v in _split(values, flag):
        try:
            out.append(check(v))
        except FieldError as exc:
            raise FlagError(f"{flag}: {exc}") from None
    return tuple(out)


def one_per_family(values: tuple[str, ...]) -> tuple[str, ...]:
    """kube-proxy takes at most one value per IP family (a dual-stack pair); raises FieldError."""
    for family in IPFamily:
        of = [v for v in values if family_of(v.split("/")[0]) is family]
        if len(of) > 1:
            raise FieldError(f"more than one IPv{family.value} value: {', '.join(of)} "
                             "(one per IP family: a dual-stack pair at most)")
    return values


def _one_per_family(flag: str, values: tuple[str, ...]) -> tuple[str, ...]:
    try:
        return one_per_family(values)
    except FieldError as exc:
        raise FlagError(f"{flag}: {exc}") from None


def node_config_from_args(args: argparse.Namespace) -> NodeConfig:
    name = args.node_name or ""
    if name:
        try:
            name = dns_subdomain(name)
        except FieldError as exc:
            raise FlagError(f"--node-name: {exc}") from None
    ips = _one_per_family("--node-ip", _each("--node-ip", args.node_ip, ip_address))
    cluster_cidrs = _one_per_family("--cluster-cidr", _each("--cluster-cidr", args.cluster_cidr, cidr))
    service_cidrs = _one_per_family(
        "--service-cluster-ip-range",
        _each("--service-cluster-ip-range", getattr(args, "service_cluster_ip_range", []), cidr),
    )
    check_service_cidrs(service_cidrs, cluster_cidrs, ips)
    return NodeConfig(
        name=name,
        # The run command reads nf_conntrack_tcp_be_liberal in the target namespace and sets
        # drop_invalid from it, as kube-proxy does; other commands render the drop.
        drop_invalid=bool(getattr(args, "drop_invalid", True)),
        ips=ips,
        cluster_cidrs=cluster_cidrs,
        masquerade_all=bool(args.masquerade_all),
        nodeport_addresses=_nodeport_addresses(args.nodeport_addresses),
        localhost_nodeports=bool(getattr(args, "localhost_nodeports", True)),
        nft_localhost_nodeports=feature_gates.enabled(getattr(args, "feature_gates", ""),
                                                      feature_gates.LOCALHOST_NODEPORTS),
        masquerade_bit=_masquerade_bit(getattr(args, "masquerade_bit", MASQUERADE_BIT)),
        service_cidrs=service_cidrs,
        **_local_detection(args),  # type: ignore[arg-type]
    )


def check_service_cidrs(service_cidrs: tuple[str, ...], cluster_cidrs: tuple[str, ...],
                        node_ips: tuple[str, ...]) -> None:
    """The nft backend drops traffic to every unallocated address of the service CIDRs after
    DNAT (docs/rules.md, cluster-ips-check): a service range that overlaps the pods' CIDR, either
    way, or holds a node IP would silently black-hole that traffic, so it is refused here."""
    import ipaddress

    for text in service_cidrs:
        service = ipaddress.ip_network(text)
        if service.prefixlen == 0:
            raise FlagError(f"--service-cluster-ip-range: {text} contains every address: "
                            "all traffic would be dropped")
        for pods in map(ipaddress.ip_network, cluster_cidrs):
            if pods.version != service.version or not service.overlaps(pods):
                continue
            how = "contains" if service.supernet_of(pods) else "is inside"  # type: ignore[arg-type]
            raise FlagError(f"--service-cluster-ip-range: {text} {how} the cluster CIDR {pods}: "
                            "traffic to pods would be dropped")
        for node_ip in node_ips:
            if ipaddress.ip_address(node_ip) in service:
                raise FlagError(f"--service-cluster-ip-range: {text} contains the node IP {node_ip}: "
                                "traffic to the node would be dropped")


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
        raise FlagError(f"{flag}: not a duration: {display(text)}: {exc} (examples: 1s, 500ms, 1h30m)") from None
    if nanoseconds < 0:
        raise FlagError(f"{flag}: {display(text)}: must not be negative")
    return nanoseconds / 1e9


# ASCII digits only (`\d` takes any Unicode digit, which int() then reads), bounded before int().
_SIZE_RE = re.compile(r"([0-9]{1,19})(Ki|Mi|Gi|k|M|G)?")
_SIZE_UNIT = {None: 1, "k": 10**3, "M": 10**6, "G": 10**9, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30}
# A file is read into one buffer of the limit's size: a limit of terabytes is a MemoryError
# waiting, not a manifest set.
MAX_BYTE_SIZE = 2**30


def byte_size(flag: str, text: str) -> int:
    """A size in bytes with an optional Kubernetes quantity suffix ("16Mi", "500k", "4096")."""
    m = _SIZE_RE.fullmatch(text.strip())
    if m is None or int(m.group(1)) == 0:
        raise FlagError(f"{flag}: not a positive size: {display(text)} (examples: 16Mi, 500Ki, 1048576)")
    size = int(m.group(1)) * _SIZE_UNIT[m.group(2)]
    if size > MAX_BYTE_SIZE:
        raise FlagError(f"{flag}: {display(text)}: must be at most 1Gi")
    return size


HEALTHZ_PORT = 10256  # kube-proxy's ports.ProxyHealthzPort
METRICS_PORT = 10249  # ports.ProxyStatusPort


def append_port_if_needed(address: str, port: int) -> str:
    """kube-proxy's proxyutil.AppendPortIfNeeded: its address flags and fields take `ip` or
    `ip:port`, and a bare IP gets the server's default port (`::` -> `[::]:10256`). Anything
    else is returned as it is, for the address check to judge."""
    import ipaddress

    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    return f"{address}:{port}" if ip.version == 4 else f"[{address}]:{port}"


_PORT_RE = re.compile(r"[0-9]{1,5}")
# "[" + the longest IPv6 text with a scope id + "]:" + five digits, with room to spare.
_MAX_BIND_ADDRESS = 100


def bind_address(flag: str, value: str) -> None:
    """Check `ip:port` / `[ipv6]:port` (or "" for off) as the daemon's servers will parse it.

    The port must be ASCII digits: the server's parser uses str.isdigit(), which also takes
    `٨٠` (and int() then reads it as 80), and a 5000-digit port is a ValueError inside int().
    """
    if len(value) > _MAX_BIND_ADDRESS:
        raise FlagError(f"{flag}: {display(value)}: too long to be ip:port")
    _, sep, port = value.rpartition(":")
    if value and sep and _PORT_RE.fullmatch(port) is None:
        raise FlagError(f"{flag}: {display(value)}: port must be a number from 0 to 65535")
    from nfproxy.daemon.server import parse_bind_address

    parse_bind_address(value, flag)

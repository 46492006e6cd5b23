"""nft names of the nftables backend: the table's fixed chains, maps and sets, the prefixes of
per-port and per-endpoint objects, quoting of what reaches a script from the model, and the
identity-carrying names (kube-proxy's hash-and-truncate scheme, so dumps read the same)."""

from __future__ import annotations

import hashlib
import re
import struct

from nfproxy import nftables as nft
from nfproxy.nftables.objects import check_comment, check_name, quote_comment
from nfproxy.core.model import Endpoint, ServicePortName


TABLE = nft.TABLE
OFF_TABLE = nft.OFF_TABLE

# Top-level chains and maps. Service and endpoint chain names always contain a "/", these
# never do: that is how a sync tells its own per-service chains apart from the fixed ones.
SERVICES_CHAIN = "services"
SERVICE_IPS_MAP = "service-ips"
SERVICE_NODEPORTS_MAP = "service-nodeports"
NODEPORT_IPS_SET = "nodeport-ips"
CLUSTER_CIDRS_SET = "cluster-cidrs"
SERVICE_ENDPOINTS_CHECK_CHAIN = "service-endpoints-check"
NODEPORT_ENDPOINTS_CHECK_CHAIN = "nodeport-endpoints-check"
NO_ENDPOINT_SERVICES_MAP = "no-endpoint-services"
NO_ENDPOINT_NODEPORTS_MAP = "no-endpoint-nodeports"
REJECT_CHAIN = "reject-chain"
FIREWALL_IPS_MAP = "firewall-ips"
FIREWALL_CHECK_CHAIN = "firewall-check"
MARK_MASQ_CHAIN = "mark-for-masquerade"
MASQUERADING_CHAIN = "masquerading"
HAIRPIN_SET = "hairpin"
# Traffic to an allocated cluster IP on a port no service uses is rejected, to an unallocated
# address of the service CIDRs dropped (kube-proxy's nftables mode; not its iptables mode).
CLUSTER_IPS_SET = "cluster-ips"
CLUSTER_IPS_CHECK_CHAIN = "cluster-ips-check"
# Named counter of the conntrack-INVALID drop (the iptables backend's nfacct counter).
INVALID_DROP_COUNTER = "ct_state_invalid_dropped_pkts"
# KubeProxyNFTablesLocalhostNodePorts: node ports on loopback that nobody proxies are rejected
# and counted, per protocol. kube-proxy 1.37 dispatches a verdict map to a chain per protocol;
# here a set of ports per protocol and one rule each do it: no element names a chain, so
# turning the gate off leaves strays a full sync can delete in any order.


def localhost_reject_set(proto: str) -> str:
    return f"localhost-nodeport-reject-{proto}"


def localhost_reject_counter(proto: str) -> str:
    """The named counter the kubeproxy_nftables_localhost_nodeport_rejected_packets_total
    metric reads (upstream's LocalhostNodePortRejectedCounterName)."""
    return f"localhost-nodeport-rejected-{proto}"
# Endpoint lanes: every endpoint-selecting chain owns a lane of LANE consecutive integers in an
# interval data map `endpoints-<proto>-ranges-M` (M = lane // LANES_PER_MAP), draws
# `numgen random mod LANE offset K` and finds its endpoint's address and port in one range per
# endpoint. LANE is divisible by every endpoint count up to 16 (and many above), so adding,
# removing or replacing an endpoint only changes map elements: the kernel does not validate the
# whole table as it does for a new rule. Weighted chains keep their rule while the weight sum
# (over the gcd) divides LANE: 5^2 makes every percentage split such a sum. Why shards, lanes and
# ranges, and why this LANE: docs/design.md ("The nft layout at scale"), bench/lane_coverage.py.
#
# An unweighted chain of at most HASH_ENDPOINTS_MAX endpoints draws `numgen random mod n offset
# K` instead, into a plain hash map `endpoints-<proto>-hash-M` of the same lanes (one key per
# endpoint, K + i): the lookup kube-proxy's layout makes, cheaper per new connection than a
# range lookup, at the price of a rule change when its endpoint count changes. Why:
# docs/design.md ("Endpoint choice: hash maps for the common case").
SHARD_PREFIX = "endpoints-"
LANE = 223_423_200  # 2^5 . 3^2 . 5^2 . 7 . 11 . 13 . 31
LANES_PER_MAP = 16  # 16 lanes fit in 32 bits; a map bound by at most 16 rules
RANGES = "-ranges"
HASHED = "-hash"
HASH_ENDPOINTS_MAX = 16
# A hash map's declared size: every lane of it full. A size makes the kernel pick its fixed
# hash (the lookup kube-proxy's anonymous maps get) over the resizable one.
HASH_MAP_SIZE = LANES_PER_MAP * HASH_ENDPOINTS_MAX

# Per service port / per endpoint name prefixes (kube-proxy's; none longer than 16 characters,
# which is what keeps prefix + hashAndTruncate's 240-character base within nft's 256).
SERVICE_PREFIX = "service-"
LOCAL_PREFIX = "local-"
EXTERNAL_PREFIX = "external-"
FIREWALL_PREFIX = "firewall-"
ENDPOINT_PREFIX = "endpoint-"
AFFINITY_PREFIX = "affinity-"

NAME_LENGTH_MAX = nft.objects.NAME_LENGTH_MAX
_NAME_BASE_LENGTH_MAX = NAME_LENGTH_MAX - 16


# --------------------------------------------------------------------------------------------
# Quoting: every string that reaches the script from the model goes through one of these two.

_ADDRESS_RE = re.compile(r"[0-9A-Fa-f.:/]+")
IP_CHARS = "0123456789abcdefABCDEF.:"


def nft_name(text: str) -> str:
    """Return `text` unchanged if nft can take it bare as a chain or set name.

    Names are written unquoted (as kube-proxy writes them), so anything else could change the
    meaning of the statement it sits in; refuse it rather than guess an escape.
    """
    if (why := check_name(text)) is not None:
        raise ValueError(why)
    return text


def nft_comment(text: str) -> str:
    """Return `text` as a double-quoted nft comment.

    nft has no escape for `"` inside a string, so the only safe way is a small allow-list. Over-long
    texts are cut instead of refused: a service port name can legally be 143 characters, and a
    comment is only a label, never worth failing a sync for.
    """
    if (why := check_comment(text)) is not None:
        raise ValueError(why)
    return quote_comment(text)


def nft_address(text: str) -> str:
    """Addresses and CIDRs are spliced into rules bare; make sure one cannot carry syntax."""
    if _ADDRESS_RE.fullmatch(text) is None:
        raise ValueError(f"not an address or CIDR: {text!r}")
    return text


# --------------------------------------------------------------------------------------------
# Names that carry identity (kube-proxy's scheme, so dumps read the same).


# Base32 (RFC 4648) of 10 bits at a time: four lookups encode the 40 bits the hash prefix
# needs, where base64.b32encode (pure Python in 3.11) costs more than the sha256 itself.
_B32 = "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567"
_B32_PAIRS = tuple(a + b for a in _B32 for b in _B32)


_FIRST_8_BYTES = struct.Struct(">Q").unpack_from


def hash_and_truncate(name: str) -> str:
    """`HASH8-name`, cut to 240 characters: the hash keeps truncated names unique and makes
    neighbouring endpoint chains (differing in one digit) visually distinct."""
    n = _FIRST_8_BYTES(hashlib.sha256(name.encode()).digest())[0] >> 24
    p = _B32_PAIRS
    name = f"{p[n >> 30]}{p[(n >> 20) & 1023]}{p[(n >> 10) & 1023]}{p[n & 1023]}-{name}"
    if len(name) > _NAME_BASE_LENGTH_MAX:
        name = name[: _NAME_BASE_LENGTH_MAX - 3] + "..."
    return name


def service_chain_base(spn: ServicePortName) -> str:
    """`HASH-ns/name/proto/port`: "/" cannot occur in any of the parts, so it separates them."""
    return hash_and_truncate(f"{spn.namespace}/{spn.name}/{spn.protocol.lower}/{spn.port}")


def endpoint_chain_base(spn: ServicePortName, ep: Endpoint) -> str:
    """`HASH-ns/name/proto/port__ip/port`; IPv6 colons become dots (colons are not allowed)."""
    ip = ep.ip.replace(":", ".")
    return hash_and_truncate(
        f"{spn.namespace}/{spn.name}/{spn.protocol.lower}/{spn.port}__{ip}/{ep.port}"
    )



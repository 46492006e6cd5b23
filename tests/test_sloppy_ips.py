"""Addresses with leading zeros in objects stored before strict IP validation (KEP-4858).

kube-proxy reads Service cluster IPs, external IPs, load-balancer ingress IPs and source ranges,
EndpointSlice addresses and its Node's addresses and pod CIDRs with netutils' sloppy parser
(`ParseIPSloppy` / `ParseCIDRSloppy`: Go's pre-1.17 parser, leading zeros read as decimal). The
real kube-apiserver refuses such addresses on write now, so these tests feed the sources'
parsing directly and through the fake API server (tests/apiserver.py), which stores what it is
given, as an old etcd would hold it.

The tables are netutils' own (k8s.io/utils internal/third_party/forked/golang/net/ip_test.go);
the cluster is kube-proxy's TestBadIPs (pkg/proxy/nftables/proxier_test.go, v1.37.2).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from nfproxy.backends.nft.render import render
from nfproxy.core.model import IPFamily, LocalMode, NodeConfig, Protocol, ServicePortName
from nfproxy.sources.kube import KubeSource, WatchSettings, api_client
from nfproxy.sources.manifests import load_objects
from nfproxy.sources.validation import FieldError, cidr, ip_address, sloppy_cidr, sloppy_ip
from tests.apiserver import FakeApiServer

V4, V6 = IPFamily.V4, IPFamily.V6

# netutils' parseIPTests: (input, what ParseIPSloppy gives). IPv4-mapped IPv6 inputs are
# left out here: nfproxy refuses those for another reason (test_ipv4_mapped_stays_refused).
PARSE_IP = [
    ("127.0.1.2", "127.0.1.2"),
    ("127.0.0.1", "127.0.0.1"),
    ("127.001.002.003", "127.1.2.3"),
    ("127.007.008.009", "127.7.8.9"),
    ("127.010.020.030", "127.10.20.30"),
    ("2001:4860:0:2001::68", "2001:4860:0:2001::68"),
    ("2001:4860:0000:2001:0000:0000:0000:0068", "2001:4860:0:2001::68"),
    # Go's old parser also took a group zero-padded past four digits while it stays <= ffff.
    ("2001:4860:000000:2001::0068", "2001:4860:0:2001::68"),
    ("64:ff9b::010.001.002.003", "64:ff9b::a01:203"),
]
BAD_IP = ["-0.0.0.0", "0.-1.0.0", "0.0.-2.0", "0.0.0.-3", "127.0.0.256", "abc", "123:",
          "fe80::1%lo0", "fe80::1%911", "", "a1:a2:a3:a4::b1:b2:b3:b4", "1.2..4",
          "0256.0.0.1", "2001:db8::10000"]
MAPPED = ["::ffff:127.1.2.3", "::ffff:127.001.002.003", "::ffff:7f01:0203",
          "0:0:0:0:0000:ffff:127.1.2.3", "0:0:0:0:000000:ffff:127.1.2.3"]

# netutils' parseCIDRTests: (input, the network ParseCIDRSloppy gives).
PARSE_CIDR = [
    ("135.104.0.0/32", "135.104.0.0/32"),
    ("0.0.0.0/24", "0.0.0.0/24"),
    ("135.104.0.0/24", "135.104.0.0/24"),
    ("135.104.0.1/32", "135.104.0.1/32"),
    ("135.104.0.1/24", "135.104.0.0/24"),
    ("127.000.000.001/32", "127.0.0.1/32"),
    ("127.007.008.009/32", "127.7.8.9/32"),
    ("127.010.020.030/32", "127.10.20.30/32"),
    ("::1/128", "::1/128"),
    ("abcd:2345::/127", "abcd:2345::/127"),
    ("abcd:2345::/65", "abcd:2345::/65"),
    ("abcd:2345::/64", "abcd:2345::/64"),
    ("abcd:2345::/63", "abcd:2345::/63"),
    ("abcd:2345::/33", "abcd:2345::/33"),
    ("abcd:2345::/32", "abcd:2345::/32"),
    ("abcd:2344::/31", "abcd:2344::/31"),
    ("abcd:2300::/24", "abcd:2300::/24"),
    ("abcd:2345::/24", "abcd:2300::/24"),
    ("2001:DB8::/48", "2001:db8::/48"),
    ("2001:DB8::1/48", "2001:db8::/48"),
    # The prefix length goes through the same decimal reader (kube-proxy's TestBadIPs).
    ("203.0.113.000/025", "203.0.113.0/25"),
    ("10.0.0.0/08", "10.0.0.0/8"),
]
BAD_CIDR = ["192.168.1.1/255.255.255.0", "192.168.1.1/35", "2001:db8::1/-1", "2001:db8::1/-0",
            "-0.0.0.0/32", "0.-1.0.0/32", "0.0.-2.0/32", "0.0.0.-3/32", "0.0.0.0/-0", "",
            "10.0.0.0", "10.0.0.0/", "010.0.0.0/33", "2001:db8::/0129"]


@pytest.mark.parametrize(("text", "expected"), PARSE_IP)
def test_sloppy_ip_reads_leading_zeros_as_decimal(text, expected):
    assert sloppy_ip(text) == expected


def test_strict_ip_still_refuses_leading_zeros():
    """The flags and ServiceCIDRs keep the strict parser: only stored objects are read leniently."""
    with pytest.raises(FieldError):
        ip_address("127.001.002.003")
    with pytest.raises(FieldError):
        cidr("203.0.113.000/025")


@pytest.mark.parametrize("text", BAD_IP)
def test_sloppy_ip_refuses_what_go_refused(text):
    with pytest.raises(FieldError, match="not a valid IP address"):
        sloppy_ip(text)


@pytest.mark.parametrize("text", MAPPED)
def test_ipv4_mapped_stays_refused(text):
    with pytest.raises(FieldError, match="IPv4-mapped"):
        sloppy_ip(text)


@pytest.mark.parametrize(("text", "expected"), PARSE_CIDR)
def test_sloppy_cidr_reads_leading_zeros_as_decimal(text, expected):
    assert sloppy_cidr(text) == expected


@pytest.mark.parametrize("text", BAD_CIDR)
def test_sloppy_cidr_refuses_what_go_refused(text):
    with pytest.raises(FieldError, match="not a valid CIDR"):
        sloppy_cidr(text)


def test_errors_name_the_value_as_written():
    with pytest.raises(FieldError, match=r"^010\.0\.0\.1 is not an IPv6 address$"):
        sloppy_ip("010.0.0.1", V6)
    with pytest.raises(FieldError, match=r"^127\.000\.000\.001 is an unspecified, loopback"):
        from nfproxy.sources.validation import sloppy_endpoint_address

        sloppy_endpoint_address("127.000.000.001")


# --------------------------------------------------------------------------------------------
# kube-proxy's TestBadIPs, through the sources


def bad_ip_objects(*, good: bool = False) -> list[dict[str, Any]]:
    """TestBadIPs' Service and slice (and a Node), as stored with zeros, or as it means."""
    def pick(bad: str, canonical: str) -> str:
        return canonical if good else bad

    return [
        {
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"namespace": "ns1", "name": "svc1"},
            "spec": {
                "type": "LoadBalancer",
                "clusterIP": pick("172.30.0.041", "172.30.0.41"),
                "clusterIPs": [pick("172.30.0.041", "172.30.0.41")],
                "ports": [{"name": "p80", "port": 80, "protocol": "TCP", "nodePort": 3001}],
                "externalIPs": [pick("192.168.099.022", "192.168.99.22")],
                "loadBalancerSourceRanges": [pick("203.0.113.000/025", "203.0.113.0/25")],
            },
            "status": {"loadBalancer": {"ingress": [{"ip": pick("1.2.3.004", "1.2.3.4")}]}},
        },
        {
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"namespace": "ns1", "name": "svc1-1",
                         "labels": {"kubernetes.io/service-name": "svc1"}},
            "addressType": "IPv4",
            "endpoints": [{"addresses": [pick("10.180.00.001", "10.180.0.1")], "nodeName": "node-a"}],
            "ports": [{"name": "p80", "port": 80, "protocol": "TCP"}],
        },
        {
            "apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-a"},
            "spec": {"podCIDRs": [pick("10.000.001.000/024", "10.0.1.0/24")]},
            "status": {"addresses": [{"type": "InternalIP", "address": pick("192.168.000.002", "192.168.0.2")}]},
        },
    ]


NODE = NodeConfig(name="node-a", detect_local_mode=LocalMode.NODE_CIDR)
SVC1 = (ServicePortName("ns1", "svc1", "p80", Protocol.TCP), V4)


def test_bad_ips_load_as_kube_proxy_reads_them():
    bad = load_objects(bad_ip_objects(), NODE)
    good = load_objects(bad_ip_objects(good=True), NODE)
    assert bad.errors == () and good.errors == ()
    assert bad.state == good.state
    port = bad.state.services[SVC1]
    assert (port.cluster_ip, port.external_ips, port.load_balancer_ips) == (
        "172.30.0.41", ("192.168.99.22",), ("1.2.3.4",))
    assert port.load_balancer_source_ranges == ("203.0.113.0/25",)
    assert [e.ip for e in bad.state.endpoints[SVC1]] == ["10.180.0.1"]
    assert bad.state.node.ips == ("192.168.0.2",)
    assert bad.state.node.cluster_cidrs == ("10.0.1.0/24",)  # --detect-local-mode NodeCIDR


def test_bad_ips_render_as_kube_proxy_writes_them():
    """TestBadIPs' point: what reaches nft is the decimal reading, never the zeros."""
    text = render(load_objects(bad_ip_objects(), NODE).state, V4).script()
    for address in ("172.30.0.41", "192.168.99.22", "1.2.3.4", "203.0.113.0/25", "10.180.0.1"):
        assert address in text
    for written in ("172.30.0.041", "192.168.099.022", "1.2.3.004", "000/025", "10.180.00.001"):
        assert written not in text


def test_bad_ips_through_the_api_source():
    """The fake API server hands the objects out as stored; the daemon's API source reads them
    as kube-proxy's informers would."""
    with FakeApiServer(bookmark_interval=0.2) as api:
        for obj in bad_ip_objects():
            api.apply(copy.deepcopy(obj))
        settings = WatchSettings(watch_timeout=5, connect_timeout=1.0, list_timeout=3.0)
        source = KubeSource(api_client(master=api.url), NODE, settings)
        source.start(lambda: None)
        try:
            assert source.wait_ready(10)
            result = source.snapshot()
        finally:
            source.stop()
    expected = load_objects(bad_ip_objects(good=True), NODE)
    assert result.errors == ()
    assert result.state == expected.state

"""Differential: random clusters through the real API server, the real kube-proxy and nfproxy.

Each cluster comes from `nfproxy.testing.random_cluster` (every Service feature the model has:
dual-stack, ClientIP affinity, topology hints, terminating fallback, eTP/iTP Local, LoadBalancer
source ranges, NodePorts, externalIPs, no-endpoint services, UDP and SCTP), written to
kube-apiserver as Services (cluster IPs in a block of each cluster's own), LoadBalancer status and
EndpointSlices. kube-proxy follows it in its namespace; `nfproxy compare --against-netns
--kubeconfig` reads the same API state and must find every probe equal. A cluster replaces the
one before it, as a rollout would.

`scripts/test` runs DIFFERENTIAL_CLUSTERS (default 3) clusters per mode; the documented longer
run sets NFPROXY_DIFFERENTIAL_CLUSTERS (docs/compat.md has its last result) and may start at
another seed (NFPROXY_DIFFERENTIAL_FIRST_SEED). Every cluster is compared; the test fails at the
end naming each cluster that differed.
"""

from __future__ import annotations

import ipaddress
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from nfproxy.core.model import ClusterState, ServicePort, ServiceType
from nfproxy.testing import NODE, manifest_objects, random_cluster
from tests.realkube import ROOT, node_addresses

pytestmark = [pytest.mark.apiserver, pytest.mark.kernel]

CLUSTERS = int(os.environ.get("NFPROXY_DIFFERENTIAL_CLUSTERS", "3"))
FIRST_SEED = int(os.environ.get("NFPROXY_DIFFERENTIAL_FIRST_SEED", "0"))
LABEL = "nfproxy.test/differential"  # on every generated Service and slice: one delete for all
NAMESPACES = [f"ns-{i}" for i in range(7)]  # random_cluster's
CLUSTER_CIDRS = ",".join(NODE.cluster_cidrs)
SETTLE = 90.0  # kube-proxy and the compare catching up with a new cluster: a bound


def _cluster_ip(first: ServicePort, seed: int, index: int) -> str:
    """random_cluster's cluster IPs lie outside the server's service CIDRs. Each cluster gets a
    block of its own (10.96.200+k.0/24, fd00:10:96::kkii), never one the server would allocate
    at random nor one another test of the session's server fixes (examples/: 10.96.0-20.x)."""
    k = seed % 50
    if first.family.value == 4:
        return f"10.96.{200 + k}.{index + 1}"
    return canonical(f"fd00:10:96::{k:02x}{index + 1:02x}")


def _service(state: ClusterState, ports: list[ServicePort], generated: dict[str, Any], seed: int) -> dict[str, Any]:
    """The generated Service with everything manifest_objects leaves out, and a cluster IP in
    the server's service CIDRs (`_cluster_ip`)."""
    first = ports[0]
    spec = generated["spec"]
    ip = _cluster_ip(first, seed, int(generated["metadata"]["name"].split("-")[-1]))
    spec["clusterIP"], spec["clusterIPs"] = ip, [ip]
    spec["ipFamilies"] = [f"IPv{first.family.value}"]
    spec["ipFamilyPolicy"] = "SingleStack"
    for port in spec["ports"]:
        port["targetPort"] = port["port"]
    if first.affinity_timeout:
        spec["sessionAffinity"] = "ClientIP"
        spec["sessionAffinityConfig"] = {"clientIP": {"timeoutSeconds": first.affinity_timeout}}
    if first.external_ips:
        spec["externalIPs"] = list(first.external_ips)
    if first.type is not ServiceType.CLUSTER_IP:
        spec["externalTrafficPolicy"] = "Local" if first.external_policy_local else "Cluster"
    spec["internalTrafficPolicy"] = "Local" if first.internal_policy_local else "Cluster"
    if first.load_balancer_source_ranges:
        spec["loadBalancerSourceRanges"] = list(first.load_balancer_source_ranges)
    return generated


def canonical(ip: str) -> str:
    """random_cluster writes IPv6 as fd02::0:1; the real server takes RFC 5952 form only (strict
    IP validation, KEP-4858), as a real cluster's objects are."""
    return str(ipaddress.ip_address(ip))


def _canonical_addresses(obj: dict[str, Any]) -> dict[str, Any]:
    for ep in obj.get("endpoints", []):
        ep["addresses"] = [canonical(a) for a in ep["addresses"]]
    spec = obj.get("spec", {})
    if "externalIPs" in spec:
        spec["externalIPs"] = [canonical(a) for a in spec["externalIPs"]]
    return obj


def cluster_objects(seed: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(objects, LoadBalancer statuses) of the random cluster of `seed`."""
    state = random_cluster(random.Random(seed), 12, max_endpoints=6)
    by_name: dict[tuple[str, str], list[ServicePort]] = {}
    for sp in state.services.values():
        by_name.setdefault((sp.name.namespace, sp.name.name), []).append(sp)
    objects, statuses = [], []
    for obj in manifest_objects(state):
        meta = obj["metadata"]
        if obj["kind"] == "Service":
            ports = by_name[(meta["namespace"], meta["name"])]
            obj = _service(state, ports, obj, seed)
            if ports[0].load_balancer_ips:
                ingress = [{"ip": canonical(ip)} for ip in ports[0].load_balancer_ips]
                statuses.append({"apiVersion": "v1", "kind": "Service", "metadata": dict(meta),
                                 "status": {"loadBalancer": {"ingress": ingress}}})
        obj.setdefault("metadata", {}).setdefault("labels", {})[LABEL] = "true"
        objects.append(_canonical_addresses(obj))
    return objects, statuses


def replace_cluster(plane: Any, seed: int) -> int:
    plane.apply(*({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}} for ns in NAMESPACES))
    plane.kubectl("delete", "services,endpointslices", "-A", "-l", LABEL, "--wait=false")
    objects, statuses = cluster_objects(seed)
    plane.apply(*objects)
    for status in statuses:
        plane.apply_status(status)
    return sum(1 for o in objects if o["kind"] == "Service")


def node(plane: Any, netns: str) -> None:
    """random_cluster's node: its IPs on an interface of the namespace and on the Node object
    (kube-proxy reads both), its zone label."""
    plane.apply({"apiVersion": "v1", "kind": "Node",
                 "metadata": {"name": NODE.name, "labels": {"topology.kubernetes.io/zone": NODE.zone}}})
    plane.apply_status({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE.name},
                        "status": {"addresses": [{"type": "InternalIP", "address": ip} for ip in NODE.ips]}})
    node_addresses(netns, *NODE.ips)


@pytest.fixture
def kube_proxy_on_random_node(control_plane, netns) -> Iterator[Any]:
    node(control_plane, netns)
    started = []

    def start(mode: str) -> str:
        control_plane.start_kube_proxy(netns, mode, "--hostname-override", NODE.name, "--cluster-cidr", CLUSTER_CIDRS)
        started.append(netns)
        return netns

    yield start
    for ns in started:
        control_plane.stop_kube_proxy(ns)
    control_plane.kubectl("delete", "services,endpointslices", "-A", "-l", LABEL, "--wait=false")


def compare_live(plane: Any, netns: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "nfproxy", "compare", "--against-netns", netns, "--kubeconfig", plane.kubeconfig,
         "--hostname-override", NODE.name, "--cluster-cidr", CLUSTER_CIDRS, "--json"],
        capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode in (0, 1), done.stderr
    return json.loads(done.stdout)


def settled(plane: Any, netns: str) -> dict[str, Any]:
    """The compare once kube-proxy has caught up: repeated while it is behind (a bound, not a
    retry of a flaky check: a difference that stays is reported as the last compare saw it)."""
    deadline = time.monotonic() + SETTLE
    while True:
        report = compare_live(plane, netns)
        if report["equal"] or time.monotonic() > deadline:
            return report
        time.sleep(1)


@pytest.mark.parametrize("mode", ["iptables", "nftables"])
def test_random_clusters_equal_under_both_proxies(control_plane, kube_proxy_on_random_node, mode):
    netns = kube_proxy_on_random_node(mode)
    failures = []
    for seed in range(FIRST_SEED, FIRST_SEED + CLUSTERS):
        services = replace_cluster(control_plane, seed)
        report = settled(control_plane, netns)
        shown = "\n".join(f"{d['service']} | {d['traffic']} | {d['why']}" for d in report["differences"][:40])
        equal = report["equal"] and report["probes"] > services
        if not equal:
            failures.append(f"cluster {seed} ({services} Services, {report['probes']} probes):\n{shown}")
        print(f"{mode} cluster {seed}: {'EQUAL' if equal else 'DIFFERENT'}", file=sys.stderr, flush=True)
    assert not failures, f"{mode}: {len(failures)} of {CLUSTERS} clusters differ\n" + "\n".join(failures)

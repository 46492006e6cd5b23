"""`nfproxy lab` on services with ClientIP session affinity: every row of theirs (node port,
external IP, LoadBalancer, cluster IP) expects one client on one endpoint, not the split."""

from __future__ import annotations

import os
import re
from fractions import Fraction

import pytest
import yaml
from pyroute2 import netns as pyroute2_netns

from nfproxy.core.model import ClusterState, NodeConfig
from nfproxy.sources import manifests
from nfproxy.verify import lab

NODE_IP = "192.168.0.2"

STICKY = """
apiVersion: v1
kind: Service
metadata: {name: sticky, namespace: t}
spec:
  type: LoadBalancer
  clusterIP: 10.96.30.10
  externalIPs: [198.51.100.30]
  sessionAffinity: ClientIP
  sessionAffinityConfig: {clientIP: {timeoutSeconds: 600}}
  ports: [{name: http, port: 80, protocol: TCP, targetPort: 8080, nodePort: 30090}]
status: {loadBalancer: {ingress: [{ip: 203.0.113.20}]}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: sticky-a, namespace: t, labels: {kubernetes.io/service-name: sticky}}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints:
  - {addresses: [10.244.0.5], nodeName: node-a}
  - {addresses: [10.244.1.5], nodeName: node-b}
---
apiVersion: v1
kind: Service
metadata: {name: plain, namespace: t}
spec:
  type: NodePort
  clusterIP: 10.96.30.11
  ports: [{name: http, port: 80, protocol: TCP, targetPort: 8080, nodePort: 30091}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: plain-a, namespace: t, labels: {kubernetes.io/service-name: plain}}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints:
  - {addresses: [10.244.0.6], nodeName: node-a}
  - {addresses: [10.244.1.6], nodeName: node-b}
"""


def _state() -> ClusterState:
    node = NodeConfig(name="node-a", ips=(NODE_IP,), cluster_cidrs=("10.244.0.0/24",))
    result = manifests.load_objects(list(yaml.safe_load_all(STICKY)), node=node)
    assert result.errors == ()
    return result.state


def test_plan_knows_which_service_ports_are_sticky() -> None:
    plan = lab.plan(_state(), 300)
    assert plan.sticky == frozenset({"t/sticky:http"})
    rows = {p.check for p in plan.probes if p.service == "t/sticky:http"}
    assert rows == {lab.Check.AFFINITY, lab.Check.NODE_PORT, lab.Check.FROM_NODE,
                    lab.Check.EXTERNAL_IP, lab.Check.LB_ALLOWED}


HALF = Fraction(1, 2)
SPLIT = {("10.244.0.5:8080", NODE_IP): HALF, ("10.244.1.5:8080", NODE_IP): HALF}


def _node_port() -> lab.Probe:
    return lab.Probe("100.64.0.1", NODE_IP, 30090, "tcp", "outside", service="t/sticky:http",
                     client="outside", count=200, check=lab.Check.NODE_PORT)


@pytest.mark.parametrize("check", [lab.Check.NODE_PORT, lab.Check.FROM_NODE,
                                   lab.Check.EXTERNAL_IP, lab.Check.LB_ALLOWED])
def test_a_sticky_row_expects_one_endpoint_per_client(check: lab.Check) -> None:
    probe = lab.Probe("100.64.0.1", NODE_IP, 30090, "tcp", "outside", service="t/sticky:http",
                      client="outside", count=200, check=check)
    one = {("10.244.1.5:8080", NODE_IP): 200}
    assert lab.judge(probe, SPLIT, one, sticky=True) == ()
    assert lab.judge(probe, SPLIT, one) != ()  # without affinity: 0.5 never reached in 200
    both = {("10.244.0.5:8080", NODE_IP): 199, ("10.244.1.5:8080", NODE_IP): 1}
    assert lab.judge(probe, SPLIT, both, sticky=True) == (
        "one client reached 2 endpoints under affinity",)
    assert lab.judge(probe, SPLIT, both) == ()


def test_a_sticky_row_still_refuses_what_the_rules_give_no_chance() -> None:
    unmasqueraded = {("10.244.1.5:8080", "100.64.0.1"): 200}
    problems = lab.judge(_node_port(), SPLIT, unmasqueraded, sticky=True)
    assert problems == ("200 connection(s) saw 10.244.1.5:8080 (source 100.64.0.1), "
                        "which the rules give no chance",)
    m = lab.measure(_node_port(), SPLIT, {("10.244.0.5:8080", NODE_IP): 200}, 0.1, sticky=True)
    assert m.problems == ()


@pytest.mark.kernel
def test_every_row_of_a_sticky_service_passes_on_both_backends() -> None:
    report = lab.run(_state(), connections=200)
    assert report.passed, [(r.probe.title, r.problems) for r in report.results if r.problems]
    sticky = [r for r in report.results if r.probe.service == "t/sticky:http"]
    assert len(sticky) == 5
    for r in sticky:
        for m in r.by_backend.values():
            assert len(m.seen_labels) == 1 and not m.unexpected
    plain = next(r for r in report.checks if r.probe.service == "t/plain:http"
                 and r.probe.check is lab.Check.NODE_PORT)
    for m in plain.by_backend.values():
        assert len(m.seen_labels) == 2  # no affinity: still spread, and checked as a split
    pid = os.getpid()
    assert [n for n in pyroute2_netns.listnetns() if re.search(rf"-{pid}-[0-9a-f]+", n)] == []

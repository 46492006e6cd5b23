"""`nfproxy lab`: planning and judging without a kernel, then real runs in throwaway namespaces."""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import json
import os
import re
import signal
import struct
import subprocess
import sys
import time
import zlib
from fractions import Fraction
from pathlib import Path

import pytest
from pyroute2 import netns as pyroute2_netns

from nfproxy.verify import lab
from nfproxy.cli.commands import lab as lab_cmd
from nfproxy.core.model import ClusterState, IPFamily, NodeConfig, Protocol
from nfproxy.sources import manifests

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
STATE = manifests.load(EXAMPLES).state
NODE_IP = "192.168.0.2"


def _net(c: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    return ipaddress.ip_network(c)


def _mine(pid: int) -> list[str]:
    """Namespaces a process made (sandbox, feature probes), by the pid in their names."""
    return [n for n in pyroute2_netns.listnetns() if re.search(rf"-{pid}-[0-9a-f]+", n)]


# --------------------------------------------------------------------------------------------
# Planning


def test_plan_derives_clients_and_endpoints_from_the_services() -> None:
    plan = lab.plan(STATE, 500)
    spec = plan.spec
    assert spec.node_ips == (NODE_IP,)  # from the Node object in examples/
    clients = {c.name: c.addresses for c in spec.clients}
    (pod,) = clients["pod"]
    (outside,) = clients["outside"]
    (allowed,) = clients["allowed0"]
    assert ipaddress.ip_address(pod) in _net("10.244.0.0/24")
    ranges = [_net("198.51.100.0/24"), _net("192.0.2.0/24")]
    assert any(ipaddress.ip_address(allowed) in r for r in ranges)
    assert not any(ipaddress.ip_address(outside) in r for r in [*ranges, _net("10.244.0.0/24")])
    slices = {ep.ip for eps in STATE.endpoints.values() for ep in eps}
    assert {e.ip for e in spec.endpoints} == slices
    ports = {e.ip: set(e.ports) for e in spec.endpoints}
    assert ports["10.244.0.2"] == {(53, "udp"), (53, "tcp"), (9153, "tcp")}
    used = {*slices, NODE_IP, "203.0.113.10", "198.51.100.20"}
    used |= {svc.cluster_ip for svc in STATE.services.values()}
    assert not used & {pod, outside, allowed}


def test_plan_has_a_distribution_per_load_balanced_port_and_every_traffic_class() -> None:
    plan = lab.plan(STATE, 700)
    dist = {(p.service, p.protocol): p for p in plan.distributions}
    assert set(dist) == {
        ("default/legacy-api:http", Protocol.TCP),
        ("kube-system/kube-dns:dns", Protocol.UDP),
        ("kube-system/kube-dns:dns-tcp", Protocol.TCP),
        ("kube-system/kube-dns:metrics", Protocol.TCP),
        ("shop/catalog:http", Protocol.TCP),
        ("shop/frontend:http", Protocol.TCP),
        ("shop/search:grpc", Protocol.TCP),
        ("shop/storefront:https", Protocol.TCP),
    }
    assert all(p.count == 700 and p.client == "pod" for p in plan.distributions)
    catalog = dist[("shop/catalog:http", Protocol.TCP)]
    assert (catalog.dst, catalog.port) == ("10.96.10.10", 80)
    checks = {(p.check, p.service, p.client, p.dst, p.port) for p in plan.checks}
    lab_ = lab.Check
    assert checks == {
        (lab_.NODE_PORT, "shop/frontend:http", "outside", NODE_IP, 30080),
        (lab_.FROM_NODE, "shop/frontend:http", "node", NODE_IP, 30080),
        (lab_.NODE_PORT, "shop/storefront:https", "outside", NODE_IP, 30443),
        (lab_.FROM_NODE, "shop/storefront:https", "node", NODE_IP, 30443),
        (lab_.LB_ALLOWED, "shop/storefront:https", "allowed0", "203.0.113.10", 443),
        (lab_.LB_BLOCKED, "shop/storefront:https", "outside", "203.0.113.10", 443),
        (lab_.EXTERNAL_IP, "default/legacy-api:http", "outside", "198.51.100.20", 8080),
        (lab_.AFFINITY, "shop/cart:http", "pod", "10.96.10.40", 80),
        (lab_.NO_ENDPOINTS, "shop/checkout:http", "pod", "10.96.10.50", 80),
    }
    assert plan.skipped == ()


# Dual-stack NodePort, an internalTrafficPolicy: Local service with no local endpoint, and SCTP.
SMALL = """
apiVersion: v1
kind: Service
metadata: {name: web, namespace: t}
spec:
  type: NodePort
  ipFamilyPolicy: PreferDualStack
  ipFamilies: [IPv4, IPv6]
  clusterIP: 10.96.5.5
  clusterIPs: [10.96.5.5, "fd00:96::5"]
  ports: [{name: http, port: 80, protocol: TCP, nodePort: 30080}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-4, namespace: t, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints:
  - {addresses: [10.244.0.5], nodeName: node-a}
  - {addresses: [10.244.1.5], nodeName: node-b}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-6, namespace: t, labels: {kubernetes.io/service-name: web}}
addressType: IPv6
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints:
  - {addresses: ["fd00:244::5"], nodeName: node-a}
  - {addresses: ["fd00:244:1::5"], nodeName: node-b}
  - {addresses: ["fd00:244:1::6"], nodeName: node-b}
---
apiVersion: v1
kind: Service
metadata: {name: local-only, namespace: t}
spec:
  clusterIP: 10.96.5.6
  internalTrafficPolicy: Local
  ports: [{name: http, port: 80, protocol: TCP}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: local-only-a, namespace: t, labels: {kubernetes.io/service-name: local-only}}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints: [{addresses: [10.244.1.7], nodeName: node-b}]
---
apiVersion: v1
kind: Service
metadata: {name: signalling, namespace: t}
spec:
  clusterIP: 10.96.5.7
  ports: [{name: diameter, port: 3868, protocol: SCTP}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: signalling-a, namespace: t, labels: {kubernetes.io/service-name: signalling}}
addressType: IPv4
ports: [{name: diameter, port: 3868, protocol: SCTP}]
endpoints: [{addresses: [10.244.1.8], nodeName: node-b}]
"""


def _small_state() -> ClusterState:
    import yaml

    node = NodeConfig(name="node-a", ips=(NODE_IP, "fd00:1::2"),
                      cluster_cidrs=("10.244.0.0/24", "fd00:244::/64"))
    result = manifests.load_objects(list(yaml.safe_load_all(SMALL)), node=node)
    assert result.errors == ()
    return result.state


def test_plan_for_another_cluster_dual_stack_local_policy_and_sctp() -> None:
    plan = lab.plan(_small_state(), 300)
    clients = {c.name: c.addresses for c in plan.spec.clients}
    assert len(clients["pod"]) == len(clients["outside"]) == 2
    assert ipaddress.ip_address(clients["pod"][1]) in _net("fd00:244::/64")
    probes = {(p.check, p.family, p.dst, p.port) for p in plan.probes}
    assert probes == {
        (None, IPFamily.V4, "10.96.5.5", 80),
        (None, IPFamily.V6, "fd00:96::5", 80),
        (lab.Check.NODE_PORT, IPFamily.V4, NODE_IP, 30080),
        (lab.Check.FROM_NODE, IPFamily.V4, NODE_IP, 30080),
        (lab.Check.NODE_PORT, IPFamily.V6, "fd00:1::2", 30080),
        (lab.Check.FROM_NODE, IPFamily.V6, "fd00:1::2", 30080),
        (lab.Check.NO_LOCAL_ENDPOINTS, IPFamily.V4, "10.96.5.6", 80),
    }
    assert plan.skipped == ("t/signalling:diameter SCTP: the sandbox speaks TCP and UDP only",)
    assert "10.244.1.8" not in {e.ip for e in plan.spec.endpoints}


@pytest.mark.parametrize("n", [0, -5, lab.MAX_CONNECTIONS + 1])
def test_plan_refuses_connection_counts_out_of_range(n: int) -> None:
    with pytest.raises(lab.LabError, match="connections per service"):
        lab.plan(STATE, n)


def test_plan_refuses_more_udp_flows_than_fresh_source_ports() -> None:
    udp = "\n".join(
        f"""---
apiVersion: v1
kind: Service
metadata: {{name: dns{i}, namespace: default}}
spec:
  clusterIP: 10.96.30.{i}
  ports: [{{name: dns, port: 53, protocol: UDP}}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: dns{i}-a, namespace: default, labels: {{kubernetes.io/service-name: dns{i}}}}}
addressType: IPv4
ports: [{{name: dns, port: 53, protocol: UDP}}]
endpoints: [{{addresses: [10.244.0.{i}]}}, {{addresses: [10.244.1.{i}]}}]
"""
        for i in range(1, 4)
    )
    import yaml

    state = manifests.load_objects(
        list(yaml.safe_load_all(udp)),
        node=STATE.node,
    ).state
    assert len(lab.plan(state, 9000).distributions) == 3
    with pytest.raises(lab.LabError, match="UDP connections from the pod client"):
        lab.plan(state, 10_000)


# --------------------------------------------------------------------------------------------
# Judging


def _probe(check: lab.Check | None = None, client: str = "pod", source: str = "10.244.0.254",
           destination: str = "10.96.10.10") -> lab.Probe:
    origin = "pod" if client == "pod" else "outside"
    return lab.Probe(source, destination, 80, "tcp", origin, service="shop/catalog:http",
                     client=client, count=300, check=check)


def test_interpreter_outcomes_map_to_what_the_sandbox_reports() -> None:
    p = _probe()
    nodes = (NODE_IP, "fd00::2")
    assert lab.seen_as("accept", "10.244.0.11:8080", False, p, nodes) == (
        "10.244.0.11:8080", "10.244.0.254")
    assert lab.seen_as("accept", "10.244.0.11:8080", True, p, nodes) == ("10.244.0.11:8080", NODE_IP)
    assert lab.seen_as("REJECT", None, False, p, nodes) == ("refused", None)
    assert lab.seen_as("drop", None, True, p, nodes) == ("timeout", None)
    # Let through untouched: to a node IP nothing listens (refused), elsewhere the silent uplink.
    assert lab.seen_as("accept", None, False, p, nodes) == ("timeout", None)
    to_node = _probe(lab.Check.NODE_PORT, "outside", "100.64.0.1", NODE_IP)
    assert lab.seen_as("accept", None, False, to_node, nodes) == ("refused", None)


THIRD = Fraction(1, 3)
EXPECTED = {(f"10.244.{i}:8080", "10.244.0.254"): THIRD for i in ("0.11", "1.12", "1.13")}


def _result(seen: dict[lab.Seen, int], check: lab.Check | None = None,
            expected: dict[lab.Seen, Fraction] | None = None) -> lab.ProbeResult:
    probe = _probe(check)
    m = lab.measure(probe, expected or EXPECTED, seen, 0.1)
    return lab.ProbeResult(probe, {"iptables": m, "nft": m})


def test_distribution_rows_fail_only_on_impossible_outcomes() -> None:
    fair = {k: 100 for k in EXPECTED}
    assert _result(fair).passed("nft")
    assert _result(fair).fits()["nft"].p == pytest.approx(1.0)
    skewed = {k: n for k, n in zip(EXPECTED, (200, 50, 50))}
    r = _result(skewed)
    assert r.passed("nft") and r.fits()["nft"].p < 1e-6  # reported as a low p, not a failure
    masqueraded = {**fair, ("10.244.0.11:8080", NODE_IP): 1}
    assert not _result(masqueraded).passed("iptables")
    assert not _result({**fair, ("timeout", None): 1}).passed("iptables")


def test_check_rows() -> None:
    one = {("10.244.1.12:8080", "10.244.0.254"): 300}
    assert _result(one, lab.Check.AFFINITY).passed("nft")
    two = {("10.244.1.12:8080", "10.244.0.254"): 299, ("10.244.1.13:8080", "10.244.0.254"): 1}
    assert not _result(two, lab.Check.AFFINITY).passed("nft")
    # A 1/3 endpoint never reached in 300 connections is not chance (p = (2/3)^300).
    assert not _result(one, lab.Check.NODE_PORT).passed("nft")
    rare = {**EXPECTED, ("10.244.9.9:8080", "10.244.0.254"): Fraction(1, 10**9)}
    spread = {k: 100 for k in EXPECTED}
    assert _result(spread, lab.Check.NODE_PORT, rare).passed("nft")
    refused = {("refused", None): Fraction(1)}
    assert _result({("refused", None): 20}, lab.Check.NO_ENDPOINTS, refused).passed("nft")
    assert not _result({("timeout", None): 20}, lab.Check.NO_ENDPOINTS, refused).passed("nft")


def _report() -> lab.Report:
    plan = lab.plan(STATE, 300)
    results = []
    for p in plan.probes:
        if p.check is None:
            exp = {(f"10.244.7.{i}:80", p.src): Fraction(1, 3) for i in (1, 2, 3)}
            by = {"iptables": lab.Measured(exp, dict(zip(exp, (97, 101, 102))), 0.25),
                  "nft": lab.Measured(exp, dict(zip(exp, (110, 95, 95))), 0.5)}
        else:
            exp = {("refused", None): Fraction(1)}
            by = {b: lab.Measured(exp, {("refused", None): p.count}, 0.1)
                  for b in ("iptables", "nft")}
        results.append(lab.ProbeResult(p, by))
    counted = {b: dict(lab.client_counts(results, b)) for b in ("iptables", "nft")}
    return lab.Report(plan, ("iptables", "nft"), tuple(results), 12.5, {"iptables": 0.05},
                      counted=counted)


def test_kernel_counts_must_equal_what_the_clients_saw() -> None:
    report = _report()
    assert report.passed and report.count_mismatches() == []
    rows = report.counts("nft")
    services = {p.service for p in report.plan.distributions}
    assert {r.service for r in rows} == services and len(rows) == 3 * len(services)
    assert all(r.seen == r.counted for r in rows)
    assert "Kernel counters" in lab_cmd.table(report, "examples/")
    # One connection counted at the wrong endpoint, one counted where no client saw it.
    (svc, ep), n = next(iter(report.counted["nft"].items()))
    wrong = {**report.counted["nft"], (svc, ep): n - 1, ("shop/cart:http", "10.244.9.9:80"): 1}
    bad = dataclasses.replace(report, counted={**report.counted, "nft": wrong})
    assert not bad.passed
    assert [(b, r.service, r.endpoint, r.seen, r.counted) for b, r in bad.count_mismatches()] == [
        ("nft", svc, ep, n, n - 1), ("nft", "shop/cart:http", "10.244.9.9:80", 0, 1)]
    text = lab_cmd.table(bad, "examples/")
    assert "SOME TRAFFIC DID NOT BEHAVE" in text and text.count("MISMATCH on nft") == 2
    doc = lab_cmd.document(bad, "examples/")
    assert {"service": "shop/cart:http", "endpoint": "10.244.9.9:80", "seen": 0, "counted": 1} in doc["kernel_counts"]["nft"]


def _numbers(value: object) -> list[float]:
    if isinstance(value, bool) or value is None:
        return []
    if isinstance(value, (int, float)):
        return [float(value)]
    if isinstance(value, str):
        return [float(x) for x in re.findall(r"(?<![\w.:/])\d+(?:\.\d+)?(?:e-?\d+)?(?![\w.:/])", value)]
    if isinstance(value, dict):
        return [n for v in value.values() for n in _numbers(v)]
    if isinstance(value, list):
        return [n for v in value for n in _numbers(v)]
    return []


def _table_numbers(text: str) -> list[float]:
    """Every number of the table that stands alone (not part of an address, port or name)."""
    out = []
    for token in text.split():
        token = token.strip(",;()")
        if re.fullmatch(r"\d+(\.\d+)?(e-?\d+)?", token):
            out.append(float(token))
    return out


def _json_has(numbers: list[float], doc: dict) -> None:
    have = _numbers(doc)
    for n in numbers:
        tol = max(abs(n) * 5e-3, 5e-13)
        assert any(abs(n - h) <= tol for h in have), f"{n} of the table is not in the JSON"


def test_json_holds_every_number_of_the_table() -> None:
    report = _report()
    text = lab_cmd.table(report, "examples/")
    doc = json.loads(json.dumps(lab_cmd.document(report, "examples/")))
    numbers = _table_numbers(text)
    assert len(numbers) > 60
    _json_has(numbers, doc)
    catalog = next(s for s in doc["services"] if s["service"] == "shop/catalog:http")
    assert [e["observed"] for e in catalog["endpoints"]] == [
        {"iptables": 97, "nft": 110}, {"iptables": 101, "nft": 95}, {"iptables": 102, "nft": 95}]
    assert catalog["endpoints"][0]["expected"]["nft"] == {"exact": "1/3", "share": 1 / 3}
    assert 0 < catalog["two_sample"]["p"] < 1
    classes = {c.value for c in lab.Check} - {lab.Check.NO_LOCAL_ENDPOINTS.value}
    assert {c["class"] for c in doc["checks"]} == classes
    assert doc["passed"] is True and doc["node_ips"] == [NODE_IP]


def test_plot_writes_a_png(tmp_path: Path) -> None:
    out = tmp_path / "lab.png"
    lab_cmd.plot(_report(), str(out))
    _assert_png(out)


def _assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    width, height = struct.unpack(">II", data[16:24])
    assert 300 < width < 2000 and 200 < height < 2000
    crc = struct.unpack(">I", data[29:33])[0]
    assert crc == zlib.crc32(data[12:29])
    assert data.endswith(b"IEND\xaeB`\x82")
    import matplotlib.image

    pixels = matplotlib.image.imread(str(path))
    assert pixels.shape[:2] == (height, width)
    assert pixels.std() > 0.05  # bars, not a blank canvas


def _args(**kw: object) -> argparse.Namespace:
    base = dict(backends="iptables,nft", connections=2000, plot=None, json=False,
                manifests=str(EXAMPLES), node_name=None, node_ip=[], cluster_cidr=[],
                masquerade_all=False, nodeport_addresses=[])
    return argparse.Namespace(**{**base, **kw})


def test_refuses_clearly_without_root(monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert lab_cmd.run(_args()) == 1
    assert "needs root" in capsys.readouterr().err
    with pytest.raises(lab.LabError, match="needs root"):
        lab.run(STATE, connections=10)


@pytest.mark.parametrize("flags,message", [
    (["--backends", "ipvs"], "unknown backend 'ipvs'"),
    (["--backends", ","], "at least one backend"),
    (["--connections", "0"], "--connections"),
    (["--plot", "/tmp/lab.svg"], ".png"),
    (["--plot", "/nonexistent-dir/lab.png"], "does not exist"),
])
def test_flag_errors_name_the_flag(flags: list[str], message: str,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    from nfproxy.cli.main import main

    with pytest.raises(SystemExit) as exit_:
        main(["lab", *flags, str(EXAMPLES)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err, err


# --------------------------------------------------------------------------------------------
# The kernel: feature probes, cleanup, real runs


@pytest.mark.kernel
def test_preflight_names_the_missing_feature() -> None:
    lab.preflight(lab.BACKENDS)  # this kernel has everything
    missing = lab.Feature("nft frobnication (nft_frob)", "nft",
                          "add table ip nfp_lab_probe\nadd rule ip nfp_lab_probe nope frob\n")
    with pytest.raises(lab.LabError, match=r"lacks nft frobnication \(nft_frob\), which the nft"):
        lab.preflight(("nft",), (*lab.FEATURES[:2], missing))
    broken = lab.Feature("iptables frob match (xt_frob)", "iptables",
                         "*filter\n:P - [0:0]\n-A P -m frob --frob 1 -j RETURN\nCOMMIT\n")
    with pytest.raises(lab.LabError, match=r"lacks iptables frob match \(xt_frob\)"):
        lab.preflight(("iptables",), (broken,))
    assert _mine(os.getpid()) == []


@pytest.mark.kernel
def test_an_error_mid_run_leaves_no_namespace(monkeypatch: pytest.MonkeyPatch) -> None:
    from nfproxy.kernel.process import KernelError

    calls = []

    def failing(backend: str, state: object, ns: str) -> float:
        calls.append(ns)
        assert ns in pyroute2_netns.listnetns()
        raise KernelError("boom")

    monkeypatch.setattr(lab, "apply", failing)
    with pytest.raises(KernelError, match="boom"):
        lab.run(STATE, connections=10)
    assert calls and _mine(os.getpid()) == []


@pytest.mark.kernel
@pytest.mark.parametrize("sig,delay", [
    (signal.SIGINT, 0.0),  # while the sandbox is being built
    (signal.SIGTERM, 0.0),
    (signal.SIGHUP, 0.0),  # the terminal went away
    (signal.SIGINT, 0.6),  # during the traffic
])
def test_interrupt_removes_every_namespace(sig: signal.Signals, delay: float) -> None:
    # As from a terminal: a shell starting the test suite in the background hands its children
    # SIGINT ignored, and Python then never turns Ctrl-C into KeyboardInterrupt.
    proc = subprocess.Popen(
        [sys.executable, "-m", "nfproxy.cli.main", "lab", "--connections", "10000", str(EXAMPLES)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: [signal.signal(s, signal.SIG_DFL) for s in (signal.SIGINT, signal.SIGHUP)],
    )
    try:
        deadline = time.monotonic() + 30
        while not any(n.startswith("nfsb-") for n in _mine(proc.pid)):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr
            time.sleep(0.01)
        time.sleep(delay)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # 130 from the command; or, seen once in five loaded runs with SIGINT during the traffic,
    # death by the SIGINT itself (-2) after the command had cleaned up and said so: a held copy
    # of the signal delivered again after it returned (not yet explained). Both are a non-zero
    # exit after cleanup, which is what this test is for; the namespaces are checked below.
    assert proc.returncode in (130, -signal.SIGINT), err
    assert "interrupted" in err
    assert _mine(proc.pid) == []


def _exact_three_way(backend: str) -> list[Fraction]:
    """The kernel's shares for three endpoints, from its integer arithmetic (reference §4)."""
    from nfproxy.analysis import quantize

    if backend == "nft":
        return [Fraction(b, quantize.NUMGEN_SCALE) for b in quantize.numgen_buckets(3)]
    return quantize.cascade([quantize.iptables_probability(f"{1 / (3 - i):.10f}")
                             for i in range(2)])


@pytest.mark.kernel
def test_lab_cli_json_plot_and_exact_expectations(tmp_path: Path) -> None:
    png = tmp_path / "lab.png"
    proc = subprocess.Popen(
        [sys.executable, "-m", "nfproxy.cli.main", "lab", "--connections", "300", "--json",
         "--plot", str(png), str(EXAMPLES)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err + out
    assert "\r" not in err  # no progress bar with --json (nor without a terminal)
    assert _mine(proc.pid) == []
    _assert_png(png)
    doc = json.loads(out)
    assert doc["passed"] and doc["backends"] == ["iptables", "nft"]
    by_name = {s["service"]: s for s in doc["services"]}
    for name in ("shop/catalog:http", "shop/storefront:https", "shop/search:grpc"):
        svc = by_name[name]
        assert len(svc["endpoints"]) == 3
        for backend in ("iptables", "nft"):
            shares = [Fraction(e["expected"][backend]["exact"]) for e in svc["endpoints"]]
            assert shares == _exact_three_way(backend), (name, backend)
            assert sum(e["observed"][backend] for e in svc["endpoints"]) == 300
            assert svc["unexpected"][backend] == []
    for check in doc["checks"]:
        assert check["passed"] == {"iptables": True, "nft": True}, check
    # LoadBalancer under eTP=Local from an allowed source: the local pod, client IP preserved.
    lb = next(c for c in doc["checks"] if c["class"] == lab.Check.LB_ALLOWED.value)
    for backend in ("iptables", "nft"):
        assert [(o["outcome"], o["seen_source"]) for o in lb["observed"][backend]] == [
            ("10.244.0.31:8443", lb["source"])]
    blocked = next(c for c in doc["checks"] if c["class"] == lab.Check.LB_BLOCKED.value)
    assert {o["outcome"] for b in ("iptables", "nft") for o in blocked["observed"][b]} == {"timeout"}
    # The kernel counted every connection once, at the endpoint the client saw (affinity too).
    for backend in ("iptables", "nft"):
        rows = doc["kernel_counts"][backend]
        assert rows and all(r["seen"] == r["counted"] for r in rows), rows
        for name in ("shop/catalog:http", "shop/search:grpc"):
            assert sum(r["counted"] for r in rows if r["service"] == name) == 300
        assert sum(r["counted"] for r in rows if r["service"] == "shop/cart:http") == sum(
            c["connections"] for c in doc["checks"] if c["service"] == "shop/cart:http")


@pytest.mark.kernel
def test_three_endpoint_services_fit_their_exact_shares_on_both_backends() -> None:
    """A few runs with fewer connections: the 20-run figure at 2 000 is in docs/benchmarks.md."""
    runs = 3
    fits = []
    for _ in range(runs):
        report = lab.run(STATE, connections=450)
        assert report.passed
        for r in report.distributions:
            if len(r.labels) == 3:
                fits.append(min(t.p for t in r.fits().values()) > lab.ALPHA)
                for m in r.by_backend.values():
                    assert sum(m.seen.values()) == 450 and not m.unexpected
    assert len(fits) == 3 * runs
    assert sum(fits) >= len(fits) - 1, fits
    assert _mine(os.getpid()) == []


@pytest.mark.kernel
def test_dual_stack_cluster_on_both_backends() -> None:
    report = lab.run(_small_state(), connections=300)
    assert report.passed
    v6 = next(r for r in report.distributions if r.probe.family is IPFamily.V6)
    for backend in ("iptables", "nft"):
        m = v6.by_backend[backend]
        assert sum(m.expected_labels.values()) == 1 and len(m.expected_labels) == 3
        assert set(m.seen_labels) == set(m.expected_labels)
        assert {src for _, src in m.seen} == {v6.probe.src}  # pods are not masqueraded
    node_port = next(r for r in report.checks
                     if r.probe.check is lab.Check.NODE_PORT and r.probe.family is IPFamily.V6)
    for m in node_port.by_backend.values():
        assert {src for _, src in m.seen} == {"fd00:1::2"}  # eTP=Cluster: masqueraded
    drop = next(r for r in report.checks if r.probe.check is lab.Check.NO_LOCAL_ENDPOINTS)
    for m in drop.by_backend.values():
        assert dict(m.seen) == {("timeout", None): drop.probe.count}
    # Per-endpoint kernel counters of both families equal the clients' counts exactly.
    for backend in ("iptables", "nft"):
        rows = report.counts(backend)
        assert {r.endpoint.startswith("[") for r in rows} == {True, False}
        assert all(r.seen == r.counted for r in rows), rows
        assert sum(r.counted for r in rows) == sum(
            n for r in report.results for (_, src), n in r.by_backend[backend].seen.items() if src)
    assert _mine(os.getpid()) == []

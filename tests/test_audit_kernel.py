"""`nfproxy audit` against real connections through each backend's rules, in a sandbox.

What the kernel counted must be exactly what the clients saw; an honest split must pass; a rule
slipped in ahead of nfproxy's that sends half of one service's connections to one endpoint must
be caught on that service alone; ClientIP affinity must be explained, not flagged.

Chance: every assertion on a p-value is one the honest kernel fails with probability below
1e-5 (alpha 1e-5 for verdicts on honest ports); the skewed port's p is ~1e-300.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
from collections.abc import Iterator

import pytest

from nfproxy.analysis.audit import EXPLAINED, OK, SKEWED, PortKey, audit
from nfproxy.cli.commands.audit import read
from nfproxy.cli.main import main
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
from nfproxy.kernel.iptables import IptablesRunner
from nfproxy.kernel.nft import NftSession
from nfproxy.kernel.process import run
from nfproxy.verify.sandbox import Sandbox, SandboxSpec, summarize
from nfproxy.verify.validate import apply_iptables, apply_nft

pytestmark = pytest.mark.kernel

NODE = NodeConfig(name="node-a", ips=("192.168.0.2",), cluster_cidrs=("10.244.0.0/16",), zone="zone-a")
HONEST_ALPHA = 1e-5
THREE = [f"10.244.0.{i}" for i in (1, 2, 3)]
FIVE = [f"10.244.0.{i}" for i in (11, 12, 13, 14, 15)]
STICKY_CLIENTS = {"s1": "10.250.0.1", "s2": "10.250.0.2"}


def _service(name: str, ip: str, ips: list[str], **fields: object) -> tuple[ServicePort, tuple[Endpoint, ...]]:
    sp = ServicePort(ServicePortName("audit", name, "http", Protocol.TCP), IPFamily.V4, ServiceType.CLUSTER_IP,
                     ip, 80, **fields)  # type: ignore[arg-type]
    return sp, sort_endpoints([Endpoint(i, 8080, node_name="node-a") for i in ips])


LOCAL, REMOTE = ["10.244.0.21", "10.244.0.22"], ["10.244.1.23", "10.244.1.24"]
WEB = ServicePort(ServicePortName("audit", "web", "http", Protocol.TCP), IPFamily.V4, ServiceType.NODE_PORT,
                  "10.96.0.7", 80, node_port=30080, external_policy_local=True)
SERVICES = [
    _service("three", "10.96.0.3", THREE),
    _service("five", "10.96.0.5", FIVE),
    _service("sticky", "10.96.0.6", THREE, affinity_timeout=600),
    (WEB, sort_endpoints([Endpoint(i, 8080, node_name="node-a") for i in LOCAL]
                         + [Endpoint(i, 8080, node_name="node-b") for i in REMOTE])),
]
STATE = ClusterState(NODE, {sp.key: sp for sp, _ in SERVICES}, {sp.key: e for sp, e in SERVICES})
KEY = {name: PortKey(f"audit/{name}:http", "tcp", "ip") for name in ("three", "five", "sticky", "web")}


@pytest.fixture(params=["iptables", "nft"])
def node(request: pytest.FixtureRequest) -> Iterator[tuple[str, Sandbox]]:
    if os.geteuid() != 0:
        pytest.fail("audit kernel tests need root: they create network namespaces")
    spec = SandboxSpec.of(
        node_ips=["192.168.0.2"],
        clients={"outside": "203.0.113.10", **STICKY_CLIENTS},
        endpoints={ip: [(8080, "tcp")] for ip in THREE + FIVE + LOCAL + REMOTE},
    )
    with Sandbox(spec) as sb:
        (apply_iptables if request.param == "iptables" else apply_nft)(STATE, sb.node_ns)
        yield request.param, sb


def _connect(sb: Sandbox, client: str, ip: str, n: int, port: int = 80) -> dict[str, int]:
    outcomes = sb.connect(client, ip, port, "tcp", count=n, timeout=3.0)
    seen = summarize(outcomes)
    assert sum(seen.values()) == n and all(o.ok for o in outcomes), seen
    return dict(seen)


def _cli_json(backend: str, ns: str, *flags: str) -> tuple[int, dict]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main(["audit", "--backend", backend, "--netns", ns, "--json", *flags])
    return status, json.loads(out.getvalue())


def test_counts_are_what_the_clients_saw_and_an_honest_split_passes(node: tuple[str, Sandbox]) -> None:
    backend, sb = node
    first = read(backend, sb.node_ns, [], "kernel")
    seen = {"three": _connect(sb, "outside", "10.96.0.3", 600), "five": _connect(sb, "outside", "10.96.0.5", 1000)}
    second = read(backend, sb.node_ns, [], "kernel")
    report = audit(first, second, alpha=HONEST_ALPHA)
    by = {p.key: p for p in report.ports}
    for name, n in (("three", 600), ("five", 1000)):
        port = by[KEY[name]]
        assert port.connections == n
        assert {e: c for e, c in port.observed.items() if c} == seen[name]
        assert port.verdict == OK and port.p is not None and port.p > HONEST_ALPHA, port
        assert port.method == "chi-square" and not port.changes
    # The command, one reading: the counters were created empty by the sandbox's rules.
    status, doc = _cli_json(backend, sb.node_ns, "--once", "--alpha", str(HONEST_ALPHA))
    assert status == 0 and doc["since_creation"] is True
    services = {(s["service"], s["family"]): s for s in doc["services"]}
    assert services[("audit/three:http", "ip")]["connections"] == 600
    five = services[("audit/five:http", "ip")]
    assert {e["endpoint"]: e["connections"] for e in five["endpoints"] if e["connections"]} == seen["five"]
    assert {e["endpoint"]: e["expected_share"] for e in five["endpoints"]} == pytest.approx(
        {f"{ip}:8080": 0.2 for ip in FIVE})


def _rogue_rule(backend: str, ns: str, endpoint_ip: str) -> None:
    """Ahead of nfproxy's rules, half of audit/five's new connections to one endpoint."""
    if backend == "iptables":
        runner = IptablesRunner(IPFamily.V4, ns)
        save = runner.save("nat")
        sep = re.search(rf"-A (KUBE-SEP-\w+) .*--to-destination {re.escape(endpoint_ip)}:8080", save)
        assert sep is not None
        run([runner.cmd, "-t", "nat", "-I", "PREROUTING", "1", "-d", "10.96.0.5", "-p", "tcp", "--dport", "80",
             "-m", "statistic", "--mode", "random", "--probability", "0.5", "-j", sep.group(1)], netns=ns)
        return
    # nft: first in nfproxy's nat prerouting chain, a jump to a chain of our own that takes the
    # endpoint's slot of nfproxy's endpoint map, so the connection is counted where nfproxy
    # counts it (a DNAT in a table of its own would bypass nfproxy's rules and counters whole).
    listing = run(["nft", "list", "table", "ip", "nfproxy"], netns=ns)
    dnat = re.search(r"chain service-\S+-audit/five/tcp/http \{[^}]*dnat ip to numgen random mod \d+(?: offset \d+)? map @(\S+)", listing)
    assert dnat is not None
    slot = re.search(rf"(\d+)(?:-\d+)? counter packets \d+ bytes \d+ : {re.escape(endpoint_ip)} \. 8080", listing)
    assert slot is not None
    session = NftSession(ns)
    session._cmd("add chain ip nfproxy rogue")
    session._cmd(f"add rule ip nfproxy rogue meta l4proto tcp dnat ip to numgen random mod 1 offset {slot.group(1)} map @{dnat.group(1)}")
    session._cmd("insert rule ip nfproxy nat-prerouting ip daddr 10.96.0.5 tcp dport 80 numgen random mod 2 == 0 goto rogue")


def test_a_rule_ahead_of_ours_skewing_one_service_is_caught(node: tuple[str, Sandbox]) -> None:
    backend, sb = node
    _rogue_rule(backend, sb.node_ns, FIVE[0])
    first = read(backend, sb.node_ns, [], "kernel")
    seen = {"five": _connect(sb, "outside", "10.96.0.5", 3000), "three": _connect(sb, "outside", "10.96.0.3", 900)}
    second = read(backend, sb.node_ns, [], "kernel")
    report = audit(first, second, alpha=HONEST_ALPHA)
    by = {p.key: p for p in report.ports}
    five, three = by[KEY["five"]], by[KEY["three"]]
    assert five.connections == 3000 and {e: c for e, c in five.observed.items() if c} == seen["five"], (five.observed, seen)
    assert five.verdict == SKEWED and five.p_adjusted is not None and five.p_adjusted < 1e-6
    assert three.verdict == OK
    assert [p.key for p in report.skewed] == [KEY["five"]]
    status, doc = _cli_json(backend, sb.node_ns, "--once", "--service", "audit/five")
    assert status == 1 and [s["verdict"] for s in doc["services"]] == [SKEWED]


def test_client_ip_affinity_is_explained(node: tuple[str, Sandbox]) -> None:
    backend, sb = node
    first = read(backend, sb.node_ns, [], "kernel")
    seen: dict[str, int] = {}
    for client in STICKY_CLIENTS:
        for ep, n in _connect(sb, client, "10.96.0.6", 200).items():
            seen[ep] = seen.get(ep, 0) + n
    second = read(backend, sb.node_ns, [], "kernel")
    (port,) = audit(first, second, alpha=HONEST_ALPHA, only="audit/sticky").ports
    # Two clients, each pinned after its first connection: 400 on one endpoint or 200 + 200.
    assert port.connections == 400 and {e: c for e, c in port.observed.items() if c} == seen
    assert port.p_plain is not None and port.p_plain < 1e-6
    assert port.verdict == EXPLAINED, port
    assert "ClientIP affinity" in port.explanations[0]
    if backend == "iptables":
        assert sum(port.tested.values()) == 2  # each client's first connection, the random choice


def test_local_traffic_policy_is_explained(node: tuple[str, Sandbox]) -> None:
    backend, sb = node
    first = read(backend, sb.node_ns, ["192.168.0.2"], "kernel")
    seen = _connect(sb, "outside", "10.96.0.7", 600)  # cluster IP: all four endpoints
    for ep, n in _connect(sb, "outside", "192.168.0.2", 600, port=30080).items():  # node port: local only
        seen[ep] = seen.get(ep, 0) + n
    second = read(backend, sb.node_ns, ["192.168.0.2"], "kernel")
    (port,) = audit(first, second, alpha=HONEST_ALPHA, only="audit/web").ports
    assert port.connections == 1200 and {e: c for e, c in port.observed.items() if c} == seen
    assert port.p_plain is not None and port.p_plain < 1e-6  # against the cluster split alone
    assert port.verdict == EXPLAINED and port.p is not None and port.p > HONEST_ALPHA, port
    assert "Local traffic policy" in port.explanations[0]


def test_the_window_is_the_time_between_snapshots(node: tuple[str, Sandbox]) -> None:
    backend, sb = node
    _connect(sb, "outside", "10.96.0.3", 50)  # before the window: not in it
    status, doc = _cli_json(backend, sb.node_ns, "--interval", "1s")
    assert status == 0 and doc["since_creation"] is False and doc["interval_seconds"] >= 1.0
    services = {s["service"]: s for s in doc["services"] if s["family"] == "ip"}
    assert services["audit/three:http"]["connections"] == 0
    assert {s["verdict"] for s in services.values()} == {"too few connections"}

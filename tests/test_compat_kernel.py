"""The compat corpus through the real kernel, both backends, and proof the runner can fail."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterator

import pytest
from pyroute2 import netns as pyroute2_netns

from tests.compat_kernel import (
    BACKENDS,
    ScenarioResult,
    run_corpus,
    run_scenario,
    sandbox_spec,
    target,
)
from nfproxy.verify.probe import Expect
from tests.scenarios import COMPAT_DIR, load, load_all

pytestmark = pytest.mark.kernel


@pytest.fixture(autouse=True)
def _root_and_no_leftovers() -> Iterator[None]:
    if os.geteuid() != 0:
        pytest.fail("kernel tests need root: they create network namespaces (run scripts/test)")
    yield
    mine = [n for n in pyroute2_netns.listnetns() if n.startswith(f"nfsb-{os.getpid()}-")]
    assert mine == [], f"namespaces left behind: {mine}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_scenario_behaves_as_kube_proxy_documents(backend: str) -> None:
    scenarios = load_all()
    started = time.monotonic()
    results = run_corpus(scenarios, [backend], workers=4)
    elapsed = time.monotonic() - started
    failures = "\n".join(r.report() for r in results if not r.ok)
    assert not failures, failures
    assert {r.scenario for r in results} == {s.name for s in scenarios}
    sent = [p for r in results for p in r.probes if not p.not_sent]
    unsent = [p for r in results for p in r.probes if p.not_sent]
    # Only the SCTP probes stay with the exact interpreter; everything else went on the wire.
    assert unsent and all(p.probe.proto == "sctp" for p in unsent)
    assert len(sent) + len(unsent) == sum(len(s.probes) for s in scenarios)
    connections = sum(p.measured().sent for p in sent)
    print(f"\n{backend}: {len(scenarios)} scenarios, {len(sent)} probes, {connections} connections,"
          f" {len(unsent)} exact-only, {elapsed:.1f}s")


def _mutated(result: ScenarioResult) -> dict[int, tuple[str, ...]]:
    return {i: p.problems for i, p in enumerate(result.probes)}


def test_the_runner_catches_wrong_expectations() -> None:
    """Each probe below is a plausible mistake; the kernel must contradict every one."""
    base = load(COMPAT_DIR / "nodeport-etp-local.yaml")
    outside_np, pod_np, node_np, _ = base.probes
    local = ("10.180.1.1:8080", "10.180.1.2:8080")
    every = (*local, "10.181.1.3:8080")
    wrong = [
        # eTP=Local ignored: remote endpoints answer outside traffic too? They must not.
        dataclasses.replace(outside_np, expect=Expect(every, "dnat", False)),
        # An endpoint the rules never choose for pods (missing from the set) shows up.
        dataclasses.replace(pod_np, expect=Expect(local, "dnat", False)),
        # Masquerade flipped both ways, including the node (seen through the port).
        dataclasses.replace(outside_np, expect=Expect(local, "dnat", True)),
        dataclasses.replace(node_np, expect=Expect(every, "dnat", False)),
        dataclasses.replace(pod_np, expect=Expect(every, "dnat", True)),
        # Wrong verdicts.
        dataclasses.replace(pod_np, expect=Expect(None, "drop", None)),
        dataclasses.replace(pod_np, expect=Expect(None, "reject", None)),
    ]
    result = run_scenario(dataclasses.replace(base, probes=tuple(wrong)), "nft")
    assert not result.error, result.error
    problems = _mutated(result)
    assert all(problems[i] for i in range(len(wrong))), problems
    assert "outside the expected set" in problems[1][0]
    assert "expected masquerade" in " ".join(problems[2])
    assert "expected no masquerade" in " ".join(problems[3])


def test_the_runner_tells_reject_drop_and_accept_apart() -> None:
    base = load(COMPAT_DIR / "no-endpoints-reject.yaml")
    rejected = base.probes[0]
    untouched = load(COMPAT_DIR / "non-service-traffic-untouched.yaml")
    direct = untouched.probes[0]
    result = run_scenario(
        dataclasses.replace(base, probes=(
            dataclasses.replace(rejected, expect=Expect(None, "drop", None)),
            dataclasses.replace(rejected, expect=Expect(None, "accept", None)),
            rejected,
        )),
        "iptables",
    )
    assert not result.error, result.error
    assert [bool(p.problems) for p in result.probes] == [True, True, False]
    result = run_scenario(
        dataclasses.replace(untouched, probes=(
            dataclasses.replace(direct, expect=Expect(None, "reject", None)),
            dataclasses.replace(direct, expect=Expect(None, "accept", True)),
            direct,
        )),
        "nft",
    )
    assert not result.error, result.error
    assert [bool(p.problems) for p in result.probes] == [True, True, False]


def test_affinity_probes_check_stickiness_not_spread() -> None:
    s = load(COMPAT_DIR / "session-affinity.yaml")
    sp = target(s.state, s.probes[0])
    assert sp is not None and sp.affinity_timeout == 600
    # Without affinity the same expectation would need all three endpoints seen; with it, a
    # client that sees two is a failure.
    result = run_scenario(s, "iptables")
    assert result.ok, result.report()
    assert all(len(p.measured().seen_labels) == 1 for p in result.probes), [
        p.measured().seen_labels for p in result.probes]


def test_the_sandbox_gets_one_client_per_source_and_every_server() -> None:
    s = load(COMPAT_DIR / "non-service-traffic-untouched.yaml")
    spec = sandbox_spec(s)
    assert spec.node_ips == ("192.168.0.2",)
    # 10.180.12.11 is an endpoint: it sends from its own namespace, it needs no client.
    assert {c.addresses for c in spec.clients} == {("10.0.5.5",), ("203.0.113.9",)}
    assert {(e.ip, e.ports) for e in spec.endpoints} == {
        ("10.180.12.11", ((8080, "tcp"),)), ("10.181.12.12", ((8080, "tcp"),)),
    }
    spec = sandbox_spec(load(COMPAT_DIR / "nodeport-addresses.yaml"))
    # The accept probe's destination is the node port on the node IP: a host server there.
    assert ("192.168.0.2", ((30097, "tcp"),)) in {(e.ip, e.ports) for e in spec.endpoints}
    spec = sandbox_spec(load(COMPAT_DIR / "sctp-clusterip.yaml"))
    assert all(p == "tcp" for e in spec.endpoints for _, p in e.ports)

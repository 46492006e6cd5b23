"""Weighted endpoints (docs/weights.md): both renderings split new connections w_i / sum(w)
exactly as written, and within 1e-9 in the kernel's arithmetic; weight 0 drains; the sources
read the annotation; check, compare and trace know the weights."""

from __future__ import annotations

import json
from fractions import Fraction
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nfproxy.analysis.check import check
from nfproxy.analysis.interpret import Packet, interpret
from nfproxy.analysis.weights import intended_weights
from nfproxy.backends.iptables import render as iptables_render
from nfproxy.backends.nft import render as nft_render
from nfproxy.core.categorize import cascade_order, categorize, slot_counts
from nfproxy.core.changes import diff
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
from nfproxy.sources import manifests
from nfproxy.verify.compare import compare, iptables_ruleset, nft_ruleset
from tests.test_kube_source import api, start_source  # noqa: F401 - fixtures of the fake API server

NODE = NodeConfig(name="node-a", ips=("192.168.50.10",), cluster_cidrs=("10.244.0.0/16",))
SPN = ServicePortName("demo", "web", "http", Protocol.TCP)
SVC = ServicePort(SPN, IPFamily.V4, ServiceType.CLUSTER_IP, "10.96.0.10", 80)
PACKET = Packet("10.244.9.9", "10.96.0.10", 80, "tcp", "pod")


def state_of(weights: list[int], svc: ServicePort = SVC) -> ClusterState:
    eps = sort_endpoints([Endpoint(f"10.244.{i // 250}.{i % 250 + 1}", 8080, weight=w) for i, w in enumerate(weights)])
    return ClusterState(NODE, {svc.key: svc}, {svc.key: eps})


def shares(state: ClusterState) -> dict[str, Fraction]:
    eps = state.endpoints[SVC.key]
    total = sum(e.weight for e in eps)
    return {e.address: Fraction(e.weight, total) for e in eps if e.weight}


def split(ruleset, mode: str) -> dict[str, Fraction]:
    out = interpret(ruleset, PACKET, mode=mode)  # type: ignore[arg-type]
    assert all(o.verdict == "dnat" for o in out), out
    return {o.endpoint: p for o, p in out.items()}


weight_lists = st.lists(st.integers(0, 1000), min_size=1, max_size=64).filter(any)


@given(weight_lists)
@settings(deadline=None, max_examples=40, derandomize=True)
def test_both_renderings_split_exactly_by_weight(weights: list[int]) -> None:
    """Ideal: exactly w_i / sum(w) in both; kernel: within 1e-9 of it in both (the bound
    core.categorize.cascade_order argues for iptables; nft's slots are off by < 2^-32)."""
    state = state_of(weights)
    want = shares(state)
    for ruleset in (iptables_ruleset(state, IPFamily.V4), nft_ruleset(state, IPFamily.V4)):
        assert split(ruleset, "ideal") == want
        kernel = split(ruleset, "kernel")
        assert kernel.keys() == want.keys()
        assert max(abs(kernel[k] - want[k]) for k in want) <= Fraction(1, 10**9)


def test_heavy_last_endpoint_stays_within_1e9() -> None:
    """63 light rules in address order in front of a heavy endpoint would sum their threshold
    errors to 1.8e-9; heaviest first keeps it within the bound."""
    state = state_of([1] * 63 + [1000])
    want = shares(state)
    kernel = split(iptables_ruleset(state, IPFamily.V4), "kernel")
    assert max(abs(kernel[k] - want[k]) for k in want) <= Fraction(1, 10**9)


def test_equal_weights_render_byte_for_byte_as_none() -> None:
    plain = state_of([1] * 5)
    same = state_of([7] * 5)
    for render in (iptables_render.render, nft_render.render):
        assert render(plain, IPFamily.V4).text() == render(same, IPFamily.V4).text()


def test_renderings_of_1_2_7() -> None:
    state = state_of([1, 2, 7])
    ipt = iptables_render.render(state, IPFamily.V4).text()
    probs = [line.split("--probability ")[1].split()[0] for line in ipt.splitlines() if "--probability" in line]
    assert probs == ["0.7000000000", "0.6666666667"]  # heaviest first: 7/10, then 2/3 of the rest
    nft = nft_render.render(state, IPFamily.V4).text()
    # One range per endpoint, sized by weight, in a lane of 223 423 200 values: 1/10, 2/10, 7/10.
    assert "numgen random mod 223423200 offset 0 map @endpoints-counted-tcp-ranges-0" in nft
    assert "0-22342319 : 10.244.0.1 . 8080" in nft
    assert "22342320-67026959 : 10.244.0.2 . 8080" in nft and "67026960-223423199 : 10.244.0.3 . 8080" in nft
    eps = state.endpoints[SVC.key]
    assert slot_counts(eps) == (1, 2, 7)
    assert cascade_order([e.weight for e in eps]) == [2, 1, 0]
    assert cascade_order([1, 3, 3, 2]) == [1, 2, 3, 0]  # ties keep address order


def test_gcd_keeps_slots_few() -> None:
    eps = state_of([100, 200, 700]).endpoints[SVC.key]
    assert slot_counts(eps) == (1, 2, 7)


def test_affinity_ports_weighted_too() -> None:
    svc = ServicePort(SPN, IPFamily.V4, ServiceType.CLUSTER_IP, "10.96.0.10", 80, affinity_timeout=60)
    state = state_of([1, 3], svc)
    want = shares(state)
    for ruleset in (iptables_ruleset(state, IPFamily.V4), nft_ruleset(state, IPFamily.V4)):
        assert split(ruleset, "ideal") == want


def test_weight_zero_drains() -> None:
    state = state_of([1, 0, 2])
    eps = state.endpoints[SVC.key]
    routing = categorize(SVC, eps, NODE)
    assert [e.weight for e in routing.cluster] == [1, 2] and routing.has_endpoints
    assert "10.244.0.2:8080" not in split(nft_ruleset(state, IPFamily.V4), "ideal")
    # All drained: no new connection anywhere, as for a service without serving endpoints.
    drained = state_of([0, 0])
    assert not categorize(SVC, drained.endpoints[SVC.key], NODE).has_endpoints
    out = interpret(iptables_ruleset(drained, IPFamily.V4), PACKET)
    assert {o.verdict for o in out} == {"reject"}


def test_weight_change_is_a_partial_sync_of_that_service() -> None:
    other = ServicePort(ServicePortName("demo", "api", "http", Protocol.TCP), IPFamily.V4, ServiceType.CLUSTER_IP, "10.96.0.11", 80)
    before = state_of([1, 1, 1])
    eps = {**before.endpoints, other.key: (Endpoint("10.244.5.1", 80),)}
    before = ClusterState(NODE, {**before.services, other.key: other}, eps)
    changed = dict(eps)
    changed[SVC.key] = tuple(e if i else Endpoint(e.ip, e.port, weight=5) for i, e in enumerate(eps[SVC.key]))
    after = ClusterState(NODE, before.services, changed)
    assert diff(before, after).keys == {SVC.key}
    prev = nft_render.render(before, IPFamily.V4)
    new = nft_render.render_update(prev, after, diff(before, after).of(IPFamily.V4))
    assert split(nft_ruleset(after, IPFamily.V4), "ideal") == split(_applied(new), "ideal")
    full = iptables_render.render(after, IPFamily.V4, only={SVC.key})
    assert set(full.service_chains) == {SVC.key}


def _applied(ruleset: nft_render.NftRuleset):
    from nfproxy.analysis import nft_json
    from nfproxy.kernel.memory.nft import MemoryNft

    kernel = MemoryNft(IPFamily.V4)
    kernel.apply(ruleset.transactions())
    return nft_json.parse(kernel.json())


def test_compare_reports_each_backends_deviation() -> None:
    result = compare(state_of([1, 2, 7, 0, 13]))
    assert result.equivalent
    assert 0 < result.iptables_deviation <= Fraction(1, 10**9)
    assert 0 < result.nft_deviation <= Fraction(1, 10**9)


# ---- check against the model's weights


def test_check_knows_intended_weights() -> None:
    state = state_of([1, 2, 7])
    weights = intended_weights(state)
    for ruleset in (iptables_ruleset(state, IPFamily.V4), nft_ruleset(state, IPFamily.V4)):
        report = check(ruleset, weights=weights)
        assert report.clean, report.problems
        svc = next(s for s in report.services if s.name == "demo/web:http")
        assert dict(svc.intended or ()) == shares(state)
        assert svc.worst_deviation_ppb < 1
    # Stale weights: the kernel holds 1:2:7, the model now says 1:1:1 (or 3:2:7).
    for stale in ([1, 1, 1], [3, 2, 7]):
        for ruleset in (iptables_ruleset(state, IPFamily.V4), nft_ruleset(state, IPFamily.V4)):
            kinds = {p.kind for p in check(ruleset, weights=intended_weights(state_of(stale))).problems}
            assert "weight-mismatch" in kinds


@pytest.mark.parametrize("cluster_cidrs", [(), ("10.244.0.0/16",)])
def test_check_names_weighted_chains_past_1000_endpoints(cluster_cidrs: tuple[str, ...]) -> None:
    """Past 1 000 endpoints the SVC, SVL and SEP rules carry no comments; without a cluster CIDR
    the SVC chain has no masquerade rule either. check still names each selection chain (from
    the KUBE-SERVICES and node-port jumps to it) and holds it to the weights, not to 1/n."""
    node = replace(NODE, cluster_cidrs=cluster_cidrs)
    svc = replace(SVC, type=ServiceType.NODE_PORT, node_port=30080, external_policy_local=True)
    eps = sort_endpoints([Endpoint(f"10.244.{i // 250}.{i % 250 + 1}", 8080, node_name="node-a" if i % 2 else "node-b",
                                   weight=(1, 2, 7)[i % 3]) for i in range(1002)])
    state = ClusterState(node, {svc.key: svc}, {svc.key: eps})
    ruleset = iptables_ruleset(state, IPFamily.V4)
    assert ' -> ' not in str(ruleset)  # no endpoint comments: the large-cluster layout
    report = check(ruleset, weights=intended_weights(state))
    assert report.clean, report.problems
    chains = {s.chain.split("-")[1]: s for s in report.services}
    assert set(chains) == {"SVC", "SVL"}
    for s in chains.values():
        assert s.name == "demo/web:http" and s.intended is not None
    assert len(chains["SVL"].endpoints) == 501  # the node's own, still held to their weights
    stale = ClusterState(node, {svc.key: svc}, {svc.key: tuple(replace(e, weight=1) for e in eps)})
    kinds = {p.kind for p in check(ruleset, weights=intended_weights(stale)).problems}
    assert "weight-mismatch" in kinds


def test_check_without_model_flags_unequal_shares() -> None:
    state = state_of([1, 2, 7])
    report = check(nft_ruleset(state, IPFamily.V4))
    assert any("--manifests" in p.detail for p in report.problems)


# ---- sources


SLICE = """\
apiVersion: v1
kind: Service
metadata: {{name: web, namespace: demo}}
spec:
  clusterIP: 10.96.0.10
  ports: [{{name: http, port: 80, targetPort: 8080}}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-1
  namespace: demo
  labels: {{kubernetes.io/service-name: web}}
  annotations:
    nfproxy.io/endpoint-weights: '{weights}'
addressType: IPv4
ports: [{{name: http, port: 8080, protocol: TCP}}]
endpoints:
- addresses: [10.1.0.1]
- addresses: [10.1.0.2]
- addresses: [10.1.0.3]
"""


def load(tmp_path: Path, weights: str) -> manifests.LoadResult:
    path = tmp_path / "w.yaml"
    path.write_text(SLICE.format(weights=weights))
    return manifests.load(path)


def test_annotation_sets_weights(tmp_path: Path) -> None:
    result = load(tmp_path, '{"10.1.0.1": 1, "10.1.0.2": 2, "10.1.0.3": 0}')
    assert not result.errors
    assert [e.weight for e in next(iter(result.state.endpoints.values()))] == [1, 2, 0]


@pytest.mark.parametrize(
    ("weights", "field", "message"),
    [
        ('{"10.1.0.1": 1001}', "[10.1.0.1]", "1001 is not a valid weight (0-1000)"),
        ('{"10.1.0.1": -1}', "[10.1.0.1]", "-1 is not a valid weight (0-1000)"),
        ('{"10.1.0.1": "2"}', "[10.1.0.1]", "expected an integer, got string 2"),
        ('{"10.1.0.1": 2.5}', "[10.1.0.1]", "expected an integer"),
        ('{"10.1.0.1": true}', "[10.1.0.1]", "expected an integer"),
        ('{"10.1.0.9": 2}', "[10.1.0.9]", "no endpoint of this slice has this address"),
        ('{"fd00::1": 2}', "[fd00::1]", "is not an IPv4 address"),
        ('{"10.1.0.1": 2', "", "not JSON"),
        ("[1, 2]", "", "expected a JSON object"),
        ("[" * 5000, "", "not JSON: nested too deeply"),
        ('{"10.1.0.1": 1' + "0" * 5000 + "}", "", "not JSON: 'Exceeds the limit"),
        ('{"10.1.0.1": 1' + "0" * 300 + "}", "[10.1.0.1]", "an integer of about 301 digits is not a valid weight"),
        ('{"a\\nb": 2}', "['a\\nb']", "'a\\nb' is not a valid IP address"),
        # A repeated key: json would keep the last value without a word; none is used.
        ('{"10.1.0.1": 3, "10.1.0.1": 1}', "[10.1.0.1]", "given 2 times: all ignored, the endpoint keeps weight 1"),
        ('{"10.1.0.1": 3, "10.1.0.2": 1, "10.1.0.1": 3, "10.1.0.1": 1001}', "[10.1.0.1]", "given 3 times: all ignored"),
    ],
)
def test_bad_weights_are_reported_and_ignored(tmp_path: Path, weights: str, field: str, message: str) -> None:
    result = load(tmp_path, weights)
    assert len(result.errors) == 1
    text = str(result.errors[0])
    assert text.startswith(f"{tmp_path / 'w.yaml'}:8: EndpointSlice demo/web-1: metadata.annotations[nfproxy.io/endpoint-weights]{field}: ")
    assert message in text
    assert "\n" not in text and len(text) < 400  # a hostile annotation cannot forge or flood lines
    # The slice itself is kept; the bad entry's endpoint keeps weight 1.
    assert [e.weight for e in next(iter(result.state.endpoints.values()))] == [1, 1, 1]


def test_api_objects_carry_weights_too() -> None:
    """The API source hands the objects it watches to the same parser (load_objects)."""
    objs = [
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web", "namespace": "demo"},
         "spec": {"clusterIP": "10.96.0.10", "ports": [{"name": "http", "port": 80}]}},
        {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
         "metadata": {"name": "web-1", "namespace": "demo", "labels": {"kubernetes.io/service-name": "web"},
                      "annotations": {"nfproxy.io/endpoint-weights": json.dumps({"10.1.0.2": 3, "10.1.0.1": "x"})}},
         "addressType": "IPv4", "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
         "endpoints": [{"addresses": ["10.1.0.1"]}, {"addresses": ["10.1.0.2"]}]},
    ]
    result = manifests.load_objects(objs)
    assert [e.weight for e in next(iter(result.state.endpoints.values()))] == [1, 3]
    assert [e.field for e in result.errors] == ["metadata.annotations[nfproxy.io/endpoint-weights][10.1.0.1]"]


def test_a_key_repeated_is_ignored_and_the_other_entries_still_count(tmp_path: Path) -> None:
    result = load(tmp_path, '{"10.1.0.1": 3, "10.1.0.2": 2, "10.1.0.1": 1}')
    assert [e.field for e in result.errors] == ["metadata.annotations[nfproxy.io/endpoint-weights][10.1.0.1]"]
    assert [e.weight for e in next(iter(result.state.endpoints.values()))] == [1, 2, 1]


def _api_slice(name: str, weights: dict[str, int] | str | None, ips: list[str], family: str = "IPv4") -> dict:
    meta: dict = {"name": name, "namespace": "demo", "labels": {"kubernetes.io/service-name": "web"}}
    if weights is not None:
        text = weights if isinstance(weights, str) else json.dumps(weights)
        meta["annotations"] = {"nfproxy.io/endpoint-weights": text}
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "metadata": meta,
            "addressType": family, "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
            "endpoints": [{"addresses": [ip]} for ip in ips]}


def _api_service(families: list[str] | None = None) -> dict:
    spec: dict = {"clusterIP": "10.96.0.10", "ports": [{"name": "http", "port": 80}]}
    if families:
        spec.update(clusterIP="fd00:96::10", clusterIPs=["fd00:96::10"], ipFamilies=families)
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web", "namespace": "demo"}, "spec": spec}


def test_two_spellings_of_one_ipv6_address_are_a_repeated_key() -> None:
    weights = '{"fd00::1": 3, "fd00:0:0::1": 1, "fd00::2": 2}'
    result = manifests.load_objects([_api_service(["IPv6"]), _api_slice("web-1", weights, ["fd00::1", "fd00::2"], "IPv6")])
    (error,) = result.errors
    assert str(error) == ("EndpointSlice demo/web-1: metadata.annotations[nfproxy.io/endpoint-weights][fd00::1]: "
                          "given 2 times (as fd00::1, fd00:0:0::1): all ignored, the endpoint keeps weight 1")
    assert [e.weight for e in next(iter(result.state.endpoints.values()))] == [1, 2]


TWO_SLICES = """\
apiVersion: v1
kind: Service
metadata: {name: web, namespace: demo}
spec:
  clusterIP: 10.96.0.10
  ports: [{name: http, port: 80, targetPort: 8080}, {name: admin, port: 81, targetPort: 8081}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: %s
  namespace: demo
  labels: {kubernetes.io/service-name: web}
  annotations: {nfproxy.io/endpoint-weights: '{"10.1.0.1": 3, "10.1.0.2": 4}'}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}, {name: admin, port: 8081, protocol: TCP}]
endpoints: [{addresses: [10.1.0.1]}, {addresses: [10.1.0.2]}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: %s
  namespace: demo
  labels: {kubernetes.io/service-name: web}
  annotations: {nfproxy.io/endpoint-weights: '{"10.1.0.1": 5, "10.1.0.2": 4}'}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}, {name: admin, port: 8081, protocol: TCP}]
endpoints: [{addresses: [10.1.0.1]}, {addresses: [10.1.0.3]}, {addresses: [10.1.0.2]}]
"""


@pytest.mark.parametrize(("first", "second"), [("web-a", "web-b"), ("web-b", "web-a")])
def test_one_endpoint_weighed_differently_by_two_slices_keeps_weight_1(tmp_path: Path, first: str, second: str) -> None:
    """Which slice wins a duplicate endpoint depends on slice names: its weight must not."""
    path = tmp_path / "w.yaml"
    path.write_text(TWO_SLICES % (first, second))
    result = manifests.load(path)
    line = {first: 8, second: 19}
    (error,) = result.errors  # once, not once per service port
    assert str(error) == (
        f"{path}:{line['web-b']}: EndpointSlice demo/web-b: metadata.annotations[nfproxy.io/endpoint-weights][10.1.0.1]: "
        f"conflicting weights: {3 if first == 'web-b' else 5} here, {3 if first == 'web-a' else 5} in EndpointSlice "
        f"demo/web-a ({path}:{line['web-a']}); the endpoint keeps weight 1")
    for eps in result.state.endpoints.values():
        # The agreed weight of 10.1.0.2 stands; 10.1.0.3 is named by no annotation of its slice.
        assert [(e.ip, e.weight) for e in eps] == [("10.1.0.1", 1), ("10.1.0.2", 4), ("10.1.0.3", 1)]


def test_api_slices_that_disagree_on_a_weight_are_reported_the_same_way() -> None:
    objs = [_api_service(), _api_slice("web-1", {"10.1.0.1": 3}, ["10.1.0.1", "10.1.0.2"]),
            _api_slice("web-2", None, ["10.1.0.1"])]  # no annotation: weight 1, not 3
    result = manifests.load_objects(objs)
    assert [str(e) for e in result.errors] == [
        "EndpointSlice demo/web-2: metadata.annotations[nfproxy.io/endpoint-weights][10.1.0.1]: "
        "conflicting weights: 1 here, 3 in EndpointSlice demo/web-1; the endpoint keeps weight 1"]
    assert [e.weight for e in next(iter(result.state.endpoints.values()))] == [1, 1]
    same = manifests.load_objects([_api_service(), _api_slice("web-1", {"10.1.0.1": 3}, ["10.1.0.1"]),
                                   _api_slice("web-2", {"10.1.0.1": 3}, ["10.1.0.1"])])
    assert same.errors == () and [e.weight for e in next(iter(same.state.endpoints.values()))] == [3]


# ---- the commands


EXAMPLE = Path(__file__).resolve().parent.parent / "examples-weighted" / "weighted.yaml"


def test_cli_check_and_trace_with_the_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from nfproxy.cli.main import main

    for backend in ("iptables", "nft"):
        assert main(["render", "--backend", backend, str(EXAMPLE)]) == 0
        dump = tmp_path / f"{backend}.txt"
        dump.write_text(capsys.readouterr().out)
        assert main(["check", "--from-file", str(dump), "--manifests", str(EXAMPLE)]) == 0
        out = capsys.readouterr().out
        assert "worst deviation from the weights" in out and "(weight share 7/10)" in out
        assert main(["check", "--from-file", str(dump)]) == 1  # held to 1/3 without the model
        capsys.readouterr()
        assert main(["trace", "--from-file", str(dump), "--manifests", str(EXAMPLE), "10.244.0.9", "10.96.10.70:80/tcp"]) == 0
        out = capsys.readouterr().out
        assert "DNAT 10.244.1.73:8080" in out and "written 7/10, weight 7)" in out
        assert "10.244.1.74" not in out  # drained
    assert main(["compare", str(EXAMPLE)]) == 0
    assert "kernel arithmetic against the rules as written: iptables" in capsys.readouterr().out


def test_proxier_weight_changes_are_partial_and_end_as_a_full_sync() -> None:
    """On the in-memory nft kernel: weights set, changed and removed again, each a partial
    sync touching that one service, each ending where a fresh full sync ends."""
    from tests.test_proxier_memory import fresh, memory_proxier, resolved

    from nfproxy.testing import uniform_cluster

    state = uniform_cluster(20, 4)
    key = sorted(state.services)[3]
    proxier, kernels = memory_proxier()
    proxier.sync(state)
    for weights in ([1, 2, 3, 4], [0, 2, 3, 4], [5, 5, 5, 10], [1, 1, 1, 1]):
        eps = tuple(replace(e, weight=w) for e, w in zip(state.endpoints[key], weights))
        state = ClusterState(state.node, state.services, {**state.endpoints, key: eps})
        result = proxier.sync(state)
        assert result.kind == "partial", result
        assert {f: resolved(k) for f, k in kernels.items()} == fresh(state)
        # And the kernel's arithmetic on the partially synced rules is still within 1e-9.
        from nfproxy.analysis import nft_json

        svc = state.services[key]
        got = interpret(nft_json.parse(kernels[IPFamily.V4].json()), Packet("10.99.0.1", svc.cluster_ip, 80, "tcp", "outside"))
        total = sum(weights)
        want = {e.address: Fraction(e.weight, total) for e in eps if e.weight}
        assert {o.endpoint for o in got} == set(want)
        assert max(abs(p - want[o.endpoint]) for o, p in got.items()) <= Fraction(1, 10**9)


def test_api_source_reads_logs_and_follows_weights(caplog: pytest.LogCaptureFixture, api, start_source) -> None:  # noqa: ANN001, F811
    """Through the fake API server: the watched slice's weights reach the state, a change of
    them is seen, and a bad entry is logged (once per change) and ignored."""
    import logging

    from tests.apiserver import endpoint_slice, service
    from tests.test_kube_source import eventually, spn

    def weighted_slice(weights: dict[str, object]) -> dict:
        obj = endpoint_slice("web-1", "web", ["10.244.0.5", "10.244.0.6"], node_name="node-a")
        obj["metadata"]["annotations"] = {"nfproxy.io/endpoint-weights": json.dumps(weights)}
        return obj

    def weights_of(source) -> list[int]:  # noqa: ANN001
        return [e.weight for e in source.snapshot().state.endpoints.get(spn("default", "web"), ())]

    api.apply(service("web", "10.96.0.10"))
    api.apply(weighted_slice({"10.244.0.5": 3, "10.244.0.6": 1}))
    with caplog.at_level(logging.WARNING, logger="nfproxy.sources.kube"):
        source, _ = start_source()
        assert weights_of(source) == [3, 1]
        api.apply(weighted_slice({"10.244.0.5": 0, "10.244.0.6": 1001}))
        assert eventually(lambda: weights_of(source) == [0, 1])
    logged = [r.getMessage() for r in caplog.records if "endpoint-weights" in r.getMessage()]
    assert logged == [
        "skipped: EndpointSlice default/web-1: metadata.annotations[nfproxy.io/endpoint-weights][10.244.0.6]: 1001 is not a valid weight (0-1000)"
    ], logged


def test_api_source_reports_slices_that_disagree_on_a_weight(caplog: pytest.LogCaptureFixture, api, start_source) -> None:  # noqa: ANN001, F811
    """Through the fake API server: a service's slices are parsed together, so two of them
    weighing one endpoint differently are caught there too, whichever arrives first."""
    import logging

    from tests.apiserver import endpoint_slice, service
    from tests.test_kube_source import eventually, spn

    def weighted(name: str, weights: dict[str, int]) -> dict:
        obj = endpoint_slice(name, "web", list(weights), node_name="node-a")
        obj["metadata"]["annotations"] = {"nfproxy.io/endpoint-weights": json.dumps(weights)}
        return obj

    def weights_of(source) -> list[int]:  # noqa: ANN001
        return [e.weight for e in source.snapshot().state.endpoints.get(spn("default", "web"), ())]

    api.apply(service("web", "10.96.0.10"))
    api.apply(weighted("web-2", {"10.244.0.5": 3, "10.244.0.6": 2}))
    with caplog.at_level(logging.WARNING, logger="nfproxy.sources.kube"):
        source, _ = start_source()
        assert weights_of(source) == [3, 2]
        api.apply(weighted("web-1", {"10.244.0.5": 7}))
        assert eventually(lambda: weights_of(source) == [1, 2])
    logged = [r.getMessage() for r in caplog.records if "endpoint-weights" in r.getMessage()]
    assert logged == [
        "skipped: EndpointSlice default/web-2: metadata.annotations[nfproxy.io/endpoint-weights][10.244.0.5]: "
        "conflicting weights: 3 here, 7 in EndpointSlice default/web-1; the endpoint keeps weight 1"
    ], logged

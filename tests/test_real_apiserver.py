"""nfproxy against the real kube-apiserver and etcd (`scripts/kube`, built from k8s.io/kubernetes).

What the home-made server of tests/apiserver.py cannot show: the real authorizer judging
deploy/rbac.yaml, the real admission and defaulting of deploy/, objects only the real server
makes (its default ServiceCIDR, names it accepts, dual-stack allocation), and its real faults (a
restart, etcd compaction). Each test works in a Kubernetes namespace of its own, with cluster
IPs and node ports of its own (none of examples/', which tests/test_kube_proxy_compare.py
applies to the same server), on the one control plane of the session.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from nfproxy.core.model import IPFamily, NodeConfig, Protocol, ServicePortName
from nfproxy.sources.kube import KubeSource, WatchSettings, api_client
from tests import apiserver as fake
from tests.realkube import ROOT, wait_for

pytestmark = pytest.mark.apiserver

NODE = "node-a"
DEPLOY = ROOT / "deploy"
SETTLE = 60.0  # a bound on a change reaching the source or the kernel, not a measurement
NFPROXY = [sys.executable, "-m", "nfproxy"]


def spn(namespace: str, name: str, port: str = "http", family: IPFamily = IPFamily.V4) -> Any:
    return (ServicePortName(namespace, name, port, Protocol.TCP), family)


def namespace(plane: Any, name: str) -> str:
    plane.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    return name


def service(name: str, ns: str, cluster_ip: str | None, **spec: Any) -> dict[str, Any]:
    obj = fake.service(name, cluster_ip or "", namespace=ns, **spec)
    if cluster_ip is None:
        del obj["spec"]["clusterIP"], obj["spec"]["clusterIPs"]
    return obj


def endpoints(addresses: list[str], **fields: Any) -> list[dict[str, Any]]:
    return [{"addresses": [a], "conditions": {"ready": True}, **fields} for a in addresses]


def endpoint_slice(name: str, svc: str, ns: str, eps: list[dict[str, Any]],
                   address_type: str = "IPv4", port: int = 8080) -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": ns, "labels": {"kubernetes.io/service-name": svc}},
        "addressType": address_type,
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
        "endpoints": eps,
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


FAST = WatchSettings(backoff_initial=0.1, backoff_max=1.0)


@contextlib.contextmanager
def source_on(plane: Any, kubeconfig: str | None = None,
              settings: WatchSettings = FAST) -> Iterator[KubeSource]:
    """nfproxy's API source (the daemon's own), started against the real server."""
    src = KubeSource(api_client(kubeconfig=kubeconfig or plane.kubeconfig), NodeConfig(name=NODE), settings)
    src.start(lambda: None)
    try:
        assert src.wait_ready(SETTLE), "the API source never listed everything"
        yield src
    finally:
        src.stop()


# --------------------------------------------------------------------------------------------
# deploy/ and RBAC, judged by the real server


@pytest.mark.parametrize("manifest", sorted(p.name for p in DEPLOY.glob("*.yaml")))
def test_deploy_manifest_is_accepted_by_the_real_server(control_plane, manifest):
    """Admission, defaulting and validation of the real server, without persisting anything."""
    done = control_plane.kubectl("apply", "--server-side", "--dry-run=server",
                                 "-f", str(DEPLOY / manifest), check=False)
    assert done.returncode == 0, done.stderr
    assert "serverside-applied (server dry run)" in done.stdout, done.stdout


def _can_i(plane: Any, account: str) -> dict[str, frozenset[str]]:
    """`kubectl auth can-i --list` as a service account: resource -> verbs."""
    out = plane.kubectl("auth", "can-i", "--list", f"--as=system:serviceaccount:kube-system:{account}").stdout
    rows: dict[str, frozenset[str]] = {}
    for line in out.splitlines()[1:]:
        cells = [c for c in line.split("  ") if c.strip()]
        resource, verbs = cells[0].strip(), cells[-1].strip()
        if resource and not resource.startswith("/") and verbs.startswith("["):
            rows[resource] = rows.get(resource, frozenset()) | frozenset(verbs.strip("[]").split())
    return rows


def _what_the_source_lists() -> set[str]:
    """The resources nfproxy's API source lists and watches, read from its code."""
    src = KubeSource(api_client(master="https://127.0.0.1:1"), NodeConfig(name=NODE))
    try:
        return {r.kind.resource for r in src.reflectors}
    finally:
        src.stop()


@pytest.fixture
def rbac(control_plane) -> Iterator[Any]:
    control_plane.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(DEPLOY / "rbac.yaml"))
    yield control_plane
    control_plane.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(DEPLOY / "rbac.yaml"))


def test_rbac_grants_exactly_list_and_watch_on_what_the_source_reads(rbac):
    """The real authorizer's answer for kube-system/nfproxy, less what any account may do."""
    granted, baseline = _can_i(rbac, "nfproxy"), _can_i(rbac, "nobody-nfproxy-test")
    extra = {r: v - baseline.get(r, frozenset()) for r, v in granted.items()}
    extra = {r: v for r, v in extra.items() if v}
    wanted = {_qualified(r) for r in _what_the_source_lists()}
    assert extra == {r: frozenset({"list", "watch"}) for r in wanted}


def _qualified(resource: str) -> str:
    """`endpointslices` -> `endpointslices.discovery.k8s.io`, as can-i prints resources."""
    groups = {"endpointslices": "discovery.k8s.io", "servicecidrs": "networking.k8s.io"}
    plural = resource.split(".")[0]
    return f"{plural}.{groups[plural]}" if plural in groups else plural


def test_rbac_asks_for_nothing_kube_proxy_is_not_granted(rbac):
    """Every permission of deploy/rbac.yaml is also in the bootstrap role the real server gives
    kube-proxy (system:node-proxier): nfproxy needs no more than the proxy it replaces."""
    proxier = rbac.get("ClusterRole", "", "system:node-proxier")["rules"]
    ours = next(d for d in yaml.safe_load_all((DEPLOY / "rbac.yaml").read_text())
                if d and d["kind"] == "ClusterRole")["rules"]
    for rule in ours:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    assert any(group in r.get("apiGroups", []) and resource in r.get("resources", [])
                               and verb in r.get("verbs", []) for r in proxier), (group, resource, verb)


# --------------------------------------------------------------------------------------------
# The daemon, as a process, with the service account's token


class Daemon:
    """`nfproxy` run as a node would run it, its log collected line by line."""

    def __init__(self, args: list[str]) -> None:
        self.lines: list[str] = []
        self.proc = subprocess.Popen([*NFPROXY, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, cwd=ROOT, start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def log(self) -> str:
        return "\n".join(self.lines)

    def wait_log(self, needle: str, timeout: float = SETTLE) -> str:
        return wait_for(lambda: next((ln for ln in list(self.lines) if needle in ln), None),
                        timeout, f"a log line with {needle!r}; log:\n{self.log()[-3000:]}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._reader.join(5)
        return self.proc.returncode


@contextlib.contextmanager
def daemon(args: list[str]) -> Iterator[Daemon]:
    d = Daemon(args)
    try:
        yield d
    finally:
        d.stop()


def checked_services(netns: str, backend: str) -> dict[str, list[str]]:
    """`nfproxy check` on the namespace: service port -> its endpoints, as read from the kernel."""
    done = subprocess.run([*NFPROXY, "check", "--backend", backend, "--netns", netns, "--json"],
                          capture_output=True, text=True, cwd=ROOT)
    if done.returncode == 2 and "no tables" in done.stderr:
        return {}  # nothing synced yet
    assert done.returncode in (0, 1), done.stderr
    return {s["name"]: sorted(e["endpoint"] for e in s["endpoints"])
            for s in json.loads(done.stdout)["services"]}


def _rbac_cluster(plane: Any) -> str:
    ns = namespace(plane, "rbac")
    plane.apply(
        service("web", ns, "10.96.1.10"),
        endpoint_slice("web-a", "web", ns, endpoints(["10.244.1.5", "10.244.1.6"])),
        service("1web", ns, "10.96.1.11"),
        endpoint_slice("1web-a", "1web", ns, endpoints(["10.244.1.7"])),
    )
    return ns


@pytest.mark.kernel
def test_daemon_with_the_service_account_token_syncs_and_keeps_rules_when_refused(rbac, netns, tmp_path):
    """The token the real server mints for kube-system/nfproxy is enough for every service; with
    one permission taken away, nfproxy names the resource and verb refused, and the node keeps
    its rules."""
    ns = _rbac_cluster(rbac)
    config = rbac.token_kubeconfig(rbac.token("nfproxy"), str(tmp_path / "token.kubeconfig"))
    base = ["--proxy-mode", "nftables", "--kubeconfig", config, "--netns", netns,
            "--hostname-override", NODE, "--healthz-bind-address", "", "--metrics-bind-address", ""]
    done = subprocess.run([*NFPROXY, *base, "--once"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    synced = checked_services(netns, "nft")
    assert synced[f"{ns}/web:http"] == ["10.244.1.5:8080", "10.244.1.6:8080"]
    assert synced[f"{ns}/1web:http"] == ["10.244.1.7:8080"]

    role = next(d for d in yaml.safe_load_all((DEPLOY / "rbac.yaml").read_text()) if d and d["kind"] == "ClusterRole")
    role["rules"] = [r for r in role["rules"] if "endpointslices" not in r["resources"]]
    rbac.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", stdin=json.dumps(role))
    with daemon(base) as d:
        line = d.wait_log("endpointslices")
        assert "403" in line or "forbidden" in line.lower(), d.log()
        assert "list" in line, line
        time.sleep(2)
        assert d.proc.poll() is None, d.log()
        assert checked_services(netns, "nft") == synced, "refused, the node lost rules"


# --------------------------------------------------------------------------------------------
# Objects only the real server makes, through nfproxy's API source


def test_the_default_service_cidr_the_server_creates_gives_the_service_ranges(control_plane):
    with source_on(control_plane) as src:
        node = wait_for(lambda: (n := src.snapshot().state.node).service_cidrs and n, SETTLE,
                        "the default ServiceCIDR")
    assert set(node.service_cidrs) == {"10.96.0.0/16", "fd00:10:96::/112"}


def test_a_service_named_with_a_leading_digit_is_proxied(control_plane):
    """KEP-5311: the real 1.37 server accepts `1web`; nfproxy must not skip it."""
    ns = namespace(control_plane, "digits")
    control_plane.apply(service("1web", ns, "10.96.2.10"),
                        endpoint_slice("1web-x", "1web", ns, endpoints(["10.244.2.5"])))
    with source_on(control_plane) as src:
        wait_for(lambda: src.snapshot().state.endpoints.get(spn(ns, "1web")), SETTLE, "1web's endpoints")
        assert not [e for e in src.snapshot().errors if e.name == "1web"]


def test_dual_stack_service_gets_both_families_from_the_server(control_plane):
    ns = namespace(control_plane, "dual")
    stored = control_plane.apply(service("web", ns, None, ipFamilyPolicy="RequireDualStack"))[0]
    ips = stored["spec"]["clusterIPs"]
    assert len(ips) == 2, ips  # allocated by the real server, one per family
    control_plane.apply(endpoint_slice("web-4", "web", ns, endpoints(["10.244.3.5"])),
                        endpoint_slice("web-6", "web", ns, endpoints(["fd00:10:244::5"]), "IPv6"))
    with source_on(control_plane) as src:
        state = wait_for(lambda: (s := src.snapshot().state).endpoints.get(spn(ns, "web", family=IPFamily.V6)) and s,
                         SETTLE, "the IPv6 endpoints")
    assert {state.services[spn(ns, "web", family=f)].cluster_ip for f in IPFamily} == set(ips)
    assert [e.address for e in state.endpoints[spn(ns, "web")]] == ["10.244.3.5:8080"]


def test_a_thousand_endpoints_across_many_slices(control_plane):
    ns = namespace(control_plane, "big")
    addresses = [f"10.245.{i // 250}.{i % 250 + 1}" for i in range(1000)]
    slices = [endpoint_slice(f"web-{k:02d}", "web", ns, endpoints(addresses[k * 100:(k + 1) * 100]))
              for k in range(10)]
    control_plane.apply(service("web", ns, "10.96.4.10"), *slices)
    with source_on(control_plane) as src:
        got = wait_for(lambda: len(src.snapshot().state.endpoints.get(spn(ns, "web"), ())) == 1000
                       and src.snapshot().state.endpoints[spn(ns, "web")], SETTLE, "1 000 endpoints")
    assert {e.ip for e in got} == set(addresses)


def test_node_hints_the_server_keeps_reach_the_model(control_plane):
    """hints.forNodes (KEP-3015, PreferSameNode): stored by the real server, read by nfproxy."""
    ns = namespace(control_plane, "hints")
    eps = [{"addresses": ["10.244.5.5"], "conditions": {"ready": True}, "nodeName": NODE,
            "hints": {"forZones": [{"name": "zone-a"}], "forNodes": [{"name": NODE}]}}]
    stored = control_plane.apply(service("web", ns, "10.96.5.10", trafficDistribution="PreferSameNode"),
                                 endpoint_slice("web-a", "web", ns, eps))
    assert stored[1]["endpoints"][0]["hints"]["forNodes"] == [{"name": NODE}]
    with source_on(control_plane) as src:
        (ep,) = wait_for(lambda: src.snapshot().state.endpoints.get(spn(ns, "web")), SETTLE, "the endpoint")
    assert ep.node_hints == frozenset({NODE}) and ep.zone_hints == frozenset({"zone-a"})


GHOST = {"ready": False, "serving": False, "terminating": True}


def test_a_pod_ip_reused_while_the_old_pod_terminates_keeps_the_service_up(control_plane):
    """kubernetes#135266: the real server stores both endpoints (it does not deduplicate); the
    live pod must win wherever the ghost sits, or the service REJECTs."""
    ns = namespace(control_plane, "reuse")
    ghost = {"addresses": ["10.244.6.5"], "conditions": GHOST, "nodeName": "node-b",
             "targetRef": {"kind": "Pod", "name": "web-old", "namespace": ns}}
    live = {"addresses": ["10.244.6.5"], "conditions": {"ready": True}, "nodeName": "node-c",
            "targetRef": {"kind": "Pod", "name": "web-new", "namespace": ns}}
    stored = control_plane.apply(service("web", ns, "10.96.6.10"),
                                 endpoint_slice("web-a", "web", ns, [ghost]),
                                 endpoint_slice("web-b", "web", ns, [live]),
                                 service("one", ns, "10.96.6.11"),
                                 endpoint_slice("one-a", "one", ns, [ghost, live]))
    assert len(stored[4]["endpoints"]) == 2
    with source_on(control_plane) as src:
        for name in ("web", "one"):
            (ep,) = wait_for(lambda: src.snapshot().state.endpoints.get(spn(ns, name)), SETTLE, name)
            assert (ep.node_name, ep.ready, ep.terminating) == ("node-c", True, False), name


# --------------------------------------------------------------------------------------------
# The fake held to the real one


SCENARIO_NS = "fake-vs-real"


def _scenario() -> list[dict[str, Any]]:
    ns = SCENARIO_NS
    return [
        service("web", ns, "10.96.7.10", sessionAffinity="ClientIP"),
        endpoint_slice("web-a", "web", ns, endpoints(["10.244.7.5", "10.244.7.6"], nodeName=NODE)),
        _node_port(service("lb", ns, "10.96.7.11", type="LoadBalancer", externalTrafficPolicy="Local"), 30981),
        endpoint_slice("web-b", "web", ns, [{"addresses": ["10.244.7.7"],
                                             "conditions": {"ready": False, "serving": True, "terminating": True}}]),
        endpoint_slice("lb-a", "lb", ns, endpoints(["10.244.7.8"], nodeName=NODE)),
        service("empty", ns, "10.96.7.12"),
    ]


def _node_port(obj: dict[str, Any], node_port: int) -> dict[str, Any]:
    obj["spec"]["ports"][0]["nodePort"] = node_port
    return obj


def _model(src: KubeSource) -> tuple[dict[Any, Any], dict[Any, Any]]:
    state = src.snapshot().state
    services = {k: v for k, v in state.services.items() if k[0].namespace == SCENARIO_NS}
    eps = {k: v for k, v in state.endpoints.items() if k[0].namespace == SCENARIO_NS}
    return services, eps


def test_the_fake_api_server_gives_the_model_the_real_one_gives(control_plane):
    """The objects as kube-apiserver stored them (defaulted, node ports allocated), served by
    tests/apiserver.py and by kube-apiserver: nfproxy's source must make the same model of both,
    or the fake's list/watch is not the real one's."""
    namespace(control_plane, SCENARIO_NS)
    stored = control_plane.apply(*_scenario())
    assert stored[2]["spec"]["healthCheckNodePort"], "the real server allocates it"
    with source_on(control_plane) as src:
        real = wait_for(lambda: len((m := _model(src))[1]) == 2 and m, SETTLE, "the scenario")
    with fake.FakeApiServer() as server:
        for obj in copy.deepcopy(stored):
            server.apply(obj)
        src = KubeSource(api_client(master=server.url), NodeConfig(name=NODE), FAST)
        src.start(lambda: None)
        try:
            assert src.wait_ready(SETTLE)
            faked = _model(src)
        finally:
            src.stop()
    assert faked[0] == real[0]
    assert faked[1] == real[1]


# --------------------------------------------------------------------------------------------
# The real server's faults


def test_restart_and_compaction_relist_and_converge(control_plane):
    """kube-apiserver restarted mid-watch while etcd moved on and compacted its history: the
    resumed watch is too old (410 Gone), the source relists, and a change made after the return
    arrives. Nothing is lost in between."""
    ns = namespace(control_plane, "restart")
    control_plane.apply(service("web", ns, "10.96.8.10"),
                        endpoint_slice("web-a", "web", ns, endpoints(["10.244.8.5"])))
    with source_on(control_plane) as src:
        wait_for(lambda: src.snapshot().state.endpoints.get(spn(ns, "web")), SETTLE, "the seed")
        lists = {k: v["lists"] for k, v in src.stats().items()}
        control_plane.stop_apiserver()
        assert src.snapshot().state.endpoints.get(spn(ns, "web")), "the outage emptied the state"
        control_plane.bump_and_compact_etcd()
        control_plane.start_apiserver()
        control_plane.apply(endpoint_slice("web-a", "web", ns, endpoints(["10.244.8.6"])))
        wait_for(lambda: [e.ip for e in src.snapshot().state.endpoints.get(spn(ns, "web"), ())] == ["10.244.8.6"],
                 SETTLE, "the change after the restart")
        relisted = {k for k, v in src.stats().items() if v["lists"] > lists[k]}
    assert "endpointslices" in relisted, f"no relist after 410: {src.stats()}"


# --------------------------------------------------------------------------------------------
# Through the sync loop into a sandbox node's kernel, real connections


SANDBOX_EPS = ("10.244.0.5", "10.244.0.6", "10.244.0.7")
# A cluster IP per test: the real server allocates each once, and a test that failed half-way
# leaves its Service behind for the rest of the session.
SANDBOX_IPS = {"follow-nft": "10.96.9.10", "follow-iptables": "10.96.9.11", "outage": "10.96.9.12"}


@pytest.fixture
def sandbox() -> Iterator[Any]:
    from nfproxy.verify.sandbox import Sandbox, SandboxSpec

    spec = SandboxSpec.of(
        node_ips=["192.168.0.2"], service_cidrs=["10.96.0.0/16"],
        clients={"client": "203.0.113.10"},
        endpoints={ip: [(8080, "tcp")] for ip in SANDBOX_EPS},
    )
    sb = Sandbox(spec)
    sb.start()
    try:
        yield sb
    finally:
        sb.close()


def reach(sb: Any, ip: str, count: int = 12, port: int = 80) -> dict[str, int]:
    from nfproxy.verify.sandbox import summarize

    # 2 s a connection: a connect through the sandbox never takes that long, even beside a CPU hog,
    # while a dropped one still ends as "timeout".
    return dict(summarize(sb.connect("client", ip, port, "tcp", count, timeout=2.0)))


def _node(plane: Any) -> None:
    plane.apply(fake.node(NODE, zone="zone-a"))
    plane.apply_status({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE},
                        "status": {"addresses": [{"type": "InternalIP", "address": "192.168.0.2"}]}})


@pytest.mark.kernel
@pytest.mark.parametrize("backend", ["nft", "iptables"])
def test_the_daemon_follows_kubectl_into_the_kernel(control_plane, sandbox, backend):
    """Services and EndpointSlices created, changed, scaled to zero and deleted with kubectl reach
    the node's rules (read back by `nfproxy check`) and real connections."""
    from nfproxy.daemon.proxier import Proxier, SyncLoop

    ns = namespace(control_plane, f"follow-{backend}")
    ip = SANDBOX_IPS[ns]
    _node(control_plane)
    control_plane.apply(service("web", ns, ip),
                        endpoint_slice("web-a", "web", ns, endpoints([SANDBOX_EPS[0]], nodeName=NODE)))
    source = KubeSource(api_client(kubeconfig=control_plane.kubeconfig), NodeConfig(name=NODE), FAST)
    loop = SyncLoop(source, Proxier(backend, netns=sandbox.node_ns), min_sync_period=1.0, sync_period=3600.0)
    loop.start()
    key, ep = f"{ns}/web:http", [f"{a}:8080" for a in SANDBOX_EPS]
    try:
        assert loop.wait_synced(SETTLE)

        def kernel_has(want: list[str] | None) -> None:
            wait_for(lambda: checked_services(sandbox.node_ns, backend).get(key) == want, SETTLE,
                     f"{key} -> {want} in the kernel")

        kernel_has([ep[0]])
        assert reach(sandbox, ip) == {ep[0]: 12}
        control_plane.apply(endpoint_slice("web-b", "web", ns, endpoints(SANDBOX_EPS[1:])))
        kernel_has(ep)
        assert set(reach(sandbox, ip, 30)) == set(ep)
        control_plane.apply(endpoint_slice("web-a", "web", ns, []),
                            endpoint_slice("web-b", "web", ns, []))  # scaled to zero
        kernel_has(None)  # `check` lists no endpoint: the service REJECTs, as the traffic shows
        assert set(reach(sandbox, ip, 4)) == {"refused"}
        control_plane.apply(endpoint_slice("web-a", "web", ns, endpoints([SANDBOX_EPS[2]])))
        kernel_has([ep[2]])
        assert reach(sandbox, ip) == {ep[2]: 12}
        control_plane.delete("Service", ns, "web")
        wait_for(lambda: set(reach(sandbox, ip, 2)) == {"timeout"}, SETTLE, "no rule left for the service")
    finally:
        loop.stop()


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:  # noqa: S310 - loopback
            return answer.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


@pytest.mark.kernel
def test_the_server_down_for_a_minute_loses_no_service(control_plane, sandbox):
    """kube-apiserver away for 60 s: connections keep flowing, the rules stay as they were,
    /healthz and /livez keep answering 200 as kube-proxy's do (nothing is pending), and a change
    made after the return reaches the kernel."""
    ns = namespace(control_plane, "outage")
    ip = SANDBOX_IPS[ns]
    _node(control_plane)
    control_plane.apply(service("web", ns, ip),
                        endpoint_slice("web-a", "web", ns, endpoints([SANDBOX_EPS[0]])))
    port = free_port()
    args = ["--proxy-mode", "nftables", "--kubeconfig", control_plane.kubeconfig, "--netns", sandbox.node_ns,
            "--hostname-override", NODE, "--healthz-bind-address", f"127.0.0.1:{port}",
            "--metrics-bind-address", "", "--min-sync-period", "1s"]
    key, ep = f"{ns}/web:http", [f"{a}:8080" for a in SANDBOX_EPS]
    with daemon(args) as d:
        wait_for(lambda: checked_services(sandbox.node_ns, "nft").get(key) == [ep[0]], SETTLE, "first sync")
        before = checked_services(sandbox.node_ns, "nft")
        control_plane.stop_apiserver()
        try:
            down = time.monotonic()
            while time.monotonic() - down < 60:
                assert reach(sandbox, ip, 3) == {ep[0]: 3}, "traffic broke during the outage"
                assert _get(f"http://127.0.0.1:{port}/healthz") == 200, d.log()[-2000:]
                assert _get(f"http://127.0.0.1:{port}/livez") == 200
                time.sleep(5)
            assert checked_services(sandbox.node_ns, "nft") == before
            assert d.proc.poll() is None, d.log()[-3000:]
        finally:
            control_plane.start_apiserver()
        control_plane.apply(endpoint_slice("web-a", "web", ns, endpoints([SANDBOX_EPS[1]])))
        wait_for(lambda: checked_services(sandbox.node_ns, "nft").get(key) == [ep[1]], SETTLE, "the change after")
        assert reach(sandbox, ip, 6) == {ep[1]: 6}


def test_bookmarks_from_the_real_server_keep_a_quiet_watch_current(control_plane):
    """Nothing changes among the Services while EndpointSlices churn: the real server's BOOKMARK
    (sent before a watch's timeout) moves the services watch's resourceVersion on without any
    event and without a relist, so a reconnect resumes from a version etcd still has."""
    ns = namespace(control_plane, "bookmarks")
    control_plane.apply(service("web", ns, "10.96.11.10"))
    settings = WatchSettings(watch_timeout=8, backoff_initial=0.1, backoff_max=1.0)
    with source_on(control_plane, settings=settings) as src:
        services = next(r for r in src.reflectors if r.kind.plural == "services")
        quiet = int(services.version)
        before, lists = dict(src.snapshot().state.services), services.lists
        for i in range(5):
            control_plane.apply(endpoint_slice("web-a", "web", ns, endpoints([f"10.244.10.{i + 1}"])))
        churned = control_plane.etcd_revision()
        # A consistent list served from the watch cache makes kube-apiserver ask etcd for watch
        # progress: the quiet services cache learns the current revision, and its next bookmark
        # carries it (etcd sends no progress of its own for ten minutes).
        control_plane.kubectl("get", "services", "-A")
        wait_for(lambda: int(services.version) >= churned, SETTLE,
                 f"a bookmark moving the services watch from {quiet} to {churned}")
        assert services.lists == lists, "the services watch relisted"
        assert dict(src.snapshot().state.services) == before

"""deploy/: every manifest is a valid object for the `kubernetes` client's models, the RBAC grants
exactly list and watch on services, endpointslices, nodes and servicecidrs, and the DaemonSet's command line
is one nfproxy itself accepts."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from nfproxy.cli.main import build_parser, parse
from nfproxy.cli.config import duration, node_config_from_args

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
MODELS = {
    ("v1", "ServiceAccount"): "V1ServiceAccount",
    ("rbac.authorization.k8s.io/v1", "ClusterRole"): "V1ClusterRole",
    ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding"): "V1ClusterRoleBinding",
    ("apps/v1", "DaemonSet"): "V1DaemonSet",
}
API = client.ApiClient()


def documents() -> list[dict[str, Any]]:
    docs = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        docs.extend(d for d in yaml.safe_load_all(path.read_text()) if d)
    return docs


def parsed() -> dict[str, list[Any]]:
    """Each document deserialized into the client's model for its kind."""
    out: dict[str, list[Any]] = {}
    for doc in documents():
        model = MODELS[(doc["apiVersion"], doc["kind"])]
        out.setdefault(doc["kind"], []).append(
            API.deserialize(json.dumps(doc), model, "application/json")
        )
    return out


def one(kind: str, name: str | None = None) -> Any:
    """The one object of `kind` (named `name`; for DaemonSets, the node proxy by default)."""
    objects = parsed()[kind]
    if name is None and kind == "DaemonSet":
        name = "nfproxy"
    if name is not None:
        objects = [o for o in objects if o.metadata.name == name]
    assert len(objects) == 1, f"expected one {kind} {name or ''}, found {len(objects)}"
    return objects[0]


def test_every_document_is_a_known_kind_and_round_trips_through_the_models():
    """A misspelled field would be dropped by the model: the round trip would not be equal."""
    docs = documents()
    assert {d["kind"] for d in docs} == {k for _, k in MODELS}
    for doc in docs:
        model = API.deserialize(json.dumps(doc), MODELS[(doc["apiVersion"], doc["kind"])], "application/json")
        assert API.sanitize_for_serialization(model) == doc, f"{doc['kind']} has unknown fields"


def test_the_round_trip_would_catch_a_misspelled_field():
    doc = next(d for d in documents() if d["kind"] == "DaemonSet")
    doc["spec"]["template"]["spec"]["hostNetwrok"] = doc["spec"]["template"]["spec"].pop("hostNetwork")
    model = API.deserialize(json.dumps(doc), "V1DaemonSet", "application/json")
    assert API.sanitize_for_serialization(model) != doc


def _grants(role: Any) -> set[tuple[str, str, str]]:
    grants = set()
    for rule in role.rules:
        assert not rule.resource_names and not rule.non_resource_urls
        for group in rule.api_groups:
            for resource in rule.resources:
                for verb in rule.verbs:
                    grants.add((group, resource, verb))
    return grants


def test_rbac_grants_exactly_list_and_watch_on_the_four_resources():
    role = one("ClusterRole")
    assert _grants(role) == {
        (group, resource, verb)
        for group, resource in (
            ("", "services"), ("", "nodes"), ("discovery.k8s.io", "endpointslices"),
            ("networking.k8s.io", "servicecidrs"),
        )
        for verb in ("list", "watch")
    }
    assert not any("*" in g for g in _grants(role) for g in g)
    assert role.aggregation_rule is None


def test_the_binding_gives_the_role_to_the_daemonsets_service_account():
    binding, account, ds = one("ClusterRoleBinding"), one("ServiceAccount"), one("DaemonSet")
    assert binding.role_ref.kind == "ClusterRole"
    assert binding.role_ref.name == one("ClusterRole").metadata.name
    assert [(s.kind, s.name, s.namespace) for s in binding.subjects] == [
        ("ServiceAccount", account.metadata.name, account.metadata.namespace)
    ]
    assert ds.spec.template.spec.service_account_name == account.metadata.name
    assert ds.metadata.namespace == account.metadata.namespace


def test_daemonset_runs_on_the_host_network_with_only_the_capabilities_it_needs():
    ds = one("DaemonSet")
    pod = ds.spec.template.spec
    assert pod.host_network is True
    assert ds.spec.selector.match_labels.items() <= ds.spec.template.metadata.labels.items()
    [container] = pod.containers
    security = container.security_context
    assert set(security.capabilities.add) == {"NET_ADMIN", "NET_RAW"}
    assert security.capabilities.drop == ["ALL"]
    assert not security.privileged
    # Tolerates every taint: a node without its proxy has no working services.
    assert any(t.operator == "Exists" and not t.key for t in pod.tolerations)


def test_daemonset_mounts_the_xtables_lock_and_kernel_modules_from_the_host():
    ds = one("DaemonSet")
    pod = ds.spec.template.spec
    [container] = pod.containers
    volumes = {v.name: v for v in pod.volumes}
    mounts = {m.mount_path: m for m in container.volume_mounts}
    lock, modules = mounts["/run/xtables.lock"], mounts["/lib/modules"]
    assert volumes[lock.name].host_path.path == "/run/xtables.lock"
    assert volumes[lock.name].host_path.type == "FileOrCreate"
    assert volumes[modules.name].host_path.path == "/lib/modules"
    assert modules.read_only is True


def test_probes_ask_the_health_server():
    [container] = one("DaemonSet").spec.template.spec.containers
    assert (container.liveness_probe.http_get.path, container.liveness_probe.http_get.port) == (
        "/livez",
        10256,
    )
    assert (container.readiness_probe.http_get.path, container.readiness_probe.http_get.port) == (
        "/healthz",
        10256,
    )
    # kubeadm's healthzBindAddress is empty: kube-proxy's default, which the probes ask.
    _, args = parse(["run", f"--config={KUBEADM_CONFIG}"])
    assert args.healthz_bind_address == "0.0.0.0:10256"


def _expanded_command_line() -> list[str]:
    """The container's argv as the kubelet builds it: $(VAR) from the downward API."""
    ds = one("DaemonSet")
    [container] = ds.spec.template.spec.containers
    assert not container.env_from, "the configuration is kubeadm's kube-proxy ConfigMap, nothing else"
    env: dict[str, str] = {}
    for var in container.env or []:
        assert var.value_from is not None and var.value_from.field_ref.field_path == "spec.nodeName"
        env[var.name] = "node-a"

    def expand(arg: str) -> str:
        def one_var(m: re.Match[str]) -> str:
            assert m.group(1) in env, f"$({m.group(1)}) is defined nowhere"
            return env[m.group(1)]

        return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one_var, arg)

    return [expand(a) for a in (container.command or []) + (container.args or [])]


KUBEADM_CONFIG = Path(__file__).resolve().parent / "kubeadm-kube-proxy-config.yaml"


def test_the_daemonset_reads_kubeadms_kube_proxy_configmap():
    """config.conf and kubeconfig.conf, mounted where kube-proxy's own DaemonSet mounts them."""
    pod = one("DaemonSet").spec.template.spec
    [container] = pod.containers
    volumes = {v.name: v for v in pod.volumes}
    [mount] = [m for m in container.volume_mounts if m.mount_path == "/var/lib/kube-proxy"]
    assert volumes[mount.name].config_map.name == "kube-proxy" and mount.read_only
    assert "--config=/var/lib/kube-proxy/config.conf" in container.args
    # kubeadm's config.conf points at kubeconfig.conf in the same mount: the API server's
    # address comes from there, never from an edited manifest.
    assert "kubeconfig: /var/lib/kube-proxy/kubeconfig.conf" in KUBEADM_CONFIG.read_text()


def test_the_command_line_is_one_nfproxy_accepts():
    argv = _expanded_command_line()
    assert argv[0] == "nfproxy"
    # What the kubelet mounts at /var/lib/kube-proxy: kubeadm's file (kept in tests/).
    argv = [a.replace("/var/lib/kube-proxy/config.conf", str(KUBEADM_CONFIG)) for a in argv]
    _, args = parse(argv[1:])
    assert args.command == "run"
    assert args.backend in ("nftables", "nft", "iptables")
    assert args.kubeconfig == "/var/lib/kube-proxy/kubeconfig.conf" and not args.manifests
    node = node_config_from_args(args)
    assert node.name == "node-a"


@pytest.mark.parametrize("mode", ["nftables", "iptables"])
def test_switching_backends_is_one_argument(mode):
    """What docs/install.md tells users to edit must be what the command line reads."""
    args = one("DaemonSet").spec.template.spec.containers[0].args
    assert "--proxy-mode=nftables" in args
    _, parsed_args = parse(["run", f"--config={KUBEADM_CONFIG}", f"--proxy-mode={mode}"])
    assert parsed_args.backend == mode


def test_the_daemonset_root_filesystem_is_read_only_and_the_owner_lock_is_the_nodes():
    pod = one("DaemonSet").spec.template.spec
    [container] = pod.containers
    assert container.security_context.read_only_root_filesystem is True
    volumes = {v.name: v for v in pod.volumes}
    [run] = [m for m in container.volume_mounts if m.mount_path == "/run/nfproxy"]
    assert volumes[run.name].host_path.path == "/run/nfproxy"


def test_containerfile_builds_debian_slim_with_both_kernel_tools_and_the_package():
    text = (DEPLOY / "Containerfile").read_text()
    instructions = [line for line in text.splitlines() if line and not line.startswith("#")]
    # The base is a build argument (scripts/image); its default is Debian's slim image.
    assert re.fullmatch(r"ARG BASE=(docker\.io/library/)?debian:[a-z]+-slim", instructions[0])
    assert instructions[1].startswith("FROM ${BASE}")
    runtime = text[text.index("AS runtime"):]
    install = re.search(r"apt-get install[^&]*", runtime, re.S)
    assert install is not None
    packages = set(install.group(0).replace("\\", " ").split())
    assert {"nftables", "libnftables1", "iptables", "python3"} <= packages
    assert re.search(r"\$pip [^\n]*/src", text)
    assert "-c /src/constraints.txt" in text
    # Every path the build copies exists (the build context is the repository root).
    for line in instructions:
        if line.startswith("COPY --from="):
            continue
        if line.startswith("COPY "):
            *sources, _ = line.split()[1:]
            for source in sources:
                assert (DEPLOY.parent / source).exists(), f"COPY {source}: no such path"
    assert 'ENTRYPOINT ["nfproxy"]' in text
    [container] = one("DaemonSet").spec.template.spec.containers
    assert container.command == ["nfproxy"]


def test_the_canary_touches_nothing_and_cannot_collide_with_kube_proxy():
    """deploy/canary.yaml: the whole daemon on in-memory kernels, on ports kube-proxy does not use."""
    canary = one("DaemonSet", "nfproxy-canary")
    [container] = canary.spec.template.spec.containers
    argv = [a.replace("/var/lib/kube-proxy/config.conf", str(KUBEADM_CONFIG)) for a in container.args]
    argv = [a.replace("$(NODE_NAME)", "node-a") for a in argv]
    _, args = parse(argv)
    assert args.dry_run is True
    ports = {args.healthz_bind_address.rsplit(":", 1)[1], args.metrics_bind_address.rsplit(":", 1)[1]}
    assert ports.isdisjoint({"10256", "10249"}), ports
    security = container.security_context
    assert security.capabilities.drop == ["ALL"] and not security.capabilities.add
    assert security.run_as_non_root is True and security.read_only_root_filesystem is True
    assert canary.spec.template.spec.service_account_name == one("ServiceAccount").metadata.name
    assert container.readiness_probe.http_get.port == int(args.healthz_bind_address.rsplit(":", 1)[1])

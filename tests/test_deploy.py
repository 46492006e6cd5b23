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

from nfproxy.cli.main import build_parser
from nfproxy.cli.config import duration, node_config_from_args

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
MODELS = {
    ("v1", "ServiceAccount"): "V1ServiceAccount",
    ("v1", "ConfigMap"): "V1ConfigMap",
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


def one(kind: str) -> Any:
    objects = parsed()[kind]
    assert len(objects) == 1, f"expected one {kind}, found {len(objects)}"
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
    assert "--healthz-bind-address=0.0.0.0:10256" in container.args


def _expanded_command_line() -> list[str]:
    """The container's argv as the kubelet builds it: $(VAR) from env and the ConfigMap."""
    ds, config = one("DaemonSet"), one("ConfigMap")
    [container] = ds.spec.template.spec.containers
    env: dict[str, str] = {}
    for source in container.env_from or []:
        assert source.config_map_ref.name == config.metadata.name
        env.update(config.data)
    for var in container.env or []:
        if var.value_from is not None:
            assert var.value_from.field_ref.field_path == "spec.nodeName"
            env[var.name] = "node-a"
        else:
            env[var.name] = var.value

    def expand(arg: str) -> str:
        def one_var(m: re.Match[str]) -> str:
            assert m.group(1) in env, f"$({m.group(1)}) is defined nowhere"
            return env[m.group(1)]

        return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one_var, arg)

    return [expand(a) for a in (container.command or []) + (container.args or [])]


def test_the_command_line_is_one_nfproxy_accepts():
    argv = _expanded_command_line()
    assert argv[0] == "nfproxy"
    args = build_parser().parse_args(argv[1:])
    assert args.command == "run"
    assert args.backend in ("nft", "iptables")
    assert not args.manifests and not args.kubeconfig and not args.master  # in-cluster
    node = node_config_from_args(args)
    assert node.name == "node-a"
    assert duration("--min-sync-period", args.min_sync_period) == 1.0
    assert duration("--sync-period", args.sync_period) == 3600.0


@pytest.mark.parametrize("backend", ["nft", "iptables"])
def test_switching_backends_is_one_configmap_value(backend):
    """What docs/install.md tells users to edit must be what the command line reads."""
    config = one("ConfigMap")
    assert config.data["NFPROXY_BACKEND"] == "nft"
    assert "--backend=$(NFPROXY_BACKEND)" in one("DaemonSet").spec.template.spec.containers[0].args
    args = build_parser().parse_args(["run", f"--backend={backend}"])
    assert args.backend == backend


def test_containerfile_builds_debian_slim_with_both_kernel_tools_and_the_package():
    text = (DEPLOY / "Containerfile").read_text()
    instructions = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert re.fullmatch(r"FROM debian:[a-z]+-slim", instructions[0])
    install = re.search(r"apt-get install[^&]*", text, re.S)
    assert install is not None
    packages = set(install.group(0).replace("\\", " ").split())
    assert {"nftables", "libnftables1", "iptables", "python3"} <= packages
    assert re.search(r"pip install [^\n]*/src", text)
    # Every path the build copies exists (the build context is the repository root).
    for line in instructions:
        if line.startswith("COPY "):
            *sources, _ = line.split()[1:]
            for source in sources:
                assert (DEPLOY.parent / source).exists(), f"COPY {source}: no such path"
    assert 'ENTRYPOINT ["nfproxy"]' in text
    [container] = one("DaemonSet").spec.template.spec.containers
    assert container.command == ["nfproxy"]

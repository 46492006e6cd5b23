"""The real control plane for tests: etcd and kube-apiserver from `scripts/kube`, driven by kubectl.

`ControlPlane` offers the same test-facing verbs as `tests/apiserver.py`'s fake (`apply`, `get`,
`delete`, `url`) so one scenario runs against both, plus what only a real server has: RBAC
(`kubectl create token`, `auth can-i`), a restart of kube-apiserver, and etcd compaction.
Objects are written with `kubectl apply --server-side`, as an operator or a controller would.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
KUBE = ROOT / "scripts" / "kube"
MANAGER = "nfproxy-tests"
# The label kube-proxy's own tests and every slice controller set: slices not made by the
# EndpointSlice controller say who made them.
MANAGED_BY = {"endpointslice.kubernetes.io/managed-by": "nfproxy-tests.example.com"}
SERVICE_CIDRS = "10.96.0.0/16,fd00:10:96::/112"
_PLURAL = {
    "Service": "services",
    "EndpointSlice": "endpointslices.discovery.k8s.io",
    "Node": "nodes",
    "ServiceCIDR": "servicecidrs.networking.k8s.io",
    "ClusterRole": "clusterroles.rbac.authorization.k8s.io",
    "Namespace": "namespaces",
}


class KubeError(RuntimeError):
    """A kubectl or scripts/kube call failed; the message holds its output."""


def kube_path(name: str) -> str:
    """A binary `scripts/kube build` made (building it first if needed)."""
    subprocess.run([str(KUBE), "build"], check=True)
    return subprocess.run(
        [str(KUBE), "path", name], check=True, capture_output=True, text=True
    ).stdout.strip()


class ControlPlane:
    """etcd + kube-apiserver on loopback, started by `scripts/kube up` into a directory of its
    own and removed by `close()` (also when the test session fails or is interrupted)."""

    def __init__(self, directory: str | None = None, service_cidrs: str = SERVICE_CIDRS) -> None:
        self.dir = directory or tempfile.mkdtemp(prefix="nfproxy-kube-")
        self.service_cidrs = service_cidrs
        self.kubectl_path = kube_path("kubectl")
        self._kube("up", "--dir", self.dir, "--service-cidr", service_cidrs)
        self.kubeconfig = os.path.join(self.dir, "admin.kubeconfig")
        self.api_port = int(Path(self.dir, "kube-apiserver.port").read_text())
        self.etcd_port = int(Path(self.dir, "etcd.port").read_text())

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.api_port}"

    def close(self) -> None:
        self._kube("down", "--dir", self.dir)

    def _kube(self, *args: str) -> str:
        done = subprocess.run([str(KUBE), *args], capture_output=True, text=True)
        if done.returncode != 0:
            raise KubeError(f"scripts/kube {' '.join(args)}: {done.stderr}{done.stdout}")
        return done.stdout

    # ---------------------------------------------------------------------------------------
    # kubectl

    def kubectl(self, *args: str, stdin: str | None = None, check: bool = True,
                kubeconfig: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [self.kubectl_path, "--kubeconfig", kubeconfig or self.kubeconfig, *args],
            input=stdin, capture_output=True, text=True, timeout=timeout,
        )
        if check and done.returncode != 0:
            raise KubeError(f"kubectl {' '.join(args)}: {done.stderr.strip()}")
        return done

    def apply(self, *objects: dict[str, Any]) -> list[dict[str, Any]]:
        """Server-side apply; the objects as the server stored them. Slices get MANAGED_BY."""
        items = [_managed(obj) for obj in objects]
        doc = {"apiVersion": "v1", "kind": "List", "items": items}
        out = self.kubectl("apply", "--server-side", "--force-conflicts",
                           f"--field-manager={MANAGER}", "-o", "json", "-f", "-",
                           stdin=json.dumps(doc)).stdout
        stored = json.loads(out)
        return stored.get("items", [stored])

    def apply_status(self, obj: dict[str, Any]) -> None:
        """A status apply leaves alone (a LoadBalancer's ingress, a Node's addresses), written
        through the status subresource as a controller or the kubelet would. A merge patch:
        server-side apply keys a Node's addresses by type, so a dual-stack node's two
        InternalIPs cannot go through it."""
        meta = obj["metadata"]
        ns = ["-n", meta["namespace"]] if meta.get("namespace") else []
        self.kubectl("patch", _PLURAL[obj["kind"]], meta["name"], *ns, "--subresource=status",
                     "--type=merge", "-p", json.dumps({"status": obj["status"]}))

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any]:
        ns = ["-n", namespace] if namespace else []
        return json.loads(self.kubectl("get", _PLURAL[kind], name, *ns, "-o", "json").stdout)

    def delete(self, kind: str, namespace: str, name: str) -> None:
        ns = ["-n", namespace] if namespace else []
        self.kubectl("delete", _PLURAL[kind], name, *ns, "--wait=false")

    def token(self, account: str, namespace: str = "kube-system") -> str:
        return self.kubectl("create", "token", account, "-n", namespace, "--duration=2h").stdout.strip()

    def token_kubeconfig(self, token: str, path: str) -> str:
        """A kubeconfig that authenticates with `token` (a service account's, as in a pod)."""
        ca = os.path.join(self.dir, "ca.crt")
        Path(path).write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config",
            "clusters": [{"name": "c", "cluster": {"server": self.url, "certificate-authority": ca}}],
            "users": [{"name": "u", "user": {"token": token}}],
            "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
            "current-context": "x",
        }))
        return path

    # ---------------------------------------------------------------------------------------
    # The real kube-proxy

    def start_kube_proxy(self, netns: str, mode: str, *flags: str) -> None:
        """kube-proxy in `netns` (`scripts/kube proxy`), back once it has synced."""
        done = subprocess.run([str(KUBE), "proxy", "--dir", self.dir, netns, "--proxy-mode", mode, *flags],
                              capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise KubeError(f"scripts/kube proxy {netns} --proxy-mode {mode}: {done.stderr}")

    def stop_kube_proxy(self, netns: str) -> None:
        subprocess.run([str(KUBE), "proxy-stop", "--dir", self.dir, netns], check=False)

    # ---------------------------------------------------------------------------------------
    # Faults only a real server has

    def stop_apiserver(self) -> None:
        self._kube("apiserver", "stop", "--dir", self.dir)

    def start_apiserver(self) -> None:
        self._kube("apiserver", "start", "--dir", self.dir)

    def etcd_revision(self) -> int:
        return int(self._etcd("/v3/kv/range", {"key": _b64("/nfproxy-tests/none")})["header"]["revision"])

    def bump_and_compact_etcd(self) -> int:
        """Write a key no Kubernetes object lives at (so etcd's revision moves past every watch
        in flight) and compact etcd's history up to it: a watch resumed from before is 410 Gone."""
        revision = int(self._etcd("/v3/kv/put", {"key": _b64("/nfproxy-tests/bump"),
                                                  "value": _b64(str(time.time()))})["header"]["revision"])
        self._etcd("/v3/kv/compaction", {"revision": str(revision), "physical": True})
        return revision

    def _etcd(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.etcd_port}{path}", data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"}, method="POST",
        )
        with urllib.request.urlopen(request, timeout=10) as answer:  # noqa: S310 - loopback etcd
            return json.loads(answer.read())


def node_addresses(netns: str, *ips: str) -> None:
    """The node's IPs on an interface of its namespace (a veth pair: no dummy module needed):
    kube-proxy takes node-port addresses from the local interfaces ("primary")."""
    for cmd in (["link", "add", "node0", "type", "veth", "peer", "name", "node1"],
                *(["addr", "add", ip, "dev", "node0"] for ip in ips),
                ["link", "set", "node0", "up"], ["link", "set", "node1", "up"]):
        subprocess.run(["ip", "-n", netns, *cmd], check=True)


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _managed(obj: dict[str, Any]) -> dict[str, Any]:
    if obj.get("kind") != "EndpointSlice":
        return obj
    labels = {**MANAGED_BY, **obj.get("metadata", {}).get("labels", {})}
    return {**obj, "metadata": {**obj["metadata"], "labels": labels}}


def wait_for(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll until `predicate()` is truthy; fail naming `what`. A bound, not a measurement."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:g}s")
        time.sleep(0.1)


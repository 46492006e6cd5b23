#!/usr/bin/env python3
"""The real kube-proxy's rules for nfproxy/testing.py's uniform cluster, dumped to files (issue S).

`bench/first_connections.py --against-kube-proxy DIR` loads these dumps into its sandbox in turns
with nfproxy's own rules for the same state, so both proxies' first connections are measured on
one node, through one sandbox, in one run. kube-proxy v1.37.2 (`scripts/kube`) writes them:

- the cluster is written to a real kube-apiserver (`scripts/kube up`) with the cluster IPs
  uniform_cluster gives (172.30.x.y; the server's service CIDR 172.16.0.0/12 holds them), so
  the state kube-proxy sees is exactly the one nfproxy renders; sizes grow (1, then 1 000, then
  10 000: uniform_cluster(S) is a prefix of uniform_cluster(S') for S < S');
- per size and mode, kube-proxy starts in a fresh namespace (`scripts/kube proxy`, node
  node-a, cluster CIDR 10.0.0.0/8 as nfproxy/testing.py's NODE), its first sync is awaited, and
  its rules are dumped: `nft list table ip kube-proxy` (nftables mode) or `iptables-legacy-save`
  (iptables mode), then it is stopped and the namespace removed;
- iptables mode runs with a PATH whose `iptables*` are the legacy ones: kube-proxy takes the
  variant of the `iptables` it finds, and nfproxy's iptables backend is measured with
  Flavour.LEGACY beside it (iptables-nft-restore of 10 000 x 10 takes many minutes per turn).

Files: DIR/kube-proxy-<mode>-<S>.{nft,rules}. Usage (the control plane stays up between runs;
`scripts/kube down --dir D` when done):

    sudo .venv/bin/python bench/kube_rules.py --plane /tmp/nfproxy-kube-h4 --out DIR [--sizes 1,1000,10000]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from nfproxy.kernel import netns as netns_mod  # noqa: E402
from nfproxy.testing import manifest_objects, uniform_cluster  # noqa: E402

KUBE = ROOT / "scripts" / "kube"
NODE = "node-a"
NODE_IP = "192.168.0.2"
SERVICE_CIDR = "172.16.0.0/12"
CLUSTER_CIDR = "10.0.0.0/8"
LEGACY = ("iptables", "iptables-save", "iptables-restore", "ip6tables", "ip6tables-save", "ip6tables-restore")


def sh(*args: str, stdin: str | None = None, timeout: float = 3600, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(args, input=stdin, capture_output=True, text=True, timeout=timeout, env=env)
    if done.returncode:
        raise SystemExit(f"{' '.join(args[:5])}...: {done.stderr.strip()[-2000:]}")
    return done.stdout


def dump_name(mode: str, size: int) -> str:
    return f"kube-proxy-{mode}-{size}.{'nft' if mode == 'nftables' else 'rules'}"


def write_cluster(plane: str, size: int, written: int) -> None:
    """Services written..size-1 of uniform_cluster(size, 10) (and their slices) through kubectl,
    cluster IPs as given."""
    kubectl = sh(str(KUBE), "path", "kubectl").strip()
    config = f"{plane}/admin.kubeconfig"
    objects = [o for o in manifest_objects(uniform_cluster(size, 10)) if _index(o) >= written]
    if written == 0:
        node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE},
                "status": {"addresses": [{"type": "InternalIP", "address": NODE_IP}]}}
        names = sorted({f"ns-{i % 100}" for i in range(max(size, 100))})
        objects = [node] + [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": n}} for n in names] + objects
    for i in range(0, len(objects), 2000):
        doc = {"apiVersion": "v1", "kind": "List", "items": objects[i:i + 2000]}
        sh(kubectl, "--kubeconfig", config, "apply", "--server-side", "--force-conflicts", "-f", "-",
           stdin=json.dumps(doc))


def _index(obj: dict) -> int:
    """The service number of a Service or EndpointSlice of uniform_cluster (svc-<i>...)."""
    if obj["kind"] == "Service":
        name = obj["metadata"]["name"]
    else:
        name = obj["metadata"]["labels"]["kubernetes.io/service-name"]
    return int(name.split("-")[1])


def legacy_path(bindir: str) -> str:
    """A PATH whose iptables, iptables-save, iptables-restore (and ip6) are the legacy ones,
    linked in `bindir`."""
    for name in LEGACY:
        os.symlink(f"/usr/sbin/{name.replace('tables', 'tables-legacy', 1)}", f"{bindir}/{name}")
    return f"{bindir}:{os.environ.get('PATH', '/usr/sbin:/usr/bin:/sbin:/bin')}"


def dump(plane: str, mode: str, out: Path, size: int) -> float:
    """Start kube-proxy on a fresh namespace, wait for its first sync, dump its rules; seconds
    to the first sync."""
    ns = f"nfp-kr-{os.getpid()}"
    netns_mod.create(ns)
    env = dict(os.environ, NFPROXY_KUBE_PROXY_WAIT="3600")
    bindir = tempfile.mkdtemp(prefix="nfp-legacy-")
    if mode == "iptables":
        env["PATH"] = legacy_path(bindir)
    try:
        began = time.monotonic()
        sh(str(KUBE), "proxy", "--dir", plane, ns, "--proxy-mode", mode, "--hostname-override", NODE,
           "--cluster-cidr", CLUSTER_CIDR, env=env)
        took = time.monotonic() - began
        time.sleep(2)  # a second sync, if one is queued, lands before the dump
        if mode == "nftables":
            text = sh("ip", "netns", "exec", ns, "nft", "list", "table", "ip", "kube-proxy")
        else:
            text = sh("ip", "netns", "exec", ns, "iptables-legacy-save")
        (out / dump_name(mode, size)).write_text(text)
        version = sh(str(KUBE), "path", "kube-proxy").strip()
        (out / "kube-proxy.version").write_text(sh(version, "--version"))
        return took
    finally:
        subprocess.run([str(KUBE), "proxy-stop", "--dir", plane, ns], check=False)
        netns_mod.remove(ns)
        shutil.rmtree(bindir, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plane", required=True, help="a directory `scripts/kube up --service-cidr 172.16.0.0/12` made")
    ap.add_argument("--out", required=True)
    ap.add_argument("--sizes", default="1,1000,10000")
    ap.add_argument("--modes", default="nftables,iptables")
    ap.add_argument("--written", type=int, default=0, help="services already in the API (a resumed run)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    written = args.written
    for size in sorted(int(s) for s in args.sizes.split(",")):
        if size > written:
            began = time.monotonic()
            write_cluster(args.plane, size, written)
            written = size
            print(f"{size} x 10 written in {time.monotonic() - began:.1f}s", flush=True)
        for mode in args.modes.split(","):
            took = dump(args.plane, mode, out, size)
            print(f"{mode} at {size}: first sync {took:.1f}s, {out / dump_name(mode, size)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The node image, built and run for real: podman runs it inside a throwaway network namespace.

It builds the image with scripts/image on a base made here (no registry is reachable), so it
fails loudly when the image cannot be built. The container is what a node runs: an
unprivileged user with only NET_ADMIN and NET_RAW, a read-only root filesystem, /run a tmpfs,
the manifests mounted read-only, the node's network namespace as its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from nfproxy.kernel import netns
from nfproxy.kernel.nft import NftSession

pytestmark = [pytest.mark.kernel, pytest.mark.image]

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
TAG = "localhost/nfproxy:test"
RUN_OPTS = ["--runtime", "runc", "--ulimit", "nofile=4096:4096", "--ulimit", "nproc=4096:4096"]


@pytest.fixture(scope="module")
def image() -> str:
    if os.geteuid() != 0:
        pytest.fail("the image test needs root: it runs podman and creates network namespaces")
    built = subprocess.run(
        [str(ROOT / "scripts" / "image"), "--local-base", "--tag", TAG],
        capture_output=True, text=True, timeout=1500,
    )
    assert built.returncode == 0, f"scripts/image failed:\n{built.stdout}\n{built.stderr}"
    size_mb = int(built.stdout.rsplit("(", 1)[1].split()[0]) / 1e6
    assert size_mb < 150, built.stdout
    return TAG


def podman_args(ns: str, *args: str, detach: str | None = None) -> list[str]:
    where = ["-d", "--name", detach] if detach else ["--rm"]
    return [
        "podman", "run", *where, *RUN_OPTS, "--network", f"ns:/run/netns/{ns}",
        "--cap-drop", "ALL", "--cap-add", "NET_ADMIN", "--cap-add", "NET_RAW",
        # The owner lock's directory, writable, as the DaemonSet has it (the host's /run/nfproxy).
        "--read-only", "--mount", "type=tmpfs,destination=/run/nfproxy,tmpfs-mode=1777",
        "-v", f"{EXAMPLES}:/examples:ro", TAG, *args,
    ]


def nft_tables(ns: str) -> set[str]:
    return {f for f in ("ip", "ip6") if NftSession(ns).list_table(f, "nfproxy")}


def healthz(ns: str) -> tuple[int, dict] | None:
    with netns.entered(ns):
        try:
            with urllib.request.urlopen("http://127.0.0.1:10256/healthz", timeout=2) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())
        except OSError:
            return None


@contextlib.contextmanager
def container(ns: str, *args: str) -> Iterator[str]:
    name = f"nfp-image-{os.getpid()}"
    started = subprocess.run(podman_args(ns, *args, detach=name), capture_output=True, text=True)
    assert started.returncode == 0, started.stderr
    try:
        yield name
    finally:
        subprocess.run(["podman", "rm", "-f", "-t", "0", name], capture_output=True)


@pytest.mark.parametrize("backend", ["nft", "iptables"])
def test_the_image_syncs_once_then_cleans_up(image: str, backend: str) -> None:
    with netns.throwaway("nfp-img") as ns:
        once = subprocess.run(
            podman_args(ns, "--backend", backend, "--manifests", "/examples", "--once"),
            capture_output=True, text=True, timeout=300,
        )
        assert once.returncode == 0, once.stderr
        if backend == "nft":
            assert nft_tables(ns) == {"ip", "ip6"}
        else:
            saved = subprocess.run(["ip", "netns", "exec", ns, "iptables-save", "-t", "nat"],
                                   capture_output=True, text=True, check=True).stdout
            assert "-A KUBE-SERVICES" in saved and "KUBE-SVC-" in saved
        clean = subprocess.run(podman_args(ns, "cleanup"), capture_output=True, text=True, timeout=300)
        assert clean.returncode == 0, clean.stderr
        assert "removed" in clean.stdout
        assert nft_tables(ns) == set()
        saved = subprocess.run(["ip", "netns", "exec", ns, "iptables-save"],
                               capture_output=True, text=True, check=True).stdout
        # All but the localnet guard, which stays while route_localnet may (as kube-proxy's).
        assert [ln for ln in saved.splitlines() if "KUBE-" in ln and "KUBE-FIREWALL" not in ln] == []


def test_the_image_as_a_daemon_serves_health_and_sigterm_keeps_the_rules(image: str) -> None:
    with netns.throwaway("nfp-img") as ns:
        with container(ns, "--backend", "nft", "--manifests", "/examples") as name:
            # /healthz answers 200 from the start (as kube-proxy's does); the rules come with the
            # first sync.
            deadline = time.monotonic() + 120
            answer = None
            while time.monotonic() < deadline and (
                answer is None or answer[0] != 200 or nft_tables(ns) != {"ip", "ip6"}
            ):
                time.sleep(0.2)
                answer = healthz(ns)
            assert answer is not None and answer[0] == 200, answer
            assert answer[1]["nodeEligible"] is True
            assert nft_tables(ns) == {"ip", "ip6"}
            stopped = subprocess.run(["podman", "stop", "-t", "30", name], capture_output=True, text=True)
            assert stopped.returncode == 0, stopped.stderr
            state = subprocess.run(["podman", "inspect", "--format", "{{.State.ExitCode}}", name],
                                   capture_output=True, text=True, check=True).stdout.strip()
            assert state == "0", "SIGTERM should end the daemon cleanly"
            assert nft_tables(ns) == {"ip", "ip6"}, "SIGTERM must leave the rules in place"
        clean = subprocess.run(podman_args(ns, "cleanup", "--backend", "nft"),
                               capture_output=True, text=True, timeout=300)
        assert clean.returncode == 0, clean.stderr
        assert nft_tables(ns) == set()

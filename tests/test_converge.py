"""Converge exactly (issue J.3): after churn, partial syncs, kill -9 and restarts, the daemon's
table equals a fresh full apply of the same manifests, object for object and element for element.

The real daemon runs on a manifests directory in a throwaway namespace; a seeded random walk
adds and removes services, changes endpoints (also of session-affinity services, whose
per-endpoint chains and affinity sets must go with them) and kills the daemon with SIGKILL at
random points, mid-churn included. The reference is `--once` on the same directory in a second
throwaway namespace. The test waits on the kernel's state (never on a sleep) and fails with the
difference when the table does not settle to the reference.
"""

from __future__ import annotations

import difflib
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from nfproxy.core.model import IPFamily
from nfproxy.kernel import netns
from nfproxy.kernel.iptables import Flavour, IptablesKernel, IptablesRunner
from nfproxy.kernel.nft import NftKernel

pytestmark = pytest.mark.kernel

MODES = {"nft": "nftables", "iptables": "iptables"}


@dataclass(frozen=True, slots=True)
class Svc:
    index: int
    affinity: bool
    endpoints: tuple[str, ...]


def manifest(s: Svc) -> str:
    name = f"svc{s.index}"
    affinity = (
        "  sessionAffinity: ClientIP\n  sessionAffinityConfig: {clientIP: {timeoutSeconds: 300}}\n"
        if s.affinity else ""
    )
    endpoints = "".join(
        f"  - addresses: [{ip}]\n    conditions: {{ready: true}}\n" for ip in s.endpoints
    )
    return (
        f"apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: churn}}\nspec:\n"
        f"  clusterIP: 10.96.50.{s.index}\n{affinity}"
        f"  ports: [{{name: http, port: 80, protocol: TCP}}]\n---\n"
        f"apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}-1\n"
        f"  namespace: churn\n  labels: {{kubernetes.io/service-name: {name}}}\n"
        f"addressType: IPv4\nports: [{{name: http, port: 8080, protocol: TCP}}]\n"
        f"endpoints:\n{endpoints or '  []'}\n"
    )


class Manifests:
    """The directory the daemon watches; every write is a rename, never a half-written file."""

    def __init__(self, root: Path, rng: random.Random) -> None:
        self.root, self.rng = root, rng
        self.services: dict[int, Svc] = {}

    def _write(self, s: Svc) -> None:
        tmp = self.root / f".svc{s.index}.tmp"
        tmp.write_text(manifest(s))
        os.replace(tmp, self.root / f"svc{s.index}.yaml")
        self.services[s.index] = s

    def _endpoints(self) -> tuple[str, ...]:
        n = self.rng.randint(1, 4)
        return tuple(sorted({f"10.244.{self.rng.randint(0, 3)}.{self.rng.randint(2, 250)}" for _ in range(n)}))

    def step(self) -> None:
        """One random change: add, remove, or change endpoints (affinity ones included)."""
        r = self.rng.random()
        free = [i for i in range(2, 40) if i not in self.services]
        if r < 0.3 and free or len(self.services) < 3:
            self._write(Svc(self.rng.choice(free), self.rng.random() < 0.5, self._endpoints()))
        elif r < 0.45:
            index = self.rng.choice(sorted(self.services))
            (self.root / f"svc{index}.yaml").unlink()
            del self.services[index]
        else:
            s = self.services[self.rng.choice(sorted(self.services))]
            # Mostly affinity services: their per-endpoint chains and sets are what went stale.
            if not s.affinity and self.rng.random() < 0.5:
                s = next((x for x in self.services.values() if x.affinity), s)
            self._write(Svc(s.index, s.affinity, self._endpoints()))


def daemon(backend: str, tree: Path, ns: str, *extra: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "nfproxy.cli.main", "--proxy-mode", MODES[backend],
         "--manifests", str(tree), "--netns", ns, "--min-sync-period", "100ms",
         "--healthz-bind-address", "127.0.0.1:0", "--metrics-bind-address", "", *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )


def table(backend: str, ns: str) -> str:
    """The canonical dump of both families: what must be byte-equal to a fresh apply."""
    kernel = NftKernel if backend == "nft" else IptablesKernel
    parts = []
    for family in IPFamily:
        k = kernel(family, netns=ns)
        try:
            parts.append(k.dump())
        except Exception as exc:  # noqa: BLE001 - no table yet is a state, not an error here
            parts.append(f"<{exc}>")
        finally:
            close = getattr(k, "close", None)
            if close is not None:
                close()
    return "\n".join(parts)


_SLOTS = re.compile(r"numgen random mod (\d+)(?: offset (\d+))? map @(endpoints-\S+)")


def slots_resolved(dump: str) -> str:
    """A canonical nft dump with each rule's endpoint lane replaced by the endpoints its ranges
    hold (with their widths) and the endpoint maps left out: where partial syncs put endpoints
    in the maps is the lane allocator's business and differs from a fresh apply's until the
    next full sync, but every chain, rule, set, element and endpoint must be the same."""
    shards: dict[str, list[tuple[int, int, str]]] = {}
    current = None
    for line in dump.splitlines():
        if line.startswith("map endpoints-"):
            current = shards.setdefault(line.split()[1], [])
        elif line == "}":
            current = None
        elif current is not None and line.startswith("\telement "):
            key, value = line.removeprefix("\telement ").split(" : ", 1)
            low, _, high = key.split()[0].partition("-")  # "K", "K-L", either with "counter …"
            current.append((int(low), int(high or low), value))
    out, skip = [], False
    for line in dump.splitlines():
        if line.startswith("map endpoints-"):
            skip = True
        if not skip:
            out.append(_SLOTS.sub(lambda m: "one of " + ", ".join(sorted(
                f"{high - low + 1} x {value}" for low, high, value in shards.get(m.group(3), [])
                if int(m.group(2) or 0) <= low and high < int(m.group(2) or 0) + int(m.group(1))
            )), line))
        if line == "}":
            skip = False
    return "\n".join(out)


def fresh_apply(backend: str, tree: Path) -> str:
    with netns.throwaway("nfp-conv-ref") as ref:
        subprocess.run(
            [sys.executable, "-m", "nfproxy.cli.main", "--proxy-mode", MODES[backend],
             "--manifests", str(tree), "--netns", ref, "--once"],
            check=True, capture_output=True,
        )
        return table(backend, ref)


def settles_to(backend: str, ns: str, want: str, timeout: float, view=lambda d: d) -> str:  # noqa: ANN001
    """The table (as `view` shows it) once it equals `want`, or as it stands at the deadline
    (the caller diffs)."""
    deadline = time.monotonic() + timeout
    got = view(table(backend, ns))
    while got != want and time.monotonic() < deadline:
        time.sleep(0.1)
        got = view(table(backend, ns))
    return got


def kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)


@pytest.mark.parametrize("backend", ["nft", "iptables"])
@pytest.mark.parametrize("seed", [4, 5])  # each: mid-churn kills and a round without one
def test_churn_kill_and_restart_converge_to_a_fresh_apply(tmp_path: Path, backend: str, seed: int) -> None:
    rng = random.Random(seed)
    tree = tmp_path / "manifests"
    tree.mkdir()
    files = Manifests(tree, rng)
    for _ in range(8):
        files.step()
    with netns.throwaway("nfp-converge") as ns:
        proc = daemon(backend, tree, ns)
        mid_churn_kills = unkilled_rounds = 0
        try:
            for _round in range(5):
                # The daemon's first sync after a start is full: exactly a fresh apply.
                want = fresh_apply(backend, tree)
                got = settles_to(backend, ns, want, 60)
                assert got == want, _diff(want, got)
                steps = rng.randint(4, 10)
                kill_at = rng.randint(0, steps + 1)  # steps + 1: no kill this round
                for i in range(steps):
                    files.step()
                    if i == kill_at:  # mid-churn: some change may be half synced, or not at all
                        time.sleep(rng.random() * 0.3)  # a random point, not a wait for anything
                        kill(proc)
                        proc = daemon(backend, tree, ns)
                        mid_churn_kills += 1
                    elif rng.random() < 0.5:
                        time.sleep(rng.random() * 0.2)
                if kill_at > steps:
                    unkilled_rounds += 1
                    # Only partial syncs since the last full one: the same objects and elements
                    # as a fresh apply, endpoints maybe at other shard-map slots.
                    want = slots_resolved(fresh_apply(backend, tree))
                    got = settles_to(backend, ns, want, 60, slots_resolved)
                    assert got == want, _diff(want, got)
                kill(proc)
                proc = daemon(backend, tree, ns)
            # The last restart came mid-churn or after it; nothing changes any more: the table
            # must become exactly the fresh apply's (stale objects of the partial syncs and of
            # the killed runs removed), and stay so across one more restart.
            want = fresh_apply(backend, tree)
            got = settles_to(backend, ns, want, 60)
            assert got == want, _diff(want, got)
            kill(proc)
            proc = daemon(backend, tree, ns)
            got = settles_to(backend, ns, want, 60)
            assert got == want, _diff(want, got)
        finally:
            kill(proc)
        assert mid_churn_kills and unkilled_rounds  # the seed walked both kinds of round


def _diff(want: str, got: str) -> str:
    return "table differs from a fresh apply:\n" + "\n".join(
        difflib.unified_diff(want.splitlines(), got.splitlines(), "fresh apply", "daemon", lineterm="", n=1)
    )


@pytest.mark.parametrize("flavour", list(Flavour))
def test_two_concurrent_appliers_never_duplicate_a_jump(netns: str, flavour: Flavour) -> None:
    """Issue J.4: check-then-insert raced by two appliers in one namespace inserted the jump
    twice. Two runners, released together by a barrier, ensure the same jumps 25 times."""
    runners = [IptablesRunner(IPFamily.V4, netns, flavour) for _ in range(2)]
    runners[0].restore("*nat\n:KUBE-SERVICES - [0:0]\nCOMMIT\n*filter\n:KUBE-FORWARD - [0:0]\nCOMMIT\n")
    jumps = [
        ("nat", "PREROUTING", ["-m", "comment", "--comment", "kubernetes service portals", "-j", "KUBE-SERVICES"]),
        ("filter", "FORWARD", ["-m", "comment", "--comment", "kubernetes forwarding rules", "-j", "KUBE-FORWARD"]),
    ]
    barrier = threading.Barrier(2)
    inserted: list[bool] = []

    def apply(runner: IptablesRunner) -> None:
        barrier.wait(timeout=30)
        for table_name, chain, spec in jumps:
            inserted.append(runner.ensure_rule(table_name, chain, spec))

    for _ in range(25):
        for table_name, chain, spec in jumps:
            runners[0].delete_rule(table_name, chain, spec)
        inserted.clear()
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(apply, runners))
        for table_name, chain, _spec in jumps:
            rules = [l for l in runners[0].save(table_name).splitlines() if l.startswith(f"-A {chain} ")]
            assert len(rules) == 1, rules
        assert inserted.count(True) == len(jumps)  # each jump inserted by exactly one applier


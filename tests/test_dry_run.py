"""`nfproxy --dry-run`: the canary beside kube-proxy syncs in-memory kernels and touches nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from nfproxy.cli.main import main
from nfproxy.kernel import netns

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize("mode", ["nftables", "iptables"])
def test_a_dry_run_syncs_everything_without_privileges(mode: str, capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["--dry-run", "--once", "--proxy-mode", mode, "--manifests", str(EXAMPLES),
                   "--healthz-bind-address", "127.0.0.1:0", "--metrics-bind-address", ""])
    out = capsys.readouterr()
    assert status == 0, out.err
    assert "kind=full servicesChanged=10" in out.out, out.out
    operations = int(out.out.split("operations=", 1)[1].split()[0])
    assert operations > 100, out.out


def test_a_dry_run_refuses_a_namespace_to_program() -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--dry-run", "--once", "--manifests", str(EXAMPLES), "--netns", "nowhere"])
    assert exit_.value.code == 2


@pytest.mark.kernel
@pytest.mark.parametrize("mode", ["nftables", "iptables"])
def test_a_dry_run_leaves_the_machine_as_it_was(mode: str) -> None:
    with netns.throwaway("nfp-dry") as ns:
        def ruleset() -> str:
            nft = subprocess.run(["ip", "netns", "exec", ns, "nft", "list", "ruleset"],
                                 capture_output=True, text=True, check=True).stdout
            ipt = "".join(
                subprocess.run(["ip", "netns", "exec", ns, tool], capture_output=True, text=True).stdout
                for tool in ("iptables-legacy-save", "iptables-nft-save")
            )
            return nft + ipt

        before = ruleset()
        done = subprocess.run(
            ["ip", "netns", "exec", ns, sys.executable, "-m", "nfproxy.cli", "--dry-run", "--once",
             "--proxy-mode", mode, "--manifests", str(EXAMPLES), "--healthz-bind-address",
             "127.0.0.1:0", "--metrics-bind-address", ""],
            capture_output=True, text=True, timeout=120,
        )
        assert done.returncode == 0, done.stderr
        assert "kind=full" in done.stdout
        assert ruleset() == before
        assert "KUBE-" not in before and "nfproxy" not in before


@pytest.mark.parametrize("verbosity,shown", [("0", False), ("2", True)])
def test_sync_lines_follow_v_and_are_klog_lines(verbosity: str, shown: bool) -> None:
    from tests.conftest import run_cli_forked

    code, _, err = run_cli_forked(["--dry-run", "--once", "--proxy-mode", "nftables", "--manifests",
                                   str(EXAMPLES), "--healthz-bind-address", "127.0.0.1:0",
                                   "--metrics-bind-address", "", f"--v={verbosity}"])
    assert code == 0, err
    syncs = [line for line in err.splitlines() if '"Syncing nftables rules"' in line]
    assert bool(syncs) is shown, err
    for line in syncs:  # klog: Lmmdd hh:mm:ss.uuuuuu PID file:line] "message" key="value" ...
        assert line[0] == "I" and "proxier.py:" in line and 'ipFamily="IPv' in line and "kind=" in line


def test_json_logging_is_one_object_per_line() -> None:
    import json

    from tests.conftest import run_cli_forked

    code, _, err = run_cli_forked(["--dry-run", "--once", "--proxy-mode", "nftables", "--manifests",
                                   str(EXAMPLES), "--healthz-bind-address", "127.0.0.1:0",
                                   "--metrics-bind-address", "", "--v=2", "--logging-format", "json"])
    assert code == 0, err
    records = [json.loads(line) for line in err.splitlines() if line.strip()]
    assert any(r.get("msg") == "Syncing nftables rules" and r.get("ipFamily") == "IPv4" for r in records), err


def _tgkill(pid: int, tid: int, sig: int) -> None:
    """A signal for one thread of another process (os.kill lets the kernel choose the thread)."""
    import ctypes
    import os

    libc = ctypes.CDLL(None, use_errno=True)
    SYS_tgkill = {"x86_64": 234, "aarch64": 131}[os.uname().machine]
    if libc.syscall(SYS_tgkill, pid, tid, sig) != 0:
        raise OSError(ctypes.get_errno(), "tgkill")


def test_sigterm_taken_by_a_worker_thread_still_stops_the_daemon(tmp_path: Path) -> None:
    """The kernel may run a process signal's handler on any thread. Python runs the Python
    handler on the main thread only, and a main thread blocked in `Event.wait()` was never
    woken: under load one SIGTERM in thirty went unseen and the daemon kept running. Aimed at
    a worker thread here, as the kernel sometimes chooses."""
    import os
    import signal
    import time

    log = tmp_path / "daemon.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "nfproxy.cli", "--dry-run", "--proxy-mode", "iptables", "--manifests",
             str(EXAMPLES), "--healthz-bind-address", "127.0.0.1:0", "--metrics-bind-address", "", "--v=2"],
            stdout=out, stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 60
        while '"Syncing iptables rules"' not in log.read_text() and proc.poll() is None:
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        workers = [int(t) for t in os.listdir(f"/proc/{proc.pid}/task") if int(t) != proc.pid]
        assert workers, "the daemon runs its sync loop and servers on threads of their own"
        _tgkill(proc.pid, workers[0], signal.SIGTERM)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail("SIGTERM to a worker thread did not stop the daemon:\n" + log.read_text())
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 0, log.read_text()
    assert "Received signal" in log.read_text() and "SIGTERM" in log.read_text()

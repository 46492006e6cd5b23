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

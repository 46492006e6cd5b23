"""The command line as a user meets it: output, exit status, error messages."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
from pathlib import Path

import pytest

from nfproxy.cli.main import main

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    """The CLI in-process, as `nfproxy ARGV` would run it: exit status, stdout and stderr.

    In-process rather than `sys.executable -m nfproxy`: the interpreter need not be executable
    by whoever runs the tests (an unprivileged user may not reach a venv's base interpreter).
    """
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as exc:  # argparse errors exit 2
            code = exc.code if isinstance(exc.code, int) else 1
    return subprocess.CompletedProcess(list(argv), code, out.getvalue(), err.getvalue())


@pytest.mark.parametrize("backend", ["iptables", "nft"])
def test_render_examples(backend: str) -> None:
    proc = run("render", "--backend", backend, str(EXAMPLES))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    if backend == "iptables":
        assert proc.stdout.count("*nat\n") == 2 and proc.stdout.count("COMMIT\n") == 4
        assert proc.stdout.index("# IPv4") < proc.stdout.index("# IPv6")
        assert "--probability 0.3333333333" in proc.stdout
    else:
        assert "add table ip nfproxy" in proc.stdout and "add table ip6 nfproxy" in proc.stdout
        assert "dnat ip to numgen random mod 3 offset" in proc.stdout and "map @endpoints-counted-tcp-hash-0" in proc.stdout


def test_render_reports_bad_objects_and_keeps_the_rest(tmp_path: Path) -> None:
    (tmp_path / "good.yaml").write_text((EXAMPLES / "shop.yaml").read_text())
    (tmp_path / "bad.yaml").write_text(
        "apiVersion: v1\nkind: Service\nmetadata: {name: broken, namespace: default}\n"
        "spec: {clusterIP: 10.96.9.9, ports: [{port: 70000}]}\n"
    )
    proc = run("render", "--backend", "nft", str(tmp_path))
    assert proc.returncode == 0
    assert "Service default/broken" in proc.stderr and "spec.ports[0].port" in proc.stderr
    assert "numgen random" in proc.stdout


def test_render_missing_path_fails() -> None:
    proc = run("render", "--backend", "nft", "/nonexistent/manifests")
    assert proc.returncode != 0
    assert "/nonexistent/manifests" in proc.stderr


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--node-ip", "300.1.1.1"], "--node-ip"),
        (["--cluster-cidr", "10.0.0.0/33"], "--cluster-cidr"),
        (["--cluster-cidr", "10.0.0.0/8,10.1.0.0/16"], "more than one IPv4"),
        (["--node-name", "Bad_Name"], "--node-name"),
        (["--nodeport-addresses", "nope"], "--nodeport-addresses"),
    ],
)
def test_bad_flags_are_named(flags: list[str], message: str) -> None:
    proc = run("render", "--backend", "nft", *flags, str(EXAMPLES))
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("argv", [
    ("check", "--netns", "nfp-no-such-namespace"),
    ("trace", "--netns", "nfp-no-such-namespace", "10.0.0.1", "10.96.0.10:53/udp"),
])
def test_a_missing_namespace_is_a_bad_flag(argv: tuple[str, ...]) -> None:
    """Status 2 and the flag named, as for any bad flag (it was 1, as for a kernel failure)."""
    proc = run(*argv)
    assert proc.returncode == 2, proc.stderr
    assert "--netns: no network namespace named 'nfp-no-such-namespace'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_node_flags_change_the_rules(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["render", "--backend", "iptables", "--masquerade-all", str(EXAMPLES)]) == 0
    out = capsys.readouterr().out
    services = [ln for ln in out.split("# IPv6")[0].splitlines() if ln.startswith("-A KUBE-SVC-")]
    assert services and not [ln for ln in services if "! -s " in ln], "masquerade-all replaces the pod-CIDR test"


@pytest.mark.kernel
def test_validate_examples(netns: str) -> None:  # noqa: ARG001 - the fixture asserts root
    proc = run("validate", str(EXAMPLES))
    assert proc.returncode == 0, proc.stderr
    assert "every ruleset was accepted by the kernel" in proc.stdout
    for line in ("iptables IPv4", "iptables IPv6", "nft      IPv4", "nft      IPv6"):
        assert line in proc.stdout
    assert "nfp-validate" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def _as_process(*argv: str, **kwargs: object) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "nfproxy", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kwargs)  # type: ignore[call-overload]


@pytest.fixture(scope="module")
def large_dump(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Rules whose `check` report is far larger than a pipe's buffer (64 KiB) and stdout's."""
    from nfproxy.backends.registry import render_text
    from nfproxy.testing import uniform_cluster

    path = tmp_path_factory.mktemp("dump") / "rules.nft"
    path.write_text(render_text("nft", uniform_cluster(400, 10)))
    return path


def test_a_command_that_exits_fast_writes_all_its_output(large_dump: Path) -> None:
    """`check` ends with os._exit (nfproxy/cli/exit.py): everything buffered must be out first,
    and the status must be the command's."""
    expected = run("check", "--from-file", str(large_dump))
    proc = _as_process("check", "--from-file", str(large_dump))
    out, err = proc.communicate(timeout=120)
    assert len(expected.stdout) > 256 * 1024
    assert (proc.returncode, out, err) == (expected.returncode, expected.stdout, expected.stderr)


def test_a_reader_that_goes_away_ends_the_command_quietly(large_dump: Path) -> None:
    """`nfproxy check | head -1`: exit 141 (as a command killed by SIGPIPE), no traceback."""
    proc = _as_process("check", "--from-file", str(large_dump))
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline().startswith("nft script")
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 141
    assert err == ""

"""Hostile or mistaken input to `--config FILE` and the daemon's flags: each is a clear error
naming the file, line and field (or the flag), exit status 2, never a traceback, never a hang,
and never a 100 KB line (docs/running.md, "kube-proxy's flags and configuration").
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conftest import run_cli_forked

from nfproxy.cli import duration as go_duration
from nfproxy.cli import kubeproxy_config
from nfproxy.cli.flag_types import decimal, display
from nfproxy.cli.main import main

HEADER = f"apiVersion: {kubeproxy_config.API_VERSION}\nkind: KubeProxyConfiguration\n"


def _refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run in process with --write-config-to; assert status 2, no output file; return stderr."""
    out = tmp_path / "out.yaml"
    try:
        status = main([*argv, "--write-config-to", str(out)])
    except SystemExit as exc:  # argparse's usage error (parser.error), as for any bad flag
        status = exc.code
    assert status == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and not out.exists()
    return err


def _config(tmp_path: Path, body: str | bytes) -> Path:
    path = tmp_path / "config.conf"
    if isinstance(body, bytes):
        path.write_bytes(body)
    else:
        path.write_text(HEADER + body)
    return path


# ---- 1. reading the file


@pytest.mark.parametrize("body, line, field, message", [
    ("bindAddress: 2020-02-30\n", 3, "bindAddress", "a value cannot be read: day is out of range"),
    ("oomScoreAdj: " + "9" * 5000 + "\n", 3, "oomScoreAdj",
     "a value cannot be read: an integer with too many digits"),
    ("conntrack:\n  min: " + "9" * 5000 + "\n", 4, "conntrack.min",
     "a value cannot be read: an integer with too many digits"),
])
def test_a_value_python_cannot_build_is_named_by_line_and_field(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], body: str, line: int, field: str,
        message: str) -> None:
    config = _config(tmp_path, body)
    err = _refused(tmp_path, capsys, "--config", str(config))
    assert f"{config}:{line}: KubeProxyConfiguration: {field}: {message}" in err
    assert "set_int_max_str_digits" not in err


def test_a_file_that_is_not_utf8_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = _config(tmp_path, b"\xff\xfe" + HEADER.encode())
    err = _refused(tmp_path, capsys, "--config", str(config))
    assert f"{config}: KubeProxyConfiguration: not UTF-8 text (byte 0)" in err


@pytest.mark.parametrize("depth", [995, 5000])
def test_a_deeply_nested_value_is_refused_without_printing_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], depth: int) -> None:
    config = _config(tmp_path, "featureGates: " + "[" * depth + "]" * depth + "\n")
    err = _refused(tmp_path, capsys, "--config", str(config))
    assert f"{config}:3: KubeProxyConfiguration: " in err
    assert len(err) < 300, err


def test_deep_values_of_a_warned_field_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """logging.options takes anything and is only warned about: its value is never printed whole."""
    config = _config(tmp_path, "logging:\n  options: " + "{a: " * 900 + "1" + "}" * 900 + "\n")
    out = tmp_path / "out.yaml"
    status = main(["--config", str(config), "--write-config-to", str(out)])
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err) < 400, err
    assert status == 2 or "logging.options: a mapping: ignored" in err


def test_a_fifo_is_refused_at_once(tmp_path: Path) -> None:
    fifo = tmp_path / "config.conf"
    os.mkfifo(fifo)
    code, _, err = run_cli_forked(["--config", str(fifo), "--write-config-to", str(tmp_path / "o")],
                                  timeout=30)
    assert code == 2, err
    assert f"{fifo}: cannot read: a FIFO, not a regular file" in err and "Traceback" not in err


def test_a_device_is_not_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = _refused(tmp_path, capsys, "--config", "/dev/zero")
    assert "/dev/zero: cannot read: a character device, not a regular file" in err


def test_a_file_over_the_size_limit_is_not_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = _config(tmp_path, "# " + "x" * kubeproxy_config.MAX_BYTES + "\n")
    err = _refused(tmp_path, capsys, "--config", str(config))
    assert f"larger than the {kubeproxy_config.MAX_BYTES}-byte limit of a configuration file" in err
    assert "--max-manifest-bytes" not in err


# ---- 2. a file's value is the file's error, not a flag's


@pytest.mark.parametrize("body, line, field, message", [
    ('clusterCIDR: "10.0.0.0/08"\n', 3, "clusterCIDR", "10.0.0.0/08 is not a valid CIDR"),
    ('clusterCIDR: "10.0.0.0/8,10.1.0.0/16"\n', 3, "clusterCIDR", "more than one IPv4 value"),
    ('clusterCIDR: "10.0.0.0/8,fd00::/48,10.1.0.0/16"\n', 3, "clusterCIDR", "more than one IPv4 value"),
    ('clusterCIDR: ",,"\n', 3, "clusterCIDR", "empty item"),
    ('nodePortAddresses: ["10.0.0.0/08"]\n', 3, "nodePortAddresses", "10.0.0.0/08 is not a valid CIDR"),
    ('nodePortAddresses: ["10.0.0.0/8,10.1.0.0/16"]\n', 3, "nodePortAddresses", "is not a valid CIDR"),
    ('bindAddress: "fe80::1%eth0"\n', 3, "bindAddress", "is not a valid IP address"),
    ("detectLocalMode: BridgeInterface\ndetectLocal:\n  bridgeInterface: 'br0\";drop'\n", 5,
     "detectLocal.bridgeInterface", "not an interface name"),
    ("detectLocal:\n  bridgeInterface: 'br0\";drop'\n", 4, "detectLocal.bridgeInterface",
     "not an interface name"),
    ('detectLocal:\n  interfaceNamePrefix: "veth\\n"\n', 4, "detectLocal.interfaceNamePrefix",
     "not an interface name: 'veth\\n'"),
    ("detectLocalMode: BridgeInterface\n", 3, "detectLocalMode", "needs detectLocal.bridgeInterface"),
    ("detectLocalMode: InterfaceNamePrefix\n", 3, "detectLocalMode", "needs detectLocal.interfaceNamePrefix"),
    ('healthzBindAddress: "127.0.0.1:٨٠"\n', 3, "healthzBindAddress", "port must be a number"),
])
def test_a_files_value_is_named_by_file_line_and_field(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], body: str, line: int, field: str,
        message: str) -> None:
    config = _config(tmp_path, body)
    err = _refused(tmp_path, capsys, "--config", str(config))
    assert f"{config}:{line}: KubeProxyConfiguration: {field}: " in err
    assert message in err
    assert "error: --" not in err and "usage:" not in err, "reported as a flag"


def test_the_command_line_can_give_the_interface_the_files_mode_needs(tmp_path: Path) -> None:
    config = _config(tmp_path, "detectLocalMode: BridgeInterface\n")
    out = tmp_path / "out.yaml"
    assert main(["--config", str(config), "--pod-bridge-interface", "cbr0", "--write-config-to", str(out)]) == 0
    assert "bridgeInterface: cbr0\n" in out.read_text()


# ---- 3. keys and long values shown safely


def test_a_feature_gate_key_is_shown_escaped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = _config(tmp_path, 'featureGates:\n  "foo bar\\nx": true\n')
    err = _refused(tmp_path, capsys, "--config", str(config))
    assert err.count("\n") == 1, err
    assert f"{config}:4: KubeProxyConfiguration: featureGates.'foo bar\\nx': " in err


def test_an_unknown_key_is_shown_escaped_and_cut(tmp_path: Path) -> None:
    # YAML allows simple keys up to 1024 characters; an unknown field is only warned about.
    config = _config(tmp_path, '"evil\\nnfproxy: forged' + "x" * 900 + '": 1\n')
    (warning,) = kubeproxy_config.load(str(config)).warnings
    assert "\n" not in warning and len(warning) < 300 + len(str(config)), warning
    assert "unknown field, ignored" in warning and "'evil\\nnfproxy: forged" in warning


def test_a_long_unknown_feature_gate_is_refused_in_a_short_line(tmp_path: Path) -> None:
    name = "A" * 100_000
    code, _, err = run_cli_forked(["--feature-gates", f"{name}=true", "--write-config-to",
                                   str(tmp_path / "out.yaml")], timeout=60)
    assert code == 2, err[-500:]
    assert "unrecognized feature gate: 'AAAA" in err and len(err) < 500


def test_a_long_bad_feature_gate_flag_is_cut(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = _refused(tmp_path, capsys, "--feature-gates", "A" * 100_000)
    assert "is not Name=true|false" in err and len(err) < 500


def test_display_is_bounded_and_one_line() -> None:
    assert display("x" * 10_000).endswith("...") and len(display("x" * 10_000)) == 60
    assert "\n" not in display("a\nb") and display("a\nb") == "'a\\nb'"
    assert display([[[]]]) == "a list" and display({"a": 1}) == "a mapping"
    assert display(True) == "true" and display(None) == "null" and display(-3) == "-3"
    # Past Python's 4 300-digit int-to-str limit: said by size (str() would raise).
    assert display(10**5000) == "an integer of about 5001 digits"
    assert display(10**200) == "an integer of about 201 digits" and display(10**40) == str(10**40)


def test_duration_errors_quote_as_go_and_stay_short() -> None:
    with pytest.raises(go_duration.DurationError) as exc:
        go_duration.parse("1\nx" + "y" * 1000)
    assert "\n" not in str(exc.value) and len(str(exc.value)) < 160
    with pytest.raises(go_duration.DurationError):
        go_duration.parse("9" * 5000 + "s")  # overflow, as Go's, not int()'s ValueError
    assert go_duration.parse("0" * 5000 + "1s") == 1_000_000_000
    assert go_duration.parse("1." + "5" * 5000 + "s") == 1_555_555_555


# ---- 4.-7. the flags


@pytest.mark.parametrize("argv, message", [
    # 4. kube-proxy's int32 fields, refused as the file refuses them
    (["--conntrack-max-per-core=99999999999999999999999"], "--conntrack-max-per-core: "
     "'99999999999999999999999': must be from 0 to 2147483647"),
    (["--conntrack-min=2147483648"], "--conntrack-min: '2147483648': must be from 0 to 2147483647"),
    (["--v=99999999999999999999999"], "must be from 0 to 2147483647"),
    (["--v=2147483648"], "must be from 0 to 2147483647"),
    # 5. what docs/running.md promises
    (["--empty-source-grace=-5s"], "--empty-source-grace: '-5s': must not be negative"),
    (["--empty-source-grace=soon"], "--empty-source-grace: not a duration"),
    (["--max-manifest-bytes", "0"], "--max-manifest-bytes: not a positive size: '0'"),
    (["--max-manifest-bytes", "2Gi"], "--max-manifest-bytes: '2Gi': must be at most 1Gi"),
    # 6. empty items
    (["--cluster-cidr", ",,"], "--cluster-cidr: ',,': empty item"),
    (["--cluster-cidr", "10.0.0.0/8,"], "--cluster-cidr: '10.0.0.0/8,': empty item"),
    (["--nodeport-addresses", "primary,"], "--nodeport-addresses: 'primary,': empty item"),
    (["--cluster-cidr", "10.0.0.0/8,10.1.0.0/16"], "one per IP family"),
    # 7. ASCII decimal digits only
    (["--healthz-bind-address", "127.0.0.1:٨٠"], "--healthz-bind-address: '127.0.0.1:٨٠': port must be"),
    (["--healthz-bind-address", "127.0.0.1:+80"], "port must be a number from 0 to 65535"),
    (["--metrics-bind-address", "127.0.0.1:1_0"], "port must be a number from 0 to 65535"),
    (["--metrics-bind-address", "127.0.0.1:" + "1" * 5000], "too long to be ip:port"),
    (["--iptables-masquerade-bit", "٨"], "--iptables-masquerade-bit: '٨' is not a decimal integer"),
    (["--iptables-masquerade-bit", "1_0"], "is not a decimal integer"),
    (["--conntrack-min", "+5"], "--conntrack-min: '+5' is not a decimal integer"),
    (["--v=٨"], "is not a verbosity level"),
    (["--max-manifest-bytes", "٨Mi"], "--max-manifest-bytes: not a positive size"),
    (["--iptables-sync-period", "٣s"], "--iptables-sync-period: not a duration"),
    (["--pod-bridge-interface", 'br0";drop'], "--pod-bridge-interface: not an interface name"),
])
def test_a_bad_flag_is_refused_before_anything_is_written(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    err = _refused(tmp_path, capsys, *argv)
    assert message in err
    assert len(err.splitlines()[-1]) < 300


@pytest.mark.parametrize("argv", [
    ["--conntrack-min=2147483647", "--conntrack-max-per-core=0", "--v=2147483647"],
    ["--cluster-cidr", "", "--cluster-cidr", "10.0.0.0/8,fd00::/48"],
    ["--healthz-bind-address", "[::1]:0080", "--max-manifest-bytes", "1Gi"],
])
def test_what_the_flags_write_reads_back(tmp_path: Path, argv: list[str]) -> None:
    first, second = tmp_path / "first.yaml", tmp_path / "second.yaml"
    assert main([*argv, "--write-config-to", str(first)]) == 0
    assert main(["--config", str(first), "--write-config-to", str(second)]) == 0
    assert first.read_text() == second.read_text()


def test_decimal_takes_ascii_digits_only() -> None:
    assert decimal("42") == 42 and decimal("-7") == -7 and decimal("007") == 7
    for text in ("+1", "1_0", "٨", " 1", "1 ", "", "-", "0x10"):
        assert decimal(text) is None, text
    assert decimal("9" * 100_000) == 10**19

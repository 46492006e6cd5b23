"""kube-proxy's configuration file and flags: parsing, precedence, errors, and what the daemon does
with them in a throwaway namespace."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import run_cli_forked

from nfproxy.cli import conntrack_sysctls, kubeproxy_config
from nfproxy.cli import duration as go_duration
from nfproxy.cli.main import main, parse
from nfproxy.core.model import NodeConfig

HERE = Path(__file__).resolve().parent
EXAMPLES = HERE.parent / "examples"
KUBEADM = HERE / "kubeadm-kube-proxy-config.yaml"
HEADER = f"apiVersion: {kubeproxy_config.API_VERSION}\nkind: KubeProxyConfiguration\n"


def nfproxy(*argv: object) -> subprocess.CompletedProcess[str]:
    """The command in a child process (forked: see conftest.run_cli_forked)."""
    code, out, err = run_cli_forked([str(a) for a in argv], timeout=120)
    return subprocess.CompletedProcess([str(a) for a in argv], code, out, err)


def parsed(*argv: object) -> argparse.Namespace:
    return parse([str(a) for a in argv] or ["run"])[1]


def comparable(args: argparse.Namespace) -> dict[str, object]:
    """The namespace without what only says where the values came from."""
    return {k: v for k, v in vars(args).items() if k not in ("config", "config_warnings", "func")}


# ---- Go durations


@pytest.mark.parametrize("text, nanoseconds", [
    ("0", 0), ("0s", 0), (".5s", 500_000_000), ("1.5h", 5_400_000_000_000), ("300ms", 300_000_000),
    ("1h2m", 3_720_000_000_000), ("-1s", -1_000_000_000), ("+2s", 2_000_000_000), ("5.s", 5_000_000_000),
    ("1µs", 1_000), ("1μs", 1_000), ("1us", 1_000), ("7ns", 7), ("1h30m0.5s", 5_400_500_000_000),
    ("0.1s", 100_000_000), ("2562047h47m16.854775807s", 2**63 - 1),
])
def test_go_durations_parse_as_go_parses_them(text: str, nanoseconds: int) -> None:
    assert go_duration.parse(text) == nanoseconds


@pytest.mark.parametrize("text", ["", "1", ".s", "s", "1d", "1e3s", "1h 1m", " 1s", "1.0.0s", "--1s",
                                  "2562047h47m16.854775808s"])
def test_what_go_refuses_is_refused(text: str) -> None:
    with pytest.raises(go_duration.DurationError):
        go_duration.parse(text)


@pytest.mark.parametrize("nanoseconds, text", [
    (0, "0s"), (30 * 10**9, "30s"), (60 * 10**9, "1m0s"), (86400 * 10**9, "24h0m0s"),
    (1_500_000_000, "1.5s"), (300_000_000, "300ms"), (1_000, "1µs"), (-10**9, "-1s"),
])
def test_durations_print_as_go_prints_them(nanoseconds: int, text: str) -> None:
    assert go_duration.format(nanoseconds) == text
    assert go_duration.parse(text) == nanoseconds


# ---- kubeadm's file


def test_kubeadms_default_file_means_kube_proxys_defaults() -> None:
    loaded = kubeproxy_config.load(str(KUBEADM))
    assert loaded.warnings == ()
    with_file = parsed("--config", KUBEADM)
    with_flags = parsed("--kubeconfig", "/var/lib/kube-proxy/kubeconfig.conf")
    assert comparable(with_file) == comparable(with_flags)
    assert with_file.backend == "iptables"
    assert (with_file.iptables_sync_period, with_file.iptables_min_sync_period) == ("30s", "1s")
    assert with_file.healthz_bind_address == "0.0.0.0:10256"


@pytest.mark.parametrize("mode, backend", [("iptables", "iptables"), ("nftables", "nftables")])
def test_mode_selects_the_backend(tmp_path: Path, mode: str, backend: str) -> None:
    config = tmp_path / "config.conf"
    config.write_text(HEADER + f"mode: {mode}\n")
    assert parsed("--config", config).backend == backend
    other = "iptables" if mode == "nftables" else "nftables"
    assert parsed("--config", config, "--proxy-mode", other).backend == other
    assert parsed("--config", config, "--backend", "nft").backend == "nft"


def test_flags_win_over_the_file_and_defaults_never_do(tmp_path: Path) -> None:
    config = tmp_path / "config.conf"
    config.write_text(HEADER + (
        "clusterCIDR: 10.0.0.0/8\n"
        "nodePortAddresses: [192.168.0.0/16]\n"
        "iptables: {syncPeriod: 10s, masqueradeAll: true}\n"
        "conntrack: {maxPerCore: 0, tcpEstablishedTimeout: 2h}\n"
        "logging: {verbosity: 3, format: json}\n"
        "hostnameOverride: node-a\n"
    ))
    only_file = parsed("--config", config)
    assert only_file.cluster_cidr == ["10.0.0.0/8"]
    assert only_file.nodeport_addresses == ["192.168.0.0/16"]
    assert only_file.iptables_sync_period == "10s" and only_file.masquerade_all is True
    assert only_file.conntrack_max_per_core == 0
    assert only_file.conntrack_tcp_timeout_established == "2h"
    assert (only_file.verbosity, only_file.logging_format, only_file.node_name) == (3, "json", "node-a")
    both = parsed("--v=1", "--config", config, "--cluster-cidr", "10.1.0.0/16", "--iptables-sync-period=30s",
                  "--nodeport-addresses", "10.9.0.0/16", "--hostname-override", "node-b",
                  "--masquerade-all=false", "--sync-period", "20s")
    # Repeatable flags replace the file's list, as kube-proxy's flags do; they never add to it.
    assert both.cluster_cidr == ["10.1.0.0/16"]
    assert both.nodeport_addresses == ["10.9.0.0/16"]
    assert both.iptables_sync_period == "30s"  # the flag's value equals its default: still wins
    assert both.masquerade_all is False and both.sync_period == "20s"
    assert (both.verbosity, both.node_name) == (1, "node-b")
    # kube-proxy would drop these (Options.Complete: `o.config = c`): one warning says so.
    assert both.config_warnings[-1] == (
        f"--config {config}: --cluster-cidr, --iptables-sync-period, --nodeport-addresses, "
        "--masquerade-all win over the file here; kube-proxy would ignore them with --config")
    assert not any("win over the file" in w for w in only_file.config_warnings)
    after = parsed("run", "--config", config, "-v", "2")
    assert after.verbosity == 2


def test_the_file_applies_the_sections_of_its_own_mode(tmp_path: Path) -> None:
    config = tmp_path / "config.conf"
    config.write_text(HEADER + (
        "mode: nftables\n"
        "iptables: {masqueradeAll: true, syncPeriod: 10s}\n"
        "nftables: {masqueradeAll: false, syncPeriod: 20s}\n"
    ))
    args = parsed("--config", config)
    assert args.masquerade_all is False
    assert (args.iptables_sync_period, args.nftables_sync_period) == ("10s", "20s")


def test_a_command_line_source_replaces_the_files_kubeconfig() -> None:
    assert parsed("--config", KUBEADM).kubeconfig == "/var/lib/kube-proxy/kubeconfig.conf"
    assert parsed("--config", KUBEADM, "--manifests", EXAMPLES).kubeconfig is None


@pytest.mark.parametrize("body, line, field, message", [
    ("mode: ipvs\n", 3, "mode", "'ipvs': nfproxy has the iptables and nftables modes only"),
    ("mode: kernelspace\n", 3, "mode", "'kernelspace'"),
    ("iptables:\n  syncPeriod: 30\n", 4, "iptables.syncPeriod", "30: must be a duration string"),
    ("iptables:\n  minSyncPeriod: -1s\n", 4, "iptables.minSyncPeriod", "'-1s': must not be negative"),
    ("nftables:\n  syncPeriod: 1d\n", 4, "nftables.syncPeriod", 'unknown unit "d"'),
    ("iptables:\n  masqueradeBit: 32\n", 4, "iptables.masqueradeBit", "32: must be from 0 to 31"),
    ("conntrack:\n  maxPerCore: -1\n", 4, "conntrack.maxPerCore", "-1: must be from 0"),
    ("conntrack:\n  tcpBeLiberal: yes please\n", 4, "conntrack.tcpBeLiberal", "must be true or false"),
    ("clusterCIDR: 10.0.0.0/33\n", 3, "clusterCIDR", "10.0.0.0/33 is not a valid CIDR"),
    ("nodePortAddresses: [nope]\n", 3, "nodePortAddresses",
     "[0] nope is not a valid CIDR (nor one of the keywords 'primary', 'localhost', 'all')"),
    ("bindAddress: here\n", 3, "bindAddress", "here is not a valid IP address"),
    ("metricsBindAddress: 127.0.0.1:0\n", 3, "metricsBindAddress", "port must be from 1 to 65535"),
    ("healthzBindAddress: 'here'\n", 3, "healthzBindAddress", "is not ip:port"),
    ("nodePortAddresses: [primary, 10.0.0.0/8, primary]\n", 3, "nodePortAddresses",
     "[2] 'primary': duplicate value"),
    ("clientConnection:\n  burst: -1\n", 4, "clientConnection.burst", "-1: must be from 0"),
    ("iptables:\n  minSyncPeriod: 1m\n", 4, "iptables.minSyncPeriod",
     "'1m': must not be greater than iptables.syncPeriod ('30s')"),
    ("mode: nftables\nnftables:\n  syncPeriod: 500ms\n", 5, "nftables.syncPeriod",
     "'1s': must not be greater than nftables.syncPeriod ('500ms')"),
    ("hostnameOverride: Bad_Name\n", 3, "hostnameOverride", "Bad_Name"),
    ("detectLocalMode: Magic\n", 3, "detectLocalMode", "must be one of ClusterCIDR"),
    ("logging:\n  format: xml\n", 4, "logging.format", "'xml': must be one of text, json"),
    ("featureGates:\n  Foo: maybe\n", 4, "featureGates.Foo", "'maybe': must be true or false"),
    ("iptables: 3\n", 3, "iptables", "must be a map"),
])
def test_a_wrong_field_is_named_with_file_and_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   body: str, line: int, field: str, message: str) -> None:
    config = tmp_path / "config.conf"
    config.write_text(HEADER + body)
    assert main(["--config", str(config), "--write-config-to", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"{config}:{line}: KubeProxyConfiguration: {field}: " in err
    assert message in err
    assert "Traceback" not in err and not (tmp_path / "out").exists()


@pytest.mark.parametrize("head, message", [
    ("apiVersion: kubeproxy.config.k8s.io/v1beta1\nkind: KubeProxyConfiguration\n", "apiVersion: "),
    ("apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeletConfiguration\n", "kind: "),
    ("- a list\n", "must hold one KubeProxyConfiguration"),
    ("mode: [\n", "invalid YAML"),
])
def test_a_file_that_is_not_kube_proxys_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   head: str, message: str) -> None:
    config = tmp_path / "config.conf"
    config.write_text(head)
    assert main(["--config", str(config), "--write-config-to", str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err


def test_a_missing_file_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--config", "/no/such/config.conf", "--write-config-to", "/dev/null"]) == 2
    assert "/no/such/config.conf: cannot read" in capsys.readouterr().err


def test_settings_nfproxy_cannot_honour_are_warned_about_one_line_each(tmp_path: Path) -> None:
    config = tmp_path / "config.conf"
    config.write_text(HEADER + "ipvs:\n  scheduler: rr\n  strictARP: true\nwinkernel:\n  enableDSR: true\n"
                      "enableProfiling: true\nclientConnection:\n  qps: 50\n")
    warnings = kubeproxy_config.load(str(config)).warnings
    assert [w.split(": ")[2] for w in warnings] == [
        "ipvs.scheduler", "ipvs.strictARP", "winkernel.enableDSR", "enableProfiling", "clientConnection.qps"]
    assert all("\n" not in w and "ignored" in w for w in warnings)
    proc = nfproxy("--config", config, "--write-config-to", tmp_path / "out.yaml")
    assert proc.returncode == 0, proc.stderr
    assert f"{config}:4: KubeProxyConfiguration: ipvs.scheduler: 'rr': ignored, nfproxy has no IPVS mode" in proc.stderr


def test_a_file_with_kube_proxys_defaults_filled_in_is_not_warned_about(tmp_path: Path) -> None:
    """Older kubeadm wrote every default out (qps 5, burst 10, oomScoreAdj -999, ...)."""
    config = tmp_path / "config.conf"
    config.write_text(HEADER + (
        "clientConnection: {acceptContentTypes: '', burst: 10, contentType: application/vnd.kubernetes.protobuf,"
        " kubeconfig: /var/lib/kube-proxy/kubeconfig.conf, qps: 5}\n"
        "configSyncPeriod: 15m0s\noomScoreAdj: -999\n"
        "conntrack: {maxPerCore: 32768, min: 131072, tcpCloseWaitTimeout: 1h0m0s, tcpEstablishedTimeout: 24h0m0s}\n"
        "ipvs: {excludeCIDRs: null, minSyncPeriod: 0s, scheduler: '', syncPeriod: 30s}\n"
        "iptables: {masqueradeAll: false, masqueradeBit: 14, minSyncPeriod: 0s, syncPeriod: 30s}\n"
    ))
    assert kubeproxy_config.load(str(config)).warnings == ()
    config.write_text(HEADER + "clientConnection: {qps: 50}\noomScoreAdj: -500\n")
    assert len(kubeproxy_config.load(str(config)).warnings) == 2


# ---- --write-config-to


def test_write_config_to_round_trips(tmp_path: Path) -> None:
    first, second = tmp_path / "first.yaml", tmp_path / "second.yaml"
    flags = ["--proxy-mode", "nftables", "--nftables-sync-period", "1m30s", "--cluster-cidr", "10.244.0.0/16",
             "--masquerade-all", "--conntrack-udp-timeout", "45s", "--hostname-override", "node-a",
             "--feature-gates", "NFTablesNetlink=false", "--v=2", "--logging-format", "json"]
    assert main([*flags, "--write-config-to", str(first)]) == 0
    assert main(["--config", str(first), "--write-config-to", str(second)]) == 0
    assert first.read_text() == second.read_text()
    text = first.read_text()
    assert "mode: nftables\n" in text and "syncPeriod: 1m30s\n" in text and "udpTimeout: 45s\n" in text
    assert kubeproxy_config.load(str(first)).warnings == ()
    from_file, from_flags = parsed("--config", first), parsed(*flags)
    for dest in ("backend", "nftables_sync_period", "cluster_cidr", "masquerade_all", "conntrack_udp_timeout",
                 "node_name", "feature_gates", "verbosity", "logging_format"):
        want = getattr(from_flags, dest)
        got = getattr(from_file, dest)
        if dest == "nftables_sync_period":
            got, want = go_duration.parse(got), go_duration.parse(want)
        assert got == want, dest


def test_kubeadms_file_written_back_has_every_default_filled_in(tmp_path: Path) -> None:
    out = tmp_path / "effective.yaml"
    assert main(["--config", str(KUBEADM), "--write-config-to", str(out)]) == 0
    import yaml

    doc = yaml.safe_load(out.read_text())
    assert doc["mode"] == "iptables"
    assert doc["iptables"]["syncPeriod"] == "30s" and doc["iptables"]["minSyncPeriod"] == "1s"
    assert doc["conntrack"] == {"maxPerCore": 32768, "min": 131072, "tcpBeLiberal": False,
                                "tcpCloseWaitTimeout": "1h0m0s", "tcpEstablishedTimeout": "24h0m0s",
                                "udpStreamTimeout": "0s", "udpTimeout": "0s"}
    assert doc["healthzBindAddress"] == "0.0.0.0:10256" and doc["metricsBindAddress"] == "127.0.0.1:10249"
    assert doc["clientConnection"]["kubeconfig"] == "/var/lib/kube-proxy/kubeconfig.conf"


# ---- every flag: its parse and its error


def test_version() -> None:
    for argv in (["--version"], ["run", "--version"]):
        proc = nfproxy(*argv)
        assert proc.returncode == 0 and proc.stdout.startswith("nfproxy "), proc.stderr


@pytest.mark.parametrize("argv, dest, value", [
    (["--proxy-mode", "nftables"], "backend", "nftables"),
    (["--backend", "nft"], "backend", "nft"),
    ([], "backend", "iptables"),
    (["--iptables-sync-period", "1m"], "iptables_sync_period", "1m"),
    (["--nftables-sync-period=.5s"], "nftables_sync_period", ".5s"),
    (["--iptables-min-sync-period", "300ms"], "iptables_min_sync_period", "300ms"),
    (["--nftables-min-sync-period", "0s"], "nftables_min_sync_period", "0s"),
    (["--v=4"], "verbosity", 4),
    (["-v", "3"], "verbosity", 3),
    (["--verbose"], "verbosity", 4),
    (["--logging-format", "json"], "logging_format", "json"),
    (["--init-only"], "init_only", True),
    (["--init-only=false"], "init_only", False),
    (["--cleanup"], "cleanup", True),
    (["--bind-address-hard-fail"], "bind_address_hard_fail", True),
    (["--bind-address", "192.168.0.2"], "bind_address", "192.168.0.2"),
    (["--hostname-override", "node-a"], "node_name", "node-a"),
    (["--conntrack-max-per-core", "0"], "conntrack_max_per_core", 0),
    (["--conntrack-min", "1000"], "conntrack_min", 1000),
    (["--conntrack-tcp-timeout-established", "2h"], "conntrack_tcp_timeout_established", "2h"),
    (["--conntrack-tcp-timeout-close-wait", "30m"], "conntrack_tcp_timeout_close_wait", "30m"),
    (["--conntrack-tcp-be-liberal"], "conntrack_tcp_be_liberal", True),
    (["--conntrack-udp-timeout", "30s"], "conntrack_udp_timeout", "30s"),
    (["--conntrack-udp-timeout-stream", "2m"], "conntrack_udp_timeout_stream", "2m"),
    (["--feature-gates", "NFTablesNetlink=false"], "feature_gates", "NFTablesNetlink=false"),
])
def test_each_flag_parses(argv: list[str], dest: str, value: object) -> None:
    assert getattr(parsed(*argv), dest) == value


@pytest.mark.parametrize("argv, message", [
    (["--proxy-mode", "ipvs"], "invalid choice: 'ipvs'"),
    (["--iptables-sync-period", "fast"], "--iptables-sync-period: not a duration: 'fast'"),
    (["--iptables-sync-period", "0s"], "--iptables-sync-period: must be greater than 0"),
    (["--proxy-mode", "nftables", "--nftables-sync-period=-1s"], "--nftables-sync-period: '-1s': must not be negative"),
    (["--iptables-min-sync-period", "1d"], "--iptables-min-sync-period: not a duration"),
    (["--proxy-mode", "nftables", "--nftables-min-sync-period=-5ms"], "--nftables-min-sync-period: '-5ms'"),
    (["--sync-period", "1 h"], "--sync-period: not a duration"),
    (["--v=x"], "'x' is not a verbosity level"),
    (["--logging-format", "xml"], "invalid choice: 'xml'"),
    (["--init-only=maybe"], "'maybe' is not a boolean"),
    (["--cleanup=2"], "'2' is not a boolean"),
    (["--bind-address-hard-fail=yes"], "'yes' is not a boolean"),
    (["--bind-address", "here"], "--bind-address:"),
    (["--healthz-bind-address", "garbage"], "--healthz-bind-address: 'garbage' is not ip:port"),
    (["--metrics-bind-address", "0.0.0.0:99999"], "--metrics-bind-address: '0.0.0.0:99999': port must be"),
    (["--hostname-override", "Bad_Name"], "--hostname-override: "),
    (["--hostname-override", "   "], "--hostname-override: empty hostname-override is invalid"),
    (["--node-name", "Bad_Name"], "--node-name: "),
    (["--iptables-min-sync-period", "1m"], "--iptables-min-sync-period: '1m': must not be greater than "
                                           "--iptables-sync-period ('30s')"),
    (["--proxy-mode", "nftables", "--sync-period", "2s", "--nftables-min-sync-period", "3s"],
     "--nftables-min-sync-period: '3s': must not be greater than --sync-period ('2s')"),
    (["--masquerade-all=maybe"], "--masquerade-all"),
    (["--conntrack-max-per-core", "-1"], "--conntrack-max-per-core: '-1': must be from 0 to 2147483647"),
    (["--conntrack-min", "lots"], "--conntrack-min: 'lots' is not a decimal integer"),
    (["--conntrack-tcp-timeout-established=-1s"], "--conntrack-tcp-timeout-established: '-1s'"),
    (["--conntrack-tcp-timeout-close-wait", "x"], "--conntrack-tcp-timeout-close-wait: not a duration"),
    (["--conntrack-tcp-be-liberal=perhaps"], "'perhaps' is not a boolean"),
    (["--conntrack-udp-timeout", "1y"], "--conntrack-udp-timeout: not a duration"),
    (["--conntrack-udp-timeout-stream=-2s"], "--conntrack-udp-timeout-stream: '-2s'"),
    (["--feature-gates", "TopologyAwareHints"], "--feature-gates: 'TopologyAwareHints' is not Name=true|false"),
    (["--feature-gates", "Foo=1"], "--feature-gates: Foo: '1' must be true or false"),
])
def test_each_flags_error_names_it(tmp_path: Path, argv: list[str], message: str) -> None:
    proc = nfproxy(*argv, "--write-config-to", tmp_path / "out.yaml")
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "out.yaml").exists()


def test_verbosity_is_accepted_before_and_after_the_subcommand() -> None:
    assert parsed("--v=2", "render", "--backend", "nft", EXAMPLES).verbosity == 2
    assert parsed("render", "--backend", "nft", "--v=3", EXAMPLES).verbosity == 3
    assert parsed("-v", "5", "--proxy-mode", "nftables").verbosity == 5
    assert parsed("--proxy-mode", "nftables", "-v", "1").verbosity == 1
    assert parsed("render", "--backend", "nft", EXAMPLES).verbosity == 0


def test_the_selected_modes_sync_periods_and_nfproxys_own_names() -> None:
    from nfproxy.cli.commands.run import sync_periods

    assert sync_periods(parsed()) == (1.0, 30.0)
    assert sync_periods(parsed("--iptables-sync-period", "1m", "--nftables-sync-period", "2m")) == (1.0, 60.0)
    assert sync_periods(parsed("--proxy-mode", "nftables", "--nftables-min-sync-period", ".5s")) == (0.5, 30.0)
    assert sync_periods(parsed("--backend", "nft", "--sync-period", "1h", "--min-sync-period", "2s")) == (2.0, 3600.0)


def test_feature_gates_are_each_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from nfproxy.cli.feature_gates import parse_feature_gates

    log = logging.getLogger("test.gates")
    with caplog.at_level(logging.WARNING, logger="test.gates"):
        assert parse_feature_gates("NFTablesNetlink=false, ContextualLogging=true", log) == {
            "NFTablesNetlink": False, "ContextualLogging": True}
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [
        "feature gate NFTablesNetlink=false", "feature gate ContextualLogging=true"]


# ---- conntrack sysctls: kube-proxy's plan


def test_conntrack_plan_is_kube_proxys() -> None:
    defaults = conntrack_sysctls.settings_from_args(parsed())
    assert conntrack_sysctls.conntrack_max(defaults, cpus=2) == 131072
    assert conntrack_sysctls.conntrack_max(defaults, cpus=8) == 262144
    assert conntrack_sysctls.planned(defaults) == (
        ("net.netfilter.nf_conntrack_tcp_timeout_established", 86400),
        ("net.netfilter.nf_conntrack_tcp_timeout_close_wait", 3600),
    )
    custom = conntrack_sysctls.settings_from_args(parsed(
        "--conntrack-max-per-core", "0", "--conntrack-tcp-timeout-established", "0",
        "--conntrack-tcp-be-liberal", "--conntrack-udp-timeout", "45s", "--conntrack-udp-timeout-stream", "2m"))
    assert conntrack_sysctls.conntrack_max(custom, cpus=64) == 0
    assert conntrack_sysctls.planned(custom) == (
        ("net.netfilter.nf_conntrack_tcp_timeout_close_wait", 3600),
        ("net.netfilter.nf_conntrack_tcp_be_liberal", 1),
        ("net.netfilter.nf_conntrack_udp_timeout", 45),
        ("net.netfilter.nf_conntrack_udp_timeout_stream", 120),
    )


# ---- in a throwaway namespace


ESTABLISHED = "net.netfilter.nf_conntrack_tcp_timeout_established"
SYSCTLS = (ESTABLISHED, "net.netfilter.nf_conntrack_tcp_timeout_close_wait",
           "net.netfilter.nf_conntrack_udp_timeout", "net.netfilter.nf_conntrack_udp_timeout_stream",
           "net.netfilter.nf_conntrack_tcp_be_liberal", "net.netfilter.nf_conntrack_max")


def _sysctls(ns: str | None) -> dict[str, str | None]:
    from nfproxy.kernel import sysctl

    return {name: sysctl.read(name, ns) for name in SYSCTLS}


def _rules(ns: str, mode: str) -> str:
    from nfproxy.kernel.process import run

    if mode == "nftables":
        return run(["nft", "list", "ruleset"], netns=ns)
    out = []
    for tool in ("iptables-legacy-save", "ip6tables-legacy-save", "iptables-nft-save", "ip6tables-nft-save"):
        out += [line for line in run([tool], netns=ns).splitlines() if not line.startswith("#")]
    return "\n".join(out)


@pytest.mark.kernel
def test_sysctls_are_read_and_written_in_the_namespace_only(netns: str) -> None:
    from nfproxy.kernel import sysctl

    root = _sysctls(None)
    before = sysctl.read(ESTABLISHED, netns)
    assert before is not None and before.isdigit()
    new = str(int(before) + 17)
    sysctl.write(ESTABLISHED, new, netns)
    assert sysctl.read(ESTABLISHED, netns) == new
    assert _sysctls(None) == root
    assert sysctl.writable(ESTABLISHED, netns)
    assert not sysctl.writable("net.netfilter.nf_conntrack_max", netns), "the global limit is read-only here"
    assert sysctl.read("net.netfilter.no_such_sysctl", netns) is None


@pytest.mark.kernel
def test_init_only_sets_the_conntrack_sysctls_in_the_target_namespace(netns: str) -> None:
    root = _sysctls(None)
    proc = nfproxy("--init-only", "--netns", netns, "--conntrack-tcp-timeout-established", "2h",
                   "--conntrack-tcp-timeout-close-wait", "10m", "--conntrack-udp-timeout", "45s",
                   "--conntrack-udp-timeout-stream", "3m", "--conntrack-tcp-be-liberal")
    assert proc.returncode == 0, proc.stderr
    assert _sysctls(netns) | {"net.netfilter.nf_conntrack_max": None} == {
        ESTABLISHED: "7200", "net.netfilter.nf_conntrack_tcp_timeout_close_wait": "600",
        "net.netfilter.nf_conntrack_udp_timeout": "45", "net.netfilter.nf_conntrack_udp_timeout_stream": "180",
        "net.netfilter.nf_conntrack_tcp_be_liberal": "1", "net.netfilter.nf_conntrack_max": None}
    assert _sysctls(None) == root, "the root namespace is never changed by a --netns run"
    assert "nf_conntrack_max is the root namespace's limit here" in proc.stderr
    from nfproxy.kernel.process import run

    assert "nfproxy" not in run(["nft", "list", "tables"], netns=netns), "--init-only writes no rules"


@pytest.mark.kernel
@pytest.mark.parametrize("mode", ["iptables", "nftables"])
def test_kubeadms_config_programs_the_same_rules_as_the_equivalent_flags(tmp_path: Path, mode: str) -> None:
    from nfproxy.kernel import netns as netns_mod

    config = tmp_path / "config.conf"
    text = KUBEADM.read_text()
    assert '\nmode: ""\n' in text
    config.write_text(text.replace('\nmode: ""\n', f"\nmode: {mode}\n"))
    root = _sysctls(None)
    with netns_mod.throwaway("nfp-cfg") as by_file, netns_mod.throwaway("nfp-flg") as by_flags:
        p1 = nfproxy("--config", config, "--manifests", EXAMPLES, "--once", "--netns", by_file)
        p2 = nfproxy("--proxy-mode", mode, "--manifests", EXAMPLES, "--once", "--netns", by_flags)
        assert p1.returncode == 0, p1.stderr
        assert p2.returncode == 0, p2.stderr
        assert "KubeProxyConfiguration: " not in p1.stderr  # no setting of kubeadm's file is warned about
        rules = _rules(by_file, mode)
        assert ("KUBE-SERVICES" if mode == "iptables" else "table ip nfproxy") in rules
        assert rules == _rules(by_flags, mode)
        assert _sysctls(by_file) == _sysctls(by_flags)
        assert _sysctls(by_file)[ESTABLISHED] == "86400"
    assert _sysctls(None) == root


@pytest.mark.kernel
@pytest.mark.parametrize("liberal", [True, False])
def test_be_liberal_is_read_in_the_target_namespace(netns: str, liberal: bool) -> None:
    from nfproxy.kernel import sysctl

    sysctl.write("net.netfilter.nf_conntrack_tcp_be_liberal", int(liberal), netns)
    proc = nfproxy("--proxy-mode", "nftables", "--manifests", EXAMPLES, "--once", "--netns", netns)
    assert proc.returncode == 0, proc.stderr
    message = "nf_conntrack_tcp_be_liberal set, not installing DROP rules for INVALID packets"
    assert (message in proc.stderr) is liberal
    # And the daemon behaves as it says: the INVALID drop is written only when not liberal.
    assert ("ct state invalid" in _rules(netns, "nftables")) is not liberal


@pytest.mark.kernel
def test_cleanup_flag_is_nfproxy_cleanup(netns: str) -> None:
    from nfproxy.kernel.process import run

    proc = nfproxy("--proxy-mode", "nftables", "--manifests", EXAMPLES, "--once", "--netns", netns)
    assert proc.returncode == 0, proc.stderr
    assert "nfproxy" in run(["nft", "list", "tables"], netns=netns)
    proc = nfproxy("--cleanup", "--netns", netns)
    assert proc.returncode == 0, proc.stderr
    assert "nfproxy" not in run(["nft", "list", "tables"], netns=netns)


@pytest.mark.kernel
@pytest.mark.parametrize("contents", [None, "", "garbage\n"])
def test_once_with_nothing_to_sync_is_an_error_and_touches_nothing(netns: str, tmp_path: Path, contents: str | None) -> None:
    """An empty directory, an empty file, a file of no object: exit 2 at once, naming the path,
    and the namespace has no table (not a 60 s wait for a state that files never send)."""
    from nfproxy.kernel.process import run

    path = tmp_path
    if contents is not None:
        path = tmp_path / "cluster.yaml"
        path.write_text(contents)
    proc = nfproxy("--proxy-mode", "nftables", "--manifests", path, "--once", "--netns", netns)
    assert proc.returncode == 2, proc.stderr
    assert f"--manifests {path}: nothing to sync" in proc.stderr and "Traceback" not in proc.stderr
    assert run(["nft", "list", "tables"], netns=netns).strip() == ""


def test_bind_address_is_the_node_ip_unless_given() -> None:
    from nfproxy.cli.commands.run import _bind_address_as_node_ip

    args = parsed("--bind-address", "192.168.0.7")
    _bind_address_as_node_ip(args)
    assert args.node_ip == ["192.168.0.7"]
    args = parsed("--bind-address", "192.168.0.7", "--node-ip", "192.168.0.9")
    _bind_address_as_node_ip(args)
    assert args.node_ip == ["192.168.0.9"]
    args = parsed("--bind-address", "::")
    _bind_address_as_node_ip(args)
    assert args.node_ip == []


def test_commands_that_do_not_talk_to_the_api_server_do_not_import_kubernetes(imports_of) -> None:  # noqa: ANN001
    with imports_of("kubernetes") as seen:
        from nfproxy.cli.main import parse

        parse(["render", "--backend", "nft", str(EXAMPLES)])
        parse(["--config", str(KUBEADM), "--manifests", str(EXAMPLES)])
    assert seen == set(), "kubernetes imported"
    with imports_of("kubernetes") as seen:  # the check can fail: the API source does import it
        from nfproxy.sources import kube  # noqa: F401

        kube.default_node_name()
        from kubernetes import client  # noqa: F401
    assert seen == {"kubernetes"}


def test_the_default_sync_period_is_kube_proxys_and_healthz_follows_it() -> None:
    from nfproxy.cli.commands.run import sync_periods
    from nfproxy.daemon.node import DaemonConfig

    assert sync_periods(parsed("--proxy-mode", "nftables")) == (1.0, 30.0)
    assert DaemonConfig("nft").sync_period == 30.0
    from nfproxy.daemon.node import Daemon
    from nfproxy.sources.files import ManifestSource

    from nfproxy.daemon.proxier import Hooks

    no_kernel = SimpleNamespace(hooks=Hooks(), close=lambda: None)  # the bound is all this test reads
    daemon = Daemon(ManifestSource(str(EXAMPLES), NodeConfig()), DaemonConfig("nft"), no_kernel)  # type: ignore[arg-type]
    try:
        assert daemon.health.timeout == 60.0, "kube-proxy: /healthz fails after 2 x sync period"
    finally:
        daemon.stop()


def test_the_files_kubeconfig_builds_the_api_source(tmp_path: Path) -> None:
    """kubeadm's `config.conf` names `kubeconfig.conf`: the daemon reaches the API server with it."""
    import yaml

    from nfproxy.cli.kube_flags import source_from_args
    from nfproxy.sources.kube import WatchSettings
    from tests.apiserver import FakeApiServer, service

    with FakeApiServer(bookmark_interval=0.2) as api:
        api.apply(service("web", "10.96.0.10"))
        kubeconfig = tmp_path / "kubeconfig.conf"
        kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config",
            "clusters": [{"name": "default", "cluster": {"server": api.url}}],
            "users": [{"name": "default", "user": {"token": "kube-proxy-token"}}],
            "contexts": [{"name": "default", "context": {"cluster": "default", "user": "default"}}],
            "current-context": "default",
        }))
        config = tmp_path / "config.conf"
        config.write_text(KUBEADM.read_text().replace("/var/lib/kube-proxy/kubeconfig.conf", str(kubeconfig)))
        args = parsed("--config", config, "--hostname-override", "node-a")
        source = source_from_args(args, WatchSettings(watch_timeout=5, connect_timeout=1.0, watch_read_margin=3.0, list_timeout=3.0))
        source.start(lambda: None)
        try:
            assert source.wait_ready(10)
            assert any(key.name == "web" for key, _family in source.snapshot().state.services)
        finally:
            source.stop()
        assert api.requests and all(r.authorization == "Bearer kube-proxy-token" for r in api.requests)


def test_the_daemon_serves_the_configuration_it_runs_with_on_configz(tmp_path: Path) -> None:
    """/configz (kube-proxy's metrics mux) says what --write-config-to would write."""
    from nfproxy.cli import kubeproxy_config
    from nfproxy.cli.commands.run import _daemon_config

    args = parsed("--proxy-mode", "nftables", "--cluster-cidr", "10.244.0.0/16", "--manifests", str(tmp_path))
    config = _daemon_config(args, 1.0, 30.0)
    assert config.configz == kubeproxy_config.effective(args)
    assert config.configz["mode"] == "nftables" and config.configz["clusterCIDR"] == "10.244.0.0/16"

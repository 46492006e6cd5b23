"""kube-proxy's flags for settings nfproxy cannot honour (cmd/kube-proxy/app/options.go, AddFlags;
component-base logsapi.AddFlags): accepted with kube-proxy's syntax and checks, written by
--write-config-to where the file has a field, warned about in the file field's words; the
deprecated --healthz-port / --metrics-port as kube-proxy's addressFromDeprecatedFlags; and
--service-cluster-ip-range refused when it would swallow pod or node traffic."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import yaml

from nfproxy.cli import kubeproxy_config
from nfproxy.cli.main import main, parse

HEADER = f"apiVersion: {kubeproxy_config.API_VERSION}\nkind: KubeProxyConfiguration\n"


def written(tmp_path: Path, *argv: object) -> dict:
    out = tmp_path / "out.yaml"
    assert main([*(str(a) for a in argv), "--write-config-to", str(out)]) == 0
    return yaml.safe_load(out.read_text())


def refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], *argv: object) -> str:
    """Status 2 (a usage error), nothing written; the error line."""
    out = tmp_path / "out.yaml"
    try:
        status = main([*(str(a) for a in argv), "--write-config-to", str(out)])
    except SystemExit as exc:
        status = exc.code
    assert status == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and not out.exists()
    return err


def warnings(*argv: object) -> tuple[str, ...]:
    return parse([str(a) for a in argv])[1].config_warnings


def path_of(doc: dict, path: str) -> object:
    for key in path.split("."):
        doc = doc[key]
    return doc


# ---- accepted, and written where the file has a field


@pytest.mark.parametrize("argv, field, value", [
    (["--kube-api-qps", "20"], "clientConnection.qps", 20),
    (["--kube-api-qps=2.5"], "clientConnection.qps", 2.5),
    (["--kube-api-burst", "30"], "clientConnection.burst", 30),
    (["--kube-api-content-type", "application/json"], "clientConnection.contentType", "application/json"),
    (["--config-sync-period", "5m"], "configSyncPeriod", "5m0s"),
    (["--oom-score-adj", "-500"], "oomScoreAdj", -500),
    (["--profiling"], "enableProfiling", True),
    (["--profiling=false"], "enableProfiling", False),
    (["--show-hidden-metrics-for-version", "1.30"], "showHiddenMetricsForVersion", "1.30"),
    (["--ipvs-scheduler", "rr"], "ipvs.scheduler", "rr"),
    (["--ipvs-sync-period", "10s"], "ipvs.syncPeriod", "10s"),
    (["--ipvs-min-sync-period", "2s"], "ipvs.minSyncPeriod", "2s"),
    (["--ipvs-exclude-cidrs", "10.0.0.0/8,fd00::/64", "--ipvs-exclude-cidrs", "192.168.0.0/16"],
     "ipvs.excludeCIDRs", ["10.0.0.0/8", "fd00::/64", "192.168.0.0/16"]),
    (["--ipvs-strict-arp=true"], "ipvs.strictARP", True),
    (["--ipvs-tcp-timeout", "90s"], "ipvs.tcpTimeout", "1m30s"),
    (["--ipvs-tcpfin-timeout", "1m"], "ipvs.tcpFinTimeout", "1m0s"),
    (["--ipvs-udp-timeout", "300ms"], "ipvs.udpTimeout", "300ms"),
    (["--log-flush-frequency", "1s"], "logging.flushFrequency", "1s"),
    (["--vmodule", "proxier=4,,sync*=2"], "logging.vmodule",
     [{"filePattern": "proxier", "verbosity": 4}, {"filePattern": "sync*", "verbosity": 2}]),
    (["--log-text-split-stream", "--log-text-info-buffer-size", "1Mi"], "logging.options.text",
     {"splitStream": True, "infoBufferSize": "1Mi"}),
    (["--log-json-split-stream=1", "--log-json-info-buffer-size=512"], "logging.options.json",
     {"splitStream": True, "infoBufferSize": "512"}),
])
def test_kube_proxy_flags_are_accepted_and_written(tmp_path: Path, argv: list[str], field: str,
                                                   value: object) -> None:
    assert path_of(written(tmp_path, *argv), field) == value


def test_the_written_file_has_kube_proxys_defaults_and_is_read_back_quietly(tmp_path: Path) -> None:
    doc = written(tmp_path, "--proxy-mode", "nftables")
    assert doc["clientConnection"] == {"burst": 10, "contentType": "application/vnd.kubernetes.protobuf",
                                       "kubeconfig": "", "qps": 5}
    assert (doc["configSyncPeriod"], doc["oomScoreAdj"], doc["enableProfiling"]) == ("15m0s", -999, False)
    assert doc["ipvs"]["syncPeriod"] == "30s" and doc["logging"]["flushFrequency"] == "5s"
    assert kubeproxy_config.load(str(tmp_path / "out.yaml")).warnings == ()


def test_what_the_flags_set_round_trips_through_the_file(tmp_path: Path) -> None:
    flags = ["--kube-api-qps", "20", "--kube-api-burst", "30", "--oom-score-adj", "-5", "--profiling",
             "--config-sync-period", "1h", "--ipvs-scheduler", "lc", "--ipvs-exclude-cidrs", "10.0.0.0/8",
             "--ipvs-strict-arp", "--ipvs-udp-timeout", "5s", "--vmodule", "a=1", "--log-flush-frequency", "2s"]
    first = tmp_path / "first.yaml"
    assert main([*flags, "--write-config-to", str(first)]) == 0
    second = written(tmp_path, "--config", first)
    assert second == yaml.safe_load(first.read_text())


# ---- the file field's warning, worded for the flag; quiet at the field's own defaults


def test_flags_are_warned_about_in_the_fields_words() -> None:
    assert warnings("--kube-api-qps", "20", "--ipvs-scheduler", "rr", "--profiling", "--oom-score-adj", "5",
                    "--log-text-split-stream") == (
        "--kube-api-qps: 20: ignored, nfproxy only lists and watches, without client-side rate limits",
        "--ipvs-scheduler: 'rr': ignored, nfproxy has no IPVS mode",
        "--profiling: true: ignored, nfproxy serves no /debug/pprof",
        "--oom-score-adj: 5: ignored, nfproxy leaves its OOM score to the container runtime",
        "--log-text-split-stream: true: ignored, klog's buffering options do not apply: lines are written "
        "unbuffered",
    )


@pytest.mark.parametrize("argv", [
    ["--kube-api-qps", "5"], ["--kube-api-qps", "0"], ["--kube-api-burst", "10"],
    ["--kube-api-content-type", "application/vnd.kubernetes.protobuf"], ["--config-sync-period", "15m"],
    ["--oom-score-adj", "-999"], ["--profiling=false"], ["--show-hidden-metrics-for-version", ""],
    ["--ipvs-sync-period", "30s"], ["--ipvs-min-sync-period", "0s"], ["--ipvs-strict-arp=false"],
    ["--log-flush-frequency", "5s"], ["--log-text-info-buffer-size", "0"], ["--log-json-split-stream=false"],
])
def test_kube_proxys_defaults_are_not_warned_about(argv: list[str]) -> None:
    assert warnings(*argv) == ()


def test_the_flags_win_over_the_file_and_only_kube_proxy_dropped_ones_are_named(tmp_path: Path) -> None:
    config = tmp_path / "config.conf"
    config.write_text(HEADER + "clientConnection: {qps: 50}\nlogging: {flushFrequency: 3s}\n")
    args = parse(["--config", str(config), "--kube-api-qps", "7", "--log-flush-frequency", "4s"])[1]
    assert (args.kube_api_qps, args.log_flush_frequency) == (7, "4s")
    named = [w for w in args.config_warnings if "win over the file" in w]
    assert named == [f"--config {config}: --kube-api-qps win over the file here; kube-proxy would ignore "
                     "them with --config"]  # the logging flags survive --config in kube-proxy too


# ---- kube-proxy's syntax and checks


@pytest.mark.parametrize("argv, message", [
    (["--kube-api-burst", "-1"], "--kube-api-burst: -1: must be from 0 to 2147483647"),
    (["--kube-api-burst", "2147483648"], "must be from"),
    (["--kube-api-qps", "fast"], "'fast' is not a number"),
    (["--kube-api-qps", "1e39"], "out of float32's range"),
    (["--oom-score-adj", "1001"], "--oom-score-adj: 1001: must be from -1000 to 1000"),
    (["--config-sync-period", "0"], "'0': must be greater than 0"),
    (["--config-sync-period", "5"], 'missing unit in duration "5"'),
    (["--ipvs-tcp-timeout=-1s"], "--ipvs-tcp-timeout: '-1s': must not be negative"),
    (["--ipvs-sync-period", "soon"], "--ipvs-sync-period: 'soon'"),
    (["--ipvs-exclude-cidrs", "10.0.0.0/33"], "--ipvs-exclude-cidrs: 10.0.0.0/33 is not a valid CIDR"),
    (["--ipvs-exclude-cidrs", "10.0.0.0/8,"], "empty item"),
    (["--profiling=maybe"], "argument --profiling: ignored explicit argument 'maybe'"),
    (["--vmodule", "proxier"], "'proxier' does not have the pattern=N format"),
    (["--vmodule", "a=-1"], "'a=-1': N must be from 0 to 2147483647"),
    (["--log-flush-frequency=-5s"], "--log-flush-frequency: '-5s': must not be negative"),
    (["--log-text-info-buffer-size", "lots"], "'lots' is not a size"),
    (["--healthz-port", "http"], "'http' is not a decimal integer"),
    (["--windows-service"], "unrecognized arguments: --windows-service"),
])
def test_bad_values_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str],
                                message: str) -> None:
    assert message in refused(tmp_path, capsys, *argv)


def test_the_file_fields_behind_the_flags_are_checked_too(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "config.conf"
    for body, message in (("clientConnection: {qps: fast}\n", "clientConnection.qps: 'fast': must be a number"),
                          ("ipvs: {excludeCIDRs: [nope]}\n", "ipvs.excludeCIDRs: nope is not a valid CIDR"),
                          ("logging: {vmodule: [{filePattern: 'a=b', verbosity: 1}]}\n", "logging.vmodule")):
        config.write_text(HEADER + body)
        assert message in refused(tmp_path, capsys, "--config", config), body


# ---- --healthz-port / --metrics-port: kube-proxy's addressFromDeprecatedFlags


@pytest.mark.parametrize("argv, healthz, metrics", [
    (["--healthz-port", "0"], "", "127.0.0.1:10249"),
    (["--metrics-port=0"], "0.0.0.0:10256", ""),
    (["--healthz-bind-address", "10.0.0.1", "--healthz-port", "8080"], "10.0.0.1:8080", "127.0.0.1:10249"),
    (["--metrics-bind-address", "::", "--metrics-port", "9100"], "0.0.0.0:10256", "[::]:9100"),
    # The defaults have their port: a port alone changes nothing, as in kube-proxy.
    (["--healthz-port", "8080", "--metrics-port", "9100"], "0.0.0.0:10256", "127.0.0.1:10249"),
])
def test_deprecated_port_flags_as_kube_proxy(argv: list[str], healthz: str, metrics: str) -> None:
    args = parse(argv)[1]
    assert (args.healthz_bind_address, args.metrics_bind_address) == (healthz, metrics)


def test_a_port_flag_that_changes_nothing_says_so() -> None:
    assert warnings("--healthz-port", "8080") == (
        "--healthz-port: deprecated: use --healthz-bind-address (as kube-proxy says)",
        "--healthz-port: 8080: ignored, --healthz-bind-address '0.0.0.0:10256' has its own port (as in kube-proxy)",
    )


def test_a_port_flag_out_of_range_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = refused(tmp_path, capsys, "--healthz-bind-address", "10.0.0.1", "--healthz-port", "70000")
    assert "--healthz-port: 70000: must be from 0 (off) to 65535" in err


def test_port_zero_is_written_as_the_server_off(tmp_path: Path) -> None:
    assert written(tmp_path, "--metrics-port", "0")["metricsBindAddress"] == ""


# ---- --service-cluster-ip-range must not swallow pod or node traffic


@pytest.mark.parametrize("argv, message", [
    (["--service-cluster-ip-range", "10.0.0.0/8", "--cluster-cidr", "10.244.0.0/16"],
     "--service-cluster-ip-range: 10.0.0.0/8 contains the cluster CIDR 10.244.0.0/16: "
     "traffic to pods would be dropped"),
    (["--service-cluster-ip-range", "10.244.128.0/20", "--cluster-cidr", "10.244.0.0/16"],
     "--service-cluster-ip-range: 10.244.128.0/20 is inside the cluster CIDR 10.244.0.0/16: "
     "traffic to pods would be dropped"),
    (["--service-cluster-ip-range", "fd00::/8", "--cluster-cidr", "10.244.0.0/16,fd00:10:244::/56"],
     "--service-cluster-ip-range: fd00::/8 contains the cluster CIDR fd00:10:244::/56"),
    (["--service-cluster-ip-range", "fd00:10:244:1::/108", "--cluster-cidr", "fd00:10:244::/56"],
     "fd00:10:244:1::/108 is inside the cluster CIDR fd00:10:244::/56"),
    (["--service-cluster-ip-range", "10.96.0.0/12", "--node-ip", "10.100.0.5"],
     "--service-cluster-ip-range: 10.96.0.0/12 contains the node IP 10.100.0.5: "
     "traffic to the node would be dropped"),
    (["--service-cluster-ip-range", "fd00::/64", "--node-ip", "10.0.0.1", "--node-ip", "fd00::1"],
     "fd00::/64 contains the node IP fd00::1"),
    # --bind-address stands for the node IP when --node-ip is not given.
    (["--service-cluster-ip-range", "10.96.0.0/12", "--bind-address", "10.96.0.7"],
     "10.96.0.0/12 contains the node IP 10.96.0.7"),
    (["--service-cluster-ip-range", "0.0.0.0/0"], "0.0.0.0/0 contains every address: all traffic would be dropped"),
    (["--service-cluster-ip-range", "::/0"], "::/0 contains every address"),
])
def test_a_service_range_over_pods_or_nodes_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                        argv: list[str], message: str) -> None:
    err = refused(tmp_path, capsys, *argv)
    assert "nfproxy: error: --service-cluster-ip-range: " in err and message in err


def test_a_service_range_over_the_files_cluster_cidr_is_refused(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "config.conf"
    config.write_text(HEADER + "clusterCIDR: 10.244.0.0/16\n")
    err = refused(tmp_path, capsys, "--config", config, "--service-cluster-ip-range", "10.0.0.0/8")
    assert "10.0.0.0/8 contains the cluster CIDR 10.244.0.0/16" in err


def test_a_render_with_an_overlapping_range_is_refused_too(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["render", "--backend", "nft", "--service-cluster-ip-range", "10.0.0.0/8",
              "--cluster-cidr", "10.244.0.0/16", "examples"])
    assert exc.value.code == 2
    assert "contains the cluster CIDR 10.244.0.0/16" in capsys.readouterr().err


def test_separate_service_pod_and_node_ranges_are_accepted(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, "nfproxy"):
        written(tmp_path, "--service-cluster-ip-range", "10.96.0.0/12,fd00:10:96::/112",
                "--cluster-cidr", "10.244.0.0/16,fd00:10:244::/56", "--node-ip", "192.168.1.10",
                "--node-ip", "fd00:1::10")
    from nfproxy.cli.commands.run import DEFAULT_MODE_WARNING

    assert [r.getMessage() for r in caplog.records] == [DEFAULT_MODE_WARNING]  # no mode given (KEP-5343)

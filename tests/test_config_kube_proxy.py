"""kube-proxy's own handling of its flags and file, matched: lenient decoding after a strict
decoding error, pflag booleans, `ip` for `ip:port`, IPv6 default addresses, blank values,
--hostname-override's normalisation and what --config replaces (cmd/kube-proxy/app/options.go,
pkg/proxy/apis/config/v1alpha1/defaults.go, validation/validation.go)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest
import yaml

from nfproxy.cli import kubeproxy_config
from nfproxy.cli.main import main, parse

HEADER = f"apiVersion: {kubeproxy_config.API_VERSION}\nkind: KubeProxyConfiguration\n"
LENIENT = "(kube-proxy: Using lenient decoding as strict decoding failed)"


def parsed(*argv: object) -> argparse.Namespace:
    return parse([str(a) for a in argv])[1]


def config(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "config.conf"
    path.write_text(HEADER + body)
    return path


def written(tmp_path: Path, *argv: object) -> dict[str, object]:
    out = tmp_path / "out.yaml"
    assert main([*(str(a) for a in argv), "--write-config-to", str(out)]) == 0
    return yaml.safe_load(out.read_text())


# ---- 1. unknown fields and repeated keys: warned about, as kube-proxy's lenient decoding


def test_unknown_fields_are_warned_about_with_file_and_line_and_ignored(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = config(tmp_path, "udpIdleTimeout: 250ms\nresourceContainer: /kube-proxy\nmetadata:\n  name: x\n"
                            "conntrack:\n  max: 5\n  min: 1000\nmode: nftables\n")
    with caplog.at_level(logging.WARNING, "nfproxy"):
        out = written(tmp_path, "--config", path)
    assert out["mode"] == "nftables" and out["conntrack"]["min"] == 1000  # type: ignore[index]
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    for line, field in ((3, "udpIdleTimeout"), (4, "resourceContainer"), (5, "metadata"), (8, "conntrack.max")):
        assert f"{path}:{line}: KubeProxyConfiguration: {field}: unknown field, ignored {LENIENT}" in warned


def test_a_key_given_twice_keeps_the_last_value_as_kube_proxys_lenient_decoding(tmp_path: Path) -> None:
    path = config(tmp_path, "mode: iptables\nconntrack:\n  min: 1\n  min: 2\nmode: nftables\n")
    loaded = kubeproxy_config.load(str(path))
    assert loaded.defaults["backend"] == "nftables" and loaded.defaults["conntrack_min"] == 2
    assert loaded.warnings == (
        f"{path}:6: KubeProxyConfiguration: conntrack.min: given twice, the last value is used {LENIENT}",
        f"{path}:7: KubeProxyConfiguration: mode: given twice, the last value is used {LENIENT}",
    )


def test_a_wrong_value_of_a_known_field_is_still_an_error(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    path = config(tmp_path, "bogus: 1\nmode: ipvs\n")
    assert main(["--config", str(path), "--write-config-to", str(tmp_path / "out")]) == 2
    assert f"{path}:4: KubeProxyConfiguration: mode: 'ipvs'" in capsys.readouterr().err


# ---- 2. --masquerade-all as pflag's boolean


@pytest.mark.parametrize("flag, value", [
    ("--masquerade-all", True), ("--masquerade-all=true", True), ("--masquerade-all=1", True),
    ("--masquerade-all=t", True), ("--masquerade-all=TRUE", True), ("--masquerade-all=false", False),
    ("--masquerade-all=0", False), ("--masquerade-all=F", False), ("--masquerade-all=False", False),
])
def test_masquerade_all_takes_go_booleans(flag: str, value: bool) -> None:
    assert parsed("run", flag).masquerade_all is value
    assert parsed("run", "--masquerade-all", flag).masquerade_all is value  # the last one wins


def test_masquerade_all_never_takes_the_next_argument_as_its_value() -> None:
    args = parsed("render", "--backend", "nft", "--masquerade-all", "examples")
    assert args.masquerade_all is True and "examples" in vars(args).values()


# ---- 3, 4. `ip` for `ip:port`, and the IPv6 defaults of an IPv6 bindAddress


@pytest.mark.parametrize("argv, healthz, metrics", [
    (["--healthz-bind-address=0.0.0.0"], "0.0.0.0:10256", "127.0.0.1:10249"),
    (["--metrics-bind-address=0.0.0.0"], "0.0.0.0:10256", "0.0.0.0:10249"),
    (["--healthz-bind-address", "::", "--metrics-bind-address", "::1"], "[::]:10256", "[::1]:10249"),
    (["--healthz-bind-address", "[::1]:9"], "[::1]:9", "127.0.0.1:10249"),
    # kube-proxy's --bind-address does not move the defaults (computed before flags are read).
    (["--bind-address", "fd00::1"], "0.0.0.0:10256", "127.0.0.1:10249"),
])
def test_address_flags_take_an_ip_and_get_the_default_port(argv: list[str], healthz: str, metrics: str) -> None:
    args = parsed("run", *argv)
    assert (args.healthz_bind_address, args.metrics_bind_address) == (healthz, metrics)


@pytest.mark.parametrize("body, healthz, metrics", [
    ("metricsBindAddress: 0.0.0.0\n", "0.0.0.0:10256", "0.0.0.0:10249"),
    ("healthzBindAddress: '::'\n", "[::]:10256", "127.0.0.1:10249"),
    ("bindAddress: '::'\n", "[::]:10256", "[::1]:10249"),
    ("bindAddress: fd00::5\nhealthzBindAddress: 0.0.0.0\n", "0.0.0.0:10256", "[::1]:10249"),
    ("bindAddress: 10.0.0.1\n", "0.0.0.0:10256", "127.0.0.1:10249"),
])
def test_file_addresses_as_kube_proxys_defaults(tmp_path: Path, body: str, healthz: str, metrics: str) -> None:
    out = written(tmp_path, "--config", config(tmp_path, body))
    assert (out["healthzBindAddress"], out["metricsBindAddress"]) == (healthz, metrics)


# ---- 7. blank values, --hostname-override


def test_blank_modes_mean_the_defaults() -> None:
    for argv in (["--proxy-mode="], ["--proxy-mode", ""], ["--detect-local-mode="], ["--detect-local-mode", ""]):
        args = parsed("run", *argv)
        assert (args.backend, args.detect_local_mode) == ("iptables", "ClusterCIDR"), argv


def test_hostname_override_is_trimmed_and_lower_cased() -> None:
    assert parsed("run", "--hostname-override", "  Node-A.Example  ").node_name == "node-a.example"
    assert parsed("run", "--hostname-override=").node_name == ""
    assert parsed("run", "--node-name", "node-b").node_name == "node-b"


# ---- 5. flags and --config: flags win; the ones kube-proxy would drop are named


def test_flags_win_over_the_file_and_those_kube_proxy_drops_are_named_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """kube-proxy drops its own flags' values once --config is given; nfproxy keeps them (its
    DaemonSet sets --proxy-mode=nftables over kubeadm's ConfigMap, its canary its own ports)
    and says which ones a kube-proxy would have ignored."""
    path = config(tmp_path, "mode: nftables\nclusterCIDR: 10.0.0.0/8\n")
    with caplog.at_level(logging.WARNING, "nfproxy"):
        out = written(tmp_path, "--config", path, "--proxy-mode", "iptables", "--cluster-cidr", "10.1.0.0/16",
                      "--kubeconfig", "/k", "--healthz-bind-address", "1.2.3.4", "--hostname-override", "Node-C",
                      "--v=3")
    assert (out["mode"], out["clusterCIDR"], out["hostnameOverride"]) == ("iptables", "10.1.0.0/16", "node-c")
    assert out["healthzBindAddress"] == "1.2.3.4:10256" and out["clientConnection"] == {
        "burst": 10, "contentType": "application/vnd.kubernetes.protobuf", "kubeconfig": "/k", "qps": 5}
    assert out["logging"] == {"flushFrequency": "5s", "format": "text", "verbosity": 3}  # type: ignore[comparison-overlap]
    named = [r for r in caplog.records if "win over the file" in r.getMessage()]
    assert [r.getMessage() for r in named] == [
        f"--config {path}: --proxy-mode, --cluster-cidr, --kubeconfig, --healthz-bind-address win over "
        "the file here; kube-proxy would ignore them with --config"]
    assert all(r.levelno == logging.WARNING for r in named)


def test_nfproxys_own_flags_win_over_the_file_unnamed(tmp_path: Path) -> None:
    path = config(tmp_path, "mode: iptables\nnftables: {syncPeriod: 10s}\n")
    args = parsed("--config", path, "--backend", "nft", "--nftables-sync-period", "20s", "--node-ip", "10.0.0.9",
                  "--netns", "x", "--manifests", str(tmp_path))
    assert (args.backend, args.nftables_sync_period, args.node_ip, args.netns) == ("nft", "20s", ["10.0.0.9"], "x")
    assert not any("win over the file" in w for w in args.config_warnings)


def test_an_abbreviated_kube_proxy_flag_is_named_too(tmp_path: Path) -> None:
    path = config(tmp_path, "mode: nftables\n")
    args = parsed("--config", path, "--proxy-mo", "iptables")
    assert args.backend == "iptables" and "--proxy-mode" in args.config_warnings[-1]

"""kube-proxy 1.36-1.37 behaviours (issue P, "Upstream moved on"), each as upstream has it.

- the computed nf_conntrack_max is capped at 1 048 576 (kubernetes#137002, 1.36);
- no proxy mode given: 1.37 warns that iptables is the fallback default and nftables will become
  the default (KEP-5343, kubernetes#139957);
- one vocabulary across commands: `render`, `audit` and `cleanup` take `--proxy-mode` as the
  daemon does;
- `render --backend iptables` says first what must exist before its output loads (the nfacct
  counter), and with that done the output loads into a fresh namespace as it is.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from nfproxy.cli import conntrack_sysctls
from nfproxy.cli.commands.run import DEFAULT_MODE_WARNING
from nfproxy.cli.main import main, parse

EXAMPLES = str(Path(__file__).resolve().parent.parent / "examples")


# ---- nf_conntrack_max


def test_the_scaled_conntrack_max_is_capped_as_kube_proxy_1_36() -> None:
    defaults = conntrack_sysctls.settings_from_args(parse(["--manifests", "x"])[1])
    computed = {cpus: conntrack_sysctls.conntrack_max(defaults, cpus=cpus) for cpus in (2, 16, 32, 64, 128)}
    # The floor (--conntrack-min), the product, the cap reached exactly, then the cap where it
    # was 2 097 152 and 4 194 304 before 1.36.
    assert computed == {2: 131072, 16: 524288, 32: 1048576, 64: 1048576, 128: 1048576}


def test_an_explicit_min_above_the_cap_still_wins() -> None:
    args = parse(["--manifests", "x", "--conntrack-min", "2000000"])[1]
    assert conntrack_sysctls.conntrack_max(conntrack_sysctls.settings_from_args(args), cpus=128) == 2000000


# ---- the mode nobody chose


def _warnings(caplog: pytest.LogCaptureFixture, tmp_path: Path, *argv: str) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="nfproxy"):
        assert main(["--manifests", EXAMPLES, *argv, "--write-config-to", str(tmp_path / "out.yaml")]) == 0
    return [r.getMessage() for r in caplog.records]


def test_no_mode_given_warns_that_nftables_will_become_the_default(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    assert "iptables" in DEFAULT_MODE_WARNING and "nftables" in DEFAULT_MODE_WARNING
    assert DEFAULT_MODE_WARNING in _warnings(caplog, tmp_path)
    assert DEFAULT_MODE_WARNING in _warnings(caplog, tmp_path, "--proxy-mode=")  # blank: the default
    for chosen in (["--proxy-mode", "iptables"], ["--proxy-mode", "nftables"], ["--backend", "nft"]):
        assert DEFAULT_MODE_WARNING not in _warnings(caplog, tmp_path, *chosen)


def test_the_configuration_files_mode_counts_as_given(caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    warned = {}
    for mode in ("iptables", "nftables", '""'):
        config.write_text(f"apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nmode: {mode}\n")
        warned[mode] = DEFAULT_MODE_WARNING in _warnings(caplog, tmp_path, "--config", str(config))
    assert warned == {"iptables": False, "nftables": False, '""': True}


# ---- --proxy-mode wherever --backend is taken


@pytest.mark.parametrize(("mode", "backend"), [("nftables", "nft"), ("iptables", "iptables"), ("nft", "nft")])
@pytest.mark.parametrize("command", [["render", EXAMPLES], ["audit"], ["cleanup"]])
def test_commands_that_take_backend_take_proxy_mode(command: list[str], mode: str, backend: str) -> None:
    _, args = parse([command[0], "--proxy-mode", mode, *command[1:]])
    assert args.backend == backend


def test_render_with_proxy_mode_prints_what_render_with_backend_prints(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["render", "--proxy-mode", "nftables", EXAMPLES]) == 0
    by_mode = capsys.readouterr().out
    assert main(["render", "--backend", "nft", EXAMPLES]) == 0
    assert by_mode == capsys.readouterr().out and by_mode.startswith("add table ip nfproxy")


# ---- render's output, loaded by hand


def _rendered(capsys: pytest.CaptureFixture[str], backend: str) -> str:
    assert main(["render", "--backend", backend, EXAMPLES]) == 0
    return capsys.readouterr().out


def test_render_iptables_names_first_the_commands_to_run_before_loading(capsys: pytest.CaptureFixture[str]) -> None:
    text = _rendered(capsys, "iptables")
    assert "--nfacct-name ct_state_invalid_dropped_pkts" in text
    head = text.splitlines()[:2]
    assert head[0].startswith("# Run first")
    assert head[1] == "#   nfacct add ct_state_invalid_dropped_pkts"
    assert "Run first" not in _rendered(capsys, "nft")  # nft declares its own counter


@pytest.mark.kernel
def test_render_iptables_loads_into_a_fresh_namespace_once_its_first_commands_ran(
    netns: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The IPv4 part, as a user pipes it into `iptables-restore` (comments and all). It fails
    without the counter; after what the first lines say (`nfacct add NAME`, done here through
    the same netlink request the tool sends), it loads."""
    from nfproxy.core.model import IPFamily
    from nfproxy.kernel.iptables import Flavour, IptablesRunner
    from nfproxy.kernel.nfacct import Nfacct
    from nfproxy.kernel.process import KernelError, feed

    text = _rendered(capsys, "iptables")
    ipv4 = text.split("# IPv6:")[0]
    runner = IptablesRunner(IPFamily.V4, netns, Flavour.LEGACY)
    restore = [runner.restore_cmd, "-w", "5"]
    with pytest.raises(KernelError):
        feed(restore, iter([ipv4]), netns=netns)
    for line in text.splitlines():
        if line.startswith("#   nfacct add "):
            Nfacct(netns).ensure(line.split()[-1])
    feed(restore, iter([ipv4]), netns=netns)
    assert "KUBE-SERVICES" in runner.save("nat")

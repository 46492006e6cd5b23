"""`nfproxy trace` on dumps and on live rules."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nfproxy.analysis import dump
from nfproxy.analysis.trace import guess_origin, parse_destination, pod_cidrs
from nfproxy.cli.main import main
from nfproxy.backends.iptables import render as iptables_backend
from nfproxy.core.model import IPFamily, NodeConfig
from nfproxy.sources import manifests
from nfproxy.verify.validate import apply_nft

ROOT = Path(__file__).resolve().parent.parent
DUMPS = Path(__file__).resolve().parent / "dumps"


def test_trace_iptables_dump(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["trace", "--from-file", str(DUMPS / "kube-proxy-iptables-save.txt"), "10.0.1.1", "172.30.0.41:80/tcp"])
    out = capsys.readouterr().out
    assert code == 0
    assert "from pod" in out  # 10.0.0.0/8 is the pod CIDR the rules reveal
    assert "DNAT 10.180.0.1:80  p = 715827883/2147483648" in out
    assert "KUBE-SVC-XPGD46QRK7WJZT7O" in out and "KUBE-SEP-SXIVWICOYRO3J4NJ" in out


def test_trace_json_node_origin(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["trace", "--json", "--from-file", str(DUMPS / "kube-proxy-iptables-save.txt"),
                 "--node-ip", "192.168.0.2", "192.168.0.2", "172.30.0.41:80/tcp"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["packet"]["origin"] == "node"
    assert {p["outcome"]["masquerade"] for p in out["paths"]} == {True}
    assert sum(p["decimal"] for p in out["paths"]) == pytest.approx(1)


def test_trace_affinity(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = manifests.load(str(ROOT / "examples"), NodeConfig()).state
    path = tmp_path / "rules.txt"
    path.write_text(iptables_backend.render(state, IPFamily.V4).restore_text(with_jumps=True))
    assert main(["trace", "--json", "--from-file", str(path), "10.244.0.5", "10.96.10.40:80/tcp"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [p["probability"] for p in out["paths"]] == ["1/2", "1/2"]
    for p in out["paths"]:
        assert len(p["affinity_lookups"]) == 2  # both endpoints' recent lists, empty for a new client
        assert p["pins"] == ["recent:" + p["steps"][-1]["chain"]] or len(p["pins"]) == 1


@pytest.mark.kernel
def test_trace_live_nft(netns: str, capsys: pytest.CaptureFixture[str]) -> None:
    apply_nft(manifests.load(str(ROOT / "examples"), NodeConfig()).state, netns)
    code = main(["trace", "--backend", "nft", "--netns", netns, "--node-ip", "192.168.0.2", "--from", "outside",
                 "8.8.8.8", "203.0.113.10:443/tcp"])
    out = capsys.readouterr().out
    assert code == 0 and "DROP  p = 1" in out and "firewall-" in out


def test_origin_guess_and_destination() -> None:
    rs = dump.read_file(str(DUMPS / "kube-proxy-nft.json")).ruleset
    assert [str(n) for n in pod_cidrs(rs)] == ["10.0.0.0/8"]
    assert guess_origin(rs, "10.1.2.3", []) == "pod"
    assert guess_origin(rs, "8.8.8.8", []) == "outside"
    assert guess_origin(rs, "192.168.0.2", ["192.168.0.2"]) == "node"
    assert parse_destination("[fd00::1]:53/udp") == ("fd00::1", 53, "udp")
    with pytest.raises(ValueError, match="IP:PORT"):
        parse_destination("nowhere:80")

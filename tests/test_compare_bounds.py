"""`compare` and `validate` bound their work (issue R.3): one Service of 20 000 ports made both
run for hours (compare: every probe evaluates the rules of every port at its address;
validate: iptables-nft-restore, superlinear in rules). Both now refuse such input before
rendering or applying anything, with a message naming the limit and the flag that moves it.
Nothing here measures time: "at once" is shown by the renderers or the restore never being
reached.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from nfproxy.cli.main import main
from nfproxy.core.model import (
    ClusterState, Endpoint, IPFamily, NodeConfig, Protocol, ServicePort, ServicePortName, ServiceType,
)
from nfproxy.testing import uniform_cluster
from nfproxy.verify import compare as compare_mod
from nfproxy.verify import validate as validate_mod
from nfproxy.verify.compare import WORK_LIMIT, TooMuchWork, compare, estimate

ADDRESS = "10.96.10.20"


def many_ports(n: int) -> ClusterState:
    """One ClusterIP Service of `n` TCP ports on one address, two endpoints behind each."""
    services, endpoints = {}, {}
    for port in range(1, n + 1):
        svc = ServicePort(ServicePortName("default", "big", f"p{port}", Protocol.TCP), IPFamily.V4,
                          ServiceType.CLUSTER_IP, ADDRESS, port)
        services[svc.key] = svc
        endpoints[svc.key] = tuple(Endpoint(ip=f"10.244.0.{i}", port=port) for i in (5, 6))
    return ClusterState(NodeConfig(), services, endpoints)


def manifest(n: int) -> str:
    ports = "".join(f"  - {{name: p{i}, port: {i}, protocol: TCP}}\n" for i in range(1, n + 1))
    return (
        "apiVersion: v1\nkind: Service\nmetadata: {name: big, namespace: default}\n"
        f"spec:\n  type: ClusterIP\n  clusterIP: {ADDRESS}\n  ports:\n{ports}---\n"
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\n"
        "metadata: {name: big-1, namespace: default, labels: {kubernetes.io/service-name: big}}\n"
        f"addressType: IPv4\nports:\n{ports}endpoints:\n  - addresses: [10.244.0.5]\n"
    )


def _never(*_: object) -> None:
    raise AssertionError("rendered although the work was over the limit")


# ---- compare


def test_one_service_of_20000_ports_is_refused_before_anything_is_rendered(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compare_mod, "nft_ruleset", _never)
    monkeypatch.setattr(compare_mod, "iptables_ruleset", _never)
    with pytest.raises(TooMuchWork) as refused:
        compare(many_ports(20_000))
    message = str(refused.value)
    assert f"over the limit of {WORK_LIMIT} (--work-limit)" in message
    assert f"20000 service ports share the address {ADDRESS} (IPv4)" in message


def test_the_estimate_is_quadratic_in_ports_at_one_address_and_linear_across_addresses() -> None:
    crowded = estimate(many_ports(1_000))
    assert (crowded.address, crowded.ports) == (ADDRESS, 1_000)
    assert crowded.evaluations >= 1_000 * 1_000
    spread = estimate(uniform_cluster(10_000, 10))  # the scale benchmark: one port per address
    assert spread.ports == 1 and spread.evaluations < WORK_LIMIT // 50


def test_the_limit_is_the_callers(monkeypatch: pytest.MonkeyPatch) -> None:
    state = many_ports(30)
    with pytest.raises(TooMuchWork, match="over the limit of 100 "):
        compare(state, work_limit=100)
    assert compare(state, work_limit=0).equivalent  # 0: no limit
    assert compare(state).equivalent  # far below the default


def test_cli_refuses_with_status_2_naming_the_limit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "big.yaml"
    path.write_text(manifest(30))
    assert main(["compare", "--work-limit", "100", str(path)]) == 2
    err = capsys.readouterr().err
    assert "nothing compared" in err and "over the limit of 100 (--work-limit)" in err, err
    assert "Traceback" not in err
    assert main(["compare", "--work-limit", "0", str(path)]) == 0
    assert capsys.readouterr().out.rstrip().endswith("EQUIVALENT")


def test_cli_bad_work_limit_is_a_flag_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "big.yaml"
    path.write_text(manifest(3))
    with pytest.raises(SystemExit) as exited:
        main(["compare", "--work-limit", "-1", str(path)])
    assert exited.value.code == 2
    assert "--work-limit: '-1' is not a whole number" in capsys.readouterr().err


# ---- validate (root: it makes namespaces)


def _no_restore(monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(*_: object, **__: object) -> None:
        raise AssertionError("applied although the restore was over the limit")

    monkeypatch.setitem(validate_mod.APPLY, "iptables", refused)
    monkeypatch.setitem(validate_mod.APPLY, "nft", refused)


@pytest.mark.kernel
def test_validate_refuses_a_large_iptables_nft_restore_before_applying(
    netns: str, monkeypatch: pytest.MonkeyPatch,  # noqa: ARG001
) -> None:
    _no_restore(monkeypatch)
    with pytest.raises(validate_mod.TooManyRules) as refused:
        validate_mod.validate(many_ports(20_000), flavour=validate_mod.Flavour.NFT)
    message = str(refused.value)
    assert f"over the limit of {validate_mod.IPTABLES_NFT_RULE_LIMIT} for iptables-nft-restore" in message
    assert "--iptables-flavour legacy" in message and "--backends nft" in message


@pytest.mark.kernel
def test_validate_cli_refuses_with_status_2_and_legacy_is_not_limited(
    netns: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],  # noqa: ARG001
) -> None:
    path = tmp_path / "big.yaml"
    path.write_text(manifest(30))
    argv = ["validate", "--backends", "iptables", "--iptables-nft-rule-limit", "50"]
    assert main([*argv, "--iptables-flavour", "nft", str(path)]) == 2
    err = capsys.readouterr().err
    assert "nothing applied" in err and "over the limit of 50 for iptables-nft-restore" in err, err
    assert "Traceback" not in err
    assert main([*argv, "--iptables-flavour", "legacy", str(path)]) == 0
    assert "iptables-legacy-restore" in capsys.readouterr().out

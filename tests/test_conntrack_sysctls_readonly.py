"""An unprivileged pod sees /proc/sys read-only: the conntrack sysctls are warned, not fatal."""

from __future__ import annotations

import logging

import pytest

from nfproxy.cli import conntrack_sysctls
from nfproxy.kernel import sysctl


def test_a_read_only_proc_sys_is_logged_and_the_start_goes_on(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    values = {"net.netfilter.nf_conntrack_tcp_timeout_established": "432000"}

    def refuse(name: str, value: object, netns: object = None) -> None:
        raise sysctl.ReadOnlySysctl(f"sysctl {name}={value}: /proc/sys is read-only here")

    monkeypatch.setattr(sysctl, "read", lambda name, netns=None: values.get(name, "0"))
    monkeypatch.setattr(sysctl, "write", refuse)
    with caplog.at_level(logging.WARNING):
        conntrack_sysctls._set("net.netfilter.nf_conntrack_tcp_timeout_established", 86400, None)
    assert "read-only" in caplog.text and "left at 432000" in caplog.text


def test_other_write_failures_still_stop_the_start(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(name: str, value: object, netns: object = None) -> None:
        raise sysctl.KernelError(f"sysctl {name}={value}: cannot write: Permission denied")

    monkeypatch.setattr(sysctl, "read", lambda name, netns=None: "0")
    monkeypatch.setattr(sysctl, "write", broken)
    with pytest.raises(sysctl.KernelError):
        conntrack_sysctls._set("net.netfilter.nf_conntrack_udp_timeout", 30, None)


def test_route_localnet_on_a_read_only_proc_sys_is_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from nfproxy.core.model import NodeConfig
    from nfproxy.daemon import localhost

    def refuse(name: str, value: object, netns: object = None) -> bool:
        raise sysctl.ReadOnlySysctl(f"sysctl {name}={value}: /proc/sys is read-only here")

    monkeypatch.setattr(sysctl, "ensure", refuse)
    with caplog.at_level(logging.WARNING):
        localhost.prepare("iptables", NodeConfig(name="n", ips=("192.168.0.2",)), None)
    assert "route_localnet" in caplog.text and "will not answer" in caplog.text

"""The daemon's flags after parsing, as kube-proxy's Options.Complete leaves them: which flags a
configuration file would replace there, --hostname-override's normalisation, the servers'
default ports, the sync periods' order."""

from __future__ import annotations

import argparse

from nfproxy.cli.config import FlagError
from nfproxy.cli.flag_types import display
from nfproxy.sources.validation import FieldError, dns_subdomain


# kube-proxy's flags that a configuration file replaces there (options.go, Complete: `o.config =
# c` drops every value the flags put in the configuration). What survives --config in
# kube-proxy: --hostname-override (processHostnameOverrideFlag), --master (kept apart from the
# configuration), the logging flags (copyLogsFromFlags), and --config, --write-config-to,
# --cleanup and --init-only, which are no fields. nfproxy lets every flag win over the file and
# warns about these (docs/running.md); flags only nfproxy has are not listed.
IGNORED_WITH_CONFIG = frozenset({
    "--bind-address", "--bind-address-hard-fail", "--cluster-cidr", "--conntrack-max-per-core",
    "--conntrack-min", "--conntrack-tcp-be-liberal", "--conntrack-tcp-timeout-close-wait",
    "--conntrack-tcp-timeout-established", "--conntrack-udp-timeout", "--conntrack-udp-timeout-stream",
    "--detect-local-mode", "--feature-gates", "--healthz-bind-address", "--iptables-localhost-nodeports",
    "--iptables-masquerade-bit", "--iptables-min-sync-period", "--iptables-sync-period", "--kubeconfig",
    "--masquerade-all", "--metrics-bind-address", "--nodeport-addresses", "--pod-bridge-interface",
    "--pod-interface-name-prefix", "--proxy-mode",
    # kube-proxy's flags for the settings nfproxy only warns about, and the deprecated ports
    # (Complete applies them only without --config and --write-config-to).
    "--config-sync-period", "--healthz-port", "--ipvs-exclude-cidrs", "--ipvs-min-sync-period",
    "--ipvs-scheduler", "--ipvs-strict-arp", "--ipvs-sync-period", "--ipvs-tcp-timeout",
    "--ipvs-tcpfin-timeout", "--ipvs-udp-timeout", "--kube-api-burst", "--kube-api-content-type",
    "--kube-api-qps", "--metrics-port", "--oom-score-adj", "--profiling", "--show-hidden-metrics-for-version",
})


def hostname_override(value: str) -> str:
    """kube-proxy's processHostnameOverrideFlag: --hostname-override trimmed and lower-cased, and
    then a node name; errors name the flag the user typed (nfproxy's --node-name is taken as it is)."""
    name = value.strip()
    if value and not name:
        raise FlagError("--hostname-override: empty hostname-override is invalid")
    try:
        return dns_subdomain(name.lower()) if name else ""
    except FieldError as exc:
        raise FlagError(f"--hostname-override: {exc}") from None


def complete_addresses(args: argparse.Namespace) -> None:
    """--healthz-bind-address / --metrics-bind-address take `ip` as kube-proxy's IPPortVar does;
    its Complete then appends --healthz-port / --metrics-port, by default the servers' ports
    (addressFromDeprecatedFlags: port 0 turns the server off, else AppendPortIfNeeded)."""
    from nfproxy.cli.config import HEALTHZ_PORT, METRICS_PORT

    args.healthz_bind_address = _address_with_port(args, "healthz", HEALTHZ_PORT)
    args.metrics_bind_address = _address_with_port(args, "metrics", METRICS_PORT)


def _address_with_port(args: argparse.Namespace, server: str, default_port: int) -> str:
    """kube-proxy's addressFromDeprecatedFlags for one server; a port that changes nothing (the
    address has its own) is warned about, since kube-proxy ignores it without a word."""
    from nfproxy.cli.config import append_port_if_needed

    address = getattr(args, f"{server}_bind_address")
    port = getattr(args, f"{server}_port", None)
    if port is None:
        return append_port_if_needed(address, default_port)
    warn(args, f"--{server}-port: deprecated: use --{server}-bind-address (as kube-proxy says)")
    if port == 0:
        return ""
    with_port = append_port_if_needed(address, port)
    if with_port == address:
        warn(args, f"--{server}-port: {port}: ignored, --{server}-bind-address {display(address)} "
                    "has its own port (as in kube-proxy)")
    elif not 1 <= port <= 65535:
        raise FlagError(f"--{server}-port: {port}: must be from 0 (off) to 65535")
    return with_port


def warn(args: argparse.Namespace, message: str) -> None:
    """One warning line, logged with the configuration file's once logging is set up."""
    args.config_warnings = (*getattr(args, "config_warnings", ()), message)


def check_sync_periods(args: argparse.Namespace) -> None:
    """kube-proxy's Validate: the selected mode's min sync period must not exceed its sync
    period (a file's pair is checked, naming its fields, when the file is read)."""
    from nfproxy.cli.commands.run import backend_of, sync_periods

    min_sync, period = sync_periods(args)  # each value's own errors first
    if min_sync <= period:
        return
    prefix = "nftables" if backend_of(args.backend) == "nft" else "iptables"
    min_flag = "--min-sync-period" if args.min_sync_period is not None else f"--{prefix}-min-sync-period"
    flag = "--sync-period" if args.sync_period is not None else f"--{prefix}-sync-period"
    min_text = args.min_sync_period if args.min_sync_period is not None else getattr(args, f"{prefix}_min_sync_period")
    text = args.sync_period if args.sync_period is not None else getattr(args, f"{prefix}_sync_period")
    raise FlagError(f"{min_flag}: {display(min_text)}: must not be greater than {flag} ({display(text)})")

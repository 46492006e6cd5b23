"""The flags that point the daemon at the API server, the API source they build, and the daemon
flags' last steps as kube-proxy's Options.Complete takes them (which flags a configuration file
replaces, --hostname-override's normalisation, the servers' default ports).

Here rather than in sources/kube.py so the source knows no command line; `kubernetes` is imported
only when a source is really built, so commands that never talk to the API server stay fast.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import TYPE_CHECKING

from nfproxy.cli.config import FlagError, node_config_from_args
from nfproxy.cli.flag_types import display
from nfproxy.sources.validation import FieldError, dns_subdomain

if TYPE_CHECKING:
    from nfproxy.sources.kube import KubeSource, WatchSettings


def add_kube_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """Add --kubeconfig and --master to a parser or to one of its argument groups."""
    parser.add_argument(
        "--kubeconfig",
        metavar="PATH",
        help="kubeconfig with the API server and credentials "
        "(default: the pod's service account, in-cluster)",
    )
    parser.add_argument(
        "--master",
        metavar="URL",
        help="API server URL; overrides the kubeconfig's server",
    )


def source_from_args(args: argparse.Namespace, settings: WatchSettings | None = None) -> KubeSource:
    """The API source for `nfproxy --kubeconfig/--master` (node flags from `add_node_flags`)."""
    from nfproxy.sources import kube

    node = node_config_from_args(args)
    if not node.name:
        name = kube.default_node_name()
        try:
            name = dns_subdomain(name)
        except FieldError as exc:
            raise FlagError(
                f"--hostname-override: not given, and the host name is not a node name: {exc}"
            ) from None
        node = replace(node, name=name)
    try:
        client = kube.api_client(getattr(args, "kubeconfig", None), getattr(args, "master", None))
    except kube.ConnectionConfigError as exc:
        raise FlagError(str(exc)) from None
    return kube.KubeSource(client, node, settings if settings is not None else kube.WatchSettings())


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
    its Complete then appends the default port (AppendPortIfNeeded)."""
    from nfproxy.cli.config import HEALTHZ_PORT, METRICS_PORT, append_port_if_needed

    args.healthz_bind_address = append_port_if_needed(args.healthz_bind_address, HEALTHZ_PORT)
    args.metrics_bind_address = append_port_if_needed(args.metrics_bind_address, METRICS_PORT)


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

"""`nfproxy [run] --proxy-mode nftables|iptables …`: the node daemon (the default command).

Its flags are kube-proxy's, with kube-proxy's names and defaults, and `--config` reads kube-proxy's
own configuration file (see nfproxy/cli/kubeproxy_config.py and docs/running.md).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import TYPE_CHECKING

from nfproxy.cli import conntrack_sysctls, feature_gates
from nfproxy.cli.config import (
    FlagError,
    add_node_flags,
    bind_address,
    byte_size,
    duration,
    node_config_from_args,
)
from nfproxy.cli.feature_gates import parse_feature_gates
from nfproxy.cli.flag_types import INT32_MAX, go_bool, integer_in

if TYPE_CHECKING:
    from nfproxy.daemon.node import Daemon, DaemonConfig
    from nfproxy.sources import Source

log = logging.getLogger("nfproxy")

BE_LIBERAL = "net.netfilter.nf_conntrack_tcp_be_liberal"
# kube-proxy's mode names, and nfproxy's older `nft`; the backends call nftables `nft`.
MODES = ("nftables", "iptables", "nft")


def backend_of(mode: str) -> str:
    return "nft" if mode in ("nft", "nftables") else "iptables"


def _source(args: argparse.Namespace) -> Source:
    node = node_config_from_args(args)
    grace = _source_flags(args)
    kube = bool(getattr(args, "kubeconfig", None) or getattr(args, "master", None))
    if args.manifests and kube:
        raise FlagError("--manifests: cannot be combined with --kubeconfig or --master")
    if args.manifests:
        from nfproxy.sources.files import ManifestSource

        if not os.path.exists(args.manifests):
            raise FlagError(f"--manifests: no such file or directory: {args.manifests}")
        return ManifestSource(args.manifests, node, empty_grace=grace,
                              max_bytes=byte_size("--max-manifest-bytes", args.max_manifest_bytes))
    from nfproxy.cli.kube_flags import source_from_args
    from nfproxy.sources.kube import WatchSettings

    return source_from_args(args, WatchSettings(empty_grace=grace))


def _source_flags(args: argparse.Namespace) -> float:
    """--empty-source-grace in seconds, with --max-manifest-bytes checked too: at start, so that
    --write-config-to and --init-only refuse them as the daemon would (docs/running.md)."""
    byte_size("--max-manifest-bytes", args.max_manifest_bytes)
    return duration("--empty-source-grace", args.empty_source_grace)


def sync_periods(args: argparse.Namespace) -> tuple[float, float]:
    """(min sync period, sync period) in seconds for the selected mode.

    kube-proxy keeps one pair per mode (`--iptables-*`, `--nftables-*`); nfproxy's own
    `--min-sync-period` / `--sync-period` override the selected mode's pair.
    """
    prefix = "nftables" if backend_of(args.backend) == "nft" else "iptables"
    min_flag, flag = f"--{prefix}-min-sync-period", f"--{prefix}-sync-period"
    min_text = getattr(args, f"{prefix}_min_sync_period")
    text = getattr(args, f"{prefix}_sync_period")
    if args.min_sync_period is not None:
        min_flag, min_text = "--min-sync-period", args.min_sync_period
    if args.sync_period is not None:
        flag, text = "--sync-period", args.sync_period
    period = duration(flag, text)
    if period <= 0:
        raise FlagError(f"{flag}: must be greater than 0")
    return duration(min_flag, min_text), period


def _bind_address_as_node_ip(args: argparse.Namespace) -> None:
    """kube-proxy's --bind-address: despite its name, the node's primary IP when not 0.0.0.0/::."""
    if not args.bind_address:
        return
    from nfproxy.sources.validation import FieldError, ip_address

    try:
        ip = ip_address(args.bind_address)
    except FieldError as exc:
        raise FlagError(f"--bind-address: {exc}") from None
    if ip not in ("0.0.0.0", "::") and not args.node_ip:
        args.node_ip = [ip]


def _check_bind_addresses(args: argparse.Namespace) -> None:
    """The servers' addresses, checked at start as kube-proxy checks its configuration: also
    with --once, --dry-run or --write-config-to, which start no server."""
    bind_address("--healthz-bind-address", args.healthz_bind_address)
    bind_address("--metrics-bind-address", args.metrics_bind_address)


def _read_be_liberal(args: argparse.Namespace) -> None:
    """kube-proxy: with nf_conntrack_tcp_be_liberal set, INVALID packets are not dropped."""
    from nfproxy.kernel import sysctl

    value = sysctl.read(BE_LIBERAL, args.netns)
    liberal = value not in (None, "0") or bool(args.conntrack_tcp_be_liberal)
    if liberal:
        log.info("nf_conntrack_tcp_be_liberal set, not installing DROP rules for INVALID packets")
    args.drop_invalid = not liberal  # node_config_from_args puts it in NodeConfig


def _cleanup(args: argparse.Namespace) -> int:
    """kube-proxy's `--cleanup`: `nfproxy cleanup` for both backends, then exit."""
    from nfproxy.cli.commands import cleanup

    return cleanup.run(argparse.Namespace(netns=args.netns, backend="all"))


# kube-proxy 1.37's warning when it defaults the mode (kubernetes#139957, KEP-5343), in our
# words: the wording of upstream's log line was not at hand, its release note's sense is kept.
DEFAULT_MODE_WARNING = (
    'No proxy mode was specified: using "iptables", the fallback default on Linux. "nftables" '
    'will become the default in a future release; set --proxy-mode (or the configuration\'s '
    '`mode`) to "iptables" to keep this mode'
)


def run(args: argparse.Namespace) -> int:
    from nfproxy.kernel import netns as netns_mod

    args.backend = backend_of(args.backend)
    _bind_address_as_node_ip(args)
    _check_bind_addresses(args)
    node_config_from_args(args)  # every node flag checked, also for --write-config-to
    _source_flags(args)
    min_sync, sync_period = sync_periods(args)
    parse_feature_gates(args.feature_gates, log, args.backend)
    settings = conntrack_sysctls.settings_from_args(args)
    if getattr(args, "mode_defaulted", False):  # after the flags are checked, as kube-proxy
        log.warning(DEFAULT_MODE_WARNING)
    if args.write_config_to:
        from nfproxy.cli import kubeproxy_config

        kubeproxy_config.write(args, args.write_config_to)
        return 0
    if args.dry_run:
        return _dry_run(args, min_sync, sync_period)
    from nfproxy.kernel import capabilities as caps

    lacking = caps.missing(caps.CAP_NET_ADMIN, *((caps.CAP_SYS_ADMIN,) if args.netns else ()))
    if lacking:
        print(f"nfproxy: needs {' and '.join(lacking)} to program the kernel", file=sys.stderr)
        return 1
    if args.netns and not netns_mod.exists(args.netns):
        raise FlagError(f"--netns: no network namespace named {args.netns!r} (see `ip netns list`)")
    if args.cleanup:
        return _cleanup(args)
    from nfproxy.kernel import lock

    owner = lock.acquire(args.backend, args.netns)  # NamespaceTaken: exit 1, nothing touched
    try:
        return _run(args, settings, min_sync, sync_period)
    finally:
        owner.release()


def _run(args: argparse.Namespace, settings: conntrack_sysctls.ConntrackSettings,
         min_sync: float, sync_period: float) -> int:
    # The source first: a bad --manifests, kubeconfig or API flag stops here, before anything
    # in the kernel is changed (sysctls included). It is built with the node's configuration,
    # which takes be_liberal from the namespace (read only; the flag counts too).
    source = None
    if not args.init_only:
        _read_be_liberal(args)
        source = _source(args)
    conntrack_sysctls.apply(settings, args.netns)
    if source is None:
        return 0
    from nfproxy.daemon.node import Daemon
    from nfproxy.daemon.open_files import raise_open_file_limit

    raise_open_file_limit()
    config = _daemon_config(args, min_sync, sync_period)
    proxier = None
    if args.iptables_flavour != "auto":
        from nfproxy.daemon.proxier import Proxier
        from nfproxy.kernel.iptables import Flavour

        proxier = Proxier(args.backend, netns=args.netns, flavour=Flavour(args.iptables_flavour))
    from nfproxy.daemon.localhost import prepare

    prepare(args.backend, node_config_from_args(args), args.netns)
    daemon = Daemon(source, config, proxier)
    if args.once:
        return _once(source, daemon)
    daemon.run_until_signalled()
    return 0


def _daemon_config(args: argparse.Namespace, min_sync: float, sync_period: float, **more: object) -> DaemonConfig:
    from nfproxy.cli import kubeproxy_config
    from nfproxy.daemon.node import DaemonConfig

    fields: dict[str, object] = {
        "backend": args.backend,
        "netns": args.netns,
        "min_sync_period": min_sync,
        "sync_period": sync_period,
        "healthz_bind_address": args.healthz_bind_address,
        "metrics_bind_address": args.metrics_bind_address,
        "conntrack": not args.no_conntrack_cleanup,
        "bind_address_hard_fail": bool(args.bind_address_hard_fail),
        "endpoint_connections_metric": bool(getattr(args, "metrics_endpoint_connections", False)),
        "configz": kubeproxy_config.effective(args),
        "empty_grace": _source_flags(args),
        "localhost_nodeports": feature_gates.enabled(args.feature_gates, feature_gates.LOCALHOST_NODEPORTS),
    }
    return DaemonConfig(**{**fields, **more})  # type: ignore[arg-type]


def _dry_run(args: argparse.Namespace, min_sync: float, sync_period: float) -> int:
    """The canary: the whole daemon (source, sync loop, servers, metrics, logs) on in-memory
    kernels. Nothing of the machine is touched: no rules, sysctls, conntrack entries, owner
    lock or health-check node ports, so it can run beside kube-proxy (on other ports)."""
    from nfproxy.daemon.node import Daemon
    from nfproxy.daemon.open_files import raise_open_file_limit
    from nfproxy.daemon.proxier import Proxier
    from nfproxy.kernel.memory import kernels

    if args.netns:
        raise FlagError("--dry-run: programs no namespace; drop --netns")
    if getattr(args, "metrics_endpoint_connections", False):
        raise FlagError("--metrics-endpoint-connections: a dry run has no kernel counters to read; drop it")
    config = _daemon_config(args, min_sync, sync_period, conntrack=False, health_check_node_ports=False)
    raise_open_file_limit()  # its servers hold connections as the real daemon's do
    proxier = Proxier(args.backend, kernels=kernels(args.backend))
    source = _source(args)
    log.info("Dry run: syncing in-memory kernels only; this machine's rules are never touched")
    daemon = Daemon(source, config, proxier)
    if args.once:
        return _once(source, daemon)
    daemon.run_until_signalled()
    return 0


def _once(source: Source, daemon: Daemon) -> int:
    if not source.ready():
        # The API source lists in the background: wait for its first complete state.
        source.start(lambda: None)
        try:
            wait = getattr(source, "wait_ready", None)
            if wait is None:
                # Files are read at once: nothing usable in them is bad input, not a wait.
                where = getattr(source, "path", "the manifests")
                print(f"nfproxy: error: --manifests {where}: nothing to sync: no valid Service, "
                      "EndpointSlice or Node read (the rules are left as they are)", file=sys.stderr)
                return 2
            if not wait(60):
                print("nfproxy: the source has no state to sync (not ready within 60 s)", file=sys.stderr)
                return 1
            result = daemon.once()
        finally:
            source.stop()
    else:
        result = daemon.once()
    print(result.log_line())
    return 0


def _add_sync_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sync periods (Go durations: 500ms, 1s, 1h30m)")
    for mode in ("iptables", "nftables"):
        g.add_argument(f"--{mode}-sync-period", default="30s", metavar="DURATION",
                       help=f"{mode} mode: full resync interval, repairing rules others changed (default 30s)")
        g.add_argument(f"--{mode}-min-sync-period", default="1s", metavar="DURATION",
                       help=f"{mode} mode: minimum time between syncs; changes in between are batched (default 1s)")
    g.add_argument("--sync-period", metavar="DURATION",
                   help="nfproxy's name: the selected mode's --*-sync-period")
    g.add_argument("--min-sync-period", metavar="DURATION",
                   help="nfproxy's name: the selected mode's --*-min-sync-period")


def _add_conntrack_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("conntrack sysctls, set in the target namespace as kube-proxy sets them")
    # kube-proxy's int32 fields: the same range as conntrack.maxPerCore and conntrack.min in
    # the file, so what --write-config-to writes reads back.
    g.add_argument("--conntrack-max-per-core", type=integer_in(0, INT32_MAX), default=32768, metavar="N",
                   help="nf_conntrack_max = max(N x CPUs, --conntrack-min); 0 leaves the limit as it is (default 32768)")
    g.add_argument("--conntrack-min", type=integer_in(0, INT32_MAX), default=131072, metavar="N",
                   help="lower bound of nf_conntrack_max (default 131072)")
    g.add_argument("--conntrack-tcp-timeout-established", default="24h0m0s", metavar="DURATION",
                   help="nf_conntrack_tcp_timeout_established; 0 leaves it (default 24h0m0s)")
    g.add_argument("--conntrack-tcp-timeout-close-wait", default="1h0m0s", metavar="DURATION",
                   help="nf_conntrack_tcp_timeout_close_wait; 0 leaves it (default 1h0m0s)")
    g.add_argument("--conntrack-tcp-be-liberal", type=go_bool, nargs="?", const=True, default=False,
                   metavar="BOOL", help="set nf_conntrack_tcp_be_liberal=1 (and so write no INVALID drop)")
    g.add_argument("--conntrack-udp-timeout", default="0s", metavar="DURATION",
                   help="nf_conntrack_udp_timeout; 0 leaves it (default 0s)")
    g.add_argument("--conntrack-udp-timeout-stream", default="0s", metavar="DURATION",
                   help="nf_conntrack_udp_timeout_stream; 0 leaves it (default 0s)")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="the node daemon (default when the first argument is a flag)")
    p.add_argument("--proxy-mode", "--backend", dest="backend", choices=MODES, default="iptables",
                   help="how to program the kernel (default iptables, as kube-proxy; --backend nft is an alias)")
    p.add_argument("--config", metavar="FILE",
                   help="kube-proxy's KubeProxyConfiguration file; flags given here win over it")
    p.add_argument("--write-config-to", metavar="FILE",
                   help="write the effective configuration, defaults filled in, to FILE and exit")
    src = p.add_argument_group("source")
    src.add_argument("--manifests", metavar="PATH", help="a YAML file or directory, re-read on change")
    src.add_argument("--empty-source-grace", default="30s", metavar="DURATION",
                     help="apply a source that turned empty (no service at all) only after it "
                     "stays so this long (default 30s)")
    src.add_argument("--max-manifest-bytes", default="16Mi", metavar="SIZE",
                     help="larger manifest files are not read (default 16Mi)")
    from nfproxy.cli.kube_flags import add_kube_flags

    add_kube_flags(src)
    p.add_argument("--netns", metavar="NAME", help="program this named network namespace instead of the current one")
    p.add_argument("--once", action="store_true", help="sync once (full) and exit")
    p.add_argument("--dry-run", action="store_true",
                   help="the canary: follow the source and sync in-memory kernels only, touching "
                   "nothing of this machine (run it beside kube-proxy on other ports)")
    p.add_argument("--init-only", type=go_bool, nargs="?", const=True, default=False, metavar="BOOL",
                   help="set the conntrack sysctls (the steps needing full root) and exit")
    p.add_argument("--cleanup", type=go_bool, nargs="?", const=True, default=False, metavar="BOOL",
                   help="remove every rule nfproxy owns, both backends (as `nfproxy cleanup`), and exit")
    _add_sync_flags(p)
    p.add_argument("--healthz-bind-address", default="0.0.0.0:10256", metavar="HOST:PORT",
                   help="/healthz and /livez (default 0.0.0.0:10256; empty: off)")
    p.add_argument("--metrics-bind-address", default="127.0.0.1:10249", metavar="HOST:PORT",
                   help="/metrics (default 127.0.0.1:10249; empty: off)")
    p.add_argument("--metrics-endpoint-connections", action="store_true",
                   help="export nfproxy_endpoint_new_connections_total, each endpoint's new "
                   "connections from the kernel's counters, read at every scrape (a series per endpoint)")
    p.add_argument("--bind-address-hard-fail", type=go_bool, nargs="?", const=True, default=False,
                   metavar="BOOL", help="a port that cannot be bound is fatal (default: logged and retried)")
    p.add_argument("--bind-address", default="0.0.0.0", metavar="IP",
                   help="kube-proxy's name for the node's primary IP when not 0.0.0.0 or :: "
                        "(used when --node-ip is not given); binds nothing")
    p.add_argument("--feature-gates", default="", metavar="NAME=BOOL,...",
                   help="kube-proxy's feature gates: KubeProxyNFTablesLocalhostNodePorts (nftables mode) "
                        "takes effect; the others are accepted, each one warned about")
    p.add_argument("--iptables-flavour", choices=("auto", "legacy", "nft"), default="auto",
                   help="iptables backend: which iptables to drive (default: what `iptables` is)")
    p.add_argument("--no-conntrack-cleanup", action="store_true",
                   help="do not delete stale UDP conntrack entries after endpoint changes")
    _add_conntrack_flags(p)
    add_node_flags(p)
    p.set_defaults(func=run, config_warnings=())

"""`nfproxy [run] --backend nft|iptables …`: the node daemon (the default command)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from nfproxy.cli.commands import BACKENDS
from nfproxy.cli.config import FlagError, add_node_flags, duration, node_config_from_args

log = logging.getLogger("nfproxy")


def _source(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    node = node_config_from_args(args)
    kube = bool(getattr(args, "kubeconfig", None) or getattr(args, "master", None))
    if args.manifests and kube:
        raise FlagError("--manifests: cannot be combined with --kubeconfig or --master")
    if args.manifests:
        from nfproxy.sources.files import ManifestSource

        if not os.path.exists(args.manifests):
            raise FlagError(f"--manifests: no such file or directory: {args.manifests}")
        return ManifestSource(args.manifests, node)
    from nfproxy.sources import kube as kube_source

    return kube_source.source_from_args(args)


def run(args: argparse.Namespace) -> int:
    from nfproxy.daemon.node import Daemon, DaemonConfig
    from nfproxy.kernel import netns as netns_mod

    if os.geteuid() != 0:
        print("nfproxy: needs root (CAP_NET_ADMIN) to program the kernel", file=sys.stderr)
        return 1
    if args.netns and not netns_mod.exists(args.netns):
        raise FlagError(f"--netns: no network namespace named {args.netns!r} (see `ip netns list`)")
    min_sync = duration("--min-sync-period", args.min_sync_period)
    sync_period = duration("--sync-period", args.sync_period)
    if sync_period <= 0:
        raise FlagError("--sync-period: must be greater than 0")
    config = DaemonConfig(
        backend=args.backend,
        netns=args.netns,
        min_sync_period=min_sync,
        sync_period=sync_period,
        healthz_bind_address=args.healthz_bind_address,
        metrics_bind_address=args.metrics_bind_address,
        conntrack=not args.no_conntrack_cleanup,
    )
    proxier = None
    if args.iptables_flavour != "auto":
        from nfproxy.kernel.iptables import Flavour
        from nfproxy.daemon.proxier import Proxier

        proxier = Proxier(args.backend, netns=args.netns, flavour=Flavour(args.iptables_flavour))
    source = _source(args)
    daemon = Daemon(source, config, proxier)
    if args.once:
        if not source.ready():
            # The API source lists in the background: wait for its first complete state.
            source.start(lambda: None)
            try:
                wait = getattr(source, "wait_ready", None)
                if wait is None or not wait(60):
                    print("nfproxy: the source has no state to sync (not ready within 60 s)", file=sys.stderr)
                    return 1
                result = daemon.once()
            finally:
                source.stop()
        else:
            result = daemon.once()
        print(result.log_line())
        return 0
    daemon.run_until_signalled()
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="the node daemon (default when the first argument is a flag)")
    p.add_argument("--backend", choices=BACKENDS, required=True, help="how to program the kernel")
    src = p.add_argument_group("source")
    src.add_argument("--manifests", metavar="PATH", help="a YAML file or directory, re-read on change")
    from nfproxy.sources.kube_flags import add_kube_flags  # not .kube: no kubernetes import at start-up

    add_kube_flags(src)
    p.add_argument("--netns", metavar="NAME", help="program this named network namespace instead of the current one")
    p.add_argument("--once", action="store_true", help="sync once (full) and exit")
    p.add_argument("--min-sync-period", default="1s", metavar="DURATION",
                   help="minimum time between syncs; changes in between are batched (default 1s)")
    p.add_argument("--sync-period", default="1h", metavar="DURATION",
                   help="full resync interval, repairing rules others changed (default 1h)")
    p.add_argument("--healthz-bind-address", default="0.0.0.0:10256", metavar="HOST:PORT",
                   help="/healthz and /livez (default 0.0.0.0:10256; empty: off)")
    p.add_argument("--metrics-bind-address", default="127.0.0.1:10249", metavar="HOST:PORT",
                   help="/metrics (default 127.0.0.1:10249; empty: off)")
    p.add_argument("--iptables-flavour", choices=("auto", "legacy", "nft"), default="auto",
                   help="iptables backend: which iptables to drive (default: what `iptables` is)")
    p.add_argument("--no-conntrack-cleanup", action="store_true",
                   help="do not delete stale UDP conntrack entries after endpoint changes")
    add_node_flags(p)
    p.set_defaults(func=run)

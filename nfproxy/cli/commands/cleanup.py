"""`nfproxy cleanup`: remove every rule nfproxy owns (both backends, both families)."""

from __future__ import annotations

import argparse
import sys

from nfproxy.cli.commands import add_backend_flag


def run(args: argparse.Namespace) -> int:
    from nfproxy.daemon.cleanup import cleanup_iptables, cleanup_nft

    from nfproxy.kernel import capabilities as caps

    lacking = caps.missing(caps.CAP_NET_ADMIN, *((caps.CAP_SYS_ADMIN,) if args.netns else ()))
    if lacking:
        print(f"nfproxy cleanup: needs {' and '.join(lacking)}", file=sys.stderr)
        return 1
    removed = []
    if args.backend in ("nft", "all"):
        removed += cleanup_nft(args.netns)
    if args.backend in ("iptables", "all"):
        removed += cleanup_iptables(args.netns)
    where = f"network namespace {args.netns}" if args.netns else "this network namespace"
    if not removed:
        print(f"nothing of nfproxy's found in {where}")
    for r in removed:
        print(f"removed {r.count:5d}  {r.what}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cleanup", help="remove every rule nfproxy owns, in both backends")
    p.add_argument("--netns", metavar="NAME", help="clean this named network namespace instead of the current one")
    add_backend_flag(p, choices=("nft", "iptables", "all"), default="all",
                     help="only this backend's rules (default: all). The iptables backend's chains are "
                          "kube-proxy's names: cleaning them also removes a running kube-proxy's rules")
    p.set_defaults(func=run)

"""`nfproxy cleanup`: remove every rule nfproxy owns (both backends, both families)."""

from __future__ import annotations

import argparse
import os
import sys


def run(args: argparse.Namespace) -> int:
    from nfproxy.cleanup import cleanup

    if os.geteuid() != 0:
        print("nfproxy cleanup: needs root (CAP_NET_ADMIN)", file=sys.stderr)
        return 1
    removed = cleanup(args.netns)
    where = f"network namespace {args.netns}" if args.netns else "this network namespace"
    if not removed:
        print(f"nothing of nfproxy's found in {where}")
    for r in removed:
        print(f"removed {r.count:5d}  {r.what}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cleanup", help="remove every rule nfproxy owns, in both backends")
    p.add_argument("--netns", metavar="NAME", help="clean this named network namespace instead of the current one")
    p.set_defaults(func=run)

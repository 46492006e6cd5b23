"""`nfproxy render`: print the full ruleset a backend would apply (no kernel needed)."""

from __future__ import annotations

import argparse
import sys

from nfproxy.backends.registry import render_text
from nfproxy.cli.commands import BACKENDS, NothingToShow, load_manifests
from nfproxy.cli.config import add_node_flags

__all__ = ["render_text", "register"]


def run(args: argparse.Namespace) -> int:
    try:
        state = load_manifests(args, nothing_to="render")
    except NothingToShow as exc:
        print(f"nfproxy: error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(render_text(args.backend, state))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("render", help="print the full ruleset a backend would apply")
    p.add_argument("--backend", choices=BACKENDS, required=True)
    add_node_flags(p)
    p.add_argument("manifests", metavar="MANIFESTS", help="a YAML file or a directory of them")
    p.set_defaults(func=run)

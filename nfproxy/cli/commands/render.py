"""`nfproxy render`: print the full ruleset a backend would apply (no kernel needed)."""

from __future__ import annotations

import argparse
import re
import sys

from nfproxy.backends.registry import render_text
from nfproxy.cli.commands import NothingToShow, add_backend_flag, load_manifests
from nfproxy.cli.config import add_node_flags

__all__ = ["render_text", "register"]


def run(args: argparse.Namespace) -> int:
    try:
        state = load_manifests(args, nothing_to="render")
    except NothingToShow as exc:
        print(f"nfproxy: error: {exc}", file=sys.stderr)
        return 2
    text = render_text(args.backend, state)
    sys.stdout.write(prerequisites(text) + text)
    return 0


_NFACCT = re.compile(r"--nfacct-name (\S+)")


def prerequisites(text: str) -> str:
    """What must exist before `iptables-restore` takes `text`, as the commands that create it,
    in comment lines (which iptables-restore skips): a rule naming an nfacct counter that does
    not exist fails the whole restore, and in a fresh namespace none does. The daemon creates
    them itself (kernel/nfacct.py)."""
    names = sorted(set(_NFACCT.findall(text)))
    if not names:
        return ""
    lines = ["# Run first (iptables-restore refuses a rule naming an nfacct counter that does not exist):"]
    lines += [f"#   nfacct add {name}" for name in names]
    return "\n".join(lines) + "\n"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("render", help="print the full ruleset a backend would apply")
    add_backend_flag(p, required=True)
    add_node_flags(p)
    p.add_argument("manifests", metavar="MANIFESTS", help="a YAML file or a directory of them")
    p.set_defaults(func=run)

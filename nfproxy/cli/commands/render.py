"""`nfproxy render`: print the full ruleset a backend would apply (no kernel needed)."""

from __future__ import annotations

import argparse
import sys

from nfproxy.cli.commands import BACKENDS, load_manifests
from nfproxy.cli.config import add_node_flags
from nfproxy.core.model import ClusterState, IPFamily


def render_text(backend: str, state: ClusterState) -> str:
    if backend == "iptables":
        from nfproxy.backends.iptables import render as iptables

        parts = []
        for family in IPFamily:
            tool = "iptables-restore" if family is IPFamily.V4 else "ip6tables-restore"
            parts.append(f"# IPv{family.value}: {tool} --noflush\n")
            parts.append(iptables.render(state, family).restore_text(with_jumps=True))
        return "".join(parts)
    from nfproxy.backends.nft import render as nft

    return "".join(nft.render(state, family).script() for family in IPFamily)


def run(args: argparse.Namespace) -> int:
    sys.stdout.write(render_text(args.backend, load_manifests(args)))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("render", help="print the full ruleset a backend would apply")
    p.add_argument("--backend", choices=BACKENDS, required=True)
    add_node_flags(p)
    p.add_argument("manifests", metavar="MANIFESTS", help="a YAML file or a directory of them")
    p.set_defaults(func=run)

"""`nfproxy validate`: apply each backend's rendering in a throwaway namespace and read it back."""

from __future__ import annotations

import argparse
import os
import sys

from nfproxy.cli.commands import BACKENDS, load_manifests
from nfproxy.cli.config import FlagError, add_node_flags


def run(args: argparse.Namespace) -> int:
    from nfproxy.verify.validate import validate

    if os.geteuid() != 0:
        print("nfproxy validate: needs root (it creates network namespaces)", file=sys.stderr)
        return 1
    backends = tuple(b for b in args.backends.split(",") if b)
    for b in backends:
        if b not in BACKENDS:
            raise FlagError(f"--backends: unknown backend {b!r} (choose from {', '.join(BACKENDS)})")
    state = load_manifests(args)
    n_services = len(state.services)
    n_endpoints = sum(len(e) for e in state.endpoints.values())
    print(f"{n_services} service ports, {n_endpoints} endpoints, node {state.node.name or '(unnamed)'}")
    for r in validate(state, backends):
        print(
            f"  {r.backend:8} IPv{r.family.value}: applied in {r.seconds * 1000:7.1f} ms "
            f"({r.detail}); kernel holds {r.inventory.summary()}"
        )
    print("every ruleset was accepted by the kernel; the namespaces are gone")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "validate",
        help="render each backend and apply it in a throwaway network namespace (root)",
    )
    p.add_argument("--backends", default=",".join(BACKENDS), metavar="LIST",
                   help="comma-separated backends to validate (default: iptables,nft)")
    add_node_flags(p)
    p.add_argument("manifests", metavar="MANIFESTS", help="a YAML file or a directory of them")
    p.set_defaults(func=run)

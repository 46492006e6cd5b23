"""`nfproxy validate`: apply each backend's rendering in a throwaway namespace and read it back."""

from __future__ import annotations

import argparse
import os
import sys

from nfproxy.cli.commands import BACKENDS, load_manifests
from nfproxy.cli.config import FlagError, add_node_flags


def _rule_limit(text: str) -> int:
    """A count of rules: a bad one is the flag's error (exit 2), not a traceback."""
    if not (text.isascii() and text.isdigit()) or len(text) > 18:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number from 0 to 10^18 (0: no limit)")
    return int(text)


def run(args: argparse.Namespace) -> int:
    from nfproxy.kernel.iptables import Flavour
    from nfproxy.verify.validate import IPTABLES_NFT_RULE_LIMIT, TooManyRules, validate

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
    limit = IPTABLES_NFT_RULE_LIMIT if args.iptables_nft_rule_limit is None else args.iptables_nft_rule_limit
    flavour = None if args.iptables_flavour == "auto" else Flavour(args.iptables_flavour)
    try:
        applied = validate(state, backends, flavour=flavour, iptables_nft_rule_limit=limit)
    except TooManyRules as exc:  # refused before anything is applied: a restore that would not end
        print(f"nfproxy: error: {args.manifests}: nothing applied: {exc}", file=sys.stderr)
        return 2
    for r in applied:
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
    p.add_argument("--iptables-flavour", choices=("auto", "legacy", "nft"), default="auto",
                   help="the iptables to validate with (auto, as the daemon's flag: in a fresh "
                        "namespace, what the plain `iptables` command is)")
    p.add_argument("--iptables-nft-rule-limit", type=_rule_limit, default=None, metavar="N",
                   help="refuse an iptables-nft restore of more than N rules per family "
                        "(default 25000; 0: no limit): its time grows faster than N^2")
    add_node_flags(p)
    p.add_argument("manifests", metavar="MANIFESTS", help="a YAML file or a directory of them")
    p.set_defaults(func=run)

"""The `nfproxy` command line."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from nfproxy.config import FlagError, add_node_flags, node_config_from_args
from nfproxy.model import ClusterState, IPFamily

BACKENDS = ("iptables", "nft")


def _load(args: argparse.Namespace) -> ClusterState:
    """Load manifests; report each bad object on stderr and go on with the rest."""
    from nfproxy.sources import manifests

    node = node_config_from_args(args)
    result = manifests.load(args.manifests, node=node)
    for err in result.errors:
        print(f"nfproxy: skipped: {err}", file=sys.stderr)
    return result.state


def render_text(backend: str, state: ClusterState) -> str:
    if backend == "iptables":
        from nfproxy.backends import iptables

        parts = []
        for family in IPFamily:
            tool = "iptables-restore" if family is IPFamily.V4 else "ip6tables-restore"
            parts.append(f"# IPv{family.value}: {tool} --noflush\n")
            parts.append(iptables.render(state, family).restore_text(with_jumps=True))
        return "".join(parts)
    from nfproxy.backends import nft

    return "".join(nft.render(state, family).script() for family in IPFamily)


def cmd_render(args: argparse.Namespace) -> int:
    state = _load(args)
    sys.stdout.write(render_text(args.backend, state))
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from nfproxy.validate import validate

    if os.geteuid() != 0:
        print("nfproxy validate: needs root (it creates network namespaces)", file=sys.stderr)
        return 1
    state = _load(args)
    backends = tuple(b for b in args.backends.split(",") if b)
    for b in backends:
        if b not in BACKENDS:
            raise FlagError(f"--backends: unknown backend {b!r} (choose from {', '.join(BACKENDS)})")
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nfproxy",
        description="Kubernetes service proxy: nftables and kube-proxy-compatible iptables backends.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("render", help="print the full ruleset a backend would apply")
    p.add_argument("--backend", choices=BACKENDS, required=True)
    add_node_flags(p)
    p.add_argument("manifests", metavar="MANIFESTS", help="a YAML file or a directory of them")
    p.set_defaults(func=cmd_render)

    p = sub.add_parser(
        "validate",
        help="render each backend and apply it in a throwaway network namespace (root)",
    )
    p.add_argument("--backends", default=",".join(BACKENDS), metavar="LIST",
                   help="comma-separated backends to validate (default: iptables,nft)")
    add_node_flags(p)
    p.add_argument("manifests", metavar="MANIFESTS", help="a YAML file or a directory of them")
    p.set_defaults(func=cmd_validate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from nfproxy.kernel.process import KernelError
    from nfproxy.sources.manifests import ManifestError

    try:
        return int(args.func(args))
    except FlagError as exc:
        parser.error(str(exc))
    except ManifestError as exc:
        print(f"nfproxy: {exc}", file=sys.stderr)
        return 1
    except KernelError as exc:
        print(f"nfproxy: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())

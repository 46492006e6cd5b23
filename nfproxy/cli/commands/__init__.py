"""One module per `nfproxy` subcommand.

Each module defines `register(subparsers)`, which adds its parser and sets `func` to a callable
taking the parsed arguments and returning the exit status. `nfproxy.cli.main` discovers the modules
here, so adding a command never means editing a shared list.
"""

from __future__ import annotations

import argparse
import sys

from nfproxy.backends.registry import backend_names
from nfproxy.cli.config import node_config_from_args
from nfproxy.core.model import ClusterState

BACKENDS = backend_names()


def backend_name(text: str) -> str:
    """kube-proxy's mode name as nfproxy's backend name: `nftables` is the nft backend."""
    return "nft" if text == "nftables" else text


def add_backend_flag(p: argparse.ArgumentParser, *, choices: tuple[str, ...] = tuple(BACKENDS), **kw: object) -> None:
    """`--backend`, also spelled `--proxy-mode` with kube-proxy's mode names, as the daemon
    takes it: one vocabulary across commands (`render --proxy-mode nftables`)."""
    p.add_argument("--backend", "--proxy-mode", dest="backend", type=backend_name, choices=choices,
                   metavar="{" + ",".join(dict.fromkeys([*choices, "nftables"])) + "}", **kw)  # type: ignore[arg-type]


class NothingToShow(ValueError):
    """The manifests hold no object at all; printed as it is, exit 2."""


def load_manifests(args: argparse.Namespace, path: str | None = None, *, nothing_to: str = "") -> ClusterState:
    """Load manifests with the node flags; report each bad object on stderr, keep the rest.

    `nothing_to` (what the command would do: "render", "compare"): refuse manifests that hold
    no object at all, as the daemon's `--once` does; the empty ruleset (or "EQUIVALENT") of an
    empty file, a file still being written or a wrong path would pass for a result."""
    from nfproxy.sources import manifests

    node = node_config_from_args(args)
    where = path if path is not None else args.manifests
    try:
        result = manifests.load(where, node=node, require_objects=bool(nothing_to))
    except manifests.NoObjects:
        raise NothingToShow(f"{where}: nothing to {nothing_to}: no valid Service, EndpointSlice "
                            "or Node read (no file holds a Kubernetes object)") from None
    for err in result.errors:
        print(f"nfproxy: skipped: {err}", file=sys.stderr)
    return result.state

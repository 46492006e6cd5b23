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


def load_manifests(args: argparse.Namespace, path: str | None = None) -> ClusterState:
    """Load manifests with the node flags; report each bad object on stderr, keep the rest."""
    from nfproxy.sources import manifests

    node = node_config_from_args(args)
    result = manifests.load(path if path is not None else args.manifests, node=node)
    for err in result.errors:
        print(f"nfproxy: skipped: {err}", file=sys.stderr)
    return result.state

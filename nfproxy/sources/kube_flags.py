"""The API source's command-line flags, apart from the source itself.

Why a module of its own: `nfproxy.sources.kube` imports the kubernetes client (about a second
to load), and every `nfproxy` command builds its parser at start-up; commands that never talk
to the API server (`trace`, `check --from-file`, `render`) must not pay for it.
"""

from __future__ import annotations

import argparse


def add_kube_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """Add --kubeconfig and --master to a parser or to one of its argument groups."""
    parser.add_argument(
        "--kubeconfig",
        metavar="PATH",
        help="kubeconfig with the API server and credentials "
        "(default: the pod's service account, in-cluster)",
    )
    parser.add_argument(
        "--master",
        metavar="URL",
        help="API server URL; overrides the kubeconfig's server",
    )

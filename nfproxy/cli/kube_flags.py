"""The flags that point the daemon at the API server, and the API source they build.

Here rather than in sources/kube.py so the source knows no command line; `kubernetes` is imported
only when a source is really built, so commands that never talk to the API server stay fast.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import TYPE_CHECKING

from nfproxy.cli.config import FlagError, node_config_from_args
from nfproxy.sources.validation import FieldError, dns_subdomain

if TYPE_CHECKING:
    from nfproxy.sources.kube import KubeSource, WatchSettings


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


def source_from_args(args: argparse.Namespace, settings: WatchSettings | None = None) -> KubeSource:
    """The API source for `nfproxy --kubeconfig/--master` (node flags from `add_node_flags`)."""
    from nfproxy.sources import kube

    node = node_config_from_args(args)
    if not node.name:
        name = kube.default_node_name()
        try:
            name = dns_subdomain(name)
        except FieldError as exc:
            raise FlagError(
                f"--hostname-override: not given, and the host name is not a node name: {exc}"
            ) from None
        node = replace(node, name=name)
    try:
        client = kube.api_client(getattr(args, "kubeconfig", None), getattr(args, "master", None))
    except kube.ConnectionConfigError as exc:
        raise FlagError(str(exc)) from None
    return kube.KubeSource(client, node, settings if settings is not None else kube.WatchSettings())

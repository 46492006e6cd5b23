"""The one list of backends: every command, validate, compare, lab and the proxier use it."""

from __future__ import annotations

from collections.abc import Callable

from nfproxy.backends.base import Backend
from nfproxy.core.model import ClusterState, IPFamily


def _nft() -> Backend:
    from nfproxy.backends.nft.backend import NftBackend

    return NftBackend()


def _iptables() -> Backend:
    from nfproxy.backends.iptables.backend import IptablesBackend

    return IptablesBackend()


BACKENDS: dict[str, Callable[..., Backend]] = {"iptables": _iptables, "nft": _nft}


def backend_names() -> tuple[str, ...]:
    return tuple(BACKENDS)


def backend(name: str) -> Backend:
    """A fresh backend (it holds beliefs about one kernel); ValueError names the choices."""
    factory = BACKENDS.get(name)
    if factory is None:
        raise ValueError(f"unknown backend {name!r} (choose from {', '.join(BACKENDS)})")
    return factory()


def render_text(name: str, state: ClusterState) -> str:
    """`nfproxy render` output: every family's rendering, in family order."""
    b = backend(name)
    return "".join(b.render(state, family).text() for family in IPFamily)

"""The real kernels, keyed like backends.registry.BACKENDS: `KERNELS[name](family, netns=...,
flavour=...)` is one backend's kernel side for one family in one namespace."""

from __future__ import annotations

from collections.abc import Callable

from nfproxy.kernel.base import Kernel


def _nft(family, **kw: object) -> Kernel:  # noqa: ANN001
    from nfproxy.kernel.nft import NftKernel

    return NftKernel(family, **kw)  # type: ignore[arg-type]


def _iptables(family, **kw: object) -> Kernel:  # noqa: ANN001
    from nfproxy.kernel.iptables import IptablesKernel

    return IptablesKernel(family, **kw)  # type: ignore[arg-type]


KERNELS: dict[str, Callable[..., Kernel]] = {"iptables": _iptables, "nft": _nft}

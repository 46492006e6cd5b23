"""The Kernel protocol: one backend's kernel side, in one namespace, for one family.

Real kernels (kernel/registry.py) and the in-memory ones (kernel/memory/) share it, so the
proxier and the verification tools never know which one they talk to.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Protocol

from nfproxy.core.model import IPFamily
from nfproxy.core.owned import Owned


class Kernel(Protocol):
    def owned(self) -> Owned:
        """Names of the backend's objects the kernel holds now."""

    def apply(self, payload: object) -> None:
        """Atomic: all or nothing. Raises KernelError; on failure the kernel keeps what it had."""

    def generation(self) -> Hashable:
        """A value that moves whenever the rules may have changed, anyone's write included, read
        without reading the rules: the periodic check compares it with the value read after
        nfproxy's own last write (daemon/proxier.py). nft and iptables-nft: nf_tables' ruleset
        generation; iptables-legacy: each table's entry count and size (kernel/xtables_info.py)."""

    def dump(self) -> str:
        """Canonical text: nft: sorted `nft list table` style; iptables: iptables-save of nat
        and filter."""

    def close(self) -> None:
        """Let go of sockets (the rules stay); a later call opens anew."""


# One family's kernel, for a proxier: how tests hand it the in-memory kernels.
KernelFactory = Callable[[IPFamily], Kernel]

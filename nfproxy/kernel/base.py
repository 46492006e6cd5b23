"""The kernel side of a backend: one namespace, one family; the only place with side effects.

`Owned` is declared here as well as in nfproxy/backends/base.py because the kernel may not import
backends and backends may not import the kernel; the two are the same shape (chains, sets), and a
backend reads a kernel's answer by those two fields only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class Owned:
    """Names of the objects the kernel holds that a backend may own (it decides which it does)."""

    chains: frozenset[str]
    sets: frozenset[str]


class Kernel(Protocol):
    def owned(self) -> Owned: ...

    def apply(self, payload: object) -> None:
        """Atomic: all or nothing; raises KernelError; on failure the kernel keeps what it had."""
        ...

    def dump(self) -> str:
        """Canonical text: nft: sorted `nft list table` style; iptables: iptables-save of nat
        and filter."""
        ...

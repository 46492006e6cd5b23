"""In-memory kernels with the Kernel interface (kernel/base.py): for tests and tools that need
a kernel's semantics without root, and for `nfproxy --dry-run` (the canary beside kube-proxy).
`last` is the last payload applied."""

from __future__ import annotations

from nfproxy.core.model import IPFamily
from nfproxy.kernel.base import Kernel, KernelFactory


def kernels(backend: str) -> KernelFactory:
    """A factory of fresh in-memory kernels for `backend`, one per family."""

    def make(family: IPFamily) -> Kernel:
        if backend == "nft":
            from nfproxy.kernel.memory.nft import MemoryNft

            return MemoryNft(family)
        from nfproxy.kernel.memory.iptables import MemoryIptablesKernel

        return MemoryIptablesKernel(family)

    return make

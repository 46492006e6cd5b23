"""One network namespace's nf_tables, spoken to in nfnetlink batches on raw sockets.

A partial sync only ever says a few things (chains added, flushed and deleted, the rules of one
service, elements of a few maps); libnftables would dump every table, chain and set of the
ruleset before it runs an `add rule` or an `add element` (docs/nft-layouts.md), which at 10 000
services costs more than the change itself. So every transaction is compiled by the batch
compiler (kernel/nft_bulk.py) and sent by the one sender (kernel/nfnetlink/sender.py): all of
it takes effect or none of it does. What the compiler cannot say raises `Unsupported` before a
byte is sent, and the caller hands the transaction to libnftables instead.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from nfproxy.kernel import nft_bulk
from nfproxy.kernel.nfnetlink.framing import batch_socket
from nfproxy.kernel.nfnetlink.sender import NetlinkKernelError, where
from nfproxy.kernel.nfnetlink.values import SetType, Unsupported
from nfproxy.kernel.nft_elements import ElementReader
from nfproxy.kernel.process import KernelError
from nfproxy.nftables import Table, Transaction


# --------------------------------------------------------------------------------------------
# The socket side.


def _close_all(*held: list[Any]) -> None:
    for sockets in held:
        for sock in sockets:
            sock.close()
        sockets.clear()


class NetlinkNft:
    """One network namespace's nf_tables, spoken to on raw netlink sockets: a reader for the
    few requests (a set's types, the named counters) and one socket, kept, for every batch,
    partial or full (kernel/nfnetlink/sender.py). Both are opened inside the namespace (a
    netlink socket keeps the namespace it was created in) on first use and used under one lock:
    the proxier syncs in one thread while the metrics read counters in another."""

    def __init__(self, netns: str | None = None) -> None:
        self.netns = netns
        self._set_types: dict[tuple[str, str, str], SetType] = {}
        self._lock = threading.RLock()
        self.messages_sent = 0
        self._reader: list[ElementReader] = []  # none or one
        self._raw: list[Any] = []  # none or one socket; closed with this object, at the latest
        self._raw_size = 0
        weakref.finalize(self, _close_all, self._reader, self._raw)

    # -- sockets -----------------------------------------------------------------------------
    def _request(self) -> ElementReader:
        """The reader's socket (call with the lock)."""
        if not self._reader:
            self._reader.append(ElementReader(self.netns))
        return self._reader[0]

    def close(self) -> None:
        """Close the sockets; a later use opens anew."""
        with self._lock:
            _close_all(self._reader, self._raw)

    def forget(self, family: str | None = None, table: str | None = None) -> None:
        """Drop the cached set declarations: of one table, after a transaction through another
        path may have changed them; of all, after a refusal."""
        with self._lock:
            if table is None:
                self._set_types.clear()
            else:
                for key in [k for k in self._set_types if k[:2] == (family, table)]:
                    del self._set_types[key]

    # -- set declarations ------------------------------------------------------------------------
    def know(self, family: str, table: str, types: dict[str, SetType]) -> None:
        """Set types known without asking: those a committed batch declared."""
        with self._lock:
            for name, st in types.items():
                self._set_types[(family, table, name)] = st

    def set_type(self, family: str, table: str, name: str) -> SetType:
        key = (family, table, name)
        with self._lock:
            st = self._set_types.get(key)
            if st is not None:
                return st
            try:
                st = self._request().set_type(family, table, name)
            except NetlinkKernelError as exc:
                raise NetlinkKernelError(
                    f"nft netlink{where(self.netns)}: set {family} {table} {name}: {os.strerror(exc.errno)}",
                    exc.errno,
                    f"(declaration of set {name})",
                ) from None
            self._set_types[key] = st
            return st

    # -- named counters --------------------------------------------------------------------------
    def counters(self, family: str, table: str) -> dict[str, int]:
        """The named counters of one table and their packets, in one netlink dump ({} without
        the table). libnftables' `list counters` would fetch the whole ruleset first: 1.9 s per
        family at 10 000 services."""
        with self._lock:
            return self._request().counters(family, table)

    # -- the batch ---------------------------------------------------------------------------
    def apply(self, tx: Transaction, *more: Transaction) -> None:
        """Send `tx` (and `more`, of the same family, other tables) as one nfnetlink batch: all
        of it takes effect, or none does.

        Raises Unsupported (nothing sent) for a transaction outside the compiler's vocabulary,
        and NetlinkKernelError (a KernelError) naming the kernel's errno and the first refused
        command when the kernel refuses the batch.
        """
        txs = (tx, *more)
        for one in txs:
            one.check()
            if one.family != tx.family:
                raise Unsupported(f"one batch of families {tx.family} and {one.family}")
        batches = [  # Unsupported here: nothing sent
            nft_bulk.compile_batch(one, self._types_of(one), first_set_id=1 + (k << 20))
            for k, one in enumerate(txs)
        ]
        count = sum(len(b.origins) for b in batches)
        if not count:
            return
        try:
            with self.raw_socket(sum(len(b.data) for b in batches) + 64) as sock:
                self.messages_sent += count
                nft_bulk.send_joined(list(zip(batches, txs)), self.netns, sock)
        except NetlinkKernelError:
            self.forget()
            raise
        except KernelError:  # no answer: answers may still come; never reuse the socket
            with self._lock:
                _close_all(self._raw)
            self.forget()
            raise
        for batch, one in zip(batches, txs):
            if any(type(o) is Table for _, o in one.ops):  # the table written anew: its sets are these
                self.forget(one.family, one.table)
            # Committed: the sets it declared are as declared, so later batches need not ask the
            # kernel for each one's type on first use.
            self.know(one.family, one.table, batch.declared)

    def _types_of(self, tx: Transaction) -> Callable[[str], SetType]:
        return lambda name: self.set_type(tx.family, tx.table, name)

    def _raw_socket(self, size: int) -> Any:
        """The kept raw socket, able to send `size` bytes in one write (call with the lock)."""
        if not self._raw or size > self._raw_size:
            _close_all(self._raw)
            self._raw_size = max(size, 1 << 22)
            self._raw.append(batch_socket(self.netns, self._raw_size))
        return self._raw[0]

    @contextlib.contextmanager
    def raw_socket(self, size: int) -> Iterator[Any]:
        """The raw socket for batches of `size` bytes, held for the block and kept: closing a
        netlink socket right after a commit waits for the kernel to free what the commit
        deleted (4-16 ms), paid by every full sync and every creation of the off table."""
        with self._lock:
            yield self._raw_socket(size)

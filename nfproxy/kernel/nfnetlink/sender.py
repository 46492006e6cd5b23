"""One sender for every nf_tables batch, partial syncs and full syncs alike: BEGIN, the
messages, END in one write on a raw socket, then the kernel's answers read by sequence number.

nfnetlink handles a batch inside the sending call, so every answer is queued by the time the
write returns. Only the last message asks for an ack; the kernel reports every refused message
whether asked or not, so: no error and the last ack means committed, and a refusal is named by
the command its message came from.
"""

from __future__ import annotations

import errno as errno_mod
import os
import socket
import struct
from collections.abc import Callable

from nfproxy.kernel.nfnetlink.framing import batch_socket
from nfproxy.kernel.nfnetlink.values import NFNL_MSG_BATCH_BEGIN, NFNL_MSG_BATCH_END, Unsupported
from nfproxy.kernel.process import KernelError

_HEADER = struct.Struct("=IHHII")
_NLM_F_REQUEST, _NLM_F_ACK = 0x1, 0x4
_NLMSG_ERROR = 2
_NFNL_SUBSYS_NFTABLES = 10


class NetlinkKernelError(KernelError):
    """The kernel refused the batch (so none of it took effect); names the errno and command."""

    def __init__(self, message: str, errno: int, command: str) -> None:
        super().__init__(message)
        self.errno = errno
        self.command = command


def batch_frame(msg_type: int, seq: int, pid: int = 0) -> bytes:
    """NFNL_MSG_BATCH_BEGIN or _END for nf_tables (res_id NFNL_SUBSYS_NFTABLES, big-endian)."""
    return _HEADER.pack(20, msg_type, _NLM_F_REQUEST, seq, pid) + bytes((0, 0)) + struct.pack(">H", _NFNL_SUBSYS_NFTABLES)


def send(
    data: bytearray, last_at: int, count: int, command_of: Callable[[int], str],
    netns: str | None, sock: socket.socket | None = None,
) -> None:
    """Send `count` messages (`data`, numbered 1..count, the last one at offset `last_at`) as
    one batch and raise for what the kernel refused. `command_of(seq)` names a message's
    command. `sock`: the caller's raw socket (left open); None opens one for this batch."""
    if not count:
        return
    flags = struct.unpack_from("=H", data, last_at + 6)[0]
    struct.pack_into("=H", data, last_at + 6, flags | _NLM_F_ACK)
    data[:0] = batch_frame(NFNL_MSG_BATCH_BEGIN, 0)  # in place: the batch is the one copy
    data += batch_frame(NFNL_MSG_BATCH_END, count + 1)
    kept = sock is not None
    sock = sock if sock is not None else batch_socket(netns, len(data))
    try:
        try:
            sock.send(data)
        except OSError as exc:  # refused before the kernel read it (too large, no memory): nothing applied
            raise Unsupported(f"nft netlink{where(netns)}: a batch of {len(data)} bytes not sent: {os.strerror(exc.errno or 0)}") from None
        errors, acked = _answers(sock, count, netns)
    finally:
        if not kept:
            sock.close()
    if errors:
        seq, code = errors[0]
        command = command_of(seq) if 0 < seq <= count else "(the batch)"
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise NetlinkKernelError(
            f"nft netlink{where(netns)} rejected the transaction: {os.strerror(code)} "
            f"(errno {errno_mod.errorcode.get(code, code)}) in: {command}{more}",
            code, command,
        )
    if not acked:
        raise KernelError(f"nft netlink{where(netns)}: no answer to the batch's last message")


def _answers(sock: socket.socket, last: int, netns: str | None) -> tuple[list[tuple[int, int]], bool]:
    """(seq, errno) of every refused message, and whether the last message was acked."""
    errors: list[tuple[int, int]] = []
    acked = False
    while True:
        try:
            buf = sock.recv(1 << 20)
        except BlockingIOError:
            return errors, acked
        except OSError as exc:
            if exc.errno == errno_mod.ENOBUFS:  # only errors overflow it: the batch failed
                return errors or [(0, errno_mod.ENOBUFS)], acked
            raise KernelError(f"nft netlink{where(netns)}: reading the answer: {os.strerror(exc.errno or 0)}") from None
        at = 0
        while at + _HEADER.size <= len(buf):
            length, mtype, _, seq, _ = _HEADER.unpack_from(buf, at)
            if length < _HEADER.size:
                break
            if mtype == _NLMSG_ERROR:
                (code,) = struct.unpack_from("=i", buf, at + _HEADER.size)
                if code:
                    errors.append((seq, -code))
                elif seq == last:
                    acked = True
            at += (length + 3) & ~3


def where(netns: str | None) -> str:
    return f" in netns {netns}" if netns else ""

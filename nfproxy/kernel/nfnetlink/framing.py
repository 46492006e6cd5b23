"""Netlink framing for nf_tables, by hand: attributes, one message, a raw socket that takes a
batch in one write, and the walk over a reply's attributes. The batch compiler writes with it
and the dump reader reads with it; both write and read hundreds of thousands of attributes a
sync, where a generic encoder's per-attribute objects cost more than the bytes (docs/design.md,
"The nft write path")."""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Iterator

from nfproxy.kernel import netns as netns_mod
from nfproxy.kernel.nfnetlink.values import Unsupported

NETLINK_NETFILTER = 12
NLA_TYPE_MASK = 0x3FFF
_SO_SNDBUFFORCE, _SO_RCVBUFFORCE = 32, 33
_NETLINK_CAP_ACK = 10
_NLM_F_REQUEST = 0x1
_HEADER = struct.Struct("=IHHII")
_ATTR = struct.Struct("=HH")
_PAD = (b"", b"\0\0\0", b"\0\0", b"\0")


def attr(kind: int, value: bytes) -> bytes:
    n = len(value)
    return _ATTR.pack(4 + n, kind) + value + _PAD[n & 3]


def strz(kind: int, text: str) -> bytes:
    return attr(kind, text.encode() + b"\0")


def frame(msg_type: int, flags: int, family: int, seq: int, payload: bytes) -> bytes:
    """One nf_tables message: nlmsghdr, nfgenmsg, attributes."""
    body = struct.pack("=BBH", family, 0, 0) + payload
    return _HEADER.pack(_HEADER.size + len(body), (10 << 8) | msg_type, _NLM_F_REQUEST | flags, seq, 0) + body


def attributes(buf: bytes, start: int, stop: int) -> Iterator[tuple[int, int, int]]:
    """(type, value start, value stop) of each attribute in buf[start:stop]."""
    unpack = _ATTR.unpack_from
    while start + 4 <= stop:
        length, kind = unpack(buf, start)
        if length < 4:
            raise Unsupported(f"netlink attribute of length {length}")
        yield kind & NLA_TYPE_MASK, start + 4, start + length
        start += (length + 3) & ~3


def batch_socket(netns: str | None, size: int) -> socket.socket:
    def make() -> socket.socket:
        return socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)

    if netns is None:
        sock = make()
    else:
        with netns_mod.entered(netns):
            sock = make()
    try:
        # The whole batch is one write (nfnetlink reads a batch from one buffer), so the send
        # buffer must hold it; errors are small with CAP_ACK, but may be many.
        sock.setsockopt(socket.SOL_SOCKET, _SO_SNDBUFFORCE, size + 65536)
        sock.setsockopt(socket.SOL_SOCKET, _SO_RCVBUFFORCE, 16 << 20)
        sock.setsockopt(270, _NETLINK_CAP_ACK, 1)  # SOL_NETLINK: errors without the message echoed
        sock.bind((0, 0))
    except OSError as exc:
        sock.close()
        raise Unsupported(f"netlink socket for a large batch: {os.strerror(exc.errno or 0)}") from None
    sock.setblocking(False)
    return sock

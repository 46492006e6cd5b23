"""nfacct counters (nfnetlink_acct): the kernel objects `iptables -m nfacct` counts into.

kube-proxy counts its conntrack-INVALID drops in the nfacct object
`ct_state_invalid_dropped_pkts`; the object must exist before a rule naming it is restored.

Hand-written netlink, on purpose: pyroute2 (our netlink library) has no nfacct family, the
`nfacct` tool is rarely installed, and the protocol needed is three small messages (create,
get, delete) of one header and a few attributes each.
"""

from __future__ import annotations

import errno
import os
import socket
import struct
from dataclasses import dataclass

from nfproxy.kernel import netns as netns_mod
from nfproxy.kernel.process import KernelError

NETLINK_NETFILTER = 12
NFNL_SUBSYS_ACCT = 7
_NEW, _GET, _DEL = 0, 1, 3
NLM_F_REQUEST, NLM_F_ACK, NLM_F_EXCL, NLM_F_CREATE = 0x1, 0x4, 0x200, 0x400
NLMSG_ERROR, NLMSG_DONE = 2, 3
NFACCT_NAME, NFACCT_PKTS, NFACCT_BYTES = 1, 2, 3
NAME_MAX = 32  # NFACCT_NAME_MAX, with the terminating NUL

_HEADER = struct.Struct("=IHHII")  # nlmsghdr
_NFGEN = struct.Struct("=BBH")  # nfgenmsg: family, version, res_id (big-endian, 0 here)
_ATTR = struct.Struct("=HH")


class NfacctError(KernelError):
    """The kernel refused an nfacct request; `code` is its errno."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class Counter:
    name: str
    packets: int
    bytes: int


def _align(n: int) -> int:
    return (n + 3) & ~3


def _name_attr(name: str) -> bytes:
    raw = name.encode() + b"\0"
    if len(raw) > NAME_MAX or not name.isascii() or not name.isprintable():
        raise ValueError(f"not an nfacct counter name: {name!r}")
    attr = _ATTR.pack(_ATTR.size + len(raw), NFACCT_NAME) + raw
    return attr + b"\0" * (_align(len(attr)) - len(attr))


def _attrs(payload: bytes) -> dict[int, bytes]:
    out: dict[int, bytes] = {}
    pos = 0
    while pos + _ATTR.size <= len(payload):
        length, kind = _ATTR.unpack_from(payload, pos)
        if length < _ATTR.size:
            break
        out[kind & 0x3FFF] = payload[pos + _ATTR.size : pos + length]
        pos += _align(length)
    return out


class Nfacct:
    """nfacct objects of one network namespace (None: the caller's own)."""

    def __init__(self, netns: str | None = None) -> None:
        self.netns = netns
        self._seq = 0

    def _where(self) -> str:
        return f" in netns {self.netns}" if self.netns else ""

    def _socket(self) -> socket.socket:
        # A netlink socket keeps the namespace it was created in.
        if self.netns is None:
            return socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        with netns_mod.entered(self.netns):
            return socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)

    def _request(self, cmd: int, flags: int, name: str) -> list[dict[int, bytes]]:
        """Send one request, return the attributes of every reply before its ack."""
        self._seq += 1
        body = _NFGEN.pack(socket.AF_UNSPEC, 0, 0) + _name_attr(name)
        msg = _HEADER.pack(_HEADER.size + len(body), (NFNL_SUBSYS_ACCT << 8) | cmd, NLM_F_REQUEST | NLM_F_ACK | flags, self._seq, 0) + body
        replies: list[dict[int, bytes]] = []
        with self._socket() as sock:
            sock.settimeout(5.0)
            sock.send(msg)
            while True:
                data = sock.recv(65536)
                pos = 0
                while pos + _HEADER.size <= len(data):
                    length, kind, _flags, seq, _pid = _HEADER.unpack_from(data, pos)
                    chunk = data[pos + _HEADER.size : pos + length]
                    pos += _align(length)
                    if seq != self._seq:
                        continue
                    if kind == NLMSG_ERROR:
                        code = -struct.unpack_from("=i", chunk)[0]
                        if code:
                            raise NfacctError(
                                f"nfacct{self._where()}: {name}: {os.strerror(code)}", code
                            )
                        return replies
                    if kind == NLMSG_DONE:
                        return replies
                    replies.append(_attrs(chunk[_NFGEN.size :]))

    def ensure(self, name: str) -> bool:
        """Create the counter unless it exists (counts are kept); True when created."""
        try:
            self._request(_NEW, NLM_F_CREATE | NLM_F_EXCL, name)
            return True
        except NfacctError as exc:
            if exc.code == errno.EEXIST:
                return False
            raise

    def get(self, name: str) -> Counter | None:
        """The counter's packets and bytes; None when it does not exist."""
        try:
            replies = self._request(_GET, 0, name)
        except NfacctError as exc:
            if exc.code == errno.ENOENT:
                return None
            raise
        for attrs in replies:
            if NFACCT_PKTS in attrs:
                packets = struct.unpack(">Q", attrs[NFACCT_PKTS])[0]
                octets = struct.unpack(">Q", attrs.get(NFACCT_BYTES, bytes(8)))[0]
                return Counter(name, packets, octets)
        return None

    def delete(self, name: str) -> bool:
        """Delete the counter; False when it did not exist. EBUSY while a rule uses it."""
        try:
            self._request(_DEL, 0, name)
            return True
        except NfacctError as exc:
            if exc.code == errno.ENOENT:
                return False
            raise

"""Reading and deleting conntrack entries over ctnetlink, inside the namespace nfproxy programs.

One dump per family and protocol, filtered in the kernel (protocol and family: the table is
walked in C and only those entries cross), decoded by hand: each reply's two tuples are read by
one regular expression of the layout the kernel writes. pyroute2 decoded the same messages at
0.35-0.7 ms an entry, which made a walk of 10 000 UDP entries cost seconds of CPU and kept the
whole-table walk off most syncs; the figures of this one are in docs/benchmarks.md ("Conntrack
reconciliation").
Every entry is judged in Python (`delete_judged`: a predicate; `delete`: filters), and each hit
is deleted by its exact original tuple (and zone), as read, many requests to a send, so an entry
created between the dump and the delete is never caught by accident. An entry that expired in
between is not an error. The conntrack tool is not needed.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import logging
import os
import re
import socket
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from nfproxy.kernel import netns as netns_mod
from nfproxy.kernel.process import KernelError
from nfproxy.core.model import IPFamily, Protocol

log = logging.getLogger(__name__)

_AF = {IPFamily.V4: socket.AF_INET, IPFamily.V6: socket.AF_INET6}
_PROTO = {Protocol.TCP: socket.IPPROTO_TCP, Protocol.UDP: socket.IPPROTO_UDP, Protocol.SCTP: 132}
_PROTO_BY_NUMBER = {v: k for k, v in _PROTO.items()}


@dataclass(frozen=True, slots=True)
class FlowFilter:
    """Matches conntrack entries; every field left None matches anything.

    Field names follow the conntrack tool: `orig_dst`/`orig_dport` are the destination the
    client sent to (a service address, or any address for a node port), `reply_src`/`reply_sport`
    the address the reply comes from, which is the DNAT target (the endpoint) when NAT happened.
    """

    family: IPFamily
    protocol: Protocol = Protocol.UDP
    orig_dst: str | None = None
    orig_dport: int | None = None
    reply_src: str | None = None
    reply_sport: int | None = None
    reason: str = field(default="", compare=False)

    @property
    def sort_key(self) -> tuple[int, str, str, int, str, int]:
        return (
            self.family.value, self.protocol.value, self.orig_dst or "", self.orig_dport or 0,
            self.reply_src or "", self.reply_sport or 0,
        )

    def matches(
        self,
        protocol: Protocol,
        orig_dst: str,
        orig_dport: int | None,
        reply_src: str,
        reply_sport: int | None,
    ) -> bool:
        """Whether an entry (its original destination and reply source) is one of ours.

        Addresses must be in canonical form (what the model and the kernel both produce).
        """
        return (
            protocol is self.protocol
            and (self.orig_dst is None or self.orig_dst == orig_dst)
            and (self.orig_dport is None or self.orig_dport == orig_dport)
            and (self.reply_src is None or self.reply_src == reply_src)
            and (self.reply_sport is None or self.reply_sport == reply_sport)
        )

    def __str__(self) -> str:
        parts = [f"-f {'ipv4' if self.family is IPFamily.V4 else 'ipv6'}", f"-p {self.protocol.lower}"]
        if self.orig_dst is not None:
            parts.append(f"--orig-dst {self.orig_dst}")
        if self.orig_dport is not None:
            parts.append(f"--orig-port-dst {self.orig_dport}")
        if self.reply_src is not None:
            parts.append(f"--reply-src {self.reply_src}")
        if self.reply_sport is not None:
            parts.append(f"--reply-port-src {self.reply_sport}")
        return " ".join(parts)


@dataclass(frozen=True, slots=True)
class Flow:
    """One conntrack entry, as the filters see it (both tuples)."""

    family: IPFamily
    protocol: Protocol
    orig_src: str
    orig_sport: int | None
    orig_dst: str
    orig_dport: int | None
    reply_src: str
    reply_sport: int | None
    reply_dst: str
    reply_dport: int | None

    @property
    def nat(self) -> bool:
        """Whether the destination was rewritten (the reply comes from somewhere else)."""
        return (self.reply_src, self.reply_sport) != (self.orig_dst, self.orig_dport)


# --------------------------------------------------------------------------------------------
# ctnetlink, by hand (linux/netfilter/nfnetlink_conntrack.h)

_NETLINK_NETFILTER = 12
_CT_GET = (1 << 8) | 1  # NFNL_SUBSYS_CTNETLINK << 8 | IPCTNL_MSG_CT_GET
_CT_DELETE = (1 << 8) | 2
_NLMSG_ERROR, _NLMSG_DONE = 2, 3
_NLM_F_REQUEST, _NLM_F_ACK, _NLM_F_DUMP = 0x1, 0x4, 0x300
_NLA_F_NESTED = 0x8000
_NLA_TYPE_MASK = 0x3FFF
_CTA_TUPLE_ORIG, _CTA_TUPLE_REPLY, _CTA_ZONE, _CTA_FILTER = 1, 2, 18, 25
_CTA_TUPLE_IP, _CTA_TUPLE_PROTO = 1, 2
_CTA_PROTO_NUM, _CTA_PROTO_SRC_PORT, _CTA_PROTO_DST_PORT = 1, 2, 3
_CTA_FILTER_ORIG_FLAGS, _CTA_FILTER_REPLY_FLAGS = 1, 2
_CTA_FILTER_FLAG_PROTO_NUM = 1 << 3

_HEADER = struct.Struct("=IHHII")  # nlmsghdr
_ATTR = struct.Struct("=HH")
_PORT = struct.Struct(">H")
_ERRNO = struct.Struct("=i")

# Deletes sent in one write: their acks (36 bytes each) must fit the socket's receive buffer.
DELETES_PER_SEND = 512
_RCVBUF = 4 << 20


def _attr(kind: int, value: bytes) -> bytes:
    return _ATTR.pack(4 + len(value), kind) + value + b"\0" * (-len(value) % 4)


def _nested(kind: int, *attrs: bytes) -> bytes:
    return _attr(kind | _NLA_F_NESTED, b"".join(attrs))


def _nfgen(af: int) -> bytes:
    return struct.pack("=BBH", af, 0, 0)  # nfgenmsg: family, NFNETLINK_V0, res_id


def _dump_request(af: int, proto: int, *, filtered: bool = True) -> bytes:
    """The entries of one family and protocol (kernel 5.8+ filters; older ones send every entry
    of the family, and the decoder drops the rest)."""
    if not filtered:
        return _nfgen(af)
    return (
        _nfgen(af)
        + _nested(_CTA_TUPLE_ORIG, _nested(_CTA_TUPLE_PROTO, _attr(_CTA_PROTO_NUM, bytes([proto]))))
        + _nested(
            _CTA_FILTER,
            _attr(_CTA_FILTER_ORIG_FLAGS, struct.pack("=I", _CTA_FILTER_FLAG_PROTO_NUM)),
            _attr(_CTA_FILTER_REPLY_FLAGS, struct.pack("=I", 0)),
        )
    )


class _Addresses:
    """Raw address bytes to canonical text, remembered: a table names few distinct addresses."""

    def __init__(self, af: int) -> None:
        self._af = af
        self._seen: dict[bytes, str] = {}

    def __call__(self, raw: bytes) -> str:
        text = self._seen.get(raw)
        if text is None:
            text = str(ipaddress.ip_address(raw)) if self._af == socket.AF_INET6 else socket.inet_ntoa(raw)
            self._seen[raw] = text
        return text


def _tuple(buf: bytes, a: int, b: int, addr: _Addresses) -> tuple[str, str, int, int | None, int | None]:
    """(src, dst, protocol, sport, dport) of a CTA_TUPLE_* attribute's contents."""
    unpack = _ATTR.unpack_from
    src = dst = ""
    proto = 0
    sport = dport = None
    while a + 4 <= b:
        length, kind = unpack(buf, a)
        if length < 4:
            break
        kind &= _NLA_TYPE_MASK
        x, y = a + 4, a + length
        if kind == _CTA_TUPLE_IP:
            while x + 4 <= y:
                n, k = unpack(buf, x)
                if n < 4:
                    break
                k &= _NLA_TYPE_MASK
                if k in (1, 3):  # CTA_IP_V4_SRC, CTA_IP_V6_SRC
                    src = addr(buf[x + 4: x + n])
                elif k in (2, 4):  # CTA_IP_V4_DST, CTA_IP_V6_DST
                    dst = addr(buf[x + 4: x + n])
                x += (n + 3) & ~3
        elif kind == _CTA_TUPLE_PROTO:
            while x + 4 <= y:
                n, k = unpack(buf, x)
                if n < 4:
                    break
                k &= _NLA_TYPE_MASK
                if k == _CTA_PROTO_NUM:
                    proto = buf[x + 4]
                elif k == _CTA_PROTO_SRC_PORT:
                    sport = _PORT.unpack_from(buf, x + 4)[0]
                elif k == _CTA_PROTO_DST_PORT:
                    dport = _PORT.unpack_from(buf, x + 4)[0]
                x += (n + 3) & ~3
        a += (length + 3) & ~3
    return src, dst, proto, sport, dport


def _tuples_pattern(af: int) -> re.Pattern[bytes]:
    """The two tuples as the kernel writes them first in every entry (ctnetlink_fill_info:
    orig then reply, each ip {src, dst} then proto {num, sport, dport}, no zone in the default
    one), as one regular expression: literal attribute headers, a group per value. An entry laid
    out otherwise takes the general walk (`_decode`)."""
    size = 4 if af == socket.AF_INET else 16
    src, dst = (1, 2) if af == socket.AF_INET else (3, 4)
    ip = _ATTR.pack(4 + 2 * (4 + size), _CTA_TUPLE_IP | _NLA_F_NESTED)
    addr = b"".join(re.escape(_ATTR.pack(4 + size, k)) + b"(.{%d})" % size for k in (src, dst))
    proto = (
        re.escape(_ATTR.pack(28, _CTA_TUPLE_PROTO | _NLA_F_NESTED) + _ATTR.pack(5, _CTA_PROTO_NUM)) + b"(.)..."
        + re.escape(_ATTR.pack(6, _CTA_PROTO_SRC_PORT)) + b"(..).."
        + re.escape(_ATTR.pack(6, _CTA_PROTO_DST_PORT)) + b"(..).."
    )
    one = re.escape(ip) + addr + proto
    length = 4 + 4 + 2 * (4 + size) + 28
    return re.compile(
        re.escape(_ATTR.pack(length, _CTA_TUPLE_ORIG | _NLA_F_NESTED)) + one
        + re.escape(_ATTR.pack(length, _CTA_TUPLE_REPLY | _NLA_F_NESTED)) + one,
        re.DOTALL,
    )


_TUPLES = {af: _tuples_pattern(af) for af in (socket.AF_INET, socket.AF_INET6)}


class _Entry:
    """One entry read: its flow, and where its message lies, to build its delete from."""

    __slots__ = ("flow", "_buf", "_start", "_stop")

    def __init__(self, flow: Flow, buf: bytes, start: int, stop: int) -> None:
        self.flow, self._buf, self._start, self._stop = flow, buf, start, stop

    def key(self) -> bytes:
        """CTA_TUPLE_ORIG and CTA_ZONE, as read: what deletes exactly this entry."""
        buf, a, b = self._buf, self._start, self._stop
        parts = []
        while a + 4 <= b:
            length, kind = _ATTR.unpack_from(buf, a)
            if length < 4:
                break
            if kind & _NLA_TYPE_MASK in (_CTA_TUPLE_ORIG, _CTA_ZONE):
                parts.append(bytes(buf[a: a + ((length + 3) & ~3)]))
            a += (length + 3) & ~3
        return b"".join(parts)


class _Socket:
    """A ctnetlink socket, created inside the namespace (a netlink socket stays bound to the
    namespace it was created in)."""

    def __init__(self, netns: str | None) -> None:
        with _inside(netns):
            self._sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_NETFILTER)
        try:
            with contextlib.suppress(OSError):
                self._sock.setsockopt(socket.SOL_SOCKET, 33, _RCVBUF)  # SO_RCVBUFFORCE (root)
            if self._sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) < _RCVBUF:
                self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _RCVBUF)
            self._sock.bind((0, 0))
        except BaseException:
            self._sock.close()
            raise
        self._seq = 0

    def close(self) -> None:
        self._sock.close()

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def dump(self, family: IPFamily, protocol: Protocol, *, filtered: bool = True) -> Iterator[_Entry]:
        """Every entry of the family and protocol. A kernel that refuses the dump filter is asked
        for the family's whole table instead (the decoder keeps the protocol's entries)."""
        af, proto = _AF[family], _PROTO[protocol]
        seq = self._next_seq()
        body = _dump_request(af, proto, filtered=filtered)
        self._sock.send(_HEADER.pack(_HEADER.size + len(body), _CT_GET, _NLM_F_REQUEST | _NLM_F_DUMP, seq, 0) + body)
        addr = _Addresses(af)
        fast = _TUPLES[af].match
        proto_byte = bytes([proto])
        kind = _PROTO_BY_NUMBER[proto]
        port = int.from_bytes
        for buf, at, end, mtype, mseq in self._messages():
            if mseq != seq:
                continue
            if mtype == _NLMSG_DONE:
                return
            if mtype == _NLMSG_ERROR:
                code = -_ERRNO.unpack_from(buf, at + _HEADER.size)[0]
                if filtered and code in (errno.EINVAL, errno.EOPNOTSUPP):
                    yield from self.dump(family, protocol, filtered=False)
                elif code:
                    raise KernelError(f"conntrack dump: {os.strerror(code)}")
                return
            start = at + _HEADER.size + 4
            if buf[start - 4] == af:  # nfgenmsg's family
                m = fast(buf, start)
                if m is None:
                    flow = _decode(buf, start, end, family, proto, addr)
                elif m[3] == proto_byte:
                    flow = Flow(
                        family, kind, addr(m[1]), port(m[4]), addr(m[2]), port(m[5]),
                        addr(m[6]), port(m[9]), addr(m[7]), port(m[10]),
                    )
                else:
                    flow = None
                if flow is not None:
                    yield _Entry(flow, buf, start, end)

    def _messages(self) -> Iterator[tuple[bytes, int, int, int, int]]:
        """(buffer, start, end, type, sequence) of each netlink message received, for ever: the
        caller stops when it has what it asked for."""
        while True:
            buf = self._sock.recv(1 << 20)
            at = 0
            while at + _HEADER.size <= len(buf):
                length, mtype, _, mseq, _ = _HEADER.unpack_from(buf, at)
                if length < _HEADER.size:
                    raise KernelError("conntrack netlink: a reply shorter than its header")
                yield buf, at, at + length, mtype, mseq
                at += (length + 3) & ~3

    def delete(self, family: IPFamily, keys: list[bytes]) -> int:
        """Delete each entry by its key; returns how many were there to delete."""
        nfgen = _nfgen(_AF[family])
        deleted = 0
        for start in range(0, len(keys), DELETES_PER_SEND):
            batch = keys[start: start + DELETES_PER_SEND]
            first = self._seq + 1
            out = []
            for key in batch:
                body = nfgen + key
                out.append(_HEADER.pack(_HEADER.size + len(body), _CT_DELETE, _NLM_F_REQUEST | _NLM_F_ACK,
                                        self._next_seq(), 0) + body)
            self._sock.send(b"".join(out))
            deleted += self._acks(first, self._seq)
        return deleted

    def _acks(self, first: int, last: int) -> int:
        """Read the acks of requests first..last; those that found nothing (ENOENT: expired or
        deleted meanwhile) are not counted, any other error is raised once all are read."""
        pending = set(range(first, last + 1))
        done, failure = 0, 0
        messages = self._messages()
        while pending:
            buf, at, _, mtype, mseq = next(messages)
            if mtype == _NLMSG_ERROR and mseq in pending:
                pending.discard(mseq)
                code = -_ERRNO.unpack_from(buf, at + _HEADER.size)[0]
                if code == 0:
                    done += 1
                elif code != errno.ENOENT:
                    failure = failure or code
        if failure:
            raise KernelError(f"conntrack delete: {os.strerror(failure)}")
        return done


def _decode(buf: bytes, a: int, b: int, family: IPFamily, proto: int, addr: _Addresses) -> Flow | None:
    """The general walk of an entry's attributes, for a layout the fast pattern does not know."""
    orig = reply = None
    while a + 4 <= b:
        length, kind = _ATTR.unpack_from(buf, a)
        if length < 4:
            break
        kind &= _NLA_TYPE_MASK
        if kind == _CTA_TUPLE_ORIG:
            orig = _tuple(buf, a + 4, a + length, addr)
        elif kind == _CTA_TUPLE_REPLY:
            reply = _tuple(buf, a + 4, a + length, addr)
        a += (length + 3) & ~3
    if orig is None or reply is None or orig[2] != proto:
        return None
    return Flow(family, _PROTO_BY_NUMBER[proto], orig[0], orig[3], orig[1], orig[4], reply[0], reply[3], reply[1], reply[4])


def _inside(netns: str | None) -> contextlib.AbstractContextManager[None]:
    return netns_mod.entered(netns) if netns else contextlib.nullcontext()


def _where(netns: str | None) -> str:
    return f" in netns {netns}" if netns else ""


@contextlib.contextmanager
def _socket(netns: str | None, what: str) -> Iterator[_Socket]:
    try:
        sock = _Socket(netns)
    except OSError as exc:
        raise KernelError(f"conntrack {what} failed{_where(netns)}: {exc}") from exc
    try:
        yield sock
    except OSError as exc:
        raise KernelError(f"conntrack {what} failed{_where(netns)}: {exc}") from exc
    finally:
        sock.close()


def list_flows(
    netns: str | None, family: IPFamily, protocol: Protocol = Protocol.UDP
) -> list[Flow]:
    """Every entry of one family and protocol (a read; for checks and tests)."""
    with _socket(netns, "dump") as sock:
        return [entry.flow for entry in sock.dump(family, protocol)]


def delete(flows: Iterable[FlowFilter], netns: str | None = None) -> int:
    """Delete every entry some filter matches; returns how many were deleted.

    Raises KernelError when the table cannot be read; an entry that vanished before its delete
    (expired, or deleted by someone else) is not an error.
    """
    return sum(delete_per_family(flows, netns).values())


def delete_per_family(flows: Iterable[FlowFilter], netns: str | None = None) -> dict[IPFamily, int]:
    """`delete`, with the count per IP family (for per-family metrics)."""
    by_key: dict[tuple[IPFamily, Protocol], list[FlowFilter]] = {}
    for f in flows:
        by_key.setdefault((f.family, f.protocol), []).append(f)
    deleted: dict[IPFamily, int] = {}
    for family, protocol in sorted(by_key, key=lambda k: (k[0], k[1].value)):
        n = delete_judged(netns, family, protocol, matcher(by_key[family, protocol]))
        deleted[family] = deleted.get(family, 0) + n
    return deleted


def matcher(filters: Iterable[FlowFilter]) -> Callable[[Flow], str | None]:
    """A judge (for `delete_judged`) from filters: the reason of the first that matches. Indexed
    by destination, so a table of 10 000 entries is not matched against every filter."""
    by_dest: dict[tuple[str | None, int | None], list[FlowFilter]] = {}
    for f in filters:
        by_dest.setdefault((f.orig_dst, f.orig_dport), []).append(f)
    ports_only = {port for dst, port in by_dest if dst is None}
    anywhere = by_dest.get((None, None), [])

    def judge(flow: Flow) -> str | None:
        candidates = [*by_dest.get((flow.orig_dst, flow.orig_dport), ()), *anywhere]
        if flow.orig_dport in ports_only and flow.orig_dport is not None:
            candidates += by_dest[None, flow.orig_dport]
        for f in candidates:
            if f.matches(flow.protocol, flow.orig_dst, flow.orig_dport, flow.reply_src, flow.reply_sport):
                return f.reason
        return None

    return judge


def delete_judged(
    netns: str | None,
    family: IPFamily,
    protocol: Protocol,
    judge: Callable[[Flow], str | None],
) -> int:
    """Delete every entry of the family and protocol that `judge` gives a reason for (None: the
    entry stays): one dump, then the deletes; returns how many were deleted. Raises KernelError
    when the table cannot be read or an entry cannot be deleted."""
    with _socket(netns, "cleanup") as sock:
        doomed: dict[bytes, None] = {}
        for entry in sock.dump(family, protocol):
            reason = judge(entry.flow)
            if reason is not None:
                doomed[entry.key()] = None
                _log_doomed(entry.flow, reason)
        deleted = sock.delete(family, list(doomed)) if doomed else 0
    if deleted:
        log.info(
            "conntrack: deleted %d stale %s %s entries%s",
            deleted, "IPv4" if family is IPFamily.V4 else "IPv6", protocol.lower, _where(netns),
        )
    return deleted


def _log_doomed(flow: Flow, reason: str) -> None:
    if log.isEnabledFor(logging.DEBUG):
        log.debug(
            "conntrack: deleting %s %s:%s -> %s:%s (reply from %s:%s): %s",
            flow.protocol.lower, flow.orig_src, flow.orig_sport, flow.orig_dst,
            flow.orig_dport, flow.reply_src, flow.reply_sport, reason,
        )

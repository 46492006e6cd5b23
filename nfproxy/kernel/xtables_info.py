"""What a legacy x_tables table looks like from outside, without reading its rules.

`iptables-legacy-save` (and every `iptables -L`, `-C`) copies the whole table out of the kernel
and decodes it: at 10 000 services x 10 a second and hundreds of MiB. The periodic check only
needs to know whether anyone wrote since nfproxy did, and the kernel answers that for the
price of one getsockopt: IPT_SO_GET_INFO gives a table's entry count, blob size and the offsets
of its hooks. Any rule or chain added or deleted moves at least the count or the size; a rule
replaced by one of exactly its size does not, and waits for the hourly full sync, as an edit
of a rule kube-proxy's canary chain does not see.

(iptables-nft keeps its tables in nf_tables, whose generation says the same: nft.py.)
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import socket
import struct

from nfproxy.core.model import IPFamily
from nfproxy.kernel import netns as netns_mod
from nfproxy.kernel.process import KernelError

_SO_GET_INFO = 64  # IPT_SO_GET_INFO and IP6T_SO_GET_INFO: IPT_BASE_CTL + 0
_NAME_LEN = 32  # XT_TABLE_MAXNAMELEN
# struct ipt_getinfo / ip6t_getinfo: name, valid_hooks, hook_entry[5], underflow[5],
# num_entries, size.
_INFO = struct.Struct(f"={_NAME_LEN}sI5I5III")
_LEVEL = {IPFamily.V4: socket.IPPROTO_IP, IPFamily.V6: socket.IPPROTO_IPV6}
_DOMAIN = {IPFamily.V4: socket.AF_INET, IPFamily.V6: socket.AF_INET6}

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)

TableInfo = tuple[int, ...]
"""valid_hooks, hook entries, underflows, entry count, size; () for a table the namespace lacks."""


class XtablesInfo:
    """A raw socket in one namespace (kept: the check runs every --sync-period) to ask with."""

    def __init__(self, family: IPFamily, netns: str | None = None) -> None:
        self.family = family
        self.netns = netns
        self._sock: socket.socket | None = None

    def _socket(self) -> socket.socket:
        if self._sock is None:
            def make() -> socket.socket:
                return socket.socket(_DOMAIN[self.family], socket.SOCK_RAW, socket.IPPROTO_RAW)

            if self.netns is None:
                self._sock = make()
            else:
                with netns_mod.entered(self.netns):
                    self._sock = make()
        return self._sock

    def table(self, name: str) -> TableInfo:
        buf = ctypes.create_string_buffer(name.encode(), _INFO.size)
        size = ctypes.c_uint32(_INFO.size)
        fd = self._socket().fileno()
        if _libc.getsockopt(fd, _LEVEL[self.family], _SO_GET_INFO, buf, ctypes.byref(size)) != 0:
            err = ctypes.get_errno()
            if err == errno.ENOENT:  # the table was never instantiated in this namespace
                return ()
            raise KernelError(f"getsockopt(SO_GET_INFO, {name}): {os.strerror(err)}")
        return _INFO.unpack(buf.raw)[1:]

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

"""nft rules as nfnetlink messages: the rule compiler and pyroute2's message classes it fills.

A rule body is read as nft reads it (selectors, relations, statements), not matched against
the shapes nfproxy happens to render today; `rule_messages` turns one Rule into the messages of
a batch (an anonymous set's declaration and elements first, then the rule), which nft_wire
encodes and the batch compiler (kernel/nft_bulk.py) places. A body outside the vocabulary
raises `Unsupported` before a byte is sent, and the caller hands the whole transaction to
libnftables instead: correctness never depends on the vocabulary being complete.

The encodings follow `nft --debug=netlink` / `--debug=mnl` of nft 1.0.6 (payload loads shrunk to
a byte-aligned prefix, bitwise masks otherwise, registers numbered as libnftables numbers them,
comments as libnftnl user data), so that nft lists the result exactly as it lists what it wrote
itself; tests/test_nft_netlink.py checks that against the kernel. (Issue Q replaces the text
this reads with typed expressions.)
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pyroute2.netlink import NLA_F_NESTED, NLM_F_ACK, NLM_F_APPEND, NLM_F_CREATE, NLM_F_REQUEST, nla
from pyroute2.netlink.nfnetlink import NFNL_SUBSYS_NFTABLES, nfgen_msg
from pyroute2.netlink.nfnetlink.nftsocket import (
    NFPROTO_IPV4,
    NFPROTO_IPV6,
    NFT_MSG_NEWRULE,
    NFT_MSG_NEWSET,
    NFT_MSG_NEWSETELEM,
    nft_contains_expr,
    nft_regs,
    nft_rule_msg,
    nft_set_elem_list_msg,
    nft_set_msg,
)

from nfproxy.kernel.nfnetlink.values import (
    CHAIN_VERDICTS,
    HOST,
    TYPE_INET_PROTO,
    TYPE_INET_SERVICE,
    TYPE_INTEGER,
    TYPE_IPV4,
    TYPE_IPV6,
    TYPE_MARK,
    TYPE_VERDICT,
    VERDICT_CODES,
    Field,
    Message,
    SetType,
    Unsupported,
    bare_name,
    encode_value,
    tokens,
    verdict_of,
)
from nfproxy.nftables import Rule

_FAMILIES = {"ip": NFPROTO_IPV4, "ip6": NFPROTO_IPV6}
_INTERVAL_END = ("NFTA_SET_ELEM_FLAGS", 1)  # NFT_SET_ELEM_INTERVAL_END

# --------------------------------------------------------------------------------------------
# pyroute2's expression classes, with the few attributes its nla_map types wrongly (fib result
# and lookup flags are plain u32 to the kernel, not pyroute2 flag sets) and with the nested flag
# libnftnl puts on every expression.


class _Own:
    """pyroute2 compiles an nla_map once per class and marks it compiled with a class attribute
    that subclasses inherit: a subclass made after its parent was used would silently reuse the
    parent's compiled map (and so the parent's classes). Each subclass here compiles its own."""

    _nlmsg_base__compiled_nla = False


class _Expr(_Own, nft_contains_expr.nft_expr):
    header_type = 1 | NLA_F_NESTED

    class nft_fib(_Own, nft_regs):
        nla_map = (
            ("NFTA_FIB_UNSPEC", "none"),
            ("NFTA_FIB_DREG", "regs"),
            ("NFTA_FIB_RESULT", "be32"),
            ("NFTA_FIB_FLAGS", "be32"),
        )

    class nft_lookup(_Own, nft_regs):
        nla_map = (
            ("NFTA_LOOKUP_UNSPEC", "none"),
            ("NFTA_LOOKUP_SET", "asciiz"),
            ("NFTA_LOOKUP_SREG", "regs"),
            ("NFTA_LOOKUP_DREG", "regs"),
            ("NFTA_LOOKUP_SET_ID", "be32"),
            ("NFTA_LOOKUP_FLAGS", "be32"),
        )

    class nft_nat(_Own, nft_regs):
        nla_map = (
            ("NFTA_NAT_UNSPEC", "none"),
            ("NFTA_NAT_TYPE", "be32"),
            ("NFTA_NAT_FAMILY", "be32"),
            ("NFTA_NAT_REG_ADDR_MIN", "regs"),
            ("NFTA_NAT_REG_ADDR_MAX", "regs"),
            ("NFTA_NAT_REG_PROTO_MIN", "regs"),
            ("NFTA_NAT_REG_PROTO_MAX", "regs"),
            ("NFTA_NAT_FLAGS", "be32"),
        )


NFT_OBJECT_COUNTER = 1  # include/uapi/linux/netfilter/nf_tables.h


class _ObjMsg(_Own, nfgen_msg):
    """A stateful object (NFT_MSG_GETOBJ): pyroute2 has no class for them. Only counters are
    asked for, so the data is read as a counter."""

    prefix = "NFTA_OBJ_"
    nla_map = (
        ("NFTA_OBJ_UNSPEC", "none"),
        ("NFTA_OBJ_TABLE", "asciiz"),
        ("NFTA_OBJ_NAME", "asciiz"),
        ("NFTA_OBJ_TYPE", "be32"),
        ("NFTA_OBJ_DATA", "counter"),
        ("NFTA_OBJ_USE", "be32"),
        ("NFTA_OBJ_HANDLE", "be64"),
        ("NFTA_OBJ_PAD", "hex"),
        ("NFTA_OBJ_USERDATA", "hex"),
    )

    class counter(_Own, nla):
        nla_map = (
            ("NFTA_COUNTER_UNSPEC", "none"),
            ("NFTA_COUNTER_BYTES", "be64"),
            ("NFTA_COUNTER_PACKETS", "be64"),
            ("NFTA_COUNTER_PAD", "hex"),
        )


class _RuleMsg(_Own, nft_rule_msg):
    nft_expr = _Expr


class _ElemListMsg(_Own, nft_set_elem_list_msg):
    """Element messages (libnftnl numbers the list's elements 1, 2, 3 as pyroute2 does), with
    element flags as the plain u32 the kernel reads."""

    class set_elem(_Own, nft_set_elem_list_msg.set_elem):
        nla_map = tuple(
            (name, "be32") if name == "NFTA_SET_ELEM_FLAGS" else (name, kind)
            for name, kind in nft_set_elem_list_msg.set_elem.nla_map
        )


# --------------------------------------------------------------------------------------------
# Values: what nft calls datatypes, and how each literal becomes bytes.

# fib ... type: rtn types (include/uapi/linux/rtnetlink.h), 4 bytes in host order.
_ADDRTYPES = {"unicast": 1, "local": 2, "broadcast": 3, "anycast": 4, "multicast": 5, "blackhole": 6,
              "unreachable": 7, "prohibit": 8}


# --------------------------------------------------------------------------------------------
# Text: nft's tokens. Names are bare (nfproxy never quotes one), strings are double-quoted.

def _data(value: bytes) -> dict[str, Any]:
    return {"attrs": [("NFTA_DATA_VALUE", value)]}


def _verdict_data(code: int, chain: str | None) -> dict[str, Any]:
    v: list[Any] = [("NFTA_VERDICT_CODE", code)]
    if chain is not None:
        v.append(("NFTA_VERDICT_CHAIN", chain))
    return {"attrs": [("NFTA_DATA_VERDICT", {"attrs": v}, NLA_F_NESTED)]}


def _expr(name: str, *attrs: tuple[Any, ...]) -> dict[str, Any]:
    return {"attrs": [("NFTA_EXPR_NAME", name), ("NFTA_EXPR_DATA", {"attrs": list(attrs)}, NLA_F_NESTED)]}


def _reg(k: int) -> int:
    """libnftables' register numbering: 32-bit slot k, named as a 128-bit register if aligned."""
    return 1 + k // 4 if k % 4 == 0 else 8 + k


# --------------------------------------------------------------------------------------------
# Rules: selectors, relations and statements, compiled to expressions.


@dataclass(frozen=True, slots=True)
class _Selector:
    """Something that loads a value into registers: what its literals mean and how to load it."""

    field: Field
    load: Callable[[int], dict[str, Any]]  # register slot -> expression
    payload: tuple[int, int] | None = None  # (base, offset) for prefix shrinking
    typeof: tuple[int, int] | None = None  # nft's (protocol description, field) of a payload


def _payload(base: int, offset: int, length: int) -> Callable[[int], dict[str, Any]]:
    def load(slot: int) -> dict[str, Any]:
        return _expr(
            "payload",
            ("NFTA_PAYLOAD_DREG", _reg(slot)),
            ("NFTA_PAYLOAD_BASE", base),
            ("NFTA_PAYLOAD_OFFSET", offset),
            ("NFTA_PAYLOAD_LEN", length),
        )

    return load


def _meta(key: int) -> Callable[[int], dict[str, Any]]:
    return lambda slot: _expr("meta", ("NFTA_META_KEY", key), ("NFTA_META_DREG", _reg(slot)))


_NETWORK, _TRANSPORT = 1, 2
_META_MARK, _META_IIFNAME, _META_L4PROTO = 3, 6, 16
_TYPE_IFNAME, _IFNAMSIZ = 41, 16
_IFNAME = re.compile(r'"([A-Za-z0-9_.@-]{1,15})(\*?)"')
# ct state and ct status bits (nf_conntrack_common.h): what `ct state new`, `ct status dnat` test.
_CT_BITS = {
    "state": (0, {"invalid": 1, "established": 2, "related": 4, "new": 8, "untracked": 64}),
    "status": (2, {"expected": 1, "seen-reply": 2, "assured": 4, "confirmed": 8, "snat": 0x10, "dnat": 0x20}),
}
_REJECT_PORT_UNREACHABLE = {"ip": 3, "ip6": 4}  # ICMP and ICMPv6 codes: a bare `reject`
_MARK = _Selector(Field(TYPE_MARK, 4, True), _meta(_META_MARK))


@dataclass
class _RuleCompiler:
    family: str
    table: str
    set_type: Callable[[str], SetType]
    command: str
    exprs: list[dict[str, Any]] = field(default_factory=list)
    # Anonymous sets this rule needs, created in the same batch before it:
    # (NEWSET attributes, name template, batch-local id, element attribute dicts).
    set_messages: list[tuple[tuple[Any, ...], str, int, list[dict[str, Any]]]] = field(default_factory=list)
    comment: str | None = None
    next_set_id: Callable[[], int] = lambda: 0

    def fail(self, why: str) -> Unsupported:
        return Unsupported(f"{why}: {self.command}")

    # -- selectors -------------------------------------------------------------------------
    def selector(self, toks: list[str], i: int) -> tuple[_Selector, int] | None:
        """Parse one selector at toks[i]; None when toks[i] does not start one."""
        t = toks[i]
        nxt = toks[i + 1] if i + 1 < len(toks) else ""
        if t in ("ip", "ip6") and nxt in ("saddr", "daddr"):
            if t != self.family:
                raise self.fail(f"{t} {nxt} in an {self.family} table")
            # nft's proto_desc ids (ip 12, ip6 13) and header field indexes, for set user data.
            if t == "ip":
                f, off, typeof = Field(TYPE_IPV4, 4), 12 if nxt == "saddr" else 16, (12, 11 if nxt == "saddr" else 12)
            else:
                f, off, typeof = Field(TYPE_IPV6, 16), 8 if nxt == "saddr" else 24, (13, 8 if nxt == "saddr" else 9)
            return _Selector(f, _payload(_NETWORK, off, f.size), (_NETWORK, off), typeof), i + 2
        if t == "meta" and nxt == "l4proto":
            return _Selector(Field(TYPE_INET_PROTO, 1), _meta(_META_L4PROTO)), i + 2
        if t == "meta" and nxt == "mark":
            return _MARK, i + 2
        if t == "iifname":
            return _Selector(Field(_TYPE_IFNAME, _IFNAMSIZ), _meta(_META_IIFNAME)), i + 1
        if t == "th" and nxt == "dport":
            return _Selector(Field(TYPE_INET_SERVICE, 2), _payload(_TRANSPORT, 2, 2)), i + 2
        if t == "fib" and nxt in ("saddr", "daddr") and toks[i + 2 : i + 3] == ["type"]:
            flag = 1 if nxt == "saddr" else 2  # NFTA_FIB_F_SADDR / _DADDR

            def load(slot: int, flag: int = flag) -> dict[str, Any]:
                return _expr(
                    "fib",
                    ("NFTA_FIB_FLAGS", flag),
                    ("NFTA_FIB_RESULT", 3),  # NFT_FIB_RESULT_ADDRTYPE
                    ("NFTA_FIB_DREG", _reg(slot)),
                )

            return _Selector(Field(-1, 4, True), load), i + 3
        if t == "numgen" and nxt == "random" and toks[i + 2 : i + 3] == ["mod"]:
            try:
                mod = int(toks[i + 3])
                j = i + 4
                offset = 0
                if toks[j : j + 1] == ["offset"]:
                    offset = int(toks[j + 1])
                    j += 2
            except (IndexError, ValueError):
                raise self.fail("numgen without a modulus") from None

            def load_ng(slot: int, mod: int = mod, offset: int = offset) -> dict[str, Any]:
                return _expr(
                    "numgen",
                    ("NFTA_NG_DREG", _reg(slot)),
                    ("NFTA_NG_MODULUS", mod),
                    ("NFTA_NG_TYPE", 1),  # NFT_NG_RANDOM
                    ("NFTA_NG_OFFSET", offset),
                )

            return _Selector(Field(TYPE_INTEGER, 4, True), load_ng), j
        return None

    def selectors(self, toks: list[str], i: int) -> tuple[list[_Selector], int] | None:
        """A selector or a concatenation `a . b . c`."""
        first = self.selector(toks, i)
        if first is None:
            return None
        sels, i = [first[0]], first[1]
        while i < len(toks) and toks[i] == ".":
            nxt = self.selector(toks, i + 1)
            if nxt is None:
                raise self.fail("concatenation of something outside the vocabulary")
            sels.append(nxt[0])
            i = nxt[1]
        return sels, i

    def load(self, sels: list[_Selector]) -> None:
        slot = 0
        for s in sels:
            self.exprs.append(s.load(slot))
            slot += -(-s.field.size // 4) if len(sels) > 1 else 0

    # -- literals ----------------------------------------------------------------------------
    def literal(self, sel: _Selector, text: str) -> bytes:
        if sel.field.type == -1:  # fib address type
            if text not in _ADDRTYPES:
                raise self.fail(f"unknown address type {text!r}")
            return _ADDRTYPES[text].to_bytes(4, HOST)
        if sel.field.type == _TYPE_IFNAME:  # "eth0": the whole padded name; "veth*": its prefix
            m = _IFNAME.fullmatch(text)
            if m is None:
                raise self.fail(f"interface name {text!r}")
            return m[1].encode() if m[2] else m[1].encode().ljust(_IFNAMSIZ, b"\0")
        return encode_value(text, sel.field, self.command)

    def cmp(self, op: int, value: bytes) -> None:
        self.exprs.append(
            _expr(
                "cmp",
                ("NFTA_CMP_SREG", 1),
                ("NFTA_CMP_OP", op),
                ("NFTA_CMP_DATA", _data(value), NLA_F_NESTED),
            )
        )

    def relation(self, sels: list[_Selector], negate: bool, rhs: str) -> None:
        """`sels [!=] rhs` where rhs is a literal, a prefix or @set."""
        if rhs.startswith("@"):
            name = bare_name(rhs[1:], self.command)
            self.load(sels)
            attrs: list[tuple[str, Any]] = [("NFTA_LOOKUP_SREG", 1), ("NFTA_LOOKUP_SET", name)]  # nft's order
            if negate:
                attrs.append(("NFTA_LOOKUP_FLAGS", 1))  # NFT_LOOKUP_F_INV
            self.exprs.append(_expr("lookup", *attrs))
            return
        if len(sels) != 1:
            raise self.fail("a concatenation compared with a literal")
        sel = sels[0]
        op = 1 if negate else 0
        if "/" in rhs and sel.payload is not None:
            try:
                net = ipaddress.ip_network(rhs, strict=True)
            except ValueError:
                raise self.fail(f"{rhs!r} is not a network") from None
            bits = net.max_prefixlen
            if sel.field.size * 8 != bits:
                raise self.fail(f"{rhs} compared with a {sel.field.size}-byte field")
            plen = net.prefixlen
            if plen == bits:
                self.load(sels)
                self.cmp(op, net.network_address.packed)
                return
            if plen == 0:
                raise self.fail("a /0 prefix")
            base, offset = sel.payload
            if plen % 8 == 0:
                n = plen // 8
                self.exprs.append(_payload(base, offset, n)(0))
                self.cmp(op, net.network_address.packed[:n])
                return
            self.load(sels)
            self.bitwise(net.netmask.packed, bytes(sel.field.size))
            self.cmp(op, net.network_address.packed)
            return
        self.load(sels)
        self.cmp(op, self.literal(sel, rhs))

    # -- anonymous sets --------------------------------------------------------------------------
    def anon_set_relation(self, sels: list[_Selector], negate: bool, items: list[list[str]]) -> None:
        """`sel [!=] { a/p, b, ... }` of addresses: as nft compiles it.

        One item is a plain relation; items with a prefix among them make an anonymous interval
        set whose ranges nft merges (overlapping or adjacent) before sending; sets of plain
        addresses only (a hash set) are left to libnftables.
        """
        if len(sels) != 1 or sels[0].typeof is None or any(len(x) != 1 for x in items) or not items:
            raise self.fail("anonymous set outside the vocabulary")
        sel = sels[0]
        if len(items) == 1:
            self.relation(sels, negate, items[0][0])
            return
        if not any("/" in x[0] for x in items):
            raise self.fail("anonymous set without ranges")
        size = sel.field.size
        top = (1 << (8 * size)) - 1
        ranges: list[tuple[int, int]] = []
        for (text,) in items:
            try:
                net = ipaddress.ip_network(text, strict=True)
            except ValueError:
                raise self.fail(f"{text!r} is not an address or network") from None
            if net.max_prefixlen != size * 8 or ("/" in text and net.prefixlen == net.max_prefixlen):
                raise self.fail(f"{text!r} in a set of {size}-byte addresses")
            ranges.append((int(net.network_address), int(net.broadcast_address)))
        ranges.sort()
        merged = [ranges[0]]
        for lo, hi in ranges[1:]:
            if lo <= merged[-1][1] + 1:
                merged[-1] = (merged[-1][0], max(hi, merged[-1][1]))
            else:
                merged.append((lo, hi))
        elements: list[dict[str, Any]] = []
        if merged[0][0] != 0:
            elements.append({"attrs": [_INTERVAL_END, ("NFTA_SET_ELEM_KEY", _data(bytes(size)), NLA_F_NESTED)]})
        for lo, hi in merged:
            start: list[Any] = [("NFTA_SET_ELEM_KEY", _data(lo.to_bytes(size, "big")), NLA_F_NESTED)]
            if hi == top:  # open interval: no end element fits; libnftnl flags it instead
                start.append(("NFTA_SET_ELEM_USERDATA", bytes((1, 4)) + (1).to_bytes(4, HOST)))
            elements.append({"attrs": start})
            if hi != top:
                elements.append(
                    {"attrs": [_INTERVAL_END, ("NFTA_SET_ELEM_KEY", _data((hi + 1).to_bytes(size, "big")), NLA_F_NESTED)]}
                )
        desc, fld = sel.typeof
        typeof = _udata(0, (7).to_bytes(4, HOST)) + _udata(
            1, _udata(0, desc.to_bytes(4, HOST)) + _udata(1, fld.to_bytes(4, HOST))
        )
        udata = (
            _udata(0, (2).to_bytes(4, HOST))  # key byte order: big endian
            + _udata(2, (1).to_bytes(4, HOST))  # merge elements
            + _udata(3, typeof)  # key typeof: a payload expression
        )
        set_id = self.next_set_id()
        self.set_messages.append((
            (
                ("NFTA_SET_TABLE", self.table),
                ("NFTA_SET_NAME", "__set%d"),
                ("NFTA_SET_FLAGS", frozenset({"NFT_SET_ANONYMOUS", "NFT_SET_CONSTANT", "NFT_SET_INTERVAL"})),
                ("NFTA_SET_KEY_TYPE", sel.field.type),
                ("NFTA_SET_KEY_LEN", size),
                ("NFTA_SET_ID", set_id),
                ("NFTA_SET_DESC", {"attrs": [("NFTA_SET_DESC_SIZE", 2 * len(merged) + (merged[0][0] != 0))]}, NLA_F_NESTED),
                ("NFTA_SET_USERDATA", udata),
            ),
            "__set%d",
            set_id,
            elements,
        ))
        self.load(sels)
        attrs: list[tuple[str, Any]] = [
            ("NFTA_LOOKUP_SREG", 1),
            ("NFTA_LOOKUP_SET", "__set%d"),
            ("NFTA_LOOKUP_SET_ID", set_id),
        ]
        if negate:
            attrs.append(("NFTA_LOOKUP_FLAGS", 1))
        self.exprs.append(_expr("lookup", *attrs))

    # -- anonymous verdict maps ------------------------------------------------------------------
    def anon_vmap(self, sels: list[_Selector], toks: list[str], i: int) -> int:
        """`numgen ... vmap { 0 : goto a , 1 : goto b }`: an anonymous constant map; with
        ranges (`0-6 : goto a , 7-9 : goto b`, a weighted choice) an interval one."""
        if len(sels) != 1 or sels[0].field.type != TYPE_INTEGER:
            raise self.fail("anonymous vmap keyed by something other than numgen")
        try:
            end = toks.index("}", i)
        except ValueError:
            raise self.fail("unterminated anonymous vmap") from None
        items: list[tuple[str, int, str | None]] = []
        for item in _split_commas(toks[i + 1 : end]):
            if len(item) < 3 or item[1] != ":":
                raise self.fail("anonymous vmap element")
            code, chain = verdict_of(item[2:], self.command)
            items.append((item[0], code, chain))
        if not items:
            raise self.fail("empty anonymous vmap")
        interval = any("-" in key for key, _, _ in items)
        elements = self._interval_vmap(items) if interval else [
            {"attrs": [
                ("NFTA_SET_ELEM_KEY", _data(self.literal(sels[0], key)), NLA_F_NESTED),
                ("NFTA_SET_ELEM_DATA", _verdict_data(code, chain), NLA_F_NESTED),
            ]} for key, code, chain in items]
        flags = {"NFT_SET_ANONYMOUS", "NFT_SET_CONSTANT", "NFT_SET_MAP"} | ({"NFT_SET_INTERVAL"} if interval else set())
        set_id = self.next_set_id()
        self.set_messages.append((
            (
                ("NFTA_SET_TABLE", self.table),
                ("NFTA_SET_NAME", "__map%d"),
                ("NFTA_SET_FLAGS", frozenset(flags)),
                ("NFTA_SET_KEY_TYPE", TYPE_INTEGER),
                ("NFTA_SET_KEY_LEN", 4),
                ("NFTA_SET_DATA_TYPE", TYPE_VERDICT),
                ("NFTA_SET_DATA_LEN", 0),
                ("NFTA_SET_ID", set_id),
                ("NFTA_SET_DESC", {"attrs": [("NFTA_SET_DESC_SIZE", 2 * len(items) if interval else len(items))]},
                 NLA_F_NESTED),
                ("NFTA_SET_USERDATA", _ANON_VMAP_UDATA),
            ),
            "__map%d",
            set_id,
            elements,
        ))
        self.load(sels)
        if interval:  # the keys are big-endian: the draw is byte-swapped first, as nft does
            self.hton()
        self.exprs.append(
            _expr(
                "lookup",
                ("NFTA_LOOKUP_SREG", 1),
                ("NFTA_LOOKUP_DREG", 0),
                ("NFTA_LOOKUP_SET", "__map%d"),
                ("NFTA_LOOKUP_SET_ID", set_id),  # the kernel names it at commit: find it by id
            )
        )
        return end + 1

    def _interval_vmap(self, items: list[tuple[str, int, str | None]]) -> list[dict[str, Any]]:
        """Elements of an anonymous interval vmap as libnftables sends them: each range's start
        (big-endian key, the verdict), and an end marker (the value after the range) only where
        the next range does not start there, and after the last one."""
        ranges: list[tuple[int, int, int, str | None]] = []
        for key, code, chain in items:
            low, _, high = key.partition("-")
            try:
                lo, hi = int(low), int(high or low)
            except ValueError:
                raise self.fail(f"anonymous vmap key {key!r}") from None
            if not 0 <= lo <= hi < 1 << 32:
                raise self.fail(f"anonymous vmap key {key!r}")
            ranges.append((lo, hi, code, chain))
        ranges.sort()
        out: list[dict[str, Any]] = []
        for n, (lo, hi, code, chain) in enumerate(ranges):
            if n and lo <= ranges[n - 1][1]:
                raise self.fail("overlapping ranges in an anonymous vmap")
            out.append({"attrs": [
                ("NFTA_SET_ELEM_KEY", _data(lo.to_bytes(4, "big")), NLA_F_NESTED),
                ("NFTA_SET_ELEM_DATA", _verdict_data(code, chain), NLA_F_NESTED),
            ]})
            following = ranges[n + 1][0] if n + 1 < len(ranges) else None
            if following != hi + 1 and hi + 1 < 1 << 32:
                out.append({"attrs": [_INTERVAL_END, ("NFTA_SET_ELEM_KEY", _data((hi + 1).to_bytes(4, "big")), NLA_F_NESTED)]})
        return out

    def interval_key(self, sels: list[_Selector], st: SetType) -> None:
        """An interval set holds its keys in network order: a host-order key (numgen) is
        byte-swapped first, as nft does (`byteorder reg 1 = hton(reg 1, 4, 4)`)."""
        if len(sels) != 1 or not sels[0].field.host_order or sels[0].field.size != 4:
            raise self.fail(f"interval map {st.name} keyed by something other than a 32-bit host-order value")
        self.hton()

    def hton(self) -> None:
        """`byteorder reg 1 = hton(reg 1, 4, 4)`: a 32-bit host-order value to network order."""
        self.exprs.append(
            _expr(
                "byteorder",
                ("NFTA_BYTEORDER_SREG", _reg(0)),
                ("NFTA_BYTEORDER_DREG", _reg(0)),
                ("NFTA_BYTEORDER_OP", 1),  # NFT_BYTEORDER_HTON
                ("NFTA_BYTEORDER_LEN", 4),
                ("NFTA_BYTEORDER_SIZE", 4),
            )
        )

    # -- statements ----------------------------------------------------------------------------
    def verdict(self, code: int, chain: str | None) -> None:
        self.exprs.append(
            _expr(
                "immediate",
                ("NFTA_IMMEDIATE_DREG", 0),
                ("NFTA_IMMEDIATE_DATA", _verdict_data(code, chain), NLA_F_NESTED),
            )
        )

    def dnat(self, toks: list[str], i: int) -> int:
        """`dnat [ip|ip6] to ADDR[:PORT]`, `dnat to [ADDR6]:PORT`, `dnat ip to <sel> map @M`."""
        fam = NFPROTO_IPV4 if self.family == "ip" else NFPROTO_IPV6
        if toks[i : i + 1] == [self.family]:
            i += 1
        if toks[i : i + 1] != ["to"]:
            raise self.fail("dnat without `to`")
        i += 1
        addr_field = Field(TYPE_IPV4, 4) if self.family == "ip" else Field(TYPE_IPV6, 16)
        found = self.selectors(toks, i)
        if found is not None:
            sels, i = found
            if toks[i : i + 1] != ["map"] or not toks[i + 1 : i + 2] or not toks[i + 1].startswith("@"):
                raise self.fail("dnat to an expression that is not a map lookup")
            st = self.set_type(bare_name(toks[i + 1][1:], self.command))
            if st.data is None or st.verdict or not st.data or st.data[0] != addr_field:
                raise self.fail(f"dnat through map {st.name} whose data is not an address")
            if len(st.data) not in (1, 2) or (len(st.data) == 2 and st.data[1].type != TYPE_INET_SERVICE):
                raise self.fail(f"dnat through map {st.name} of unexpected data")
            self.load(sels)
            if st.interval:
                self.interval_key(sels, st)
            self.exprs.append(
                _expr("lookup", ("NFTA_LOOKUP_SREG", 1), ("NFTA_LOOKUP_DREG", 1), ("NFTA_LOOKUP_SET", st.name))
            )
            attrs: list[tuple[str, int]] = [
                ("NFTA_NAT_TYPE", 1),
                ("NFTA_NAT_FAMILY", fam),
                ("NFTA_NAT_REG_ADDR_MIN", 1),
            ]
            if len(st.data) == 2:
                attrs.append(("NFTA_NAT_REG_PROTO_MIN", _reg(-(-addr_field.size // 4))))
            self.exprs.append(_expr("nat", *attrs))
            return i + 2
        dest = toks[i]
        m = re.fullmatch(r"\[([0-9A-Fa-f:.]+)\]:(\d+)", dest) if self.family == "ip6" else re.fullmatch(
            r"([0-9.]+)(?::(\d+))?", dest
        )
        if m is None:
            if self.family == "ip6" and re.fullmatch(r"[0-9A-Fa-f:.]+", dest):
                addr, port = dest, None
            else:
                raise self.fail(f"dnat destination {dest!r}")
        else:
            addr, port = m.group(1), m.group(2)
        self.exprs.append(
            _expr(
                "immediate",
                ("NFTA_IMMEDIATE_DREG", 1),
                ("NFTA_IMMEDIATE_DATA", _data(encode_value(addr, addr_field, self.command)), NLA_F_NESTED),
            )
        )
        attrs = [("NFTA_NAT_TYPE", 1), ("NFTA_NAT_FAMILY", fam), ("NFTA_NAT_REG_ADDR_MIN", 1)]
        if port is not None:
            self.exprs.append(
                _expr(
                    "immediate",
                    ("NFTA_IMMEDIATE_DREG", 2),
                    ("NFTA_IMMEDIATE_DATA", _data(int(port).to_bytes(2, "big")), NLA_F_NESTED),
                )
            )
            attrs += [("NFTA_NAT_REG_PROTO_MIN", 2), ("NFTA_NAT_FLAGS", 2)]  # PROTO_SPECIFIED
        self.exprs.append(_expr("nat", *attrs))
        return i + 1

    def update(self, toks: list[str], i: int) -> int:
        """`update @set { sel }`: the affinity record (no timeout, no data)."""
        if not toks[i].startswith("@") or toks[i + 1 : i + 2] != ["{"]:
            raise self.fail("update without @set { key }")
        name = bare_name(toks[i][1:], self.command)
        found = self.selectors(toks, i + 2)
        if found is None or toks[found[1] : found[1] + 1] != ["}"]:
            raise self.fail("update key outside the vocabulary")
        self.load(found[0])
        self.exprs.append(
            _expr(
                "dynset",
                ("NFTA_DYNSET_SREG_KEY", 1),
                ("NFTA_DYNSET_OP", 1),  # NFT_DYNSET_OP_UPDATE
                ("NFTA_DYNSET_SET_NAME", name),
            )
        )
        return found[1] + 1

    # -- the base chains' fixed words: connection tracking, marks, named counters, reject, masquerade
    def fixed(self, toks: list[str], i: int) -> tuple[int, bool] | None:
        """One of the words at toks[i] (where it ends, whether it ends the rule), or None."""
        t, nxt = toks[i], toks[i + 1] if i + 1 < len(toks) else ""
        if t == "ct" and nxt in _CT_BITS:
            return self.ct_bits(toks, i + 1), False
        if toks[i : i + 5] == ["meta", "mark", "set", "meta", "mark"] and i + 6 < len(toks):
            op, value = toks[i + 5], int.from_bytes(self.literal(_MARK, toks[i + 6]), HOST)
            if op not in ("and", "or", "xor"):
                raise self.fail(f"meta mark set meta mark {op}")
            mask, xor = {"and": (value, 0), "or": (~value, value), "xor": (-1, value)}[op]
            self.exprs.append(_MARK.load(0))
            self.bitwise((mask & 0xFFFFFFFF).to_bytes(4, HOST), xor.to_bytes(4, HOST), boolean=True)
            self.exprs.append(_expr("meta", ("NFTA_META_KEY", _META_MARK), ("NFTA_META_SREG", 1)))
            return i + 7, False
        if t == "counter" and nxt == "name":
            name = bare_name(toks[i + 2] if i + 2 < len(toks) else "", self.command)
            self.exprs.append(_expr("objref", ("NFTA_OBJREF_IMM_TYPE", NFT_OBJECT_COUNTER), ("NFTA_OBJREF_IMM_NAME", name)))
            return i + 3, False
        if t == "reject" and nxt in ("", "comment"):
            code = _REJECT_PORT_UNREACHABLE[self.family]
            self.exprs.append(_expr("reject", ("NFTA_REJECT_TYPE", 0), ("NFTA_REJECT_ICMP_CODE", code)))  # ICMP_UNREACH
            return i + 1, True
        if t == "masquerade" and nxt == "fully-random":
            self.exprs.append(_expr("masq", ("NFTA_MASQ_FLAGS", frozenset({"NF_NAT_RANGE_PROTO_RANDOM_FULLY"}))))
            return i + 2, True
        return None

    def ct_bits(self, toks: list[str], i: int) -> int:
        """`ct state new`, `ct status dnat`, `ct state established,related`: any of the bits set."""
        key, bits = _CT_BITS[toks[i]]
        names, i = toks[i + 1 : i + 2], i + 2
        while toks[i : i + 1] == [","]:
            names, i = names + toks[i + 1 : i + 2], i + 2
        if not names or any(n not in bits for n in names):
            raise self.fail(f"ct {' '.join(names)} outside the vocabulary")
        self.exprs.append(_expr("ct", ("NFTA_CT_KEY", key), ("NFTA_CT_DREG", 1)))
        self.bitwise(sum({bits[n] for n in names}).to_bytes(4, HOST), bytes(4))
        self.cmp(1, bytes(4))  # != 0
        return i

    def masked(self, sels: list[_Selector], toks: list[str], i: int) -> int:
        """`meta mark and 0x4000 == 0`, after its `and`."""
        if len(sels) != 1 or sels[0].field.type != TYPE_MARK or i + 2 >= len(toks) or toks[i + 1] not in ("==", "!="):
            raise self.fail("a bit operation outside the vocabulary")
        self.load(sels)
        self.bitwise(self.literal(sels[0], toks[i]), bytes(4), boolean=True)
        self.cmp(int(toks[i + 1] == "!="), self.literal(sels[0], toks[i + 2]))
        return i + 3

    def bitwise(self, mask: bytes, xor: bytes, boolean: bool = False) -> None:
        """reg 1 = (reg 1 & mask) ^ xor; nft names the operation (boolean) for a mark's
        arithmetic, not for a prefix or a flag test."""
        attrs: list[tuple[str, Any]] = [("NFTA_BITWISE_SREG", 1), ("NFTA_BITWISE_DREG", 1)]
        attrs += [("NFTA_BITWISE_OP", 0)] if boolean else []  # NFT_BITWISE_BOOL
        attrs += [("NFTA_BITWISE_LEN", len(mask)), ("NFTA_BITWISE_MASK", _data(mask), NLA_F_NESTED),
                  ("NFTA_BITWISE_XOR", _data(xor), NLA_F_NESTED)]
        self.exprs.append(_expr("bitwise", *attrs))

    def compile(self, toks: list[str]) -> None:
        i = 0
        terminal = False
        while i < len(toks):
            if terminal and toks[i] != "comment":
                raise self.fail("statements after a verdict")
            t = toks[i]
            if t == "comment":
                if i + 2 != len(toks) or not toks[i + 1].startswith('"'):
                    raise self.fail("comment that is not the last, quoted word")
                self.comment = toks[i + 1][1:-1]
                i += 2
                continue
            if t in CHAIN_VERDICTS:
                self.verdict(CHAIN_VERDICTS[t], bare_name(toks[i + 1] if i + 1 < len(toks) else "", self.command))
                i += 2
                terminal = True
                continue
            if t in VERDICT_CODES:
                self.verdict(VERDICT_CODES[t], None)
                i += 1
                terminal = True
                continue
            if t == "dnat":
                i = self.dnat(toks, i + 1)
                terminal = True
                continue
            if t == "update":
                i = self.update(toks, i + 1)
                continue
            fixed = self.fixed(toks, i)
            if fixed is not None:
                i, ends = fixed
                terminal = terminal or ends
                continue
            if t == "counter":  # an anonymous rule counter (per-endpoint chains' DNAT)
                self.exprs.append(_expr("counter", ("NFTA_COUNTER_BYTES", 0), ("NFTA_COUNTER_PACKETS", 0)))
                i += 1
                continue
            found = self.selectors(toks, i)
            if found is None:
                raise self.fail(f"{t!r} is outside the netlink vocabulary")
            sels, i = found
            if i >= len(toks):
                raise self.fail("a selector without a value")
            if toks[i] == "vmap":
                if toks[i + 1 : i + 2] == ["{"]:
                    i = self.anon_vmap(sels, toks, i + 1)
                elif toks[i + 1 : i + 2] and toks[i + 1].startswith("@"):
                    self.load(sels)
                    self.exprs.append(
                        _expr(
                            "lookup",
                            ("NFTA_LOOKUP_SREG", 1),
                            ("NFTA_LOOKUP_DREG", 0),
                            ("NFTA_LOOKUP_SET", bare_name(toks[i + 1][1:], self.command)),
                        )
                    )
                    i += 2
                else:
                    raise self.fail("vmap of something outside the vocabulary")
                terminal = True
                continue
            if toks[i] == "and":
                i = self.masked(sels, toks, i + 1)
                continue
            negate = False
            if toks[i] in ("!=", "=="):
                negate = toks[i] == "!="
                i += 1
            if i < len(toks) and toks[i] == "{":
                try:
                    end = toks.index("}", i)
                except ValueError:
                    raise self.fail("unterminated anonymous set") from None
                self.anon_set_relation(sels, negate, _split_commas(toks[i + 1 : end]))
                i = end + 1
                continue
            if i >= len(toks) or toks[i] in ("{", "}") or toks[i] in ("<", ">", "<=", ">=", "&", "|"):
                raise self.fail("relation outside the vocabulary (anonymous set, range or bit operation)")
            self.relation(sels, negate, toks[i])
            i += 1
        if not self.exprs:
            raise self.fail("an empty rule")


def _udata(kind: int, value: bytes) -> bytes:
    """One libnftnl user-data TLV (type, length, value): opaque to the kernel, read by nft."""
    return bytes((kind, len(value))) + value


def _split_commas(body: list[str]) -> list[list[str]]:
    items: list[list[str]] = [[]]
    for tok in body:
        if tok == ",":
            items.append([])
        else:
            items[-1].append(tok)
    return [x for x in items if x]


# The user data libnftables 1.0.6 gives an anonymous `numgen ... vmap { ... }`: key byte order
# host (1), data byte order 0, the data's typeof (verdict), data not an interval. nft reads the
# key byte order back to print the keys, so it must be the same.
_ANON_VMAP_UDATA = bytes.fromhex("00040100000001040000000004080004010000000100060400000000")


# --------------------------------------------------------------------------------------------
# Commands to messages.


def rule_messages(
    rule: Rule, family: str, table: str, set_type: Callable[[str], SetType], command: str, set_ids: Any
) -> list[Message]:
    rc = _RuleCompiler(family, table, set_type, command, next_set_id=lambda: next(set_ids))
    rc.compile(tokens(rule.body))
    out: list[Message] = []
    for set_attrs, set_name, set_id, elements in rc.set_messages:
        out.append(Message(nft_set_msg, NFT_MSG_NEWSET, NLM_F_CREATE, set_attrs, command))
        out.append(Message(_ElemListMsg, NFT_MSG_NEWSETELEM, NLM_F_CREATE, (
            ("NFTA_SET_ELEM_LIST_TABLE", table),
            ("NFTA_SET_ELEM_LIST_SET", set_name),
            ("NFTA_SET_ELEM_LIST_SET_ID", set_id),
            ("NFTA_SET_ELEM_LIST_ELEMENTS", elements, NLA_F_NESTED),
        ), command))
    attrs: list[Any] = [
        ("NFTA_RULE_TABLE", table),
        ("NFTA_RULE_CHAIN", rule.chain),
        ("NFTA_RULE_EXPRESSIONS", rc.exprs, NLA_F_NESTED),
    ]
    if rc.comment is not None:
        if len(rc.comment.encode()) + 1 > 255:
            raise Unsupported(f"rule comment too long: {command}")
        attrs.append(("NFTA_RULE_USERDATA", rc.comment))
    out.append(Message(_RuleMsg, NFT_MSG_NEWRULE, NLM_F_CREATE | NLM_F_APPEND, tuple(attrs), command))
    return out


def build(message: Message, family: int, seq: int) -> Any:
    """The pyroute2 message object for one Message: what pyroute2's encoder would write, the
    reference nft_wire's bytes are held equal to (tests/test_nft_wire.py, bench/); what is
    sent is nft_wire's."""
    msg = message.msg_class()
    msg["nfgen_family"] = family
    msg["res_id"] = 0
    msg["version"] = 0
    msg["header"]["type"] = (NFNL_SUBSYS_NFTABLES << 8) | message.msg_type
    msg["header"]["flags"] = NLM_F_REQUEST | NLM_F_ACK | message.flags
    msg["header"]["sequence_number"] = seq
    msg["attrs"] = list(message.attrs)
    return msg

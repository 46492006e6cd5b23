"""nft rules as nfnetlink messages: the rule compiler and pyroute2's message classes it fills.

A rule body is the typed statements of nftables/expr.py (selectors, relations, statements),
compiled as nft compiles them, not matched against the shapes nfproxy happens to render today;
`rule_messages` turns one Rule into the messages of a batch (an anonymous set's declaration and elements first, then the rule), which nft_wire
encodes and the batch compiler (kernel/nft_bulk.py) places. A body outside the vocabulary
raises `Unsupported` before a byte is sent, and the caller hands the whole transaction to
libnftables instead: correctness never depends on the vocabulary being complete.

The encodings follow `nft --debug=netlink` / `--debug=mnl` of nft 1.0.6 (payload loads shrunk to
a byte-aligned prefix, bitwise masks otherwise, registers numbered as libnftables numbers them,
comments as libnftnl user data), so that nft lists the result exactly as it lists what it wrote
itself; tests/test_nft_netlink.py checks that against the kernel.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Iterable
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
)
from nfproxy.nftables import Rule
from nfproxy.nftables import expr as x
from nfproxy.nftables.script import rule_body

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
# Expressions as pyroute2's encoder takes them.


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
# Rules: the typed statements of nftables/expr.py, compiled to expressions.


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


def _address(family: str, field_: str, size: int, offset: int, typeof: tuple[int, int]) -> _Selector:
    f = Field(TYPE_IPV4 if family == "ip" else TYPE_IPV6, size)
    return _Selector(f, _payload(_NETWORK, offset, size), (_NETWORK, offset), typeof)


_NETWORK, _TRANSPORT = 1, 2
_META_MARK, _META_IIFNAME, _META_L4PROTO = 3, 6, 16
_TYPE_IFNAME, _TYPE_ADDRTYPE, _IFNAMSIZ = 41, -1, 16
_IFNAME = re.compile(r"([A-Za-z0-9_.@-]{1,15})(\*?)")
# ct state and ct status bits (nf_conntrack_common.h): what `ct state new`, `ct status dnat` test.
_CT_BITS = {
    "state": (0, {"invalid": 1, "established": 2, "related": 4, "new": 8, "untracked": 64}),
    "status": (2, {"expected": 1, "seen-reply": 2, "assured": 4, "confirmed": 8, "snat": 0x10, "dnat": 0x20}),
}
_REJECT_PORT_UNREACHABLE = {"ip": 3, "ip6": 4}  # ICMP and ICMPv6 codes: a bare `reject`
_MARK = _Selector(Field(TYPE_MARK, 4, True), _meta(_META_MARK))
# The selectors that are the same in every rule; nft's proto_desc ids (ip 12, ip6 13) and header
# field indexes are what a set's user data says its key is.
_SELECTORS = {
    x.payload("ip", "saddr"): _address("ip", "saddr", 4, 12, (12, 11)),
    x.payload("ip", "daddr"): _address("ip", "daddr", 4, 16, (12, 12)),
    x.payload("ip6", "saddr"): _address("ip6", "saddr", 16, 8, (13, 8)),
    x.payload("ip6", "daddr"): _address("ip6", "daddr", 16, 24, (13, 9)),
    x.TH_DPORT: _Selector(Field(TYPE_INET_SERVICE, 2), _payload(_TRANSPORT, 2, 2)),
    x.L4PROTO: _Selector(Field(TYPE_INET_PROTO, 1), _meta(_META_L4PROTO)),
    x.MARK: _MARK,
    x.Meta("iifname"): _Selector(Field(_TYPE_IFNAME, _IFNAMSIZ), _meta(_META_IIFNAME)),
}


def _fib(flag: int) -> _Selector:
    def load(slot: int) -> dict[str, Any]:
        return _expr("fib", ("NFTA_FIB_FLAGS", flag), ("NFTA_FIB_RESULT", 3), ("NFTA_FIB_DREG", _reg(slot)))  # ADDRTYPE

    return _Selector(Field(_TYPE_ADDRTYPE, 4, True), load)


_FIBS = {x.Fib("saddr"): _fib(1), x.Fib("daddr"): _fib(2)}  # NFTA_FIB_F_SADDR / _DADDR


def _numgen(ng: x.Numgen) -> _Selector:
    def load(slot: int) -> dict[str, Any]:
        return _expr(
            "numgen",
            ("NFTA_NG_DREG", _reg(slot)),
            ("NFTA_NG_MODULUS", ng.mod),
            ("NFTA_NG_TYPE", 1),  # NFT_NG_RANDOM
            ("NFTA_NG_OFFSET", ng.offset or 0),
        )

    return _Selector(Field(TYPE_INTEGER, 4, True), load)


def _lookup(sreg: int, name: str, dreg: int | None = None, set_id: int | None = None, invert: bool = False) -> dict[str, Any]:
    """A lookup, its attributes in nft's order."""
    attrs: list[tuple[str, Any]] = [("NFTA_LOOKUP_SREG", sreg)]
    attrs += [("NFTA_LOOKUP_DREG", dreg)] if dreg is not None else []
    attrs += [("NFTA_LOOKUP_SET", name)]
    attrs += [("NFTA_LOOKUP_SET_ID", set_id)] if set_id is not None else []
    attrs += [("NFTA_LOOKUP_FLAGS", 1)] if invert else []  # NFT_LOOKUP_F_INV
    return _expr("lookup", *attrs)


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

    def name(self, name: str) -> str:
        return bare_name(name, self.command)

    def compile(self, body: tuple[x.Statement, ...]) -> None:
        """The statements in order; a verdict (or NAT, reject) ends the rule, bar its comment."""
        terminal = False
        for n, s in enumerate(body):
            if type(s) is x.Comment:
                if n != len(body) - 1:
                    raise self.fail("a comment that is not last")
                self.comment = s.text
            elif terminal:
                raise self.fail("statements after a verdict")
            else:
                terminal = self.statement(s)
        if not self.exprs:
            raise self.fail("an empty rule")

    def statement(self, s: x.Statement) -> bool:
        """Compile one statement; whether it ends the rule."""
        kind = type(s)
        if kind is x.Match:
            self.match(s)  # type: ignore[arg-type]
        elif kind is x.Lookup:
            self.load(self.selectors(s.key))  # type: ignore[union-attr]
            self.exprs.append(_lookup(1, self.name(s.set)))  # type: ignore[union-attr]
        elif kind is x.Verdict:
            self.verdict(s)  # type: ignore[arg-type]
        elif kind is x.VerdictMap:
            self.vmap(s)  # type: ignore[arg-type]
        elif kind is x.Dnat:
            self.dnat(s)  # type: ignore[arg-type]
        elif kind is x.Counter:
            self.counter(s.name)  # type: ignore[union-attr]
        elif kind is x.MetaSet:
            self.mark_set(s)  # type: ignore[arg-type]
        elif kind is x.SetUpdate:
            self.update(s)  # type: ignore[arg-type]
        elif kind is x.Reject:
            code = _REJECT_PORT_UNREACHABLE[self.family]
            self.exprs.append(_expr("reject", ("NFTA_REJECT_TYPE", 0), ("NFTA_REJECT_ICMP_CODE", code)))  # ICMP_UNREACH
        elif kind is x.Masquerade and s.fully_random:  # type: ignore[union-attr]
            self.exprs.append(_expr("masq", ("NFTA_MASQ_FLAGS", frozenset({"NF_NAT_RANGE_PROTO_RANDOM_FULLY"}))))
        else:
            raise self.fail(f"{s!s} is outside the netlink vocabulary")
        return kind in (x.Verdict, x.VerdictMap, x.Dnat, x.Reject, x.Masquerade)

    # -- selectors -------------------------------------------------------------------------
    def selector(self, e: x.Expr) -> _Selector:
        kind = type(e)
        if kind is x.Numgen:
            return _numgen(e)  # type: ignore[arg-type]
        found = (_FIBS if kind is x.Fib else _SELECTORS).get(e)  # type: ignore[call-overload]
        if found is None:
            raise self.fail(f"{e!s} is outside the netlink vocabulary")
        if kind is x.Payload and e.protocol in _FAMILIES and e.protocol != self.family:  # type: ignore[union-attr]
            raise self.fail(f"{e!s} in an {self.family} table")
        return found

    def selectors(self, e: x.Expr) -> list[_Selector]:
        """A selector, or the parts of a concatenation."""
        return [self.selector(p) for p in e.parts] if type(e) is x.Concat else [self.selector(e)]  # type: ignore[union-attr]

    def load(self, sels: list[_Selector]) -> None:
        slot = 0
        for s in sels:
            self.exprs.append(s.load(slot))
            slot += -(-s.field.size // 4) if len(sels) > 1 else 0

    # -- relations ---------------------------------------------------------------------------
    def literal(self, sel: _Selector, value: x.Value) -> bytes:
        text = str(value)
        if sel.field.type == _TYPE_ADDRTYPE:
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
        self.exprs.append(_expr("cmp", ("NFTA_CMP_SREG", 1), ("NFTA_CMP_OP", op), ("NFTA_CMP_DATA", _data(value), NLA_F_NESTED)))

    def match(self, m: x.Match) -> None:
        """`left [!=] right`: a literal, a prefix, an anonymous set, a set (`!= @s`), flags."""
        if m.op not in ("==", "!="):
            raise self.fail(f"operator {m.op}")
        negate, left, right = m.op == "!=", m.left, m.right
        if type(left) is x.Ct:
            self.ct_bits(left, right, negate)
        elif type(left) is x.Bitwise:
            self.masked(left, right, negate)
        elif type(right) is x.AnonSet:
            self.anon_set_relation(self.selectors(left), negate, right.items)
        elif type(right) is str and right.startswith("@"):  # `!= @set`: the reader's negated lookup
            self.load(self.selectors(left))
            self.exprs.append(_lookup(1, self.name(right[1:]), invert=negate))
        else:
            self.relation(self.selectors(left), negate, right)

    def relation(self, sels: list[_Selector], negate: bool, rhs: x.Value) -> None:
        """`sel [!=] rhs` where rhs is a literal or a prefix."""
        if len(sels) != 1:
            raise self.fail("a concatenation compared with a literal")
        sel = sels[0]
        op = 1 if negate else 0
        if type(rhs) is str and "/" in rhs and sel.payload is not None:
            self.prefix(sel, op, rhs)
            return
        self.load(sels)
        self.cmp(op, self.literal(sel, rhs))

    def prefix(self, sel: _Selector, op: int, rhs: str) -> None:
        """An address prefix as nft compiles it: the whole address, a shorter load for whole
        bytes, a mask otherwise."""
        try:
            net = ipaddress.ip_network(rhs, strict=True)
        except ValueError:
            raise self.fail(f"{rhs!r} is not a network") from None
        bits = net.max_prefixlen
        if sel.field.size * 8 != bits:
            raise self.fail(f"{rhs} compared with a {sel.field.size}-byte field")
        plen = net.prefixlen
        if plen == 0:
            raise self.fail("a /0 prefix")
        if plen == bits:
            self.exprs.append(sel.load(0))
            self.cmp(op, net.network_address.packed)
        elif plen % 8 == 0:
            n = plen // 8
            self.exprs.append(_payload(*sel.payload, n)(0))  # type: ignore[misc]
            self.cmp(op, net.network_address.packed[:n])
        else:
            self.exprs.append(sel.load(0))
            self.bitwise(net.netmask.packed, bytes(sel.field.size))
            self.cmp(op, net.network_address.packed)

    def ct_bits(self, ct: x.Ct, value: x.Value | x.AnonSet, negate: bool) -> None:
        """`ct state new`, `ct status dnat`, `ct state established,related`: any of the bits set."""
        if ct.key not in _CT_BITS or negate or type(value) is not str:
            raise self.fail(f"{ct!s} {value!s} outside the vocabulary")
        key, bits = _CT_BITS[ct.key]
        names = value.split(",")  # a flag list is one constant
        if any(n not in bits for n in names):
            raise self.fail(f"{ct!s} {value} outside the vocabulary")
        self.exprs.append(_expr("ct", ("NFTA_CT_KEY", key), ("NFTA_CT_DREG", 1)))
        self.bitwise(sum({bits[n] for n in names}).to_bytes(4, HOST), bytes(4))
        self.cmp(1, bytes(4))  # != 0

    def masked(self, bw: x.Bitwise, value: x.Value | x.AnonSet, negate: bool) -> None:
        """`meta mark and 0x4000 == 0`."""
        if bw.left != x.MARK or bw.op != "and" or type(value) is x.AnonSet:
            raise self.fail("a bit operation outside the vocabulary")
        self.load([_MARK])
        self.bitwise(self.literal(_MARK, bw.value), bytes(4), boolean=True)
        self.cmp(int(negate), self.literal(_MARK, value))  # type: ignore[arg-type]

    def bitwise(self, mask: bytes, xor: bytes, boolean: bool = False) -> None:
        """reg 1 = (reg 1 & mask) ^ xor; nft names the operation (boolean) for a mark's
        arithmetic, not for a prefix or a flag test."""
        attrs: list[tuple[str, Any]] = [("NFTA_BITWISE_SREG", 1), ("NFTA_BITWISE_DREG", 1)]
        attrs += [("NFTA_BITWISE_OP", 0)] if boolean else []  # NFT_BITWISE_BOOL
        attrs += [("NFTA_BITWISE_LEN", len(mask)), ("NFTA_BITWISE_MASK", _data(mask), NLA_F_NESTED),
                  ("NFTA_BITWISE_XOR", _data(xor), NLA_F_NESTED)]
        self.exprs.append(_expr("bitwise", *attrs))

    # -- anonymous sets --------------------------------------------------------------------------
    def anon_set_relation(self, sels: list[_Selector], negate: bool, items: tuple[x.Value, ...]) -> None:
        """`sel [!=] { a/p, b, ... }` of addresses: as nft compiles it.

        One item is a plain relation; items with a prefix among them make an anonymous interval
        set whose ranges nft merges (overlapping or adjacent) before sending; sets of plain
        addresses only (a hash set) are left to libnftables.
        """
        if len(sels) != 1 or sels[0].typeof is None or not items:
            raise self.fail("anonymous set outside the vocabulary")
        if len(items) == 1:
            self.relation(sels, negate, items[0])
            return
        texts = [str(item) for item in items]
        if not any("/" in text for text in texts):
            raise self.fail("anonymous set without ranges")
        sel = sels[0]
        merged = self.merged(texts, sel.field.size)
        set_id = self.next_set_id()
        self.set_messages.append((
            (
                ("NFTA_SET_TABLE", self.table),
                ("NFTA_SET_NAME", "__set%d"),
                ("NFTA_SET_FLAGS", frozenset({"NFT_SET_ANONYMOUS", "NFT_SET_CONSTANT", "NFT_SET_INTERVAL"})),
                ("NFTA_SET_KEY_TYPE", sel.field.type),
                ("NFTA_SET_KEY_LEN", sel.field.size),
                ("NFTA_SET_ID", set_id),
                ("NFTA_SET_DESC", {"attrs": [("NFTA_SET_DESC_SIZE", 2 * len(merged) + (merged[0][0] != 0))]}, NLA_F_NESTED),
                ("NFTA_SET_USERDATA", _interval_set_udata(*sel.typeof)),  # type: ignore[misc]
            ),
            "__set%d",
            set_id,
            _interval_elements(merged, sel.field.size),
        ))
        self.load(sels)
        self.exprs.append(_lookup(1, "__set%d", set_id=set_id, invert=negate))

    def merged(self, texts: list[str], size: int) -> list[tuple[int, int]]:
        """The addresses and prefixes as ranges, overlapping or adjacent ones merged."""
        ranges: list[tuple[int, int]] = []
        for text in texts:
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
        return merged

    # -- verdicts and verdict maps -----------------------------------------------------------------
    def verdict_code(self, v: x.Verdict) -> tuple[int, str | None]:
        if v.chain is None and v.kind in VERDICT_CODES:
            return VERDICT_CODES[v.kind], None
        if v.chain is not None and v.kind in CHAIN_VERDICTS:
            return CHAIN_VERDICTS[v.kind], self.name(v.chain)
        raise self.fail(f"verdict {v!s}")

    def verdict(self, v: x.Verdict) -> None:
        data = _verdict_data(*self.verdict_code(v))
        self.exprs.append(_expr("immediate", ("NFTA_IMMEDIATE_DREG", 0), ("NFTA_IMMEDIATE_DATA", data, NLA_F_NESTED)))

    def vmap(self, vm: x.VerdictMap) -> None:
        sels = self.selectors(vm.key)
        if type(vm.map) is x.AnonMap:
            self.anon_vmap(sels, vm.map)
        else:
            self.load(sels)
            self.exprs.append(_lookup(1, self.name(vm.map), dreg=0))  # type: ignore[arg-type]

    def anon_vmap(self, sels: list[_Selector], amap: x.AnonMap) -> None:
        """`numgen ... vmap { 0 : goto a , 1 : goto b }`: an anonymous constant map; with
        ranges (`0-6 : goto a , 7-9 : goto b`, a weighted choice) an interval one."""
        if len(sels) != 1 or sels[0].field.type != TYPE_INTEGER:
            raise self.fail("anonymous vmap keyed by something other than numgen")
        if not amap.items:
            raise self.fail("empty anonymous vmap")
        items = [(key, *self.verdict_code(v)) for key, v in amap.items]
        interval = any(type(key) is x.Range for key, _, _ in items)
        elements = self.interval_vmap(items) if interval else [
            {"attrs": [
                ("NFTA_SET_ELEM_KEY", _data(self.literal(sels[0], key)), NLA_F_NESTED),  # type: ignore[arg-type]
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
        self.exprs.append(_lookup(1, "__map%d", dreg=0, set_id=set_id))  # the kernel names it at commit: find it by id

    def interval_vmap(self, items: list[tuple[int | x.Range, int, str | None]]) -> list[dict[str, Any]]:
        """Elements of an anonymous interval vmap as libnftables sends them: each range's start
        (big-endian key, the verdict), and an end marker (the value after the range) only where
        the next range does not start there, and after the last one."""
        ranges = sorted((k.low, k.high, code, chain) if type(k) is x.Range else (k, k, code, chain)  # type: ignore[union-attr]
                        for k, code, chain in items)
        out: list[dict[str, Any]] = []
        for n, (lo, hi, code, chain) in enumerate(ranges):
            if not 0 <= lo <= hi < 1 << 32:
                raise self.fail(f"anonymous vmap key {lo}-{hi}")
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
    def dnat(self, d: x.Dnat) -> None:
        """`dnat [ip|ip6] to ADDR[:PORT]`, `dnat to [ADDR6]:PORT`, `dnat ip to <sel> map @M`."""
        if d.family not in (None, self.family):
            raise self.fail(f"dnat {d.family} in an {self.family} table")
        addr_field = Field(TYPE_IPV4, 4) if self.family == "ip" else Field(TYPE_IPV6, 16)
        attrs: list[tuple[str, int]] = [("NFTA_NAT_TYPE", 1), ("NFTA_NAT_FAMILY", _FAMILIES[self.family]),
                                        ("NFTA_NAT_REG_ADDR_MIN", 1)]
        if type(d.to) is x.MapLookup:
            data = self.dnat_map(d.to, addr_field)
            if len(data) == 2:
                attrs.append(("NFTA_NAT_REG_PROTO_MIN", _reg(-(-addr_field.size // 4))))
        else:
            self.immediate(1, encode_value(d.to, addr_field, self.command))  # type: ignore[arg-type]
            if d.port is not None:
                if not 0 <= d.port < 1 << 16:
                    raise self.fail(f"dnat port {d.port}")
                self.immediate(2, d.port.to_bytes(2, "big"))
                attrs += [("NFTA_NAT_REG_PROTO_MIN", 2), ("NFTA_NAT_FLAGS", 2)]  # PROTO_SPECIFIED
        self.exprs.append(_expr("nat", *attrs))

    def dnat_map(self, lookup: x.MapLookup, addr_field: Field) -> tuple[Field, ...]:
        """The address (and port) a data map holds for the key, into registers 1 (and on)."""
        st = self.set_type(self.name(lookup.map))
        if st.data is None or st.verdict or not st.data or st.data[0] != addr_field:
            raise self.fail(f"dnat through map {st.name} whose data is not an address")
        if len(st.data) not in (1, 2) or (len(st.data) == 2 and st.data[1].type != TYPE_INET_SERVICE):
            raise self.fail(f"dnat through map {st.name} of unexpected data")
        sels = self.selectors(lookup.key)
        self.load(sels)
        if st.interval:  # an interval map holds its keys in network order, as nft swaps them
            if len(sels) != 1 or not sels[0].field.host_order or sels[0].field.size != 4:
                raise self.fail(f"interval map {st.name} keyed by something other than a 32-bit host-order value")
            self.hton()
        self.exprs.append(_lookup(1, st.name, dreg=1))
        return st.data

    def immediate(self, reg: int, value: bytes) -> None:
        self.exprs.append(_expr("immediate", ("NFTA_IMMEDIATE_DREG", reg), ("NFTA_IMMEDIATE_DATA", _data(value), NLA_F_NESTED)))

    def update(self, u: x.SetUpdate) -> None:
        """`update @set { sel }`: the affinity record (no timeout, no data)."""
        name = self.name(u.set)
        self.load(self.selectors(u.key))
        self.exprs.append(
            _expr("dynset", ("NFTA_DYNSET_SREG_KEY", 1), ("NFTA_DYNSET_OP", 1), ("NFTA_DYNSET_SET_NAME", name))  # OP_UPDATE
        )

    def counter(self, name: str | None) -> None:
        """An anonymous rule counter (per-endpoint chains' DNAT), or a reference to a named one."""
        if name is None:
            self.exprs.append(_expr("counter", ("NFTA_COUNTER_BYTES", 0), ("NFTA_COUNTER_PACKETS", 0)))
        else:
            self.exprs.append(_expr("objref", ("NFTA_OBJREF_IMM_TYPE", NFT_OBJECT_COUNTER), ("NFTA_OBJREF_IMM_NAME", self.name(name))))

    def mark_set(self, ms: x.MetaSet) -> None:
        """`meta mark set meta mark or 0x4000` (and, xor): the mark's arithmetic."""
        bw = ms.value
        if ms.meta != x.MARK or type(bw) is not x.Bitwise or bw.left != x.MARK or bw.op not in ("and", "or", "xor"):
            raise self.fail(f"{ms!s} outside the vocabulary")
        value = int.from_bytes(self.literal(_MARK, bw.value), HOST)
        mask, xor = {"and": (value, 0), "or": (~value, value), "xor": (-1, value)}[bw.op]
        self.exprs.append(_MARK.load(0))
        self.bitwise((mask & 0xFFFFFFFF).to_bytes(4, HOST), xor.to_bytes(4, HOST), boolean=True)
        self.exprs.append(_expr("meta", ("NFTA_META_KEY", _META_MARK), ("NFTA_META_SREG", 1)))


def _udata(kind: int, value: bytes) -> bytes:
    """One libnftnl user-data TLV (type, length, value): opaque to the kernel, read by nft."""
    return bytes((kind, len(value))) + value


def _interval_set_udata(desc: int, fld: int) -> bytes:
    """An anonymous address set's user data: big-endian keys, merged, typeof a payload field."""
    typeof = _udata(0, (7).to_bytes(4, HOST)) + _udata(1, _udata(0, desc.to_bytes(4, HOST)) + _udata(1, fld.to_bytes(4, HOST)))
    return (
        _udata(0, (2).to_bytes(4, HOST))  # key byte order: big endian
        + _udata(2, (1).to_bytes(4, HOST))  # merge elements
        + _udata(3, typeof)  # key typeof: a payload expression
    )


def _interval_elements(merged: list[tuple[int, int]], size: int) -> list[dict[str, Any]]:
    """An interval set's elements as libnftnl sends them: a range's start, its end the value
    after it, and a first end element when the set does not start at zero."""
    top = (1 << (8 * size)) - 1
    elements: list[dict[str, Any]] = []
    if merged[0][0] != 0:
        elements.append({"attrs": [_INTERVAL_END, ("NFTA_SET_ELEM_KEY", _data(bytes(size)), NLA_F_NESTED)]})
    for lo, hi in merged:
        start: list[Any] = [("NFTA_SET_ELEM_KEY", _data(lo.to_bytes(size, "big")), NLA_F_NESTED)]
        if hi == top:  # open interval: no end element fits; libnftnl flags it instead
            start.append(("NFTA_SET_ELEM_USERDATA", bytes((1, 4)) + (1).to_bytes(4, HOST)))
        elements.append({"attrs": start})
        if hi != top:
            elements.append({"attrs": [_INTERVAL_END, ("NFTA_SET_ELEM_KEY", _data((hi + 1).to_bytes(size, "big")), NLA_F_NESTED)]})
    return elements


# The user data libnftables 1.0.6 gives an anonymous `numgen ... vmap { ... }`: key byte order
# host (1), data byte order 0, the data's typeof (verdict), data not an interval. nft reads the
# key byte order back to print the keys, so it must be the same.
_ANON_VMAP_UDATA = bytes.fromhex("00040100000001040000000004080004010000000100060400000000")


# --------------------------------------------------------------------------------------------
# Commands to messages.


def statements(body: str | Iterable[x.Statement], command: str) -> tuple[x.Statement, ...]:
    """A rule body's typed statements. A body still held as text is read into them first, by
    the reader of nftables/script.py: nothing in the kernel layer reads rule text."""
    if not isinstance(body, str):
        return tuple(body)
    try:
        return rule_body(body)
    except ValueError as exc:
        raise Unsupported(f"{exc}: {command}") from None


def rule_messages(
    rule: Rule, family: str, table: str, set_type: Callable[[str], SetType], command: str, set_ids: Any
) -> list[Message]:
    """One rule's messages: the anonymous sets it declares, their elements, the rule. Raw text
    in the body (expr.Raw) is Unsupported: libnftables says it."""
    rc = _RuleCompiler(family, table, set_type, command, next_set_id=lambda: next(set_ids))
    rc.compile(statements(rule.body, command))
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

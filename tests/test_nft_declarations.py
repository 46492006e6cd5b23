"""Declarations written from the objects (kernel/nfnetlink/declarations.py) are the bytes
libnftables 1.0.6 sends for them, attribute for attribute and user data included, for every
declaration the renderers make; and a set's element types are those the kernel then reports.

The oracle is libnftables itself: its debug print of each message it sends (libmnl's
`mnl_nlmsg_fprintf`, every attribute header and every four bytes of a value on a line of their
own) read back into bytes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import random
import re
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest

from nfproxy.backends.nft import render as nft_backend
from nfproxy.core.model import IPFamily, LocalMode
from nfproxy.kernel import netns
from nfproxy.kernel.nfnetlink.declarations import NEWSET, Declaration, declared
from nfproxy.kernel.nfnetlink.framing import attributes, strz
from nfproxy.kernel.nfnetlink.values import Unsupported
from nfproxy.kernel.nft_elements import ElementReader
from nfproxy.nftables import Chain, Counter, Map, Set, Table, Verb
from nfproxy.nftables import script as nft_script
from nfproxy.nftables import text as nft_text
from nfproxy.testing import NODE, random_cluster

ROOT = Path(__file__).parent.parent
GOLDENS = sorted([*(ROOT / "tests" / "golden" / "render").glob("*.nft.txt"), *(ROOT / "tests" / "golden" / "nft").glob("*.nft")])
_KINDS = (Table, Chain, Set, Map, Counter)

# --------------------------------------------------------------------------------------------
# libnftables' messages, from its debug print.

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_LENGTH = re.compile(r"^\|  (\d{10})  \|\t\| message length")
_TYPE = re.compile(r"^\| (\d{5}) \|")
_ATTR = re.compile(r"^\|(\d{5})\|([N-])([B-])\|(\d{5})\|")
_WORD = re.compile(r"^\| ([0-9a-f]{2}) ([0-9a-f]{2}) ([0-9a-f]{2}) ([0-9a-f]{2})  \|\t\|      data")


def sent_messages(text: str) -> list[tuple[int, bytes]]:
    """(message type, attributes after the nfgenmsg) of each message libmnl printed; padding
    as zeros (libnftables sends what its buffer held there, which the kernel never reads)."""
    out: list[tuple[int, bytearray]] = []
    lines = [_ANSI.sub("", line) for line in text.splitlines()]
    left = 0  # bytes of the current attribute's value not printed yet
    for n, line in enumerate(lines):
        if _LENGTH.match(line):
            out.append((int(_TYPE.match(lines[n + 1]).group(1)), bytearray()))  # type: ignore[union-attr]
        elif out and (head := _ATTR.match(line)):
            flags = (0x8000 if head.group(2) == "N" else 0) | (0x4000 if head.group(3) == "B" else 0)
            out[-1][1].extend(struct.pack("=HH", int(head.group(1)), int(head.group(4)) | flags))
            left = 0 if flags & 0x8000 else int(head.group(1)) - 4
        elif out and (word := _WORD.match(line)):
            value = bytes(int(x, 16) for x in word.groups())
            out[-1][1].extend(value[:left] + bytes(4 - min(left, 4)))
            left = max(left - 4, 0)
    return [(t, bytes(p)) for t, p in out]


def libnftables_sends(ns: str, family: str, table: Table, objs: list[Declaration]) -> list[tuple[int, bytes]]:
    """The declaration messages libnftables sends for `table` and `objs` (nf_tables' types),
    in order; the table is left in the namespace."""
    import nftables

    with netns.entered(ns):
        ctx = nftables.Nftables()
    ctx.set_debug("mnl")
    where = f"{family} {table.name}"
    script = "\n".join(nft_text.command(Verb.ADD, o, where) for o in [table, *objs]) + "\n"
    rc, out, err = ctx.cmd(script)
    assert rc == 0, err
    return [(t & 0xFF, p) for t, p in sent_messages(out) if t >> 8 == 10 and t & 0xFF in (0, 3, 9, 18)]


# --------------------------------------------------------------------------------------------
# What the renderers declare.


def _rendered() -> Iterator[tuple[str, object]]:
    from nfproxy.cli.main import main

    texts = [path.read_text() for path in GOLDENS]
    for where in ("examples", "examples-weighted"):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(["render", "--backend", "nft", str(ROOT / where)]) == 0
        texts.append(out.getvalue())
    for text in texts:
        for tx in nft_script.parse(text):
            yield from ((tx.family, o) for verb, o in tx.ops if verb is Verb.ADD)
    nodes = [NODE, dataclasses.replace(NODE, nft_localhost_nodeports=True, nodeport_addresses=("127.0.0.0/8", "::1/128")),
             dataclasses.replace(NODE, detect_local_mode=LocalMode.BRIDGE_INTERFACE, pod_bridge_interface="cni0")]
    for seed, node in enumerate(nodes):
        state = random_cluster(random.Random(seed), 30, node=node)
        for family in IPFamily:
            for tx in nft_backend.render(state, family).transactions():
                yield from ((tx.family, o) for verb, o in tx.ops if verb is Verb.ADD)


def _sized_hash_maps() -> Iterator[tuple[str, Map]]:
    """The endpoint maps of the layout in the making: fixed-size hashes, counted or not."""
    for family in ("ip", "ip6"):
        for proto in ("tcp", "udp", "sctp"):
            spec = f"numgen random mod 1 : {family} daddr . {proto} dport"
            yield family, Map(f"endpoints-counted-{proto}-hash-0", typeof=spec, size=256, counter=True)
            yield family, Map(f"endpoints-{proto}-hash-1", typeof=spec, size=256)


def renderer_declarations() -> dict[str, list[Declaration]]:
    """One of each declaration the renderers make (names aside), by family."""
    seen: dict[tuple[str, object], Declaration] = {}
    for family, obj in [*_rendered(), *_sized_hash_maps()]:
        if type(obj) in _KINDS and type(obj) is not Table:
            seen.setdefault((family, dataclasses.replace(obj, name="")), obj)  # type: ignore[arg-type]
    out: dict[str, list[Declaration]] = {"ip": [], "ip6": []}
    for (family, _), obj in seen.items():
        out[family].append(dataclasses.replace(obj, name=f"d{len(out[family])}-{obj.name}"[:200]))  # type: ignore[arg-type]
    return out


_TABLES = [Table("", "nfproxy", comment="rules for nfproxy"),
           Table("", "nfproxy-off", comment="rules for nfproxy: weighted ports off the lane"), Table("", "plain")]
# Beyond the renderers: every datatype, typeof expression and flag the encoder knows.
_MORE: list[Declaration] = [
    Set("old-set", "ipv4_addr"), Set("protos", "inet_proto"), Set("marks", "mark"), Set("ports", "inet_service"),
    Set("pairs", "inet_proto . inet_service", comment="x" * 200),  # a long comment is cut as the script cuts it
    Set("short", "ipv4_addr", timeout=60), Set("fixed", "ipv4_addr", flags=("constant",)),
    Map("old-map", "ipv4_addr : verdict"), Map("nat", "ipv4_addr : ipv4_addr . inet_service"),
    Map("by-mark", "mark : ipv4_addr", flags=("interval",)),
    Map("ranges", typeof="numgen random mod 1 : ip daddr . tcp dport", flags=("interval",), size=512, counter=True),
    Map("offset", typeof="numgen random mod 7 offset 3 : ip saddr . udp sport"),
    Map("sctp-ports", typeof="ip daddr . sctp dport : ip daddr", comment="typeof on both sides"),
    Chain("hooked", "route", "output", "-150", comment="a base chain with a comment"),
    Counter("commented", comment="counts"),
]


@pytest.mark.kernel
def test_declarations_are_the_bytes_libnftables_sends() -> None:
    """Every declaration the renderers make, a sized counted hash map among them, and the
    encoder's other words; then the element types of each set, as the kernel reports them."""
    found = renderer_declarations()
    kinds = {(type(o), bool(getattr(o, "hook", None))) for objs in found.values() for o in objs}
    assert kinds >= {(Chain, True), (Chain, False), (Set, False), (Map, False), (Counter, False)}, kinds
    assert any(type(o) is Map and o.size and o.counter and "interval" not in o.flags for o in found["ip"])
    with netns.throwaway("nfp-decl") as ns:
        for family, objs in found.items():
            more = [o for o in _MORE if family == "ip" or " ip " not in f" {getattr(o, 'typeof', '')} "]
            objs = objs + more
            for n, table in enumerate(_TABLES):
                table = dataclasses.replace(table, family=family)
                sent = libnftables_sends(ns, family, table, objs if n == 0 else [])
                assert len(sent) == 1 + (len(objs) if n == 0 else 0)
                head = strz(1, table.name)
                assert sent[0] == (0, head + declared(table).attrs), table
                for obj, (msg_type, payload) in zip(objs, sent[1:]):
                    ours = declared(obj, _set_id(payload) if type(obj) in (Set, Map) else 0)
                    assert (ours.msg_type, head + ours.attrs) == (msg_type, payload), (family, obj)
            kernel = ElementReader(ns).sets(family, "nfproxy")
            for obj in objs:
                if type(obj) in (Set, Map):
                    assert declared(obj).set_type == kernel[obj.name][0], obj  # type: ignore[union-attr]


def _set_id(payload: bytes) -> int:
    """The set id libnftables gave (its context numbers every set it declares)."""
    return next(struct.unpack_from(">I", payload, a)[0] for t, a, _ in attributes(payload, 0, len(payload)) if t == 10)


@pytest.mark.parametrize("obj", [
    Set("s", "ether_addr"),
    Set("s", "ipv4_addr . inet_service", flags=("interval",)),  # needs NFTA_SET_DESC_CONCAT
    Set("s", "ipv4_addr", flags=("dynamic", "evaluate")),
    Set("s", "verdict"),
    Set("s", typeof="meta l4proto"),
    Set("s", "ipv4_addr", timeout=0),
    Map("m", "ipv4_addr"),
    Map("m", "ipv4_addr : verdict . inet_service"),
    Map("m", typeof="numgen inc mod 2 : ip daddr"),
    Chain("c", "nat", "prerouting", "dstnat"),
    Chain("c", "nat", "ingress", "0"),
], ids=repr)
def test_what_the_encoder_cannot_say_is_unsupported(obj: Declaration) -> None:
    with pytest.raises(Unsupported):
        declared(obj, 1)


def test_a_set_declaration_numbers_the_set_for_its_batch() -> None:
    one, two = declared(Set("s", "ipv4_addr"), 1), declared(Set("s", "ipv4_addr"), 2)
    assert one.msg_type == NEWSET and one.attrs != two.attrs and len(one.attrs) == len(two.attrs)

"""Set elements read over netlink (kernel/nft_elements.py), as rule IR.

`nft -j -t list ruleset` lists everything but the elements of named sets in a quarter of the
time of the full listing at 10 000 services, and prints a third of the JSON. The elements come from
the kernel's own dump instead and are made into the IR `nft_json.parse` would make of
libnftables' JSON for them: the same constants, through the same memo, so the two ways of
reading a namespace give equal rulesets (tests/test_nft_elements.py holds them equal on the
real kernel). docs/benchmarks.md, "Elements over netlink", has the figures.

Interval sets are kept by the kernel as range starts (with the data) and end markers one past
each range; libnftables pairs them up, printing a lone value for a one-value range and an
address prefix where the range is exactly one, and so does `_intervals`. Intervals come in key
order; other sets in the kernel's dump order (libnftables sorts them; nothing the analysis
reads depends on the order).
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from nfproxy.analysis.ir import PROTOCOL_NAMES, Const, Element, Kind, Prefix, Range, Verdict, endpoint_text
from nfproxy.analysis.nft_json import Memo, memo_canonical, memo_value
from nfproxy.kernel.nft_elements import ElementReader, RawElement, SetElements
from nfproxy.kernel.nfnetlink.values import TYPE_INTEGER, Unsupported
from nfproxy.kernel.process import KernelError

_ADDRESS_TYPES = (7, 8)  # ipv4_addr, ipv6_addr

log = logging.getLogger(__name__)
T = TypeVar("T")
U = TypeVar("U")


def reader(tables: Mapping[tuple[str, str], Mapping[str, SetElements]]) -> Any:
    """The `elements` hook of `nft_json.parse`: a set's elements from the netlink dump. A set
    the dump does not have (a table of a family the reader does not read) raises
    `Unsupported`: the terse listing holds none of its elements, so it must not look empty."""

    def elements(family: str, table: str, name: str, key_kinds: tuple[Kind, ...],
                 data_kinds: tuple[Kind, ...], memo: Memo) -> tuple[Element, ...]:
        found = tables.get((family, table), {}).get(name)
        if found is None:
            raise Unsupported(f"set {family} {table} {name} was listed but not read")
        return ir_elements(found, key_kinds, data_kinds, memo)

    return elements


def ir_elements(found: SetElements, key_kinds: tuple[Kind, ...], data_kinds: tuple[Kind, ...],
                memo: Memo) -> tuple[Element, ...]:
    st = found.type
    if len(key_kinds) != len(st.key) or (st.data and len(data_kinds) != len(st.data)):
        raise Unsupported(f"set {st.name}: the listing's types do not match the kernel's")
    data_of = _data_reader(st.verdict, data_kinds if st.data else (), memo)
    if st.interval:
        return tuple(_intervals(found, key_kinds[0], data_of, memo))
    consts = [memo.setdefault(("consts", k), {}) for k in key_kinds]
    out = []
    append = out.append
    for raw in found.elements:
        key = []
        for part, known, kind in zip(raw.key, consts, key_kinds):
            c = known.get(part)
            if c is None:
                c = known[part] = memo_value(_named(part, kind), kind, memo)
            key.append(c)
        append(Element(tuple(key), data_of(raw), raw.comment or ""))
    return tuple(out)


def _data_reader(verdict: bool, kinds: tuple[Kind, ...], memo: Memo) -> Any:
    if verdict:
        def read_verdict(raw: RawElement) -> Verdict:
            kind, target = raw.data  # type: ignore[misc]
            key = ("verdict", kind, target)
            found = memo.get(key)
            if found is None:
                found = memo[key] = Verdict(kind, target) if kind in ("jump", "goto") else Verdict(kind)
            return found  # type: ignore[no-any-return]
        return read_verdict
    if not kinds:
        return lambda raw: None
    caches = [memo.setdefault(("values", k), {}) for k in kinds]

    def read_values(raw: RawElement) -> Const:
        out = []
        for part, cache, kind in zip(raw.data, caches, kinds):  # type: ignore[arg-type]
            v = cache.get(part)
            if v is None:
                v = cache[part] = memo_canonical(_named(part, kind), kind, memo)
            out.append(v)
        return Const(tuple(out) if len(out) > 1 else out[0])
    return read_values


def _named(value: int | str, kind: Kind) -> int | str:
    """libnftables prints a protocol by its /etc/protocols name, and rules as it printed them
    are matched against these keys: only the protocols whose names the IR knows (and every
    /etc/protocols spells the same) are read here; another one sends the ruleset to libnftables."""
    if kind == "proto" and value not in PROTOCOL_NAMES:
        raise Unsupported(f"protocol {value} in a set: libnftables names it from /etc/protocols")
    return value


def _intervals(found: SetElements, kind: Kind, data_of: Any, memo: Memo) -> list[Element]:
    """One element per range, from the kernel's starts and end markers in key order."""
    if kind not in ("addr", "int"):
        raise Unsupported(f"set {found.type.name}: intervals of {kind} values")  # printed by name
    address = found.type.key[0].type in _ADDRESS_TYPES
    return [_element(start, high, address, found.key_bits, kind, data_of, memo) for start, high in _spans(found)]


def _spans(found: SetElements) -> list[tuple[RawElement, int]]:
    """(the start element, the range's last value) per range of an interval set."""
    out: list[tuple[RawElement, int]] = []
    start: RawElement | None = None
    for raw in sorted(found.elements, key=_order):
        if start is not None:  # an end marker, or the next range's start, closes the open range
            out.append((start, _number(raw.key[0]) - 1))
            start = None
        if not raw.end:
            start = raw
    if start is not None:  # a range up to the key's last value has no end marker
        out.append((start, (1 << found.key_bits) - 1))
    return out


def _element(start: RawElement, high: int, address: bool, bits: int, kind: Kind, data_of: Any, memo: Memo) -> Element:
    return Element((_key(start.key[0], high, address, bits, kind, memo),), data_of(start), start.comment or "")


def _order(raw: RawElement) -> tuple[bytes, bool]:
    """Keys in the kernel's order (an interval set's keys are big-endian bytes), and at one
    key an interval's end before the next one's start."""
    return raw.packed, not raw.end


def _number(value: int | str) -> int:
    return value if isinstance(value, int) else int(ipaddress.ip_address(value))


def _key(low: int | str, high: int, address: bool, bits: int, kind: Kind, memo: Memo) -> Const | Prefix | Range:
    lo = _number(low)
    if high == lo:
        return memo_value(low, kind, memo)  # type: ignore[no-any-return]
    if not address:
        return Range(memo_canonical(lo, kind, memo), memo_canonical(high, kind, memo))  # type: ignore[arg-type]
    size = high - lo + 1
    if size & (size - 1) == 0 and lo % size == 0:  # exactly one prefix: printed as one
        return Prefix(ipaddress.ip_network((lo if bits == 32 else ipaddress.IPv6Address(lo), bits - size.bit_length() + 1)))
    top = ipaddress.IPv4Address(high) if bits == 32 else ipaddress.IPv6Address(high)
    return Range(memo_canonical(low, kind, memo), memo_canonical(str(top), kind, memo))  # type: ignore[arg-type]


# ---- the endpoint counters (analysis/counters.py): a table's listing with its counted maps


# Times the ruleset may change between the listing and the element dumps before a reading
# gives up and lists everything through libnftables (which retries on its own).
ATTEMPTS = 3


def in_one_generation(netns: str | None, listing: Callable[[Any], T], dump: Callable[[ElementReader], U],
                      what: str) -> tuple[T, U] | None:
    """`listing(session)` through libnftables on a worker thread (ctypes drops the GIL, so it runs
    beside the dump) and `dump(reader)` over netlink, both within one nf_tables generation: read
    again while a commit came in between. None when the dump has no words for something
    (`Unsupported`), a table went away between two dumps, or the ruleset kept changing; the
    caller then lists through libnftables alone, and the log says why."""
    from concurrent.futures import ThreadPoolExecutor

    from nfproxy.kernel.nft import NftSession

    session = NftSession(netns)
    with ElementReader(netns) as reader, ThreadPoolExecutor(1) as pool:
        for _ in range(ATTEMPTS):
            before = reader.generation()
            listed = pool.submit(listing, session)
            try:
                dumped = dump(reader)
            except (Unsupported, KernelError) as exc:
                listed.result()
                log.info("listing %s through libnftables: %s", what, exc)
                return None
            result = listed.result()
            if reader.generation() == before:
                return result, dumped
    log.info("listing %s through libnftables: it changed %d times while being read", what, ATTEMPTS)
    return None


def counted_table(netns: str | None, family: str, table: str) -> tuple[dict[str, Any], dict[tuple[str, str, str], list[tuple[int, int, int, str]]]] | None:
    """`nft -j list table FAMILY TABLE` as the endpoint counters read it (`counters.
    endpoint_counts_nft(doc, elements)`): the terse listing, and the elements of the maps that
    count (`counter` on the map) with their packets, read over netlink in one generation, as
    (first value, last value, packets, endpoint) per element. None when there is no such table.
    libnftables' full listing (and no elements apart) when a counted map is not keyed by
    integers with an address and port as data (nothing nfproxy writes)."""
    from nfproxy.kernel.nft import NftSession

    def counted(reader: ElementReader) -> dict[tuple[str, str, str], list[tuple[int, int, int, str]]]:
        return {(family, table, name): _element_counts(
                    SetElements(st, bits, tuple(reader.elements(family, table, name, st, counters=True))))
                for name, (st, bits, counts) in reader.sets(family, table).items() if counts}

    read = in_one_generation(netns, lambda session: session.list_table(family, table, terse=True), counted,
                             f"{family} {table}")
    if read is not None:
        doc, elements = read
        return None if doc is None else (doc, elements)
    doc = NftSession(netns).list_table(family, table)
    return None if doc is None else (doc, {})


def counted_elements(tables: Mapping[tuple[str, str], Mapping[str, SetElements]]) -> dict[tuple[str, str, str], list[tuple[int, int, int, str]]]:
    """The counted maps' elements of dumped tables (read with `counters=True`), by map."""
    return {(family, table, name): _element_counts(found)
            for (family, table), sets in tables.items() for name, found in sets.items()
            if any(raw.packets is not None for raw in found.elements)}


def _element_counts(found: SetElements) -> list[tuple[int, int, int, str]]:
    """`counters._element_counts` of the same map as libnftables would list it: elements
    without a counter count nothing, and are left out as there."""
    st = found.type
    if len(st.key) != 1 or st.key[0].type != TYPE_INTEGER or st.verdict or not st.data or len(st.data) != 2:
        raise Unsupported(f"map {st.name}: a counted map not keyed by integers to an address and port")
    spans = _spans(found) if st.interval else [(raw, raw.key[0]) for raw in found.elements]
    out = [(start.key[0], high, start.packets, endpoint_text(*start.data))  # type: ignore[misc]
           for start, high in spans if start.packets is not None]
    out.sort()
    return out  # type: ignore[return-value]

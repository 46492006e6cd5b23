"""The one place nft script text is written from objects (for libnftables and `nfproxy render`).

An `Elements` batch, and a run of consecutive `add element` operations on one set, are written as
one command with one element per line, as a reader (and nft, which then sends one message per
set) prefers.
"""

from __future__ import annotations

from nfproxy.nftables.objects import (
    Chain, Counter, Element, Elements, Map, Note, Object, Rule, Set, Table, quote_comment,
)
from nfproxy.nftables.transaction import Transaction, Verb


def set_spec(obj: Set | Map) -> str:
    """What goes between the braces of `add set|map`."""
    parts = [f"type {obj.type}" if obj.type is not None else f"typeof {obj.typeof}"]
    if isinstance(obj, Map) and obj.size is not None:
        parts.append(f"size {obj.size}")
    if obj.flags:
        parts.append(f"flags {','.join(obj.flags)}")
    if isinstance(obj, Map) and obj.counter:
        parts.append("counter")
    if isinstance(obj, Set) and obj.timeout is not None:
        parts.append(f"timeout {obj.timeout}s")
    if obj.comment:
        parts.append(f"comment {quote_comment(obj.comment)}")
    return " ; ".join(parts) + " ;"


def chain_spec(chain: Chain) -> str:
    parts = []
    if chain.hook is not None:
        parts.append(f"type {chain.type} hook {chain.hook} priority {chain.priority}")
    if chain.comment:
        parts.append(f"comment {quote_comment(chain.comment)}")
    return " ; ".join(parts) + " ;" if parts else ""


def element_text(el: Element) -> str:
    comment = f" comment {quote_comment(el.comment)}" if el.comment else ""
    value = f" : {el.value}" if el.value else ""
    return f"{el.key}{comment}{value}"


def elements_text(batch: Elements) -> list[str] | tuple[str, ...]:
    """Each element of `batch` as `element_text` writes it, joined in bulk where it can be."""
    keys, values, comments = batch.keys, batch.values, batch.comments
    if comments or "" in values:
        return [element_text(el) for el in batch.each()]
    if values:
        return list(map(" : ".join, zip(keys, values)))
    return keys


def command(verb: Verb, obj: Object, where: str) -> str:
    """One operation as one nft command (no newline); `where` is `FAMILY TABLE`."""
    v = verb.value
    if type(obj) is Elements:
        return f"{v} element {where} {obj.set} {{ {', '.join(elements_text(obj))} }}"
    if type(obj) is Rule:
        return f"{v} rule {where} {obj.chain} {obj.body}"
    if type(obj) is Element:
        inner = element_text(obj) if verb is not Verb.DELETE else obj.key
        return f"{v} element {where} {obj.set} {{ {inner} }}"
    if type(obj) is Chain:
        spec = chain_spec(obj) if verb in (Verb.ADD, Verb.CREATE) else ""
        return f"{v} chain {where} {obj.name}" + (f" {{ {spec} }}" if spec else "")
    if type(obj) in (Set, Map):
        kind = "set" if type(obj) is Set else "map"
        spec = f" {{ {set_spec(obj)} }}" if verb in (Verb.ADD, Verb.CREATE) else ""
        return f"{v} {kind} {where} {obj.name}{spec}"
    if type(obj) is Counter:
        spec = f" {{ comment {quote_comment(obj.comment)} ; }}" if obj.comment and verb in (Verb.ADD, Verb.CREATE) else ""
        return f"{v} counter {where} {obj.name}{spec}"
    if type(obj) is Table:
        spec = f" {{ comment {quote_comment(obj.comment)} ; }}" if obj.comment and verb in (Verb.ADD, Verb.CREATE) else ""
        return f"{v} table {where}{spec}"
    raise TypeError(f"not an nft object: {obj!r}")


def script(tx: Transaction) -> str:
    """The whole transaction as one `nft -f` script (one atomic batch)."""
    where = f"{tx.family} {tx.table}"
    out: list[str] = []
    ops = tx.ops
    i, n = 0, len(ops)
    add = Verb.ADD
    while i < n:
        verb, obj = ops[i]
        kind = type(obj)
        if kind is Rule:
            out.append(f"add rule {where} {obj.chain} {obj.body}\n")  # type: ignore[union-attr]
        elif kind is Elements:
            if obj.keys:  # type: ignore[union-attr]
                items = ",\n\t".join(elements_text(obj))  # type: ignore[arg-type]
                out.append(f"\nadd element {where} {obj.set} {{\n\t{items}\n}}\n")  # type: ignore[union-attr]
        elif kind is Element and verb is add:
            i = _element_block(ops, i, where, out)
            continue
        elif kind is Chain and obj.hook is None and obj.comment is None:  # type: ignore[union-attr]
            out.append(f"{verb.value} chain {where} {obj.name}\n")  # type: ignore[union-attr]
        elif kind is Note:
            out.append(f"\n# {obj.text}\n")  # type: ignore[union-attr]
        else:
            out.append(command(verb, obj, where) + "\n")  # type: ignore[arg-type]
        i += 1
    return "".join(out)


def _element_block(ops: list, i: int, where: str, out: list[str]) -> int:
    """Write the run of `add element` ops on one set starting at ops[i]; return where it ends.
    (The hot loop of a full sync's text: 200 000 elements at 10 000 services.)"""
    add = Verb.ADD
    name = ops[i][1].set
    items: list[str] = []
    append = items.append
    n = len(ops)
    while i < n:
        verb, el = ops[i]
        if verb is not add or el.__class__ is not Element or el.set != name:
            break
        if el.comment:
            append(f"\t{element_text(el)}")
        elif el.value:
            append(f"\t{el.key} : {el.value}")
        else:
            append(f"\t{el.key}")
        i += 1
    out.append(f"\nadd element {where} {name} {{\n" + ",\n".join(items) + "\n}\n")
    return i


def commands(tx: Transaction) -> list[str]:
    """One command per operation (notes left out): what an error message can point at."""
    where = f"{tx.family} {tx.table}"
    return [command(verb, obj, where) for verb, obj in tx.operations()]

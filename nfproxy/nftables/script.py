"""Reading back the nft script subset nfproxy writes (text.py): `nfproxy render` output into
Transactions, so that tools can apply it to the in-memory kernel and analyse it without root.

Only what text.py writes is understood: `add|create|flush|delete` of tables, chains, sets and
maps with their `{ ... }` specs, `add rule`, `add|delete element` (one line or one element per
line), `#` notes and blank lines. Anything else is refused with its line number.
"""

from __future__ import annotations

import re

from nfproxy.nftables.objects import Chain, Counter, Element, Map, Object, Rule, Set, Table
from nfproxy.nftables.transaction import Transaction, Verb

_HEAD = re.compile(r"(add|create|flush|delete) (table|chain|set|map|counter|rule|element) (ip6?) (\S+)(?: (.*))?$")
_COMMENT = re.compile(r'comment "([^"]*)"')


class ScriptError(ValueError):
    pass


def parse(text: str, name: str = "input", located: list[tuple[int, Object]] | None = None) -> list[Transaction]:
    """One Transaction per table the script names, in the order they first appear. `located`,
    when given, receives (line, object) for every object, so a reader that refuses one later
    can say on which line it was."""
    txs: dict[tuple[str, str], Transaction] = {}
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        lineno = i + 1
        i += 1
        if not line:
            continue
        if line.startswith("#"):
            if txs:  # a note belongs to the table whose commands it sits among
                last.note(line[1:].strip())
            continue
        m = _HEAD.match(line)
        if m is None:
            raise ScriptError(f"{name}:{lineno}: not an nft command nfproxy writes: {line[:80]!r}")
        verb, kind, family, table, rest = Verb(m.group(1)), m.group(2), m.group(3), m.group(4), m.group(5) or ""
        tx = txs.get((family, table))
        if tx is None:
            tx = txs[(family, table)] = Transaction(family, table)
        last = tx
        if kind == "element" and rest.endswith("{"):  # one element per line, up to "}"
            body: list[tuple[int, str]] = []
            while i < len(lines) and lines[i].strip() != "}":
                body.append((i + 1, lines[i].strip().rstrip(",")))
                i += 1
            if i == len(lines):
                raise ScriptError(f"{name}:{lineno}: the element list is never closed by a line '}}'")
            i += 1
            objs = [(at, _element(rest[:-1].strip(), item)) for at, item in body]
        else:
            objs = [(lineno, _object(kind, family, table, rest, lineno, name))]
        for at, obj in objs:
            getattr(tx, verb.value)(obj)
            if located is not None:
                located.append((at, obj))
        if tx.error is not None:
            raise ScriptError(f"{name}:{lineno}: {tx.error}")
    return list(txs.values())


def _spec(rest: str) -> tuple[str, dict[str, str]]:
    """`NAME { a x ; b y ; }` -> (NAME, {a: x, b: y}); `NAME` -> (NAME, {})."""
    name, _, spec = rest.partition(" ")
    fields: dict[str, str] = {}
    spec = spec.strip()
    if spec:
        if not (spec.startswith("{") and spec.endswith("}")):
            raise ValueError(f"unexpected {spec!r}")
        for part in spec[1:-1].split(";"):
            part = part.strip()
            if part:
                key, _, value = part.partition(" ")
                fields[key] = value.strip()
    return name, fields


def _comment(value: str | None) -> str | None:
    if value is None:
        return None
    m = _COMMENT.fullmatch(f"comment {value}")
    return m.group(1) if m else None


def _object(kind: str, family: str, table: str, rest: str, lineno: int, source: str) -> Object:
    try:
        if kind == "table":
            _, fields = _spec(f"{table} {rest}".strip())
            return Table(family, table, _comment(fields.get("comment")))
        if kind == "rule":
            chain, _, body = rest.partition(" ")
            return Rule(chain, body)
        if kind == "element":
            set_name, _, inner = rest.partition(" ")
            return _element(set_name, inner.strip().removeprefix("{").removesuffix("}").strip())
        name, fields = _spec(rest)
        if kind == "counter":
            return Counter(name, _comment(fields.get("comment")))
        if kind == "chain":
            hook = None
            kind_, prio = None, None
            if "type" in fields:
                m = re.fullmatch(r"(\S+) hook (\S+) priority (\S+)", fields["type"])
                if m is None:
                    raise ValueError(f"base chain spec {fields['type']!r}")
                kind_, hook, prio = m.groups()
            return Chain(name, kind_, hook, prio, _comment(fields.get("comment")))
        flags = tuple(f for f in fields.get("flags", "").split(",") if f)
        comment = _comment(fields.get("comment"))
        if kind == "map":
            size = fields.get("size")
            return Map(name, fields.get("type"), fields.get("typeof"), flags, comment, "counter" in fields,
                       int(size) if size is not None else None)
        timeout = fields.get("timeout")
        return Set(name, fields.get("type"), fields.get("typeof"), flags, int(timeout.rstrip("s")) if timeout else None, comment)
    except ValueError as exc:
        raise ScriptError(f"{source}:{lineno}: {kind}: {exc}") from None


def _element(set_name: str, item: str) -> Element:
    comment = ""
    m = _COMMENT.search(item)
    if m:
        comment = m.group(1)
        item = (item[: m.start()] + item[m.end():]).strip()
    key, _, value = item.partition(" : ")
    return Element(set_name, key.strip(), value.strip(), comment)

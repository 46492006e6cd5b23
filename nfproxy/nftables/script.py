"""Reading back the nft script subset nfproxy writes (text.py): `nfproxy render` output into
Transactions, so that tools can apply it to the in-memory kernel and analyse it without root.

Only what text.py writes is understood: `add|create|flush|delete` of tables, chains, sets and
maps with their `{ ... }` specs, `add rule`, `add|delete element` (one line or one element per
line), `#` notes and blank lines. Anything else is refused with its line number. A rule body is
read into the statements the renderers build (expr.py: the same objects, so a script read back
is the transaction that wrote it); one outside that vocabulary is refused too.
"""

from __future__ import annotations

import re

from nfproxy.nftables import expr as x
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
            return Rule(chain, rule_body(body))
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


# --------------------------------------------------------------------------------------------
# Rule bodies: nft's grammar, as far as nfproxy's renderers speak it.

_TOKEN = re.compile(r'"[^"]*"|[{},]|[^\s{},]+')
_PAYLOADS = {
    ("ip", "saddr"), ("ip", "daddr"), ("ip6", "saddr"), ("ip6", "daddr"), ("th", "dport"), ("th", "sport"),
    ("tcp", "dport"), ("udp", "dport"), ("sctp", "dport"),
}
_VERDICTS = ("accept", "drop", "return", "continue")
_BITWISE = ("and", "or", "xor")


def rule_body(text: str) -> x.Body:
    """The statements of one rule body; ValueError for a body outside the vocabulary."""
    return _Body(text).statements()


class _Body:
    """Reads one rule body, token by token."""

    def __init__(self, text: str) -> None:
        self.toks = _TOKEN.findall(text)
        self.i = 0
        self.text = text

    def fail(self, why: str) -> ValueError:
        return ValueError(f"rule body outside the JSON vocabulary ({why}): {self.text}")

    def peek(self, k: int = 0) -> str | None:
        j = self.i + k
        return self.toks[j] if j < len(self.toks) else None

    def take(self) -> str:
        t = self.peek()
        if t is None:
            raise self.fail("unexpected end")
        self.i += 1
        return t

    def name(self) -> str:
        """`@name`: a named set or map."""
        t = self.take()
        if not t.startswith("@"):
            raise self.fail(f"{t!r} is not a set")
        return t[1:]

    def selector(self) -> x.Expr | None:
        a, b = self.peek(), self.peek(1)
        if (a, b) in _PAYLOADS:
            self.i += 2
            return x.payload(a, b)  # type: ignore[arg-type]
        if a == "meta" and b in ("l4proto", "mark"):
            self.i += 2
            return x.Meta(b)  # type: ignore[arg-type]
        if a in x.UNQUALIFIED_META:
            self.i += 1
            return x.Meta(a)  # type: ignore[arg-type]
        if a == "ct" and b in ("state", "status"):
            self.i += 2
            return x.Ct(b)  # type: ignore[arg-type]
        if a == "fib" and b in ("saddr", "daddr") and self.peek(2) == "type":
            self.i += 3
            return x.Fib(b)  # type: ignore[arg-type]
        if a == "numgen" and b == "random" and self.peek(2) == "mod":
            self.i += 3
            mod = int(self.take())
            offset = None
            if self.peek() == "offset":
                self.i += 1
                offset = int(self.take())
            return x.numgen(mod, offset)
        return None

    def selectors(self) -> x.Expr | None:
        """A selector, or several joined by `.` (a concatenation)."""
        first = self.selector()
        if first is None:
            return None
        parts = [first]
        while self.peek() == ".":
            self.i += 1
            nxt = self.selector()
            if nxt is None:
                raise self.fail("a concatenation of something else")
            parts.append(nxt)
        return parts[0] if len(parts) == 1 else x.Concat(tuple(parts))

    def verdict(self) -> x.Verdict | None:
        t = self.peek()
        if t in ("jump", "goto"):
            self.i += 1
            return x.Verdict(t, self.take())
        if t in _VERDICTS:
            self.i += 1
            return x.Verdict(t)
        return None

    def anon_map(self) -> x.AnonMap:
        if self.take() != "{":
            raise self.fail("vmap without braces")
        items: list[tuple[int | x.Range, x.Verdict]] = []
        while self.peek() != "}":
            key = self.take()
            if self.take() != ":":
                raise self.fail("vmap element")
            v = self.verdict()
            if v is None:
                raise self.fail("vmap value")
            low, dash, high = key.partition("-")  # `LOW-HIGH`: an interval map's range
            items.append((x.Range(int(low), int(high)) if dash else int(key), v))
            if self.peek() == ",":
                self.i += 1
        self.i += 1
        return x.AnonMap(tuple(items))

    def anon_set(self) -> x.AnonSet:
        self.i += 1  # {
        items: list[x.Value] = []
        while self.peek() != "}":
            t = self.take()
            if t == "{":
                raise self.fail("a set in a set is not supported")
            if t != ",":
                items.append(_constant(t))
        self.i += 1
        return x.AnonSet(tuple(items))

    def statements(self) -> x.Body:
        out: list[x.Statement] = []
        comment = None
        while self.peek() is not None:
            if self.peek() == "comment":
                self.i += 1
                comment = x.Comment(self.take().strip('"'))
                continue
            out.append(self.statement())
        if comment is not None:
            out.append(comment)
        return x.Body(out)

    def statement(self) -> x.Statement:
        t = self.peek()
        v = self.verdict()
        if v is not None:
            return v
        if t == "counter":
            self.i += 1
            if self.peek() == "name":
                self.i += 1
                return x.Counter(self.take())
            return x.COUNTER
        if t == "reject":
            self.i += 1
            return x.REJECT
        if t == "masquerade":
            self.i += 1
            if self.peek() == "fully-random":
                self.i += 1
                return x.Masquerade(fully_random=True)
            return x.MASQUERADE
        if t == "update":
            self.i += 1
            name = self.name()
            if self.take() != "{":
                raise self.fail("update without an element")
            key = self.selectors()
            if key is None or self.take() != "}":
                raise self.fail("update element")
            return x.SetUpdate(name, key)
        if t == "dnat":
            return self.dnat()
        if t == "meta" and self.peek(1) == "mark" and self.peek(2) == "set":
            self.i += 3
            if self.take() != "meta" or self.take() != "mark":
                raise self.fail("mark arithmetic")
            op = self.take()
            if op not in _BITWISE:
                raise self.fail("mark operator")
            return x.MetaSet(x.MARK, x.Bitwise(x.MARK, op, int(self.take(), 0)))
        return self.relation()

    def dnat(self) -> x.Dnat:
        self.i += 1
        family = None
        if self.peek() in ("ip", "ip6"):
            family = self.take()
        if self.take() != "to":
            raise self.fail("dnat without to")
        if self.peek() == "numgen":
            key = self.selector()
            if key is None or self.take() != "map":
                raise self.fail("dnat map")
            return x.Dnat(x.MapLookup(key, self.name()), family=family)
        dest = self.take()
        m = re.fullmatch(r"\[(.+)\]:(\d+)|([^:]+):(\d+)|([^\[\]]+)", dest)  # an address alone: no port
        if m is None:
            raise self.fail("dnat destination")
        if m.group(5):
            return x.Dnat(m.group(5), None, family)
        addr, port = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
        return x.Dnat(addr, int(port), family)

    def relation(self) -> x.Statement:
        left = self.selectors()
        if left is None:
            raise self.fail(f"{self.peek()!r}")
        if self.peek() == "vmap":
            self.i += 1
            return x.VerdictMap(left, self.anon_map() if self.peek() == "{" else self.name())
        if self.peek() in _BITWISE:
            left = x.Bitwise(left, self.take(), int(self.take(), 0))
        op = "=="
        if self.peek() in ("==", "!="):
            op = self.take()
        t = self.peek()
        if t == "{":
            return x.Match(left, self.anon_set(), op)
        if t is not None and t.startswith("@") and op == "==" and type(left) is not x.Bitwise:
            return x.Lookup(left, self.name())
        value = _constant(self.take())
        while type(left) is x.Ct and self.peek() == ",":  # a flag list is one constant: `ct state established,related`
            self.i += 1
            value = f"{value},{self.take()}"
        return x.Match(left, value, op)


def _constant(token: str) -> x.Value:
    """A constant as the renderers hold it: numbers as ints, strings unquoted."""
    if token.isdigit():
        return int(token)
    if token.startswith('"') and token.endswith('"') and len(token) > 1:
        return token[1:-1]
    return token

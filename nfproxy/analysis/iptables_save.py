"""`iptables-save` output and `iptables-restore` input, read into the rule IR.

Public API: `parse(text: str, family) -> Ruleset` (family: IPFamily, "ip"/"ip6" or 4/6), and
`ParseError`.

Both formats are one grammar: `*table`, `:CHAIN POLICY [p:b]`, `-A CHAIN options`, `COMMIT`.
They differ only in spelling: iptables-save reorders options (`-s`/`-d`/`-p` first), adds `/32`,
quotes every comment and prints statistic probabilities with 11 digits; kube-proxy writes
`-m comment` first and 10 digits. Options are therefore read by meaning, never by position.
A restore text may omit built-in chains (they always exist) and may delete chains (`-X`);
several tables may follow each other. What iptables-restore would refuse is a ParseError with
its line: an address of the other family, a port past 16 bits, a mark past 32, a user chain
declared twice, a table iptables does not have, names and comments past xtables' lengths.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Iterable, Iterator

from nfproxy.core.gc_pause import gc_paused
from nfproxy.analysis import quantize
from nfproxy.analysis.ir import (
    address,
    AnonSet,
    Bitwise,
    Chain,
    Const,
    Ct,
    Dnat,
    Element,
    Fib,
    Field,
    Masquerade,
    Match,
    MarkSet,
    Prefix,
    Range,
    Rule,
    Ruleset,
    SetDef,
    SetRef,
    SetUpdate,
    Statement,
    Statistic,
    Table,
    Unknown,
    Verdict,
    canonical,
)
from nfproxy.core.model import IPFamily

# Built-in chains: (hook, table type, priority) per table; priorities as netfilter defines them
# (NF_IP_PRI_RAW -300, MANGLE -150, NAT_DST -100, FILTER 0, NAT_SRC 100), so iptables and nft
# base chains of one namespace are ordered on a single scale.
BUILTIN: dict[str, dict[str, tuple[str, str, int]]] = {
    "raw": {"PREROUTING": ("prerouting", "filter", -300), "OUTPUT": ("output", "filter", -300)},
    "mangle": {
        "PREROUTING": ("prerouting", "route", -150),
        "INPUT": ("input", "filter", -150),
        "FORWARD": ("forward", "filter", -150),
        "OUTPUT": ("output", "route", -150),
        "POSTROUTING": ("postrouting", "filter", -150),
    },
    "nat": {
        "PREROUTING": ("prerouting", "nat", -100),
        "INPUT": ("input", "nat", 100),
        "OUTPUT": ("output", "nat", -100),
        "POSTROUTING": ("postrouting", "nat", 100),
    },
    "filter": {
        "INPUT": ("input", "filter", 0),
        "FORWARD": ("forward", "filter", 0),
        "OUTPUT": ("output", "filter", 0),
    },
    "security": {
        "INPUT": ("input", "filter", 50),
        "FORWARD": ("forward", "filter", 50),
        "OUTPUT": ("output", "filter", 50),
    },
}

_STANDARD_TARGETS = {"ACCEPT": "accept", "DROP": "drop", "RETURN": "return"}
# Target extensions that change nothing a first packet's outcome depends on.
_NOOP_TARGETS = {"LOG", "NFLOG", "TRACE", "AUDIT"}
# Target extensions we do not model; a rule using one is Unknown, never a jump to a "chain".
_OTHER_TARGETS = {
    "SNAT", "CT", "NOTRACK", "TCPMSS", "CONNMARK", "TPROXY", "REDIRECT", "NETMAP", "CLASSIFY",
    "DSCP", "TOS", "TTL", "HL", "NFQUEUE", "QUEUE", "SET", "CHECKSUM", "TEE", "IDLETIMER", "LED",
    "SECMARK", "CONNSECMARK", "SYNPROXY", "HMARK", "CLUSTERIP", "ECN",
}
_CT_STATES = {"new", "established", "related", "invalid", "untracked", "snat", "dnat"}
# What xtables reads into fixed-size fields: XT_EXTENSION_MAXNAMELEN (29, NUL included) for a
# chain's name, XT_MAX_COMMENT_LEN (256) for a comment, 16 bits for a port, 32 for a mark.
CHAIN_NAME_MAX = 28
COMMENT_MAX = 255
PORT_MAX = 0xFFFF
MARK_MAX = 0xFFFFFFFF
# A number longer than this is out of every range above; it is refused before int() reads it
# (Python's own limit, 4 300 digits, would raise a ValueError in its own words).
_DIGITS_MAX = 24


class ParseError(ValueError):
    """The text is not iptables-save/restore syntax; the message names the line, which is also
    kept in `line` (so a caller can say FILE:LINE)."""

    def __init__(self, message: str, line: int | None = None) -> None:
        super().__init__(f"line {line}: {message}" if line is not None else message)
        self.line = line
        self.reason = message


def _family(family: object) -> str:
    if family in (IPFamily.V6, 6, "ip6", "ipv6"):
        return "ip6"
    if family in (IPFamily.V4, 4, "ip", "ipv4"):
        return "ip"
    raise ValueError(f"unknown family {family!r}")


class _TableBuilder:
    def __init__(self, name: str) -> None:
        self.name = name
        builtins = BUILTIN.get(name, {})
        self.policies: dict[str, str] = {c: "accept" for c in builtins}
        self.rules: dict[str, list[Rule]] = {c: [] for c in builtins}
        self.recent: dict[str, int] = {}
        self.declared: dict[str, int] = {}  # user chain -> the line that declared it

    def declare(self, chain: str, policy: str, number: int = 0) -> None:
        """iptables-restore creates a user chain once ("error creating chain: File exists");
        a built-in one's policy may be set again, the last one holding."""
        if len(chain) > CHAIN_NAME_MAX:
            raise ParseError(f"chain name {chain[:40]!r} too long ({CHAIN_NAME_MAX} chars max)", number)
        if chain not in BUILTIN.get(self.name, {}):
            first = self.declared.setdefault(chain, number)
            if first != number:
                raise ParseError(f"chain {chain} declared again (first at line {first}): iptables-restore "
                                 "refuses it (File exists)", number)
        self.rules.setdefault(chain, [])
        if policy != "-":
            self.policies[chain] = policy.lower()

    def build(self, family: str) -> Table:
        builtins = BUILTIN.get(self.name, {})
        chains = {}
        for name, rules in self.rules.items():
            if name in builtins:
                hook, ctype, prio = builtins[name]
                chains[name] = Chain(name, tuple(rules), hook, ctype, prio, self.policies[name])
            else:
                chains[name] = Chain(name, tuple(rules))
        sets = {
            name: SetDef(name, "set", ("addr",), flags=frozenset({"dynamic", "timeout"}), timeout=secs)
            for name, secs in self.recent.items()
        }
        return Table(family, self.name, "iptables", chains, sets)


@gc_paused()  # as nft_json.parse
def parse(text: str | Iterable[str], family: object = IPFamily.V4) -> Ruleset:
    """A table must end with COMMIT: a dump cut short (a truncated file, a killed save) is an
    error, not a smaller ruleset that looks clean. `text` may be lines as a tool writes them
    (`IptablesRunner.save_lines`): parsed while the rest is still being written."""
    fam = _family(family)
    tables: dict[str, _TableBuilder] = {}
    current: _TableBuilder | None = None
    opened = 0
    number = 0
    for number, raw in enumerate(text.splitlines() if isinstance(text, str) else text, 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("*"):
            if current is not None:
                raise ParseError(f"*{line[1:].strip()} starts before *{current.name} (line {opened}) has its COMMIT", number)
            name = line[1:].strip()
            if not name:
                raise ParseError("a table line names no table", number)
            if name not in BUILTIN:
                raise ParseError(f"*{name[:40]}: no such table (iptables has {', '.join(BUILTIN)})", number)
            current = tables.setdefault(name, _TableBuilder(name))
            opened = number
            continue
        if line == "COMMIT":
            if current is None:
                raise ParseError("COMMIT outside a *table ... COMMIT block", number)
            current = None
            continue
        if current is None:
            raise ParseError(f"{line[:80]!r} outside a *table ... COMMIT block", number)
        try:
            _line(current, line, number, fam)
        except (IndexError, ValueError) as exc:
            if isinstance(exc, ParseError):
                raise
            raise ParseError(f"{exc}: {line[:200]!r}", number) from None
    if current is not None:
        raise ParseError(f"*{current.name} (line {opened}) has no COMMIT: the dump ends mid-table", number)
    return Ruleset(tuple(t.build(fam) for t in tables.values()))


# The four rule lines that make up nine tenths of a large save (at 10 000 services x 10: an
# endpoint's `-s A/32 -j KUBE-MARK-MASQ` and `-p tcp -m tcp -j DNAT --to-destination A:P`, a
# service's `-m statistic --mode random --probability P -j KUBE-SEP-...` and its last `-j ...`),
# as iptables-save prints them, with or without a `-m comment`. One regular expression reads
# them into the statements the general reader below makes (about a fifth off reading a whole
# save: docs/benchmarks.md, "The commonest iptables lines read by one regular expression";
# tests/test_analysis_parsers.py holds the two readings equal on whole saves); any other line,
# or one of these the shortcut cannot finish, goes the general way.
_COMMON = re.compile(
    r"-A (\S+)"
    r"(?: -s ((?:\d{1,3}\.){3}\d{1,3}/32)"
    r"| -p (tcp|udp|sctp) -m \3"
    r"| -m statistic --mode random --probability ([0-9.]+))?"
    r" -j ([\w-]+)(?: --to-destination ((?:\d{1,3}\.){3}\d{1,3}:\d{1,5}))?"
)
_SADDR, _L4PROTO = Field("saddr"), Field("l4proto")


_COMMENT = re.compile(r' -m comment --comment (?:"([^"\\]*)"|([^\s"]+))')


def _common(current: _TableBuilder, line: str, number: int, fam: str = "ip") -> bool:
    """Read `line` if it is one of the common shapes (with or without one comment, which adds
    no statement wherever it stands); False to read it the general way."""
    comment, shape = "", line
    if " -m comment " in line:
        found = _COMMENT.search(line)
        if found is None:
            return False
        comment = found.group(1) if found.group(1) is not None else found.group(2)
        shape = line[: found.start()] + line[found.end():]
    m = _COMMON.fullmatch(shape)
    if m is None:
        return False
    chain, source, proto, probability, target, dest = m.groups()
    if dest is not None and target != "DNAT":
        return False  # options after a target that takes none: the general reader says what they are
    if fam != "ip" and (source or dest) or len(comment) > COMMENT_MAX:
        return False  # an IPv4 address in an IPv6 save, a long comment: the general reader refuses them
    try:
        matches: list[Statement] = []
        if source is not None:
            matches.append(Match(_SADDR, "==", _operand(_networks(source))))
        elif proto is not None:
            matches.append(Match(_L4PROTO, "==", Const(canonical(proto, "proto"))))
        elif probability is not None:
            quantize.iptables_threshold(probability)
            matches.append(Statistic(probability))
        if dest is not None:
            tail: list[Statement] = [_dnat(dest)]  # what _target makes of DNAT --to-destination
        elif target.startswith("KUBE-"):
            tail = [Verdict("jump", target)]  # no built-in target starts so: a chain
        else:
            tail = _target("-j", _Tokens([target]), line)
    except (IndexError, ValueError):
        return False
    current.rules.setdefault(chain, []).append(Rule((*matches, *tail), comment, line, number))
    return True


def _line(current: _TableBuilder, line: str, number: int, fam: str) -> None:
    """One line inside a table: a chain declaration or a command."""
    if line.startswith("-A ") and _common(current, line, number, fam):
        return
    if line.startswith(":"):
        parts = line[1:].split()
        if len(parts) < 2:
            raise ParseError(f"bad chain declaration {line[:200]!r}", number)
        current.declare(parts[0], parts[1], number)
        return
    tokens = _split(line, number)
    if tokens and tokens[0].startswith("[") and tokens[0].endswith("]"):
        tokens = tokens[1:]  # iptables-save -c packet:byte counters
    if not tokens:
        return
    op = tokens[0]
    if op in ("-A", "--append") and len(tokens) >= 2:  # almost every line: first
        current.rules.setdefault(tokens[1], []).append(_rule(tokens[2:], line, current, fam, number))
        return
    if op in ("-X", "--delete-chain"):
        for chain in tokens[1:2]:
            current.rules.pop(chain, None)
            current.declared.pop(chain, None)
        return
    if op in ("-F", "--flush"):
        for chain in tokens[1:2] or list(current.rules):
            current.rules[chain] = []
        return
    if op in ("-N", "--new-chain"):
        current.declare(tokens[1], "-", number)
        return
    if op in ("-A", "--append", "-I", "--insert") and len(tokens) >= 2:
        chain = tokens[1]
        rest = tokens[2:]
        position: int | None = None
        if op in ("-I", "--insert"):
            position = 0
            if rest and rest[0].isascii() and rest[0].isdigit():
                position = int(rest[0]) - 1 if len(rest[0]) <= _DIGITS_MAX else 1 << 64
                rest = rest[1:]
        rule = _rule(rest, line, current, fam, number)
        rules = current.rules.setdefault(chain, [])
        if position is not None and not 0 <= position <= len(rules):
            # iptables refuses these too ("Invalid rule number", "Index of insertion too big").
            raise ParseError(f"{op} {chain} {position + 1}: no such position ({len(rules)} rules before it)", number)
        if position is None:
            rules.append(rule)
        else:
            rules.insert(position, rule)
        return
    raise ParseError(f"unknown command {op!r} in {line[:200]!r}", number)


# A token is a double-quoted string (iptables-save escapes `"` and `\\` inside) or a run of
# non-blank characters. shlex would do, at twenty times the cost on a 300 000-line save.
_TOKEN = re.compile(r'"((?:[^"\\]|\\.)*)"|(\S+)')
_UNESCAPE = re.compile(r"\\(.)")


def _split(line: str, number: int) -> list[str]:
    if '"' not in line:
        return line.split()
    tokens = []
    for quoted, bare in _TOKEN.findall(line):
        if bare:
            if '"' in bare:
                raise ParseError(f"unbalanced quote in {line[:200]!r}", number)
            tokens.append(bare)
        else:
            tokens.append(_UNESCAPE.sub(r"\1", quoted) if "\\" in quoted else quoted)
    return tokens


def _networks(text: str, family: str = "ip") -> tuple[Prefix, ...]:
    # Cached: a service's addresses recur in its rules (the cluster IP in KUBE-SERVICES and its
    # KUBE-SVC chain, an endpoint in its KUBE-SEP chain's match and DNAT).
    found = _NETWORKS.get(text)
    if found is None:
        if len(_NETWORKS) >= 1 << 16:
            _NETWORKS.clear()
        found = _NETWORKS[text] = tuple(Prefix(_network(part)) for part in text.split(","))
    version = 6 if family == "ip6" else 4
    for prefix in found:
        if prefix.network.version != version:
            _check_version(prefix.network, family)
    return found


def _check_version(value: ipaddress.IPv4Address | ipaddress.IPv6Address | ipaddress.IPv4Network
                   | ipaddress.IPv6Network, family: str) -> None:
    """iptables-restore reads IPv4 addresses only, ip6tables-restore IPv6 ones ("host/network
    not found", "Bad IP address"): one of the other family was not saved by either."""
    version = 6 if family == "ip6" else 4
    if value.version != version:
        tool = "ip6tables-restore" if version == 6 else "iptables-restore"
        raise ValueError(f"{value} is an IPv{value.version} address in an IPv{version} save ({tool} refuses it)")


def _network(text: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    """`ip_network(text, strict=False)`, twice as fast for the IPv4 host addresses that fill a
    save (an endpoint's `-s A/32`, 100 000 of them at 10 000 services, none repeated). Only
    the canonical dotted quad takes the short way, so every other spelling meets
    ipaddress's own checks and errors."""
    addr, slash, length = text.partition("/")
    if length == "32" or not slash:
        try:
            packed = socket.inet_pton(socket.AF_INET, addr)
        except OSError:
            packed = b""
        if packed and socket.inet_ntop(socket.AF_INET, packed) == addr:
            return ipaddress.IPv4Network(int.from_bytes(packed, "big"))
    return ipaddress.ip_network(text, strict=False)


_NETWORKS: dict[str, tuple[Prefix, ...]] = {}


def _ports(text: str) -> tuple[Const | Range, ...]:
    """Ports and ranges (`80`, `1000:2000`, `:1023`), each 16 bits, as iptables reads them
    ("invalid port/service", "invalid portrange (min > max)")."""
    out: list[Const | Range] = []
    for part in text.split(","):
        if ":" in part:
            lo, hi = part.split(":", 1)
            low, high = _unsigned(lo or "0", PORT_MAX, "port"), _unsigned(hi or str(PORT_MAX), PORT_MAX, "port")
            if low > high:
                raise ValueError(f"port range {part} has its minimum above its maximum")
            out.append(Range(low, high))
        else:
            out.append(Const(_unsigned(part, PORT_MAX, "port")))
    return tuple(out)


def _operand(items: tuple) -> Const | Prefix | Range | AnonSet:
    if len(items) == 1:
        return items[0]
    return AnonSet(tuple(Element((i,)) for i in items))


def _mark(text: str) -> tuple[int, int]:
    value, _, mask = text.partition("/")
    return _unsigned(value, MARK_MAX, "mark", 0), _unsigned(mask, MARK_MAX, "mark mask", 0) if mask else MARK_MAX


def _unsigned(text: str, limit: int, what: str, base: int = 10) -> int:
    """A number as xtables_strtoui reads it (base 0: 0x… hex too), from 0 to `limit`."""
    if len(text) > _DIGITS_MAX:
        raise ValueError(f"{what} of {len(text)} characters, out of range (0-{limit})")
    value = int(text, base)
    if not 0 <= value <= limit:
        raise ValueError(f"{what} {text} out of range (0-{limit})")
    return value


class _Tokens:
    def __init__(self, tokens: list[str]) -> None:
        self.tokens = tokens
        self.i = 0

    def __bool__(self) -> bool:
        return self.i < len(self.tokens)

    def next(self) -> str:
        if self.i >= len(self.tokens):
            raise IndexError("missing value")
        tok = self.tokens[self.i]
        self.i += 1
        return tok

    def peek(self) -> str | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def values(self) -> Iterator[str]:
        """Arguments up to the next option (for options this parser does not know)."""
        while self.i < len(self.tokens) and not self.tokens[self.i].startswith("-") and self.tokens[self.i] != "!":
            yield self.next()


def _rule(tokens: list[str], line: str, table: _TableBuilder, family: str, number: int) -> Rule:
    try:
        return _rule_unchecked(tokens, line, table, family, number)
    except (IndexError, ValueError) as exc:
        raise ParseError(f"{exc}: {line[:200]!r}", number) from None


def _rule_unchecked(tokens: list[str], line: str, table: _TableBuilder, family: str, number: int) -> Rule:
    ts = _Tokens(tokens)
    matches: list[Statement] = []
    tail: list[Statement] = []
    comment = ""
    module = ""
    negate = False
    proto: str | None = None
    recent: dict[str, str] = {}
    unpriced = False

    def cmp(left, operand) -> None:  # noqa: ANN001
        matches.append(Match(left, "!=" if negate else "==", operand))

    tokens_ = ts.tokens
    count = len(tokens_)
    while ts.i < count:
        tok = tokens_[ts.i]
        ts.i += 1
        if tok == "!":
            negate = True
            continue
        # The options every kube-proxy rule has come first: `-m` two or three times a rule.
        if tok in ("-m", "--match"):
            module = ts.next()
            if module == "recent":
                recent = {}
        elif tok == "--comment" and module == "comment":
            comment = ts.next()
            if len(comment) > COMMENT_MAX:
                raise ValueError(f"comment of {len(comment)} characters: iptables keeps at most {COMMENT_MAX}")
        elif tok in ("-p", "--protocol"):
            value = canonical(ts.next(), "proto")
            proto = str(value)
            if value != "all":
                cmp(Field("l4proto"), Const(value))
        elif tok in ("-s", "--source", "--src", "-d", "--destination", "--dst"):
            name = "saddr" if tok in ("-s", "--source", "--src") else "daddr"
            cmp(Field(name), _operand(_networks(ts.next(), family)))
        elif tok in ("-i", "--in-interface", "-o", "--out-interface"):
            name = "iifname" if tok.startswith(("-i", "--in")) else "oifname"
            cmp(Field(name), Const(ts.next()))
        elif tok in ("-j", "--jump", "-g", "--goto"):
            tail.extend(_target(tok, ts, line, family))
        elif tok in ("--dport", "--destination-port", "--sport", "--source-port") and module in (
            "tcp", "udp", "sctp", "dccp", "udplite"
        ):
            name = "dport" if "d" in tok[2:4] else "sport"
            cmp(Field(name, module), _operand(_ports(ts.next())))
        elif tok in ("--dports", "--destination-ports", "--sports", "--source-ports") and module == "multiport":
            name = "dport" if "d" in tok[2:4] else "sport"
            cmp(Field(name, proto), _operand(_ports(ts.next())))
        elif module == "statistic" and tok == "--mode":
            mode = ts.next()
            if mode != "random":
                matches.append(Unknown(f"-m statistic --mode {mode}"))
            else:
                unpriced = True  # random mode needs its --probability (checked at the end)
        elif module == "statistic" and tok == "--probability":
            unpriced = False
            value = ts.next()
            quantize.iptables_threshold(value)  # a ValueError unless a number in [0, 1]
            matches.append(Statistic(value, negate))
        elif module == "nfacct" and tok == "--nfacct-name":
            ts.next()  # counts the packet, decides nothing
        elif module in ("conntrack", "state") and tok in ("--ctstate", "--state", "--ctstatus"):
            key = "status" if tok == "--ctstatus" else "state"
            flags = tuple(s.lower() for s in ts.next().split(","))
            if key == "state" and not set(flags) <= _CT_STATES:
                matches.append(Unknown(f"{tok} {','.join(flags)}"))
            else:
                cmp(Ct(key), _operand(tuple(Const(f) for f in flags)))
        elif module == "mark" and tok == "--mark":
            value, mask = _mark(ts.next())
            cmp(Bitwise("&", Field("mark"), mask), Const(value & mask))
        elif module == "addrtype" and tok in ("--src-type", "--dst-type"):
            types = tuple(Const(t.lower()) for t in ts.next().split(","))
            cmp(Fib("saddr" if tok == "--src-type" else "daddr"), _operand(types))
        elif module == "recent" and tok in ("--name", "--seconds", "--mask", "--hitcount"):
            recent[tok[2:]] = ts.next()
            if tok == "--hitcount":
                matches.append(Unknown(f"-m recent --hitcount {recent['hitcount']}"))
        elif module == "recent" and tok in ("--rsource", "--reap"):
            pass
        elif module == "recent" and tok in ("--rcheck", "--update", "--set", "--remove", "--rdest"):
            if tok in ("--update", "--remove", "--rdest"):
                matches.append(Unknown(f"-m recent {tok}"))
            recent["action"] = tok[2:]
            # Options after the action (--seconds, --name) belong to it: resolve at the end.
            matches.append(_RecentPlaceholder(recent, negate))
        else:
            args = " ".join(ts.values())
            matches.append(Unknown(f"{'! ' if negate else ''}{tok} {args}".strip()))
        negate = False
    if unpriced:
        # iptables-restore refuses it; read as "always" it would hide the cascade's split.
        raise ValueError("-m statistic --mode random without --probability")

    statements: list[Statement] = []
    for st in matches:
        if isinstance(st, _RecentPlaceholder):
            statements.append(st.resolve(table))
        else:
            statements.append(st)
    statements.extend(tail)
    return Rule(tuple(statements), comment, line, number)


class _RecentPlaceholder:
    """`-m recent` options come in any order around the action; resolved once the rule is read."""

    def __init__(self, options: dict[str, str], negate: bool) -> None:
        self.options = options
        self.negate = negate

    def resolve(self, table: _TableBuilder) -> Statement:
        name = self.options.get("name", "DEFAULT")
        mask = self.options.get("mask")
        if mask is not None and mask not in ("255.255.255.255", "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff"):
            return Unknown(f"-m recent --mask {mask}")
        set_name = f"recent:{name}"
        if self.options.get("action") == "set":
            table.recent.setdefault(set_name, 0)
            return SetUpdate(set_name, Field("saddr"))
        seconds = _unsigned(self.options.get("seconds", "0"), 0xFFFFFFFF, "--seconds")
        table.recent[set_name] = max(table.recent.get(set_name, 0), seconds)
        return Match(Field("saddr"), "!=" if self.negate else "==", SetRef(set_name))


def _target(tok: str, ts: _Tokens, line: str, family: str = "ip") -> list[Statement]:
    target = ts.next()
    if tok in ("-g", "--goto"):
        return [Verdict("goto", target)]
    if target in _STANDARD_TARGETS:
        return [Verdict(_STANDARD_TARGETS[target])]  # type: ignore[arg-type]
    opts: dict[str, str] = {}
    while ts:
        opt = ts.next()
        values = list(ts.values())
        opts[opt] = " ".join(values)
    if target == "REJECT":
        return [Verdict("reject")]
    if target == "DNAT":
        dest = opts.get("--to-destination", "")
        return [_dnat(dest, family)]
    if target == "MASQUERADE":
        if "--to-ports" in opts:
            return [Unknown(f"-j MASQUERADE --to-ports {opts['--to-ports']}")]
        return [Masquerade()]
    if target == "MARK":
        return [_mark_target(opts)]
    if target in _NOOP_TARGETS:
        return []
    if target in _OTHER_TARGETS:
        return [Unknown(f"-j {target} " + " ".join(f"{k} {v}".strip() for k, v in opts.items()))]
    if opts:
        return [Unknown(f"-j {target} with options {opts}")]
    return [Verdict("jump", target)]


def _dnat(dest: str, family: str = "ip") -> Statement:
    """`--to-destination ip[:port]`, IPv6 as `[ip]:port`; ranges are not modelled."""
    if dest.startswith("["):
        ip, _, port = dest[1:].partition("]")
        port = port.lstrip(":")
    elif dest.count(":") == 1:
        ip, port = dest.split(":")
    else:
        ip, port = dest, ""
    if "-" in ip or "-" in port:
        return Unknown(f"-j DNAT --to-destination {dest}")
    addr = Const(address(ip))
    _check_version(addr.value, family)
    if port and not (port.isdigit() and len(port) <= 5 and int(port) <= 65_535):
        raise ValueError(f"Port `{port}' not valid")  # as iptables-restore says it
    return Dnat(addr, Const(int(port)) if port else None)


def _mark_target(opts: dict[str, str]) -> Statement:
    """MARK's options all reduce to xt_MARK's `mark = (mark & ~mask) ^ value`."""
    mark = Field("mark")
    full = 0xFFFFFFFF
    if "--set-xmark" in opts:
        value, mask = _mark(opts["--set-xmark"])
    elif "--set-mark" in opts:
        value, mask = _mark(opts["--set-mark"])
        mask |= value  # "clear the mask's bits, then OR value in" is xmark value/(mask|value)
    elif "--or-mark" in opts:
        value = mask = _unsigned(opts["--or-mark"], MARK_MAX, "mark", 0)
    elif "--xor-mark" in opts:
        value, mask = _unsigned(opts["--xor-mark"], MARK_MAX, "mark", 0), 0
    elif "--and-mark" in opts:
        value, mask = 0, ~_unsigned(opts["--and-mark"], MARK_MAX, "mark", 0) & full
    else:
        return Unknown(f"-j MARK {opts}")
    kept = Bitwise("&", mark, ~mask & full)
    return MarkSet(Bitwise("^", kept, value) if value else kept)

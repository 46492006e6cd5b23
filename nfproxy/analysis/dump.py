"""Where rules are read from: a live network namespace or a dump file, into one Ruleset.

Public API: `read_live(backend, netns) -> Source`, `read_file(path, max_bytes=…) -> Source`,
`read_text(text, name) -> Source`, `DumpError`. A `Source` carries the ruleset, the backend it
was read as and a human description ("iptables-legacy in netns X"). Reading never writes to the
kernel.

Every way a file can be unreadable (missing, not a regular file, larger than `max_bytes`, not
UTF-8 text, not a dump, cut short) is a `DumpError` whose message starts `FILE:LINE:` (or
`FILE:` when no line applies), so commands print it as it is and exit 2. Only regular files
are opened: a FIFO would block forever and /dev/zero never ends.

iptables text may hold both families: `nfproxy render --backend iptables` prints the IPv4
tables and then the IPv6 ones, each after a `# IPv4:` / `# IPv6:` comment. Each table block is
read as the family its marker comment names, or, without markers, as the family of the
addresses in its run of tables (a run ends where a table name repeats).
"""

from __future__ import annotations

import json
import logging
import os
import re
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nfproxy.analysis import iptables_save, nft_json
from nfproxy.analysis.ir import Ruleset
from nfproxy.kernel.process import KernelError
from nfproxy.core.model import IPFamily

if TYPE_CHECKING:
    from nfproxy.nftables.objects import Object

# Tables iptables-nft creates: the nft backend's check leaves them to the iptables one.
IPTABLES_TABLES = frozenset({"filter", "nat", "mangle", "raw", "security"})

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Source:
    ruleset: Ruleset
    backend: str  # "iptables" or "nft"
    description: str


def read_live(backend: str, netns: str | None) -> Source:
    where = f"netns {netns}" if netns else "the current namespace"
    if backend == "nft":
        return Source(read_nft(netns), "nft", f"nft ruleset of {where}")
    if backend != "iptables":
        raise ValueError(f"unknown backend {backend!r}")
    from nfproxy.kernel.iptables import Flavour, IptablesRunner

    tables = []
    used = []
    for flavour in (Flavour.LEGACY, Flavour.NFT):
        for family in IPFamily:
            saved = _Kube(IptablesRunner(family, netns, flavour).save_lines())
            try:
                ruleset = iptables_save.parse(saved, family)  # while the save is still writing
            except KernelError:
                continue
            if saved.seen:
                tables.extend(ruleset.tables)
                used.append(f"{'ip6' if family is IPFamily.V6 else 'ip'}tables-{flavour.value}")
    if not used:
        raise KernelError(f"no KUBE-* iptables rules in {where} (looked at iptables-legacy and iptables-nft)")
    return Source(Ruleset(tuple(tables)), "iptables", f"{', '.join(used)} in {where}")


class _Kube:
    """Lines passed through, noting whether any names a KUBE- chain: a save without one is
    not kube-proxy's or nfproxy's (the other flavour's or family's empty tables)."""

    def __init__(self, lines: Iterator[str]) -> None:
        self.lines = lines
        self.seen = False

    def __iter__(self) -> Iterator[str]:
        for line in self.lines:
            if not self.seen and "KUBE-" in line:
                self.seen = True
            yield line


def read_nft(netns: str | None) -> Ruleset:
    return read_nft_counted(netns, counters=False).ruleset


@dataclass(frozen=True, slots=True)
class NftReading:
    """One reading of a live nft ruleset, with what the endpoint counters read from it
    (`counters.endpoint_counts_nft(doc, counted)`, `audit.nft_pins(doc)`): the listed document
    (without set elements, unless it came from libnftables' full listing), the counted maps'
    elements, and when the kernel was read (before the parse)."""

    ruleset: Ruleset
    doc: dict[str, Any]
    counted: dict[tuple[str, str, str], list[tuple[int, int, int, str]]]
    taken: float


def read_nft_counted(netns: str | None, *, counters: bool = True) -> NftReading:
    """`read_nft`, with the counters of the maps that count when `counters`."""
    """`nft -j list ruleset` without iptables-nft's tables (the iptables backend reads those),
    read: the terse listing through libnftables while the elements of every other named set are
    read over netlink (analysis/nft_elements.py says why), both within one generation of the
    ruleset; libnftables' full listing where the netlink reader has no words for a set.
    iptables-nft's tables are left out before they are parsed: during a migration they hold as
    many rules as ours."""
    from nfproxy.analysis import nft_elements
    from nfproxy.kernel.nft import NftSession
    from nfproxy.kernel.nft_elements import FAMILIES
    from nfproxy.kernel.nfnetlink.values import Unsupported

    def tables(reader: Any) -> dict[tuple[str, str], Any]:
        # Tables of other families (netdev, bridge, arp) are not dumped: a set of theirs makes
        # the parse below give up (`nft_elements.reader`), their chains do not.
        return {where: reader.table(*where, counters=counters) for where in reader.tables()
                if where[0] in FAMILIES and where[1] not in IPTABLES_TABLES}

    read = nft_elements.in_one_generation(netns, lambda session: session.list_ruleset(terse=True), tables,
                                          "the ruleset")
    if read is not None:
        taken = time.monotonic()
        doc, dumped = read
        doc = _without_iptables(doc)
        try:
            counted = nft_elements.counted_elements(dumped) if counters else {}
            return NftReading(nft_json.parse(doc, nft_elements.reader(dumped)), doc, counted, taken)
        except Unsupported as exc:
            log.info("listing the ruleset through libnftables: %s", exc)
    doc = _without_iptables(NftSession(netns).list_ruleset())
    taken = time.monotonic()
    return NftReading(nft_json.parse(doc), doc, {}, taken)


def _without_iptables(doc: dict[str, Any]) -> dict[str, Any]:
    items = doc.get("nftables") if isinstance(doc, dict) else None
    if not isinstance(items, list):
        return doc  # nft_json.parse says what is wrong with it
    kept = [item for item in items if not _of_iptables(item)]
    return {**doc, "nftables": kept}


def _of_iptables(item: object) -> bool:
    if not isinstance(item, dict) or len(item) != 1:
        return False
    body = next(iter(item.values()))
    if not isinstance(body, dict):
        return False
    name = body.get("name") if "table" in item else body.get("table")
    return name in IPTABLES_TABLES


# A dump of 10 000 services x 10 endpoints is ~40 MB of JSON; parsing costs ~10x its size.
MAX_DUMP_BYTES = 256 * 1024 * 1024


class DumpError(ValueError):
    """A dump that cannot be read; the message starts with FILE:LINE: or FILE:."""


_ADDR6 = re.compile(r"\s(?:-s|-d|--to-destination)\s+\[?[0-9a-fA-F]*:[0-9a-fA-F:]*[:\]]")
_ADDR4 = re.compile(r"\s(?:-s|-d|--to-destination)\s+\d{1,3}(?:\.\d{1,3}){3}\b")
# A family marker: our own `# IPv4`/`# IPv6` (render output), or the header the save tools
# write (`iptables-save > f; ip6tables-save >> f` keeps both).
_MARKER = re.compile(r"#\s*(?:IPv([46])\b|Generated by ip(6?)tables-save\b)")


def _is_nft_script(text: str) -> bool:
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            return line.startswith(("add table ip ", "add table ip6 "))
    return False


def read_nft_script(text: str, name: str = "input") -> Source:
    """`nfproxy render --backend nft` output: parsed into transactions, applied to the in-memory
    kernel (which refuses what the real one would: dangling jumps, missing sets) and read back
    as the kernel's JSON would be."""
    from nfproxy.kernel.memory.nft import MemoryNft
    from nfproxy.kernel.process import KernelError
    from nfproxy.nftables import script

    located: list[tuple[int, Object]] = []
    try:
        txs = script.parse(text, name, located)
    except script.ScriptError as exc:
        raise DumpError(str(exc)) from None
    except (ValueError, TypeError) as exc:  # a value the script's own grammar cannot hold
        raise DumpError(f"{name}: {exc}") from None
    objects: list[object] = []
    try:
        for tx in txs:
            kernel = MemoryNft(IPFamily.V4 if tx.family == "ip" else IPFamily.V6, table=tx.table)
            try:
                kernel.apply(tx)
            except KernelError as exc:
                raise DumpError(f"{name}: {tx.family} {tx.table}: {exc}") from None
            objects.extend(kernel.json()["nftables"])  # type: ignore[arg-type]
        return Source(nft_json.parse({"nftables": objects}), "nft", f"nft script (nfproxy render) from {name}")
    except (ValueError, TypeError) as exc:  # nft_json.ParseError is a ValueError too
        raise DumpError(_located_failure(located, txs, exc, name)) from None


def _located_failure(located: list[tuple[int, Object]], txs: list[Any], exc: Exception, name: str) -> str:
    """`exc` (what reading the script as the kernel's JSON refused) with the line of the first
    object that cannot be read on its own; only on this error path, so its cost is no matter."""
    from nfproxy.nftables import json as script_json
    from nfproxy.nftables.objects import Chain, Element, Map, Rule, Set

    family, table = (txs[0].family, txs[0].table) if txs else ("ip", "nfproxy")
    decls: dict[str, Set | Map] = {}
    for _, obj in located:  # the declaration, not a later `flush set` of the same name
        if isinstance(obj, (Set, Map)) and (obj.type is not None or obj.typeof is not None):
            decls.setdefault(obj.name, obj)
    for line, obj in located:
        try:
            if isinstance(obj, Rule):
                nft_json.parse({"nftables": [script_json.rule(family, table, obj.chain, obj.body, 1)]})
            elif isinstance(obj, Chain):
                nft_json.parse({"nftables": [script_json.chain(family, table, obj, 1)]})
            elif isinstance(obj, Element) and obj.set in decls:
                nft_json.parse({"nftables": [script_json.set_(family, table, decls[obj.set], [obj], 1)]})
        except (ValueError, TypeError) as why:
            return f"{name}:{line}: {why}"
    return f"{name}: {exc}"


def read_text(text: str, name: str = "input") -> Source:
    """JSON is `nft -j` output; an nft script is `nfproxy render --backend nft` output; anything
    else is iptables-save/restore text, of one family or of both (see the module's docstring)."""
    if "\x00" in text:
        line = text.count("\n", 0, text.index("\x00")) + 1
        raise DumpError(f"{name}:{line}: a NUL byte: binary data, not a dump")
    if _is_nft_script(text):
        try:
            return read_nft_script(text, name)
        except DumpError as exc:
            raise DumpError(_plain(str(exc))) from None
    if text.lstrip().startswith(("{", "[")):
        return _read_json(text, name)
    if not text.strip():
        raise DumpError(f"{name}: empty: no rules to read")
    blocks = _family_blocks(text, source=name)
    tables = []
    families = []
    for family, masked in blocks:
        try:
            tables.extend(iptables_save.parse(masked, family).tables)
        except iptables_save.ParseError as exc:
            where = f"{name}:{exc.line}" if exc.line is not None else name
            raise DumpError(f"{where}: {exc.reason}") from None
        families.append(f"IPv{family.value}")
    if not tables:
        raise DumpError(f"{name}: no *table ... COMMIT block: not iptables-save or iptables-restore text")
    return Source(Ruleset(tuple(tables)), "iptables", f"iptables text ({' and '.join(families)}) from {name}")


_INT_LIMIT = re.compile(r"Exceeds the limit \(\d+ digits\) for integer string conversion(?:: value has (\d+) digits)?"
                        r"[^;]*; use sys\.set_int_max_str_digits\(\) to increase the limit")


def _plain(message: str) -> str:
    """The script reader's words for a number too long for Python's int(), in the dump's:
    nft would refuse it as no field of the kernel's holds it."""
    return _INT_LIMIT.sub(lambda m: f"a number of {m.group(1) or 'thousands of'} digits: no field of the kernel's holds it",
                          message)


def _read_json(text: str, name: str) -> Source:
    try:
        doc = nft_json.loads(text)  # bounded as nft reads it: 64-bit integers, finite reals
    except nft_json.NumberError as exc:
        raise DumpError(f"{name}:{exc.line}: {exc.reason}") from None
    except json.JSONDecodeError as exc:
        raise DumpError(f"{name}:{exc.lineno}: not valid JSON: {exc.msg} (column {exc.colno})") from None
    except RecursionError:
        raise DumpError(f"{name}: JSON nested too deeply to be nft output") from None
    try:
        ruleset = nft_json.parse(doc)
    except nft_json.ParseError as exc:
        raise DumpError(f"{name}: {exc}") from None
    except RecursionError:
        raise DumpError(f"{name}: JSON nested too deeply to be nft output") from None
    return Source(ruleset, "nft", f"nft JSON from {name}")


def _family_blocks(text: str, source: str = "input") -> list[tuple[IPFamily, str]]:
    """The text once per family it holds, other families' lines blanked (so line numbers stay
    those of the file)."""
    lines = text.splitlines()
    owner: list[IPFamily | None] = [None] * len(lines)
    runs: list[list[int]] = []  # line indexes of each run of tables
    marked: dict[int, IPFamily] = {}  # run -> family its marker names
    seen: set[str] = set()
    marker: IPFamily | None = None
    for i, raw in enumerate(lines):
        line = raw.strip()
        m = _MARKER.match(line)
        if m:
            marker = IPFamily.V6 if "6" in (m.group(1), m.group(2)) else IPFamily.V4
            if runs and runs[-1]:
                runs.append([])
                seen = set()
            continue
        if line.startswith("*"):
            name = line[1:].strip()
            if name in seen or not runs:
                runs.append([])
                seen = set()
            seen.add(name)
            if marker is not None:
                marked[len(runs) - 1] = marker
        if not runs:
            runs.append([])
        runs[-1].append(i)
    tables: dict[tuple[IPFamily, str], int] = {}
    for r, members in enumerate(runs):
        family = marked.get(r)
        if family is None:
            family = _guess_family("\n".join(lines[i] for i in members))
        for i in members:
            owner[i] = family
            if lines[i].startswith("*"):
                # Two saves of one family, or an unmarked save of the other family guessed
                # wrong: merging them would answer for rules no kernel holds.
                key = (family, lines[i][1:].strip())
                if key in tables:
                    raise DumpError(
                        f"{source}:{i + 1}: {lines[i].strip()} again for IPv{family.value} (first at line "
                        f"{tables[key] + 1}): concatenated saves need their '# Generated by ip6tables-save' "
                        "header, or a '# IPv4'/'# IPv6' line before each"
                    )
                tables[key] = i
    out = []
    for family in IPFamily:
        if family not in owner:
            continue
        masked = "\n".join(raw if owner[i] is family else "" for i, raw in enumerate(lines))
        out.append((family, masked))
    return out


def _guess_family(body: str) -> IPFamily:
    """An unmarked save is of the family of its first address: a save of one family holding an
    address of the other is then refused at that address's line, not at every other one."""
    v6, v4 = _ADDR6.search(body), _ADDR4.search(body)
    return IPFamily.V6 if v6 is not None and (v4 is None or v6.start() < v4.start()) else IPFamily.V4


def read_file(path: str, max_bytes: int = MAX_DUMP_BYTES) -> Source:
    """Read a dump from a regular file of at most `max_bytes` (symlinks followed)."""
    return read_text(read_text_file(path, max_bytes, "a dump"), path)


def read_text_file(path: str, max_bytes: int = MAX_DUMP_BYTES, what: str = "text") -> str:
    """A regular file's UTF-8 text, of at most `max_bytes`: a FIFO would block for ever and a
    device never end, so both are refused before they are opened."""
    try:
        info = os.stat(path)
    except OSError as exc:
        raise DumpError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if not stat.S_ISREG(info.st_mode):
        kind = "a directory" if stat.S_ISDIR(info.st_mode) else "a FIFO" if stat.S_ISFIFO(info.st_mode) else "a device or socket"
        raise DumpError(f"{path}: {kind}, not a regular file")
    if info.st_size > max_bytes:
        raise DumpError(f"{path}: {info.st_size} bytes, more than the limit of {max_bytes} (--max-dump-bytes)")
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as exc:
        raise DumpError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if len(data) > max_bytes:
        raise DumpError(f"{path}: more than the limit of {max_bytes} bytes (--max-dump-bytes)")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise DumpError(f"{path}:{line}: not UTF-8 text (byte {exc.start}): binary data, not {what}") from None
    return text.removeprefix("\ufeff")  # a BOM some editors write: it hid a JSON dump's `{`

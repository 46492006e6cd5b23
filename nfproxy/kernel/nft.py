"""Talking to nf_tables: libnftables in-process, one context per network namespace.

In-process libnftables avoids forking `nft` for every sync and lets one transaction carry a whole
sync atomically. A libnftables context is bound to the namespace it was created in, so the
context is created inside the target namespace and kept for the life of the session. When the
Python bindings are missing, `nft -f -` does the same job, slower; that fallback is logged.
"""

from __future__ import annotations

import json
import logging
from typing import Any
from collections.abc import Callable, Iterable

from nfproxy.core.gc_pause import gc_paused
from nfproxy.core.model import IPFamily
from nfproxy.core.owned import Owned
from nfproxy.kernel import netns as netns_mod
from nfproxy.kernel.process import KernelError, run
from nfproxy.nftables import OFF_TABLE, TABLE, Table, Transaction
from nfproxy.nftables import text as nft_text

log = logging.getLogger(__name__)

try:  # pragma: no branch - depends on the host
    import nftables as _nftables
except ImportError:  # pragma: no cover - exercised only on hosts without the bindings
    _nftables = None


class NftSession:
    """Applies nft scripts and reads rules back in one namespace (None: the current one)."""

    def __init__(self, netns: str | None = None, *, use_bindings: bool = True) -> None:
        self.netns = netns
        self._ctx: Any = None
        self._bindings = use_bindings and _nftables is not None
        if self._bindings:
            self._context()
        else:
            log.warning("libnftables Python bindings unavailable: falling back to `nft -f -`")

    @property
    def uses_bindings(self) -> bool:
        return self._bindings

    def _context(self) -> Any:
        """The libnftables context, made in the session's namespace (a context stays bound to
        the namespace it was created in)."""
        if self._ctx is None and self._bindings:
            if self.netns is None:
                self._ctx = _nftables.Nftables()
            else:
                with netns_mod.entered(self.netns):
                    self._ctx = _nftables.Nftables()
        return self._ctx

    def release(self) -> None:
        """Drop the libnftables context, and with it the cache of the ruleset it keeps between
        commands: after a full sync that cache holds every rule and every element of every
        interval set (360 MiB at 10 000 x 10, which no trim returns while the context lives).
        The next command makes a new context."""
        self._ctx = None

    def _cmd(self, text: str, *, json_output: bool = False, terse: bool = False) -> str:
        ctx = self._context()
        if ctx is None:
            argv = ["nft", *(["-j"] if json_output else []), *(["-t"] if terse else []), "-f", "-"]
            return run(argv, netns=self.netns, stdin=text)
        ctx.set_json_output(json_output)
        ctx.set_terse_output(terse)
        rc, out, err = ctx.cmd(text)
        if rc != 0:
            where = f" in netns {self.netns}" if self.netns else ""
            raise KernelError(f"nft{where} rejected the transaction: {err.strip()}")
        return out

    def apply(self, script: str) -> None:
        """Run a whole script as one atomic transaction: all of it takes effect, or none."""
        self._cmd(script)

    def list_table(self, family: str, table: str, *, terse: bool = False) -> dict[str, Any] | None:
        """`nft -j list table` (`terse`: without set elements), or None when there is no table."""
        try:
            out = self._cmd(f"list table {family} {table}", json_output=True, terse=terse)
        except KernelError as exc:
            if "No such file or directory" in str(exc):
                return None
            raise
        return _loads(out, f"list table {family} {table}")

    def object_names(
        self, family: str, table: str, *, counters: Callable[[], Iterable[str]] | None = None
    ) -> tuple[set[str], set[str], set[str]] | None:
        """Names of the chains, of the sets/maps and of the named counters in one table, without
        rules or elements.

        A full sync needs them to remove what the new state does not render: chains and sets
        left by services that vanished while nfproxy was not running, a counter of a feature
        turned off; listing the whole table would also fetch every rule (and asking whether the
        table exists first did: `list table -t` still lists the rules).
        """
        return self.tables_object_names(family, (table,), counters=counters and (lambda _t: counters()))[table]

    def tables_object_names(
        self, family: str, tables: tuple[str, ...], *, counters: Callable[[str], Iterable[str]] | None = None
    ) -> dict[str, tuple[set[str], set[str], set[str]] | None]:
        """`object_names` of several tables of one family from one listing of each kind."""
        chains = json.loads(self._cmd(f"list chains {family}", json_output=True))
        # `list sets` leaves maps out: both lists, or a stray map is never seen.
        sets = json.loads(self._cmd(f"list sets {family}", json_output=True, terse=True))
        maps = json.loads(self._cmd(f"list maps {family}", json_output=True, terse=True))
        listed = None if counters is not None else json.loads(self._cmd(f"list counters {family}", json_output=True))
        out: dict[str, tuple[set[str], set[str], set[str]] | None] = {}
        for table in tables:
            chain_names = _named(chains, ("chain",), table)
            set_names = _named({"nftables": [*sets.get("nftables", ()), *maps.get("nftables", ())]}, ("set", "map"), table)
            # netlink: libnftables' listing of counters fetches every rule
            counter_names = set(counters(table)) if counters is not None else _named(listed or {}, ("counter",), table)
            if not (chain_names or set_names or counter_names) and self.list_table(family, table, terse=True) is None:
                out[table] = None  # only then can the table be missing: it costs nothing to ask
            else:
                out[table] = (chain_names, set_names, counter_names)
        return out

    def list_ruleset(self, *, terse: bool = False) -> dict[str, Any]:
        """`nft -j [-t] list ruleset` (terse: named sets without their elements). The context is
        dropped before the JSON is decoded, so the decoded document can reuse the memory of its
        cache of the whole ruleset (the peak is the listing's own: dropping the context first
        lowers it by ~40 MiB at 10 000 x 10)."""
        text = self._cmd("list ruleset", json_output=True, terse=terse)
        self.release()
        return _loads(text, "list ruleset")

    def list_text(self) -> str:
        return self._cmd("list ruleset")

    def delete_table(self, family: str, table: str) -> bool:
        """Delete a table if it exists; True when something was deleted. (Not by listing it
        first: that fetches every element, and nft 1.0.6 prints invalid JSON for a dormant
        table.)"""
        try:
            self._cmd(f"delete table {family} {table}")
        except KernelError as exc:
            if "No such file or directory" in str(exc):
                return False
            raise
        return True


def _named(listing: dict[str, Any], kinds: tuple[str, ...], table: str) -> set[str]:
    """Names of the objects of `kinds` in `table` in an `nft -j list …` document."""
    return {
        body["name"]
        for o in listing.get("nftables", ())
        for kind in kinds
        if (body := o.get(kind)) is not None and body["table"] == table
    }


class NftKernel:
    """The nft Kernel (kernel/base.py) of one family in one namespace: applies Transactions.

    Every transaction, a full sync or a partial one, goes as one nfnetlink batch compiled from
    the objects (kernel/nft_bulk.py, through NetlinkNft); what the compiler cannot say goes
    through libnftables as text (nftables/text.py). Either way one atomic batch. (libnftables for a partial sync would first
    dump every element of every interval map: 0.7 s at 10 000 services.)
    """

    def __init__(
        self, family: IPFamily, *, netns: str | None = None, table: str = TABLE, netlink: bool = True, **_: object
    ) -> None:
        from nfproxy.kernel.nft_netlink import NetlinkNft

        self.family = family
        self.nft_family = "ip" if family is IPFamily.V4 else "ip6"
        self.table = table
        # The off table goes with nfproxy's (nftables.OFF_TABLE); another table stands alone.
        self.tables = (table, OFF_TABLE) if table == TABLE else (table,)
        self.session = NftSession(netns)
        # nfnetlink batches; None sends everything through libnftables.
        self.fast: NetlinkNft | None = NetlinkNft(netns) if netlink else None
        self._reader: Any = None  # nft_elements.ElementReader, for the generation

    def generation(self) -> int:
        """nf_tables' generation (NFT_MSG_GETGEN): one round trip on a socket kept open, since
        the periodic check reads it every --sync-period. It counts every commit in the namespace,
        both families' and other users', so it proves only that nobody wrote."""
        if self._reader is None:
            from nfproxy.kernel.nft_elements import ElementReader

            self._reader = ElementReader(self.session.netns)
        return self._reader.generation()

    def owned(self) -> Owned:
        fast = self.fast
        found = self.session.tables_object_names(
            self.nft_family, self.tables,
            counters=None if fast is None else lambda table: fast.counters(self.nft_family, table),
        )
        main, off = (found.get(t) for t in (self.table, OFF_TABLE))
        owned_off = None if off is None else Owned(frozenset(off[0]), frozenset(off[1]), frozenset(off[2]))
        if main is None:
            return Owned(off=owned_off)
        return Owned(frozenset(main[0]), frozenset(main[1]), frozenset(main[2]), owned_off)

    def apply(self, payload: object) -> None:
        """A Transaction atomically; a tuple of them in order, each atomically (a port moving
        between nfproxy and the off table: backends/nft/backend.py), as one batch when neither
        declares or deletes a table."""
        from nfproxy.kernel.nfnetlink.values import Unsupported

        if isinstance(payload, tuple):
            txs = [tx for tx in payload if tx]
            if self.fast is not None and len(txs) > 1 and not any(type(o) is Table for tx in txs for _, o in tx.ops):
                try:  # what a partial sync says of both tables: one batch, one commit
                    self.fast.apply(*txs)
                    return
                except Unsupported as exc:  # a rule body outside the vocabulary
                    log.debug("transactions one by one: %s", exc)
            for tx in txs:  # one declares the off table (or deletes it): each atomic, in order
                self.apply(tx)
            return
        if not isinstance(payload, Transaction):
            raise TypeError(f"an nft kernel applies Transactions, not {type(payload).__name__}")
        payload.check()
        if not payload:
            return
        if self.fast is not None:
            try:
                self.fast.apply(payload)
                return
            except Unsupported as exc:  # a rule body or declaration outside the vocabulary
                log.debug("transaction through libnftables: %s", exc)
        try:
            self.session.apply(nft_text.script(payload))
        finally:
            self.session.release()  # libnftables' cache of what it just wrote
        if self.fast is not None:
            self.fast.forget(payload.family, payload.table)  # its set declarations may have changed

    def dump(self) -> str:
        """The table as nft lists it, chains and sets in name order, elements sorted (then the
        off table, when there is one)."""
        out = canonical_listing(self.session._cmd(f"list table {self.nft_family} {self.table}"))
        for table in self.tables[1:]:
            try:
                out += canonical_listing(self.session._cmd(f"list table {self.nft_family} {table}"))
            except KernelError as exc:
                if "No such file or directory" not in str(exc):
                    raise
        return out

    def counted_dump(self) -> dict[str, Any]:
        """`nft -j list table` of our tables, counters included (rule counters, named counters,
        per-element counters of the endpoint maps), or an empty document without them."""
        try:
            out: list[Any] = []
            for table in self.tables:
                listed = self.session.list_table(self.nft_family, table)
                if listed is not None:
                    out.extend(o for o in listed.get("nftables", ()) if "metainfo" not in o or not out)
            return {"nftables": out}
        finally:
            self.session.release()  # the whole table, cached: not worth keeping between scrapes

    def close(self) -> None:
        if self.fast is not None:
            self.fast.close()
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        self.session.release()


def canonical_listing(text: str) -> str:
    """`nft list table` text with its blocks (chains, sets, maps) in name order and set
    elements one per line, sorted: two kernels holding the same table list the same."""
    head, blocks, current = "", {}, None
    for line in text.splitlines():
        stripped = line.strip()
        if line.startswith("table "):
            head = stripped
        elif stripped.startswith(("chain ", "set ", "map ")) and stripped.endswith("{"):
            current = stripped
            blocks[current] = []
        elif stripped == "}":
            current = None
        elif current is not None and stripped:
            blocks[current].append(stripped)
    out = [head]
    for name in sorted(blocks):
        body = blocks[name]
        if name.startswith(("set ", "map ")):
            body = _sorted_elements(body)
        out.append(name)
        out.extend(f"\t{b}" for b in body)
        out.append("}")
    return "\n".join(out) + "\n"


def _sorted_elements(body: list[str]) -> list[str]:
    decl = [b for b in body if not b.startswith("elements = ") and not body_is_element(b)]
    joined = " ".join(b for b in body if b.startswith("elements = ") or body_is_element(b))
    joined = joined.removeprefix("elements = {").removesuffix("}").strip()
    items = sorted(x.strip() for x in joined.split(",") if x.strip())
    return decl + [f"element {x}" for x in items]


def body_is_element(line: str) -> bool:
    """A continuation line of an `elements = { ... }` list (nft wraps long lists)."""
    if line == "counter":  # the map's per-element counter flag
        return False
    return not line.startswith(("type ", "typeof ", "flags ", "timeout ", "comment ", "size ", "policy ", "elements = "))


def _loads(text: str, command: str) -> dict[str, Any]:
    """json.loads of a whole listing (25 MB at 10 000 services): 2.5x faster without the
    collections its million dicts and strings trigger. nft 1.0.6 prints invalid JSON for some
    tables (a dormant one, one with `flags owner` held by another process): the error names the
    listing, not only a line and column."""
    with gc_paused():
        try:
            return json.loads(text)  # type: ignore[no-any-return]
        except json.JSONDecodeError as exc:
            raise KernelError(f"`nft -j {command}` printed JSON that cannot be read ({exc}); "
                              "nft 1.0.6 does so for a dormant table or one another process owns") from None

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

from nfproxy.kernel import netns as netns_mod
from nfproxy.kernel.process import KernelError, run

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
        if use_bindings and _nftables is not None:
            if netns is None:
                self._ctx = _nftables.Nftables()
            else:
                with netns_mod.entered(netns):
                    self._ctx = _nftables.Nftables()
        else:
            log.warning("libnftables Python bindings unavailable: falling back to `nft -f -`")

    @property
    def uses_bindings(self) -> bool:
        return self._ctx is not None

    def _cmd(self, text: str, *, json_output: bool = False, terse: bool = False) -> str:
        if self._ctx is None:
            argv = ["nft", *(["-j"] if json_output else []), *(["-t"] if terse else []), "-f", "-"]
            return run(argv, netns=self.netns, stdin=text)
        self._ctx.set_json_output(json_output)
        self._ctx.set_terse_output(terse)
        rc, out, err = self._ctx.cmd(text)
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
        return json.loads(out)

    def object_names(self, family: str, table: str) -> tuple[set[str], set[str]] | None:
        """Names of the chains and of the sets/maps in one table, without rules or elements.

        A full sync needs them to find chains and sets left by services that vanished while
        nfproxy was not running; listing the whole table would also fetch every rule.
        """
        if self.list_table(family, table, terse=True) is None:
            return None
        chains = json.loads(self._cmd(f"list chains {family}", json_output=True))
        sets = json.loads(self._cmd(f"list sets {family}", json_output=True, terse=True))
        chain_names = {
            o["chain"]["name"] for o in chains.get("nftables", ()) if "chain" in o and o["chain"]["table"] == table
        }
        set_names = {
            body["name"]
            for o in sets.get("nftables", ())
            for kind in ("set", "map")
            if (body := o.get(kind)) is not None and body["table"] == table
        }
        return chain_names, set_names

    def counter_packets(self, family: str, table: str, name: str) -> int | None:
        """Packets of a named counter object, or None when it (or its table) does not exist."""
        try:
            out = self._cmd(f"list counter {family} {table} {name}", json_output=True)
        except KernelError as exc:
            if "No such file or directory" in str(exc):
                return None
            raise
        for item in json.loads(out).get("nftables", []):
            if "counter" in item:
                return int(item["counter"].get("packets", 0))
        return None

    def list_ruleset(self) -> dict[str, Any]:
        return json.loads(self._cmd("list ruleset", json_output=True))

    def list_text(self) -> str:
        return self._cmd("list ruleset")

    def delete_table(self, family: str, table: str) -> bool:
        """Delete a table if it exists; True when something was deleted."""
        if self.list_table(family, table) is None:
            return False
        self._cmd(f"delete table {family} {table}")
        return True

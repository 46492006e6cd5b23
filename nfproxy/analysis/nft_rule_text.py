"""An nft rule read back as JSON (`nft -j`, libnftables-json(5)), written as nft prints it.

The readers keep an nft rule's text as the JSON of its expressions (`Rule.text`): exact, and
cheap to keep for the 20 000 rules of a large node. `trace` shows the rules a packet went
through, and a person reads `ct state new jump firewall-check` faster than the JSON of it, so
the few rules a trace shows are written out here, when shown. Only what nft prints for the
rules nfproxy and kube-proxy write is spelled out; any other expression is shown as its JSON,
and a text that is not a JSON rule (iptables lines) is returned as it is. This module reads the
kernel's view; it does not import the renderers (the analysis never does).
"""

from __future__ import annotations

import json
from typing import Any

_BINOPS = ("&", "|", "^", "<<", ">>")
_VERDICTS = ("accept", "drop", "return", "continue", "queue")


def readable(text: str) -> str:
    """`text` as nft syntax when it is the JSON of a rule's expressions, else `text`."""
    if not text.startswith("["):
        return text
    try:
        exprs = json.loads(text)
        if not isinstance(exprs, list):
            return text
        return " ".join(_statement(e) for e in exprs)
    except (ValueError, TypeError, KeyError, AttributeError, IndexError, RecursionError):
        return text


def _raw(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def _one(obj: Any) -> tuple[str, Any] | None:
    """The single (key, value) of a one-key JSON object, or None."""
    if isinstance(obj, dict) and len(obj) == 1:
        return next(iter(obj.items()))
    return None


def _statement(e: Any) -> str:
    item = _one(e)
    if item is None:
        return _raw(e)
    kind, body = item
    if kind == "match":
        # nft leaves out `==` and `in`, but not after a bitwise operation (`meta mark & 0x4000 == 0`).
        masked = (_one(body["left"]) or ("",))[0] in _BINOPS
        left, right, op = _expr(body["left"]), _expr(body["right"], hexadecimal=masked), body["op"]
        if op in ("==", "in") and not masked:
            return f"{left} {right}"
        return f"{left} {op} {right}"
    if kind == "counter":
        return f'counter name "{body}"' if isinstance(body, str) else "counter"
    if kind == "reject":
        if not body:
            return "reject"
        how = " ".join(str(body[k]) for k in ("type", "expr") if k in body)
        return f"reject with {how}" if how else "reject"
    if kind == "vmap":
        return f"{_expr(body['key'])} vmap {_expr(body['data'])}"
    if kind in ("dnat", "snat"):
        return _nat(kind, body)
    if kind in ("masquerade", "redirect"):
        flags = (body or {}).get("flags") if isinstance(body, dict) else None
        if isinstance(flags, list):
            flags = ",".join(str(f) for f in flags)
        return f"{kind} {flags}" if flags else kind
    if kind == "mangle":
        return f"{_expr(body['key'])} set {_expr(body['value'])}"
    if kind == "set":
        return f"{body['op']} {body['set']} {{ {_expr(body['elem'])} }}"
    return _expr(e)  # verdicts (as in a verdict map's data), or the JSON of anything else


def _nat(kind: str, body: dict[str, Any]) -> str:
    family = f" {body['family']}" if "family" in body else ""
    addr = _expr(body["addr"]) if "addr" in body else ""
    if "port" in body:
        port = _expr(body["port"])
        addr = f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"
    out = f"{kind}{family} to {addr}"
    flags = body.get("flags")
    if flags:
        out += " " + (",".join(str(f) for f in flags) if isinstance(flags, list) else str(flags))
    return out


def _expr(v: Any, hexadecimal: bool = False) -> str:
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, int):
        return hex(v) if hexadecimal else str(v)
    if isinstance(v, str):
        return v
    if isinstance(v, list):
        return "{ " + ", ".join(_expr(x) for x in v) + " }"
    item = _one(v)
    if item is None:
        return _raw(v)
    kind, body = item
    if kind == "payload":
        if "protocol" in body:
            return f"{body['protocol']} {body['field']}"
        return f"@{body['base']},{body['offset']},{body['len']}"
    if kind == "meta":
        return f"meta {body['key']}"
    if kind == "ct":
        direction = f" {body['dir']}" if "dir" in body else ""
        return f"ct{direction} {body['key']}"
    if kind == "fib":
        flags = body.get("flags", [])
        flags = flags if isinstance(flags, list) else [flags]
        return f"fib {' . '.join(str(f) for f in flags)} {body['result']}"
    if kind == "concat":
        return " . ".join(_expr(x) for x in body)
    if kind == "prefix":
        return f"{_expr(body['addr'])}/{body['len']}"
    if kind == "range":
        return f"{_expr(body[0])}-{_expr(body[1])}"
    if kind == "set":
        items = body if isinstance(body, list) else [body]
        return "{ " + ", ".join(_element(x) for x in items) + " }"
    if kind == "elem":
        return _expr(body["val"])
    if kind == "map":
        return f"{_expr(body['key'])} map {_expr(body['data'])}"
    if kind == "numgen":
        offset = f" offset {body['offset']}" if body.get("offset") else ""
        return f"numgen {body['mode']} mod {body['mod']}{offset}"
    if kind in _BINOPS:
        left, right = body
        return f"{_expr(left)} {kind} {_expr(right, hexadecimal=True)}"
    if kind in ("jump", "goto"):
        return f"{kind} {body['target']}"
    if kind in _VERDICTS:
        return kind
    return _raw(v)


def _element(x: Any) -> str:
    """A member of an anonymous set, or a `key : value` pair of an anonymous map."""
    if isinstance(x, list) and len(x) == 2:
        return f"{_expr(x[0])} : {_expr(x[1])}"
    return _expr(x)

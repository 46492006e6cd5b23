"""Logs as kube-proxy writes them: klog text lines by default, JSON objects on request.

Operators grep kube-proxy's logs (`I1201 10:24:31.660123    1234 proxier.go:812] "Syncing
nftables rules" ipFamily="IPv4"`) and feed its JSON lines to collectors, and they turn detail up
with `--v=N`. So the daemon's lines have klog's shape, whatever module wrote them:

- text: `Lmmdd hh:mm:ss.uuuuuu PID file:line] "message" key="value" ...`, L one of I W E F, the
  message and string values quoted as Go's %q, numbers and booleans bare, multi-line values in
  klog's `key=<` block, so every line stays logfmt-clean (no repr quotes, no tracebacks);
- json: one object per line, component-base's shape: `ts` (seconds), `caller`, `msg`, `v`
  (absent on errors, which carry `err`), then the keys.

Verbosity is klog's: a line logged at V(n) shows when `--v` >= n. kube-proxy's habits, which
nfproxy follows: the per-family sync line at V(2), rule dumps at V(9), Python DEBUG lines count
as V(4). Warnings and errors always show.

Structured calls go through `info` / `warning` / `error` here; plain `logging` calls from any
module (and libraries) still come out in the same format, their text as the message.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import IO, Any, Literal

Format = Literal["text", "json"]
FORMATS: tuple[Format, ...] = ("text", "json")
# klog's V-level of a Python DEBUG record that did not say otherwise.
DEBUG_LEVEL = 4
V_ATTR = "klog_v"
KEYS_ATTR = "klog_keys"
MSG_ATTR = "klog_msg"

_verbosity = 0


@dataclass(frozen=True, slots=True)
class Duration:
    """Seconds that print as Go's time.Duration does (`1.5ms`, `2.25s`): what `elapsed` shows."""

    seconds: float

    def __str__(self) -> str:
        return go_duration(self.seconds)


def go_duration(seconds: float) -> str:
    """Go's Duration.String for a non-negative span: the unit is chosen by size, as Go does."""
    if seconds < 0:
        return "-" + go_duration(-seconds)
    ns = round(seconds * 1e9)
    if ns == 0:
        return "0s"
    for unit, size in (("ns", 1), ("µs", 1_000), ("ms", 1_000_000)):
        if ns < size * 1000:
            return _trim(ns / size) + unit
    total = ns / 1e9
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    out = f"{int(hours)}h" if hours else ""
    out += f"{int(minutes)}m" if hours or minutes else ""
    return out + _trim(secs) + "s"


def _trim(value: float) -> str:
    text = f"{value:.9f}".rstrip("0").rstrip(".")
    return text or "0"


def enabled(level: int) -> bool:
    """klog's V(level).Enabled(): build an expensive value (a rule dump) only when it shows."""
    return level <= _verbosity


def verbosity() -> int:
    return _verbosity


class _Line:
    """A structured call's text for formatters that know nothing of klog (pytest's, a user's
    basicConfig): `message key="value" ...`, built only if such a formatter asks."""

    __slots__ = ("msg", "keys")

    def __init__(self, msg: str, keys: Mapping[str, Any]) -> None:
        self.msg = msg
        self.keys = keys

    def __str__(self) -> str:
        return " ".join([self.msg, *(f"{k}={text_value(v)}" for k, v in self.keys.items())])


def _log(logger: logging.Logger, levelno: int, msg: str, v: int, keys: Mapping[str, Any]) -> None:
    if logger.isEnabledFor(levelno):
        keys = dict(keys)
        extra = {V_ATTR: v, KEYS_ATTR: keys, MSG_ATTR: msg}
        # stacklevel 3: the caller of info()/warning()/error(), as klog reports its caller.
        logger.log(levelno, "%s", _Line(msg, keys), extra=extra, stacklevel=3)


def info(logger: logging.Logger, msg: str, *, level: int = 0, **keys: Any) -> None:
    """klog's V(level).InfoS(msg, keys...)."""
    if level < 0:
        raise ValueError(f"verbosity level cannot be negative: {level}")
    _log(logger, logging.INFO, msg, level, keys)


def warning(logger: logging.Logger, msg: str, **keys: Any) -> None:
    _log(logger, logging.WARNING, msg, 0, keys)


def error(logger: logging.Logger, msg: str, err: BaseException | str | None = None, **keys: Any) -> None:
    """klog's ErrorS(err, msg, keys...): the error comes first, under `err`."""
    if err is not None:
        keys = {"err": err, **keys}
    _log(logger, logging.ERROR, msg, 0, keys)


# --------------------------------------------------------------------------------------------
# Rendering


def record_level(record: logging.LogRecord) -> int:
    """The V-level a record was logged at (plain DEBUG records count as V(4))."""
    v = getattr(record, V_ATTR, None)
    if v is not None:
        return int(v)
    return DEBUG_LEVEL if record.levelno < logging.INFO else 0


def message(record: logging.LogRecord) -> str:
    """The message alone: a structured call's `msg`, or a plain call's formatted text."""
    msg = getattr(record, MSG_ATTR, None)
    return msg if msg is not None else record.getMessage()


def _keys(record: logging.LogRecord) -> dict[str, Any]:
    keys = dict(getattr(record, KEYS_ATTR, None) or {})
    if record.exc_info and record.exc_info[1] is not None and "err" not in keys:
        keys["err"] = record.exc_info[1]
    return keys


def _severity(levelno: int) -> str:
    if levelno >= logging.CRITICAL:
        return "F"
    if levelno >= logging.ERROR:
        return "E"
    if levelno >= logging.WARNING:
        return "W"
    return "I"


def quote(text: str) -> str:
    """Go's %q for printable text: double quotes, backslash escapes, control characters escaped."""
    return json.dumps(text, ensure_ascii=False)


def _error_text(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def text_value(value: Any) -> str:
    """One value as klog's text format writes it: logfmt-clean, never a Python repr."""
    if value is None:
        return "<nil>"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return _float_text(value)
    if isinstance(value, BaseException):
        value = _error_text(value)
    text = str(value)
    if "\n" in text:
        # klog: a multi-line string becomes an indented block, so each line stays greppable.
        body = "".join(f"\t{line}\n" for line in text.rstrip("\n").split("\n"))
        return f"<\n{body} >"
    return quote(text)


def _float_text(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(value) if value != int(value) else str(int(value))


def json_value(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, BaseException):
        return _error_text(value)
    if isinstance(value, (list, tuple)):
        return [json_value(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): json_value(v) for k, v in value.items()}
    return str(value)


class KlogFormatter(logging.Formatter):
    """`Lmmdd hh:mm:ss.uuuuuu PID file:line] "message" key="value" ...`"""

    def format(self, record: logging.LogRecord) -> str:
        t = datetime.datetime.fromtimestamp(record.created)
        head = (
            f"{_severity(record.levelno)}{t:%m%d %H:%M:%S}.{t.microsecond:06d} "
            f"{record.process or os.getpid():>7} {record.filename}:{record.lineno}]"
        )
        parts = [head, quote(message(record))]
        parts.extend(f"{key}={text_value(value)}" for key, value in _keys(record).items())
        return " ".join(parts)


class JsonFormatter(logging.Formatter):
    """kube-proxy's `--logging-format=json`: one object per line."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": round(record.created, 6),
            "caller": f"{record.filename}:{record.lineno}",
            "msg": message(record),
        }
        if record.levelno < logging.ERROR:
            doc["v"] = record_level(record)
        for key, value in _keys(record).items():
            doc.setdefault(key, json_value(value))
        return json.dumps(doc, ensure_ascii=False, separators=(",", ":"))


class VerbosityFilter(logging.Filter):
    """Lets a record through when its V-level is at most --v; warnings and errors always."""

    def __init__(self, verbosity: int) -> None:
        super().__init__()
        self.verbosity = verbosity

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or record_level(record) <= self.verbosity


class _Handler(logging.StreamHandler):  # type: ignore[type-arg]
    """Ours, so that configuring again replaces it and leaves other handlers (pytest's) alone."""


def configure(verbosity: int, fmt: str, stream: IO[str] | None = None) -> logging.Handler:
    """Send every log line to stderr (or `stream`) in `fmt` at klog verbosity `verbosity`.

    Called once by the command line (`--v`, `--logging-format`); calling it again replaces the
    previous setup. Returns the handler (tests read what it writes).
    """
    global _verbosity
    if isinstance(verbosity, bool) or not isinstance(verbosity, int) or verbosity < 0:
        raise ValueError(f"--v: {verbosity!r}: verbosity must be a whole number >= 0")
    if fmt not in FORMATS:
        raise ValueError(f"--logging-format: {fmt!r}: choose one of {', '.join(FORMATS)}")
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _Handler)]:
        root.removeHandler(old)
        old.close()
    handler = _Handler(stream if stream is not None else sys.stderr)
    handler.setFormatter(KlogFormatter() if fmt == "text" else JsonFormatter())
    handler.addFilter(VerbosityFilter(verbosity))
    root.addHandler(handler)
    # Python DEBUG records are V(4): below that, libraries need not even build them.
    root.setLevel(logging.DEBUG if verbosity >= DEBUG_LEVEL else logging.INFO)
    _verbosity = verbosity
    return handler

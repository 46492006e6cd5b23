"""argparse value types for kube-proxy's flag syntax (Go's pflag), so its command lines parse.

Numbers are read from ASCII decimal digits only: Python's `int()` also takes `1_0`, `+80`,
surrounding spaces and any Unicode decimal digit (`٨٠`), none of which kube-proxy's flags take,
and a value read one way here and another way by whatever reads it back (the file written by
`--write-config-to`, a log line) is a bug waiting. Lengths are bounded before `int()` sees the
text, so a 100 000-digit value is a clear error rather than a ValueError from deep inside.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable

_TRUE = {"1", "t", "T", "TRUE", "true", "True"}
_FALSE = {"0", "f", "F", "FALSE", "false", "False"}

# kube-proxy's int32 configuration fields (conntrack.maxPerCore, conntrack.min, logging.verbosity).
INT32_MAX = 2**31 - 1
# Longest rendering of a user's value quoted in an error or warning: enough to recognise it, not
# enough for a 100 KB value to flood the log.
DISPLAY_LIMIT = 60
_DECIMAL = re.compile(r"-?[0-9]+")
# More significant digits than any int64 has: such a value is only ever out of range, and is
# not given to int() (which refuses beyond 4300 digits, and is slow well before).
_MAX_DIGITS = 19


def display(value: object, limit: int = DISPLAY_LIMIT) -> str:
    """A one-line, bounded rendering of a user's value for messages: strings always quoted and
    escaped (a newline cannot forge a log line) and cut at `limit`; everything else as the
    manifest errors show it (`sources.validation.show`: containers named, never printed, so a
    value nested a thousand deep costs nothing; integers past 4 300 digits by their size)."""
    from nfproxy.sources.validation import show

    if value is None:
        return "null"
    if not isinstance(value, str):
        return show(value)
    text = repr(value[: limit + 1])
    return text if len(text) <= limit else text[: limit - 3] + "..."


def decimal(text: str) -> int | None:
    """An integer written with an optional `-` and ASCII digits only, else None.

    A value of more than 19 significant digits comes back as ±10**19: out of every range a
    caller checks, so it is refused as too large rather than as not a number.
    """
    if _DECIMAL.fullmatch(text) is None:
        return None
    negative = text.startswith("-")
    digits = text.lstrip("-").lstrip("0")
    if len(digits) > _MAX_DIGITS:
        return -(10**_MAX_DIGITS) if negative else 10**_MAX_DIGITS
    return -int(digits or "0") if negative else int(digits or "0")


def integer_in(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: a decimal integer from `low` to `high`, as the file's field takes it."""

    def parse(text: str) -> int:
        value = decimal(text)
        if value is None:
            raise argparse.ArgumentTypeError(f"{display(text)} is not a decimal integer")
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{display(text)}: must be from {low} to {high}")
        return value

    return parse


def go_bool(text: str) -> bool:
    """Go's strconv.ParseBool, as pflag reads `--flag=false`."""
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise argparse.ArgumentTypeError(f"{display(text)} is not a boolean (true or false)")


def verbosity(text: str) -> int:
    """klog's -v / --v: a level from 0 to kube-proxy's int32 maximum (logging.verbosity)."""
    value = text.removeprefix("=")
    number = decimal(value)
    if number is None or number < 0:
        raise argparse.ArgumentTypeError(f"{display(text)} is not a verbosity level (0, 1, 2, ...)")
    if number > INT32_MAX:
        raise argparse.ArgumentTypeError(f"{display(text)}: must be from 0 to {INT32_MAX}")
    return number


def add_go_bool_switch(parser: argparse.ArgumentParser | argparse._ArgumentGroup, name: str, *,
                       dest: str, help: str) -> None:  # noqa: A002 - argparse's own keyword
    """A boolean flag as pflag has it: `--name` alone is true, `--name=VALUE` is go_bool's VALUE,
    and the next argument is never taken as the value.

    `nargs="?"` would read `--masquerade-all manifests/` as a boolean: each `--name=VALUE`
    spelling is a hidden option of its own instead (argparse matches a whole option string
    before it splits at `=`), so positional arguments after the flag stay positional.
    """
    parser.add_argument(name, dest=dest, action="store_true", default=False, help=help)
    parser.add_argument(*(f"{name}={v}" for v in sorted(_TRUE)), dest=dest, action="store_true",
                        default=False, help=argparse.SUPPRESS)
    parser.add_argument(*(f"{name}={v}" for v in sorted(_FALSE)), dest=dest, action="store_false",
                        default=False, help=argparse.SUPPRESS)

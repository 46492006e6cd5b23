"""Go's `time.ParseDuration` and `Duration.String`, the duration syntax of kube-proxy's flags.

Why not a library: durationpy (already installed with `kubernetes`) also accepts units Go does
not (`d`, `w`, `y`), gaps between terms (`1h 1m`) and sums in floating point, so `0.1s` + `0.2s`
could be off by a nanosecond; kube-proxy users' values must mean exactly what they mean there.
"""

from __future__ import annotations

import re
from fractions import Fraction

NANOSECONDS = {
    "ns": 1,
    "us": 1_000,
    "µs": 1_000,  # U+00B5 micro sign
    "μs": 1_000,  # U+03BC Greek mu
    "ms": 1_000_000,
    "s": 1_000_000_000,
    "m": 60 * 1_000_000_000,
    "h": 3600 * 1_000_000_000,
}
_MAX = (1 << 63) - 1
# ASCII digits only: `\d` would take any Unicode digit (`٣s`), which Go refuses.
_TERM = re.compile(r"([0-9]*)(?:\.([0-9]*))?([^0-9.]*)")
# Go keeps at most this many digits of a fraction (the rest cannot change a nanosecond count)
# and refuses a whole part that overflows int64; both bound what int() is given.
_MAX_DIGITS = 19


class DurationError(ValueError):
    """Not a Go duration; the message says why, as Go's error does."""


def parse(text: str) -> int:
    """Nanoseconds, as Go's time.ParseDuration (`[-+]?([0-9]*(\\.[0-9]*)?[a-z]+)+`, or `0`)."""
    rest, sign = text, 1
    if rest[:1] in ("-", "+"):
        sign = -1 if rest[0] == "-" else 1
        rest = rest[1:]
    if rest == "0":
        return 0
    if not rest:
        raise DurationError(f'invalid duration "{_short(text)}"')
    total = Fraction(0)
    while rest:
        m = _TERM.match(rest)
        assert m is not None  # the pattern matches the empty string
        whole, frac, unit = m.group(1), m.group(2), m.group(3)
        if not whole and not frac:
            raise DurationError(f'invalid duration "{_short(text)}"')
        if not unit:
            raise DurationError(f'missing unit in duration "{_short(text)}"')
        size = NANOSECONDS.get(unit)
        if size is None:
            raise DurationError(f'unknown unit "{_short(unit)}" in duration "{_short(text)}"')
        whole = whole.lstrip("0")
        if len(whole) > _MAX_DIGITS:
            raise DurationError(f'invalid duration "{_short(text)}"')
        frac = (frac or "")[:_MAX_DIGITS]
        value = Fraction(int(whole or "0"))
        if frac:
            value += Fraction(int(frac), 10 ** len(frac))
        total += value * size
        if total > _MAX + (1 if sign < 0 else 0):
            raise DurationError(f'invalid duration "{_short(text)}"')
        rest = rest[m.end():]
    # Go truncates the fractional nanoseconds of each term; summing exactly then truncating
    # differs only below one nanosecond.
    return sign * int(total)


def _short(text: str, limit: int = 60) -> str:
    """The value as quoted in an error, as Go quotes it: escaped (a newline cannot start a forged
    log line) and cut, so a 100 KB flag does not become a 100 KB line."""
    cut = text if len(text) <= limit else text[: limit - 3] + "..."
    return "".join(c if c.isprintable() and c not in '"\\' else repr(c)[1:-1] if c != '"' else '\\"'
                   for c in cut)


def format(nanoseconds: int) -> str:  # noqa: A001 - Go's name, used as duration.format
    """Go's Duration.String: `30s`, `1m0s`, `24h0m0s`, `1.5s`, `300ms`, `0s`."""
    if nanoseconds == 0:
        return "0s"
    sign = "-" if nanoseconds < 0 else ""
    n = abs(nanoseconds)
    if n < 1_000_000_000:
        for unit, size in (("ms", 1_000_000), ("µs", 1_000), ("ns", 1)):
            if n >= size:
                return sign + _decimal(n, size) + unit
    hours, n = divmod(n, NANOSECONDS["h"])
    minutes, n = divmod(n, NANOSECONDS["m"])
    seconds = _decimal(n, NANOSECONDS["s"]) + "s"
    if hours:
        return f"{sign}{hours}h{minutes}m{seconds}"
    if minutes:
        return f"{sign}{minutes}m{seconds}"
    return sign + seconds


def _decimal(n: int, size: int) -> str:
    whole, frac = divmod(n, size)
    if not frac:
        return str(whole)
    digits = len(str(size)) - 1
    return f"{whole}.{frac:0{digits}d}".rstrip("0")

"""The error every layer raises for a bad flag value.

It lives in core, below everything, because flags are validated where their meaning is known:
the daemon parses its own bind addresses (`--healthz-bind-address`), the cli the rest, and the
cli turns any of them into one `nfproxy: error: --flag: ...` line with exit status 2.
"""

from __future__ import annotations


class FlagError(ValueError):
    """A flag value is invalid; the message names the flag and the value."""

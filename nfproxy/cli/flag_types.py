"""argparse value types for kube-proxy's flag syntax (Go's pflag), so its command lines parse."""

from __future__ import annotations

import argparse

_TRUE = {"1", "t", "T", "TRUE", "true", "True"}
_FALSE = {"0", "f", "F", "FALSE", "false", "False"}


def go_bool(text: str) -> bool:
    """Go's strconv.ParseBool, as pflag reads `--flag=false`."""
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not a boolean (true or false)")


def verbosity(text: str) -> int:
    """klog's -v / --v: a level from 0."""
    value = text.removeprefix("=")
    if not value.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a verbosity level (0, 1, 2, ...)")
    return int(value)

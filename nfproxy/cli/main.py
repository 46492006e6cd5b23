"""The `nfproxy` command line."""

from __future__ import annotations

import argparse
import importlib
import logging
import pkgutil
import signal
import sys
from collections.abc import Sequence

from nfproxy.cli import commands
from nfproxy.cli.config import FlagError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nfproxy",
        description="Kubernetes service proxy: nftables and kube-proxy-compatible iptables backends.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        importlib.import_module(f"{commands.__name__}.{info.name}").register(sub)
    return parser


def _default_to_run(argv: list[str]) -> list[str]:
    """`nfproxy --backend nft …` is the daemon, as `kube-proxy --proxy-mode …` is."""
    for i, arg in enumerate(argv):
        if arg in ("-v", "--verbose"):
            continue
        if arg.startswith("-") and arg not in ("-h", "--help"):
            return argv[:i] + ["run"] + argv[i:]
        break
    return argv


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(_default_to_run(list(sys.argv[1:] if argv is None else argv)))
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else (logging.INFO if args.command == "run" else logging.WARNING),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from nfproxy.kernel.process import KernelError
    from nfproxy.sources.manifests import ManifestError

    try:
        return int(args.func(args))
    except FlagError as exc:
        parser.error(str(exc))
    except ManifestError as exc:
        print(f"nfproxy: {exc}", file=sys.stderr)
        return 2  # bad input from the user, as a bad flag
    except KernelError as exc:
        print(f"nfproxy: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:
        # netns.Interrupted (SIGTERM, SIGHUP) carries its signal; the namespaces are gone by now.
        signum = getattr(exc, "signum", 2)
        print(f"nfproxy: interrupted ({signal.Signals(signum).name})", file=sys.stderr)
        return 128 + signum
    return 0


if __name__ == "__main__":
    sys.exit(main())

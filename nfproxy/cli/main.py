"""The `nfproxy` command line."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import pkgutil
import signal
import sys
from collections.abc import Sequence

from nfproxy.cli import commands
from nfproxy.cli.config import FlagError
from nfproxy.cli.flag_types import verbosity

log = logging.getLogger("nfproxy")

# Options of the top-level parser; the values of those that take one are skipped over when
# looking for the first flag of `nfproxy --proxy-mode …` (the daemon, with `run` implied).
_TOP_LEVEL = {"-v": True, "--v": True, "--verbose": False, "--logging-format": True}


def version() -> str:
    from importlib import metadata

    try:
        return metadata.version("nfproxy")
    except metadata.PackageNotFoundError:  # a source tree that was never installed
        return "unknown"


class _Version(argparse.Action):
    """`--version`, reading the installed package's metadata only when asked: importlib.metadata
    costs ~40 ms of every command's start otherwise."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="show the version and exit")

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        print(f"nfproxy {version()}")
        parser.exit()


def _add_logging_flags(parser: argparse.ArgumentParser, suppress: bool) -> None:
    """-v/--v and --logging-format, before or after the subcommand, as kube-proxy takes them.

    A subcommand's copies default to SUPPRESS: argparse copies a subparser's defaults over the
    values the top-level parser already parsed, which would undo `nfproxy --v=2 run`.
    """
    def default(value: object) -> object:
        return argparse.SUPPRESS if suppress else value

    g = parser.add_argument_group("logging")
    g.add_argument("-v", "--v", dest="verbosity", type=verbosity, default=default(0), metavar="N",
                   help="log verbosity, as klog's: 2 logs every sync, 4 debug (default 0)")
    g.add_argument("--verbose", dest="verbosity", action="store_const", const=4, default=default(0),
                   help="the same as --v=4")
    g.add_argument("--logging-format", choices=("text", "json"), default=default("text"),
                   help="text (klog lines) or json, one object per line (default text)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nfproxy",
        description="Kubernetes service proxy: nftables and kube-proxy-compatible iptables backends.",
    )
    parser.add_argument("--version", action=_Version)
    _add_logging_flags(parser, suppress=False)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        importlib.import_module(f"{commands.__name__}.{info.name}").register(sub)
    for name, subparser in sub.choices.items():
        _add_logging_flags(subparser, suppress=True)
        if name == "run":
            subparser.add_argument("--version", action=_Version)
            from nfproxy.cli.warned_flags import add_kube_proxy_flags

            add_kube_proxy_flags(subparser)
    return parser


def _default_to_run(argv: list[str]) -> list[str]:
    """`nfproxy --proxy-mode nftables …` is the daemon, as `kube-proxy --proxy-mode …` is."""
    i = 0
    while i < len(argv):
        arg = argv[i]
        name = arg.split("=", 1)[0]
        if name in _TOP_LEVEL:
            i += 2 if _TOP_LEVEL[name] and "=" not in arg and len(arg) == len(name) else 1
            continue
        if arg.startswith("-v") and len(arg) > 2 and not arg.startswith("--"):  # -v2
            i += 1
            continue
        if arg.startswith("-") and arg not in ("-h", "--help", "--version"):
            return argv[:i] + ["run"] + argv[i:]
        return argv
    # Only logging flags (`nfproxy --v=2`): the daemon too, as `kube-proxy --v=2` is.
    return argv + ["run"] if argv else argv


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser | None:
    for action in parser._actions:  # noqa: SLF001 - argparse keeps subparsers only here
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            return action.choices.get(name)
    return None


def _given_on_command_line(argv: list[str]) -> dict[str, object]:
    """The dests the command line sets itself: parsed with every default suppressed."""
    parser = build_parser()
    for p in (parser, _subparser(parser, "run")):
        assert p is not None
        for action in p._actions:  # noqa: SLF001
            if not isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
                action.default = argparse.SUPPRESS
    return vars(parser.parse_args(argv))


# kube-proxy's flags whose blank value means the default (validation.go accepts "" for the mode
# and the local-traffic mode); argparse's choices would refuse "", so a blank one is dropped.
_BLANK_IS_DEFAULT = ("--proxy-mode", "--detect-local-mode")


def _blank_means_default(argv: list[str]) -> list[str]:
    """`--proxy-mode=""` / `--detect-local-mode ""` as if not given, as in kube-proxy."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            return out + argv[i:]
        if arg in _BLANK_IS_DEFAULT and i + 1 < len(argv) and argv[i + 1] == "":
            i += 2
            continue
        if arg.endswith("=") and arg[:-1] in _BLANK_IS_DEFAULT:
            i += 1
            continue
        out.append(arg)
        i += 1
    return out


def _options_given(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """The long options of `parser` that argv names, in order, by their full names (an argparse
    abbreviation resolved; `--flag=value` by `--flag`): two flags may share a dest (--proxy-mode
    and nfproxy's --backend), and only kube-proxy's is replaced by a configuration file."""
    names = [o for o in parser._option_string_actions if o.startswith("--")]  # noqa: SLF001
    given: list[str] = []
    for arg in argv:
        if arg == "--":
            break
        if not arg.startswith("--"):
            continue
        name = arg.split("=", 1)[0]
        matches = [name] if name in names else [o for o in names if o.startswith(name) and "=" not in o]
        if len(matches) == 1 and matches[0] not in given:
            given.append(matches[0])
    return given


def parse(argv: list[str]) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """Parse, with `--config FILE` (kube-proxy's KubeProxyConfiguration) as kube-proxy takes it.

    The file sets the defaults of the dests the command line does not set, so a flag always
    wins over the file and a flag's default never does (kube-proxy would ignore most flags:
    `_apply_config` says which). Raises ConfigFileError, and FlagError for a flag kube-proxy's
    Complete step refuses.
    """
    argv = _blank_means_default(_default_to_run(argv))
    parser = build_parser()
    given = _given_on_command_line(argv)
    run_parser = _subparser(parser, "run")
    assert run_parser is not None
    options = _options_given(argv, run_parser) if given.get("command") == "run" else []
    file_mode = _apply_config(parser, run_parser, given, options) if given.get("config") else False
    args = parser.parse_args(argv)
    if args.command == "run":
        # Neither a flag nor the file chose: kube-proxy 1.37 warns (KEP-5343; run.py says it).
        args.mode_defaulted = "backend" not in given and not file_mode
        _complete_run(args, options)
    return parser, args


def _apply_config(parser: argparse.ArgumentParser, run_parser: argparse.ArgumentParser,
                  given: dict[str, object], options: list[str]) -> bool:
    """Set the file's values as the parsers' defaults: a flag given wins over the file. True
    when the file names the proxy mode (a blank `mode:` does not).

    kube-proxy drops what its own flags set once a file is given (Options.Complete); nfproxy
    keeps them, as KEP-2157 asks and as its DaemonSet relies on (`--proxy-mode=nftables` over
    kubeadm's ConfigMap, the canary's own ports), and says which ones kube-proxy would ignore."""
    from nfproxy.cli import kubeproxy_config
    from nfproxy.cli.complete import IGNORED_WITH_CONFIG

    loaded = kubeproxy_config.load(str(given["config"]), given)
    top_dests = {a.dest for a in parser._actions}  # noqa: SLF001
    values = {d: v for d, v in loaded.defaults.items() if d not in given}
    if "manifests" in given:
        # A source on the command line replaces the file's (kubeadm's names the kubeconfig).
        values.pop("kubeconfig", None)
    warnings = loaded.warnings
    if overriding := [o for o in options if o in IGNORED_WITH_CONFIG]:
        warnings += (f"--config {given['config']}: {', '.join(overriding)} win over the file here; "
                     "kube-proxy would ignore them with --config",)
    parser.set_defaults(**{d: v for d, v in values.items() if d in top_dests})
    run_parser.set_defaults(config_warnings=warnings, **{d: v for d, v in values.items() if d not in top_dests})
    return "backend" in loaded.defaults


def _complete_run(args: argparse.Namespace, options: list[str]) -> None:
    """The daemon's flags after parsing, as kube-proxy's Options.Complete leaves them."""
    from nfproxy.cli import complete, warned_flags

    if "--hostname-override" in options and args.node_name is not None:
        args.node_name = complete.hostname_override(args.node_name)
    complete.complete_addresses(args)
    warned_flags.apply_warned_flags(args, options)
    complete.check_sync_periods(args)


def _configure_logging(args: argparse.Namespace) -> None:
    """klog lines (or JSON) on stderr; commands other than the daemon say only what went wrong
    unless --v asks for more."""
    from nfproxy.daemon import logs

    level = getattr(args, "verbosity", 0)
    try:
        logs.configure(level, getattr(args, "logging_format", "text"))
    except ValueError as exc:
        raise FlagError(str(exc)) from None
    if args.command != "run" and not level:
        logging.getLogger().setLevel(logging.WARNING)


# What a command's exception means: exit 2 for bad input from the user (as a bad flag), 1 for
# a kernel or socket failure. Named by module so that `main` imports none of them: a command
# can only raise one of these after importing its module, and a small command such as `trace
# --from-file` must not pay for importing the daemon's servers or the YAML loader (issue K.6).
_EXIT_STATUS: tuple[tuple[str, str, int], ...] = (
    ("nfproxy.cli.kubeproxy_config", "ConfigFileError", 2),
    ("nfproxy.sources.manifests", "ManifestError", 2),
    ("nfproxy.kernel.process", "KernelError", 1),
    ("nfproxy.daemon.server", "BindError", 1),
)


def _exit_status(exc: BaseException) -> int | None:
    for module, name, status in _EXIT_STATUS:
        loaded = sys.modules.get(module)
        if loaded is not None and isinstance(exc, getattr(loaded, name)):
            return status
    return None


def main(argv: Sequence[str] | None = None) -> int:
    try:
        parser, args = parse(list(sys.argv[1:] if argv is None else argv))
    except FlagError as exc:
        build_parser().error(str(exc))
    except Exception as exc:  # noqa: BLE001 - re-raised unless it is a bad config file
        if _exit_status(exc) != 2:
            raise
        print(f"nfproxy: {exc}", file=sys.stderr)
        return 2
    try:
        _configure_logging(args)
    except FlagError as exc:
        parser.error(str(exc))
    for warning in getattr(args, "config_warnings", ()):
        log.warning("%s", warning)
    try:
        return int(args.func(args))
    except FlagError as exc:
        parser.error(str(exc))
    except BrokenPipeError:
        # The reader went away (`nfproxy check | head`): stop writing, as `cat` would, and send
        # whatever is still buffered nowhere rather than into a second BrokenPipeError at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except KeyboardInterrupt as exc:
        # netns.Interrupted (SIGTERM, SIGHUP) carries its signal; the namespaces are gone by now.
        signum = getattr(exc, "signum", 2)
        print(f"nfproxy: interrupted ({signal.Signals(signum).name})", file=sys.stderr)
        return 128 + signum
    except Exception as exc:  # noqa: BLE001 - re-raised unless it is a user or kernel error
        if (status := _exit_status(exc)) is None:
            raise
        print(f"nfproxy: {exc}", file=sys.stderr)
        return status
    return 0


if __name__ == "__main__":  # `nfproxy` and `python -m nfproxy` go through cli/exit.py's entry
    raise SystemExit(main())

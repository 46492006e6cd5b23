"""`nfproxy compare --against-netns [NS] | --against-file DUMP`: nfproxy beside another proxy.

The cluster comes from MANIFESTS or, with `--kubeconfig`, from the live API; the other proxy's
rules from a namespace (read-only; the node's own when NS is left out) or a dump. Exit 0 when
every probe is equal, 1 when one differs (each named), 2 for bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from nfproxy.analysis.quantize import JSON_EXACT_DIGITS, exact_text
from nfproxy.cli.commands import NothingToShow, load_manifests
from nfproxy.core.model import ClusterState

API_WAIT = 60.0


def _state(args: argparse.Namespace) -> ClusterState:
    if args.manifests:
        return load_manifests(args, nothing_to="compare")
    from nfproxy.cli.kube_flags import source_from_args

    source = source_from_args(args)
    source.start(lambda: None)
    try:
        if not source.wait_ready(API_WAIT):
            raise NothingToShow(f"the API server did not list everything within {API_WAIT:g}s")
        return source.snapshot().state
    finally:
        source.stop()


def _theirs(args: argparse.Namespace) -> Any:
    """The other proxy's rules: a `dump.Source` (ruleset, backend, description)."""
    from nfproxy.analysis import dump

    if args.against_file:
        return dump.read_file(args.against_file)
    netns = args.against_netns or None
    backend = args.backend or _live_mode(netns)
    theirs = dump.read_live(backend, netns)
    if backend == "nft" and not {t.name for t in theirs.ruleset.tables} - dump.IPTABLES_TABLES:
        raise dump.DumpError(f"{theirs.description}: no nftables proxy table (kube-proxy's is "
                             "`kube-proxy`), only iptables-nft's: give --proxy-mode iptables")
    return theirs


def _live_mode(netns: str | None) -> str:
    """kube-proxy's nftables mode keeps a table named kube-proxy; otherwise its iptables chains."""
    from nfproxy.analysis.dump import read_nft

    tables = {t.name for t in read_nft(netns).tables}
    return "nft" if "kube-proxy" in tables else "iptables"


def run(args: argparse.Namespace) -> int:
    from nfproxy.analysis.dump import DumpError
    from nfproxy.analysis.interpret import InterpretError
    from nfproxy.kernel.process import KernelError
    from nfproxy.verify.against import against
    from nfproxy.verify.compare import WORK_LIMIT, TooMuchWork

    if not args.manifests and not getattr(args, "kubeconfig", None):
        print("nfproxy: error: compare --against-*: give MANIFESTS or --kubeconfig (the cluster to render)",
              file=sys.stderr)
        return 2
    try:
        theirs = _theirs(args)
        if args.backend and theirs.backend != args.backend:
            raise DumpError(f"{theirs.description}: {theirs.backend} rules, not {args.backend} (--proxy-mode)")
        state = _state(args)
        result = against(state, theirs.ruleset, theirs.backend, theirs.description,
                         WORK_LIMIT if args.work_limit is None else args.work_limit)
    except (NothingToShow, DumpError, KernelError, TooMuchWork, InterpretError) as exc:
        print(f"nfproxy: error: {exc}", file=sys.stderr)
        return 2
    (_json if args.json else _text)(result)
    return 0 if result.equal else 1


def _dist(d: dict[Any, Any]) -> dict[str, str]:
    return {str(k): exact_text(v, JSON_EXACT_DIGITS) for k, v in d.items()}


def _json(result: Any) -> None:
    json.dump({
        "equal": result.equal,
        "backend": result.backend,
        "against": result.description,
        "probes": len(result.matches),
        "differences": [
            {"service": m.probe.service, "traffic": m.probe.traffic,
             "packet": {"src": m.probe.src, "dst": m.probe.dst, "port": m.probe.port, "proto": m.probe.proto},
             "why": m.why, "nfproxy": _dist(m.ours.kernel), "theirs": _dist(m.theirs.kernel)}
            for m in result.differences
        ],
    }, sys.stdout, indent=2)
    print()


def _text(result: Any) -> None:
    print(f"nfproxy ({result.backend}) against {result.description}: {len(result.matches)} probes")
    for m in result.differences:
        print(f"  DIFF {m.probe.service}: {m.probe.traffic} ({m.probe.src} -> {m.probe.dst}:{m.probe.port}/{m.probe.proto})")
        print(f"       {m.why}")
        for o in sorted(set(m.ours.kernel) | set(m.theirs.kernel), key=str):
            print(f"         {str(o):<44} nfproxy {float(m.ours.kernel.get(o, 0)):.12f}"
                  f"  theirs {float(m.theirs.kernel.get(o, 0)):.12f}")
    print("EQUAL" if result.equal else f"NOT EQUAL: {len(result.differences)} probe(s) differ")


def add_flags(p: argparse.ArgumentParser) -> None:
    from nfproxy.cli.commands import add_backend_flag
    from nfproxy.cli.kube_flags import add_kube_flags

    g = p.add_argument_group("against another proxy (kube-proxy)")
    where = g.add_mutually_exclusive_group()
    where.add_argument("--against-netns", nargs="?", const="", default=None, metavar="NS",
                       help="compare with the rules live in network namespace NS (read-only; "
                            "without NS: this node's own namespace)")
    where.add_argument("--against-file", metavar="DUMP",
                       help="compare with a dump: iptables-save output or nft -j list ruleset")
    add_backend_flag(g, choices=("iptables", "nft"), default=None,  # type: ignore[arg-type]
                     help="the other proxy's mode (default: found from its rules)")
    add_kube_flags(g)

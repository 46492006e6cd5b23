"""`nfproxy compare`: prove both backends treat every service and traffic class alike (no root)."""

from __future__ import annotations

import argparse
import json
import sys
from fractions import Fraction

from nfproxy.cli import against as compare_against
from nfproxy.cli.commands import NothingToShow, load_manifests
from nfproxy.cli.config import add_node_flags
from nfproxy.cli.exit import hold


def _dist(d: dict) -> dict[str, str]:
    """Outcome -> probability: the exact "p/q" while short, else the value rounded to 20
    significant digits (a decimal point marks it; docs/semantics.md, "Long fractions")."""
    from nfproxy.analysis.quantize import JSON_EXACT_DIGITS, exact_text

    return {str(k): exact_text(v, JSON_EXACT_DIGITS) for k, v in d.items()}


def _work_limit(text: str) -> int:
    """A count of rule evaluations: a bad one is the flag's error (exit 2), not a traceback."""
    if not (text.isascii() and text.isdigit()) or len(text) > 18:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number from 0 to 10^18 (0: no limit)")
    return int(text)


def run(args: argparse.Namespace) -> int:
    if args.against_netns is not None or args.against_file:
        return compare_against.run(args)
    if args.manifests is None:
        print("nfproxy: error: compare: MANIFESTS is required (or --against-* with --kubeconfig)", file=sys.stderr)
        return 2
    from nfproxy.analysis.interpret import InterpretError
    from nfproxy.verify.compare import WORK_LIMIT, TooMuchWork, compare

    try:
        state = load_manifests(args, nothing_to="compare")
    except NothingToShow as exc:  # an empty ruleset is trivially "EQUIVALENT" to another
        print(f"nfproxy: error: {exc}", file=sys.stderr)
        return 2
    try:
        result = compare(state, WORK_LIMIT if args.work_limit is None else args.work_limit)
    except TooMuchWork as exc:  # refused before rendering: a run that would not end in time
        print(f"nfproxy: error: {args.manifests}: nothing compared: {exc}", file=sys.stderr)
        return 2
    except InterpretError as exc:  # a rendering the interpreter cannot read: name the rule
        print(f"nfproxy: error: {args.manifests}: rendered rules: {exc}", file=sys.stderr)
        return 2
    if args.json:
        json.dump(
            {
                "equivalent": result.equivalent,
                "max_difference": float(result.max_difference),
                "total_variation": float(result.total_variation),
                "iptables_kernel_deviation": float(result.iptables_deviation),
                "nft_kernel_deviation": float(result.nft_deviation),
                "ideal_exact": result.ideal_exact,
                "ideal_inexact_services": result.ideal_inexact_services,
                "probes": [
                    {
                        "service": r.probe.service,
                        "traffic": r.probe.traffic,
                        "packet": {"src": r.probe.src, "dst": r.probe.dst, "port": r.probe.port,
                                   "proto": r.probe.proto, "origin": r.probe.origin},
                        "iptables": _dist(r.iptables),
                        "nft": _dist(r.nft),
                        "max_difference": float(r.max_difference),
                        "total_variation": float(r.total_variation),
                        "ideal_max_difference": float(r.ideal_max_difference),
                        "ideal_exact": r.ideal_exact,
                        "equivalent": r.equivalent,
                        "documented_difference": r.probe.nft_only or None,
                    }
                    for r in result.results
                ],
            },
            sys.stdout,
            indent=2,
        )
        print()
    else:
        service = None
        for r in result.results:
            if r.probe.service != service:
                service = r.probe.service
                print(service if r.ideal_exact else f"{service}  (ideal mode: within 1e-9, not exact; see below)")
            mark = ("doc " if r.documented else "ok  ") if r.equivalent else "DIFF"
            print(f"  {mark} {r.probe.traffic} ({r.probe.src} -> {r.probe.dst}:{r.probe.port})")
            for o in sorted(set(r.iptables) | set(r.nft)):
                a, b = r.iptables.get(o, Fraction(0)), r.nft.get(o, Fraction(0))
                print(f"         {str(o):<40} iptables {float(a):.12f}  nft {float(b):.12f}")
        print(f"{len(result.results)} probes; largest difference (kernel mode) {float(result.max_difference):.3e}, "
              f"largest total-variation distance {float(result.total_variation):.3e}")
        print(f"kernel arithmetic against the rules as written: iptables (31-bit thresholds) {float(result.iptables_deviation):.3e}, "
              f"nft (numgen buckets) {float(result.nft_deviation):.3e}")
        documented = sum(1 for r in result.results if r.documented)
        if documented:
            print(f"{documented} documented differences (as between kube-proxy's modes; see docs/semantics.md)")
        inexact = result.ideal_inexact_services
        if inexact:
            print(f"ideal mode compared within 1e-9, not exactly, for {len(inexact)} service(s): their iptables "
                  f"cascades hold rules w/rest whose reduced denominator exceeds 100000, which kube-proxy's ten decimals cannot "
                  f"pin to one fraction (docs/weights.md); kernel mode is exact as everywhere")
        print("EQUIVALENT" if result.equivalent else "NOT EQUIVALENT")
    hold(state, result)
    return 0 if result.equivalent else 1


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="interpret both backends' renderings exactly and compare them")
    add_node_flags(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--work-limit", type=_work_limit, default=None, metavar="N",
                   help="refuse manifests whose estimated rule evaluations exceed N (default "
                        "4000000; 0: no limit; docs/semantics.md, \"Bounded work\")")
    p.add_argument("manifests", metavar="MANIFESTS", nargs="?",
                   help="a YAML file or a directory of them")
    compare_against.add_flags(p)
    p.set_defaults(func=run)

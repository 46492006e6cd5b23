"""`nfproxy check`: per service port, the exact endpoint shares; and the problems, if any."""

from __future__ import annotations

import argparse
import json
import sys

from nfproxy.cli.commands import add_backend_flag
from nfproxy.cli.exit import hold
from nfproxy.cli.commands.trace import SourceError, add_source_flags, fail, load_source, load_weights


def run(args: argparse.Namespace) -> int:
    from nfproxy.analysis.check import check
    from nfproxy.analysis.interpret import InterpretError
    from nfproxy.analysis.quantize import JSON_EXACT_DIGITS, exact_text, shown

    try:
        source = load_source(args)
        weights = load_weights(args)
    except SourceError as exc:
        return fail(str(exc))
    where = args.from_file or source.description
    if not source.ruleset.tables:
        return fail(f"{where}: no tables: nothing to check")
    try:
        report = check(source.ruleset, node_ips=args.node_ip, mode=args.mode, weights=weights)
    except (InterpretError, ValueError) as exc:
        return fail(f"{where}: {exc}")
    except RecursionError:
        # The last line of defence: the analysis bounds its recursion (jumps 64 deep,
        # expressions 64 deep) and walks graphs with explicit stacks.
        return fail(f"{where}: rules nested too deeply to analyse")
    if args.json:
        json.dump(
            {
                "source": source.description,
                "mode": args.mode,
                "clean": report.clean,
                "services": [
                    {
                        "name": s.name,
                        "table": s.table,
                        "chain": s.chain,
                        "protocol": s.protocol,
                        "endpoints": [
                            # Exact "p/q" while short, else the value rounded to 20 digits
                            # (a decimal point marks it): docs/semantics.md, "Long fractions".
                            {"endpoint": e, "probability": exact_text(p, JSON_EXACT_DIGITS), "decimal": float(p),
                             **({"intended": exact_text(dict(s.intended)[e], JSON_EXACT_DIGITS)} if s.intended is not None else {})}
                            for e, p in s.endpoints
                        ],
                        "worst_deviation_ppb": s.worst_deviation_ppb,
                        "fallthrough": exact_text(s.fallthrough, JSON_EXACT_DIGITS),
                        "affinity_timeout": s.affinity_timeout,
                    }
                    for s in report.services
                ],
                "problems": [{"kind": p.kind, "where": p.where, "detail": p.detail} for p in report.problems],
            },
            sys.stdout,
            indent=2,
        )
        print()
    else:
        print(f"{source.description}: {len(report.services)} endpoint-selection chains, {args.mode} mode")
        for s in report.services:
            affinity = f", affinity {s.affinity_timeout}s" if s.affinity_timeout else ""
            against = "the weights" if s.intended is not None else f"1/{len(s.endpoints)}"
            print(f"{s.name} ({s.protocol}, {s.chain}): {len(s.endpoints)} endpoints, "
                  f"worst deviation from {against} {s.worst_deviation_ppb:.3f} ppb{affinity}")
            intended = dict(s.intended or ())
            for e, p in s.endpoints:
                meant = f"  (weight share {shown(intended[e])})" if e in intended else ""
                print(f"    {e:<28} {float(p):.12f}  {shown(p)}{meant}")
        if report.problems:
            print(f"{len(report.problems)} problem(s):")
            for p in report.problems:
                print(f"  {p}")
        else:
            print("no problems found")
    hold(source, report)
    return 0 if report.clean else 1


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("check", help="exact endpoint probabilities per service port, and rule problems")
    add_backend_flag(p, help="which rules to read live (default nft; a file says what it is)")
    add_source_flags(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)

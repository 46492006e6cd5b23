"""`nfproxy check`: per service port, the exact endpoint shares; and the problems, if any."""

from __future__ import annotations

import argparse
import json
import sys

from nfproxy.cli.commands import BACKENDS
from nfproxy.cli.commands.trace import add_source_flags, load_source


def run(args: argparse.Namespace) -> int:
    from nfproxy.analysis.check import check

    try:
        source = load_source(args)
    except (ValueError, OSError) as exc:  # a dump that does not parse: named, exit 2
        print(f"nfproxy check: {exc}", file=sys.stderr)
        return 2
    report = check(source.ruleset, node_ips=args.node_ip, mode=args.mode)
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
                        "endpoints": [{"endpoint": e, "probability": str(p), "decimal": float(p)} for e, p in s.endpoints],
                        "worst_deviation_ppb": s.worst_deviation_ppb,
                        "fallthrough": str(s.fallthrough),
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
            print(f"{s.name} ({s.protocol}, {s.chain}): {len(s.endpoints)} endpoints, "
                  f"worst deviation from 1/{len(s.endpoints)} {s.worst_deviation_ppb:.3f} ppb{affinity}")
            for e, p in s.endpoints:
                print(f"    {e:<28} {float(p):.12f}  {p}")
        if report.problems:
            print(f"{len(report.problems)} problem(s):")
            for p in report.problems:
                print(f"  {p}")
        else:
            print("no problems found")
    return 0 if report.clean else 1


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("check", help="exact endpoint probabilities per service port, and rule problems")
    p.add_argument("--backend", choices=BACKENDS, help="which rules to read live (default nft; a file says what it is)")
    add_source_flags(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)

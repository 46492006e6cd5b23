"""`nfproxy compare`: prove both backends treat every service and traffic class alike (no root)."""

from __future__ import annotations

import argparse
import json
import sys
from fractions import Fraction

from nfproxy.cli.commands import load_manifests
from nfproxy.cli.config import add_node_flags


def _dist(d: dict) -> dict[str, str]:
    return {str(k): str(v) for k, v in d.items()}


def run(args: argparse.Namespace) -> int:
    from nfproxy.verify.compare import compare

    state = load_manifests(args)
    result = compare(state)
    if args.json:
        json.dump(
            {
                "equivalent": result.equivalent,
                "max_difference": float(result.max_difference),
                "total_variation": float(result.total_variation),
                "probes": [
                    {
                        "service": r.probe.service,
                        "traffic": r.probe.traffic,
                        "packet": {"src": r.probe.packet.src, "dst": r.probe.packet.dst, "port": r.probe.packet.port,
                                   "proto": r.probe.packet.proto, "origin": r.probe.packet.origin},
                        "iptables": _dist(r.iptables),
                        "nft": _dist(r.nft),
                        "max_difference": float(r.max_difference),
                        "total_variation": float(r.total_variation),
                        "equivalent": r.equivalent,
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
                print(service)
            mark = "ok  " if r.equivalent else "DIFF"
            print(f"  {mark} {r.probe.traffic} ({r.probe.packet.src} -> {r.probe.packet.dst}:{r.probe.packet.port})")
            for o in sorted(set(r.iptables) | set(r.nft)):
                a, b = r.iptables.get(o, Fraction(0)), r.nft.get(o, Fraction(0))
                print(f"         {str(o):<40} iptables {float(a):.12f}  nft {float(b):.12f}")
        print(f"{len(result.results)} probes; largest difference (kernel mode) {float(result.max_difference):.3e}, "
              f"largest total-variation distance {float(result.total_variation):.3e}")
        print("EQUIVALENT" if result.equivalent else "NOT EQUIVALENT")
    return 0 if result.equivalent else 1


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="interpret both backends' renderings exactly and compare them")
    add_node_flags(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("manifests", metavar="MANIFESTS", help="a YAML file or a directory of them")
    p.set_defaults(func=run)

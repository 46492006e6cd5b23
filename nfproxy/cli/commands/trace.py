"""`nfproxy trace`: follow one first packet through live rules or a dump."""

from __future__ import annotations

import argparse
import json
import sys

from nfproxy.cli.commands import BACKENDS


def add_source_flags(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--netns", metavar="NAME", help="read the live rules of this network namespace")
    src.add_argument("--from-file", metavar="DUMP", help="read a dump: nft -j JSON, `nfproxy render --backend nft` output, or iptables-save/restore text")
    p.add_argument("--node-ip", action="append", default=[], metavar="IP",
                   help="a node IP: `fib … type local` / `--src-type LOCAL` are true for these and loopback")
    p.add_argument("--mode", choices=("kernel", "ideal"), default="kernel",
                   help="kernel: the kernel's integer arithmetic (default); ideal: probabilities as written")


def load_source(args: argparse.Namespace):  # noqa: ANN201
    from nfproxy.analysis import dump

    if args.from_file:
        source = dump.read_file(args.from_file)
        if getattr(args, "backend", None) and source.backend != args.backend:
            print(f"nfproxy: note: {args.from_file} reads as {source.backend} rules", file=sys.stderr)
        return source
    return dump.read_live(args.backend or "nft", args.netns)


def run(args: argparse.Namespace) -> int:
    from nfproxy.analysis.interpret import InterpretError, Packet, trace
    from nfproxy.analysis.trace import format_trace, guess_origin, parse_destination
    from nfproxy.cli.config import FlagError

    try:
        dst, port, proto = parse_destination(args.destination)
        source = load_source(args)
        origin = args.origin or guess_origin(source.ruleset, args.source, args.node_ip)
        packet = Packet(args.source, dst, port, proto, origin)
        paths = trace(source.ruleset, packet, node_ips=args.node_ip, mode=args.mode)
    except (ValueError, OSError) as exc:
        if isinstance(exc, InterpretError):
            print(f"nfproxy trace: {exc}", file=sys.stderr)
            return 2
        raise FlagError(str(exc)) from None
    if args.json:
        out = {
            "packet": {"src": args.source, "dst": dst, "port": port, "proto": proto, "origin": origin},
            "source": source.description,
            "mode": args.mode,
            "paths": [
                {
                    "outcome": {"verdict": p.outcome.verdict, "endpoint": p.outcome.endpoint, "masquerade": p.outcome.masquerade},
                    "probability": str(p.probability),
                    "decimal": float(p.probability),
                    "steps": [{"table": s.table, "chain": s.chain, "rule": s.rule + 1, "text": s.text} for s in p.steps],
                    "affinity_lookups": list(p.lookups),
                    "pins": list(p.pins),
                }
                for p in paths
            ],
        }
        json.dump(out, sys.stdout, indent=2)
        print()
        return 0
    print(f"{args.source} -> {dst}:{port}/{proto} from {origin}, {source.description}, {args.mode} mode")
    print(format_trace(paths))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("trace", help="the chains a first packet walks and the probability of each outcome")
    p.add_argument("--backend", choices=BACKENDS, help="which rules to read live (default nft; a file says what it is)")
    add_source_flags(p)
    p.add_argument("--from", dest="origin", choices=("node", "pod", "outside"),
                   help="where the packet enters (default: node for a node IP, pod inside a pod CIDR the rules show, else outside)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("source", metavar="SRC", help="source IP")
    p.add_argument("destination", metavar="DST:PORT/PROTO", help="e.g. 10.96.0.10:53/udp or [fd00::10]:80/tcp")
    p.set_defaults(func=run)

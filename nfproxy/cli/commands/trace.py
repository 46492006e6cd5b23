"""`nfproxy trace`: follow first packets through live rules or a dump.

One packet from the command line, or many (`--packets FILE`, `-` for stdin: one
`SRC DST:PORT/PROTO [ORIGIN]` per line), all answered from one reading of the rules.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import sys
from collections.abc import Iterable, Iterator
from typing import Any

from nfproxy.cli.commands import add_backend_flag
from nfproxy.cli.exit import hold


def add_source_flags(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--netns", metavar="NAME", help="read the live rules of this network namespace")
    src.add_argument("--from-file", metavar="DUMP", help="read a dump: nft -j JSON, `nfproxy render` output (either backend), or iptables-save/restore text")
    p.add_argument("--max-dump-bytes", type=int, default=None, metavar="BYTES",
                   help="refuse a --from-file dump larger than this (default 268435456, 256 MiB)")
    p.add_argument("--node-ip", action="append", default=[], metavar="IP",
                   help="a node IP: `fib … type local` / `--src-type LOCAL` are true for these and loopback")
    p.add_argument("--mode", choices=("kernel", "ideal"), default="kernel",
                   help="kernel: the kernel's integer arithmetic (default); ideal: probabilities as written")
    p.add_argument("--manifests", metavar="MANIFESTS", default=None,
                   help="the model the rules come from (YAML file or directory): its endpoint weights are "
                        "the intended shares (docs/weights.md)")


class SourceError(ValueError):
    """The rules cannot be read or the request does not fit them; printed as it is, exit 2."""


def fail(message: str) -> int:
    print(f"nfproxy: error: {message}", file=sys.stderr)
    return 2


def check_node_ips(node_ips: list[str]) -> None:
    """--node-ip, as check, trace and audit take it: before any rule is read."""
    for ip in node_ips:
        try:
            ipaddress.ip_address(ip)
        except ValueError:
            raise SourceError(f"--node-ip {ip!r}: not an IP address") from None


def check_netns(name: str) -> None:
    """A named namespace that does not exist is a bad flag (status 2), not a kernel failure."""
    from nfproxy.kernel import netns

    if not netns.exists(name):
        raise SourceError(f"--netns: no network namespace named {name!r} (see `ip netns list`)")


def load_source(args: argparse.Namespace):  # noqa: ANN201
    """The rules, from --from-file or live; a bad dump or flag is a SourceError naming it."""
    from nfproxy.analysis import dump

    check_node_ips(args.node_ip)
    if args.from_file:
        limit = args.max_dump_bytes if args.max_dump_bytes is not None else dump.MAX_DUMP_BYTES
        if limit <= 0:
            raise SourceError(f"--max-dump-bytes {limit}: must be positive")
        try:
            source = dump.read_file(args.from_file, limit)
        except dump.DumpError as exc:
            raise SourceError(str(exc)) from None
        if getattr(args, "backend", None) and source.backend != args.backend:
            print(f"nfproxy: note: {args.from_file} reads as {source.backend} rules", file=sys.stderr)
        return source
    if args.netns:
        check_netns(args.netns)
    try:
        return dump.read_live(args.backend or "nft", args.netns)
    except (dump.DumpError, ValueError) as exc:
        raise SourceError(f"{args.netns or 'current namespace'}: {exc}") from None


def load_weights(args: argparse.Namespace):  # noqa: ANN201
    """The intended endpoint weights of --manifests (analysis.weights), or None without it."""
    if args.manifests is None:
        return None
    from nfproxy.analysis.weights import intended_weights
    from nfproxy.sources import manifests

    try:
        result = manifests.load(args.manifests)
    except (manifests.ManifestError, manifests.UnsafeFile) as exc:
        raise SourceError(str(exc)) from None
    for err in result.errors:
        print(f"nfproxy: skipped: {err}", file=sys.stderr)
    return intended_weights(result.state)


def _requests(args: argparse.Namespace) -> Iterator[tuple[str, str, str, str | None, str | None]]:
    """(where, source IP, DST:PORT/PROTO, origin or None, error or None) per packet asked about."""
    if args.packets is None:
        if args.source is None or args.destination is None:
            raise SourceError("trace: give SRC and DST:PORT/PROTO, or --packets FILE")
        yield "command line", args.source, args.destination, args.origin, None
        return
    if args.source is not None:
        raise SourceError("trace: give either SRC DST:PORT/PROTO or --packets, not both")
    name = "<stdin>" if args.packets == "-" else args.packets
    if args.packets == "-":
        lines: Iterable[str] = sys.stdin
    else:
        from nfproxy.analysis import dump

        limit = args.max_dump_bytes if args.max_dump_bytes is not None else dump.MAX_DUMP_BYTES
        try:  # the dump's checks: no FIFO, no device, a size cap, UTF-8
            lines = dump.read_text_file(args.packets, limit, "a packet list").splitlines()
        except dump.DumpError as exc:
            raise SourceError(str(exc)) from None
    try:
        for number, line in enumerate(lines, 1):
            fields = line.split("#", 1)[0].split()
            if not fields:
                continue
            if len(fields) not in (2, 3):
                yield f"{name}:{number}", "", "", None, f"expected SRC DST:PORT/PROTO [ORIGIN], got {line.strip()[:80]!r}"
                continue
            yield f"{name}:{number}", fields[0], fields[1], fields[2] if len(fields) == 3 else args.origin, None
    except UnicodeDecodeError as exc:  # stdin
        raise SourceError(f"{name}: not UTF-8 text (byte {exc.start})") from None


def run(args: argparse.Namespace) -> int:
    try:
        source = load_source(args)
        requests = list(_requests(args))
        weights = load_weights(args)
    except SourceError as exc:
        return fail(str(exc))
    status = 0
    first = True
    for where, src, destination, origin, error in requests:
        try:
            if error is not None:
                raise SourceError(error)
            answer = _answer(args, source, src, destination, origin, weights)
        except SourceError as exc:
            status = 2
            print(f"nfproxy: error: {where + ': ' if args.packets else ''}{exc}", file=sys.stderr)
            continue
        if args.json:
            json.dump(answer, sys.stdout, indent=None if args.packets else 2)
            print()
        else:
            if not first:
                print()
            print(answer["text"])
            first = False
    hold(source)
    return status


def _answer(
    args: argparse.Namespace, source: Any, src: str, destination: str, origin: str | None, weights: Any = None
) -> dict:
    from fractions import Fraction

    from nfproxy.analysis import quantize
    from nfproxy.analysis.interpret import InterpretError, Packet, distribution, trace
    from nfproxy.analysis.nft_rule_text import readable
    from nfproxy.analysis.trace import endpoint_weights, format_trace, guess_origin, parse_destination

    if origin is not None and origin not in ("node", "pod", "outside"):
        raise SourceError(f"origin {origin!r}: node, pod or outside")
    try:
        dst, port, proto = parse_destination(destination)
        version = ipaddress.ip_address(src).version
    except ValueError as exc:
        raise SourceError(str(exc)) from None
    if ipaddress.ip_address(dst).version != version:
        raise SourceError(f"{src} and {dst} are of different families")
    dump = args.from_file or source.description
    families = ("ip" if version == 4 else "ip6", "inet")
    if not any(t.family in families for t in source.ruleset.tables):
        held = sorted({t.family for t in source.ruleset.tables}) or ["none"]
        raise SourceError(f"{dump}: holds no IPv{version} rules (tables of family {', '.join(held)}), so {src} cannot be traced")
    origin = origin or guess_origin(source.ruleset, src, args.node_ip)
    packet = Packet(src, dst, port, proto, origin)
    try:
        paths = trace(source.ruleset, packet, node_ips=args.node_ip, mode=args.mode)
        written = paths if args.mode == "ideal" else trace(source.ruleset, packet, node_ips=args.node_ip, mode="ideal")
    except InterpretError as exc:
        raise SourceError(f"{dump}:{exc.line}: {exc}" if exc.line else f"{dump}: {exc}") from None
    except RecursionError:
        # The last line of defence: the interpreter bounds jumps and expressions 64 deep.
        raise SourceError(f"{dump}: rules nested too deeply to analyse") from None
    shares = distribution(written)
    by_endpoint = endpoint_weights(weights) if weights is not None else {}
    if not args.json:
        shown = f"[{dst}]" if version == 6 else dst
        head = f"{src} -> {shown}:{port}/{proto} from {origin}, {source.description}, {args.mode} mode"
        return {"text": f"{head}\n{format_trace(paths, written=shares, weights=by_endpoint)}"}
    return {
        "packet": {"src": src, "dst": dst, "port": port, "proto": proto, "origin": origin},
        "source": source.description,
        "mode": args.mode,
        "paths": [
            {
                "outcome": {"verdict": p.outcome.verdict, "endpoint": p.outcome.endpoint, "masquerade": p.outcome.masquerade},
                "probability": quantize.exact_text(p.probability, quantize.JSON_EXACT_DIGITS),
                "decimal": float(p.probability),
                "written": quantize.exact_text(Fraction(shares.get(p.outcome, 0)), quantize.JSON_EXACT_DIGITS),
                "weight": by_endpoint.get(p.outcome.endpoint or ""),
                "count": p.count,
                "steps": [{"table": s.table, "chain": s.chain, "rule": s.rule + 1, "text": readable(s.text)} for s in p.steps],
                "affinity_lookups": list(p.lookups),
                "pins": list(p.pins),
                # Only on a path of more than interpret._MAX_STEPS matched rules (the first
                # ones are listed): docs/semantics.md, "Bounded work".
                **({"steps_not_listed": p.unlisted} if p.unlisted else {}),
            }
            for p in paths
        ],
    }


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("trace", help="the chains first packets walk and the probability of each outcome")
    add_backend_flag(p, help="which rules to read live (default nft; a file says what it is)")
    add_source_flags(p)
    p.add_argument("--from", dest="origin", choices=("node", "pod", "outside"),
                   help="where the packet enters (default: node for a node IP, pod inside a pod CIDR the rules show, else outside)")
    p.add_argument("--packets", metavar="FILE",
                   help="trace many packets: one `SRC DST:PORT/PROTO [ORIGIN]` per line ('-': stdin)")
    p.add_argument("--json", action="store_true", help="machine-readable output (one JSON object per line with --packets)")
    p.add_argument("source", metavar="SRC", nargs="?", help="source IP")
    p.add_argument("destination", metavar="DST:PORT/PROTO", nargs="?", help="e.g. 10.96.0.10:53/udp or [fd00::10]:80/tcp")
    p.set_defaults(func=run)

"""`nfproxy audit`: is the split on this node, right now, what the rules promise?

Two readings of the kernel's per-endpoint counters and the live rules, `--interval` apart (or one,
`--once`: counts since each counter was created); the statistics are in nfproxy.analysis.audit.
Exit status: 0 nothing skewed, 1 some service port skewed, 2 bad flags or unreadable rules.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import stat
import sys
import time
from typing import Any

from nfproxy.cli.commands import add_backend_flag
from nfproxy.cli.commands.trace import SourceError, check_netns, check_node_ips, fail

DEFAULT_INTERVAL = "30s"
DEFAULT_ALPHA = "0.001"
# A plain decimal, ASCII digits only, with an optional exponent: float() alone also takes `0.5_0`,
# ` 0.5 `, `nan`, `inf` and other scripts' digits, none of which docs/audit.md promises.
_ALPHA = re.compile(r"-?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")
# argparse takes an argument that starts with "-" for an option unless it looks like a number;
# a duration is number-like too, so `--interval -1s` reaches the "must be positive" check
# instead of failing as "expected one argument" (Python 3.13's own pattern, on 3.11 as well).
_NUMBER_LIKE = re.compile(r"-\.?[0-9]")


class AuditError(ValueError):
    """A flag or the kernel's state does not allow an audit; printed as it is, exit 2."""


def _interval(args: argparse.Namespace) -> float:
    from nfproxy.cli.duration import DurationError, parse

    text = args.interval if args.interval is not None else DEFAULT_INTERVAL
    try:
        ns = parse(text)
    except DurationError as exc:
        raise AuditError(f"--interval {text!r}: {exc}") from None
    if ns <= 0:
        raise AuditError(f"--interval {text!r}: must be positive")
    return ns / 1e9


def alpha(text: str) -> float:
    """--alpha as typed: the errors quote the text, not what float() made of it (`1e-400` is
    0.0 to a float, and was reported as such)."""
    from nfproxy.cli.flag_types import DISPLAY_LIMIT, display

    if _ALPHA.fullmatch(text) is None:
        raise AuditError(f"--alpha {display(text)}: not a decimal number (examples: 0.001, .05, 1e-3)")
    value = float(text)
    if not 0 < value < 1:
        shown = text if len(text) <= DISPLAY_LIMIT else text[: DISPLAY_LIMIT - 3] + "..."
        raise AuditError(f"--alpha {shown}: must be between 0 and 1 (exclusive)")
    return value


def check_metrics_file(path: str) -> None:
    """The textfile is written beside PATH and renamed over it, which replaces whatever PATH was:
    a device or FIFO would become a regular file, a symlink would be replaced, not followed. So
    only a regular file, or nothing yet, may be there; a symlink is refused rather than resolved,
    as a root job should not write where a link in a shared directory points."""
    from nfproxy.sources.manifests import file_type

    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as exc:
        raise AuditError(f"--metrics-file {path}: {exc.strerror or exc}") from None
    if stat.S_ISLNK(mode):
        raise AuditError(f"--metrics-file {path}: a symbolic link, not a regular file "
                         "(give the path of the file it points to)")
    if not stat.S_ISREG(mode):
        raise AuditError(f"--metrics-file {path}: {file_type(mode)}, not a regular file")


def _check_flags(args: argparse.Namespace) -> tuple[float, float | None]:
    """(alpha, interval in seconds or None for --once); before any reading, so a bad flag costs
    no window of waiting."""
    level = alpha(args.alpha)
    if args.service is not None:
        ns, sep, name = args.service.partition("/")
        if not sep or not ns or not name or "/" in name:
            raise AuditError(f"--service {args.service!r}: expected NAMESPACE/NAME")
    if args.once and args.interval is not None:
        raise AuditError("--once and --interval exclude each other")
    interval = None if args.once else _interval(args)
    if args.metrics_file:
        check_metrics_file(args.metrics_file)
    try:
        check_node_ips(args.node_ip)
        if args.netns:
            check_netns(args.netns)
    except SourceError as exc:
        raise AuditError(str(exc)) from None
    return level, interval


def read(backend: str, netns: str | None, node_ips: list[str], mode: str) -> Any:
    """One reading of counters and rules, from one snapshot of the kernel."""
    from nfproxy.analysis import audit, counters

    if backend == "nft":
        from nfproxy.analysis.dump import read_nft_counted

        got = read_nft_counted(netns)  # the counted maps' elements over netlink
        rs, doc, taken = got.ruleset, got.doc, got.taken
        first = audit.reading(rs, counters.endpoint_counts_nft(doc, got.counted), node_ips=node_ips, mode=mode)  # type: ignore[arg-type]
        return audit.Reading(first.counts, first.selections, audit.nft_pins(doc),
                             audit.nft_pinned_clients(rs, first.selections), taken)
    return _read_iptables(netns, node_ips, mode)


def _read_iptables(netns: str | None, node_ips: list[str], mode: str) -> Any:
    from nfproxy.analysis import audit, counters, iptables_save
    from nfproxy.analysis.ir import Ruleset
    from nfproxy.core.model import IPFamily
    from nfproxy.kernel.iptables import Flavour, IptablesRunner
    from nfproxy.kernel.process import KernelError

    texts = []
    for flavour in (Flavour.LEGACY, Flavour.NFT):
        for family in IPFamily:
            try:
                texts.append((family, IptablesRunner(family, netns, flavour).save(counters=True)))
            except KernelError:
                continue
    taken = time.monotonic()
    tables, counts = [], []
    pins: dict = {}
    for family, text in texts:
        if "KUBE-" not in text:
            continue
        tables.extend(iptables_save.parse(text, family).tables)
        counts.extend(counters.endpoint_counts_iptables(text))
        for chain, per in audit.iptables_pins(text).items():
            pins.setdefault(chain, {}).update(per)  # ip and ip6 share chain names, not endpoints
    if not tables:
        raise AuditError(f"no KUBE-* iptables rules in {netns or 'the current namespace'}")
    return audit.reading(Ruleset(tuple(tables)), counts, pins, node_ips=node_ips, mode=mode, taken_at=taken)  # type: ignore[arg-type]


def run(args: argparse.Namespace) -> int:
    from nfproxy.analysis.audit import audit
    from nfproxy.analysis.interpret import InterpretError
    from nfproxy.kernel.process import KernelError

    try:
        level, interval = _check_flags(args)
        backend = args.backend or "nft"
        first = None
        if interval is not None:
            first = read(backend, args.netns, args.node_ip, args.mode)
            time.sleep(max(0.0, first.taken_at + interval - time.monotonic()))
        second = read(backend, args.netns, args.node_ip, args.mode)
        if first is not None:
            interval = second.taken_at - first.taken_at  # what the counters really spanned
        report = audit(first, second, alpha=level, only=args.service)
    except (AuditError, KernelError, InterpretError, ValueError) as exc:
        return fail(f"audit: {args.netns + ': ' if args.netns and not isinstance(exc, AuditError) else ''}{exc}")
    if args.service is not None and not report.ports:
        return fail(f"audit: --service {args.service}: no rules or counters for this service")
    if args.metrics_file:
        try:
            _write_metrics(args.metrics_file, report)
        except AuditError as exc:
            return fail(f"audit: {exc}")
    where = f"netns {args.netns}" if args.netns else "this node"
    span = "since each endpoint's counter was created" if interval is None else f"in {interval:.1f}s"
    if args.json:
        json.dump(to_json(report, backend, where, interval), sys.stdout, indent=2)
        print()
    else:
        print(format_report(report, f"{backend} rules of {where}, new connections {span}"))
    return 1 if report.skewed else 0


def _fmt_p(p: float | None) -> str:
    if p is None:
        return "-"
    return "<1e-300" if p == 0 else f"{p:.3g}"  # 0.0 is an underflow, not a certainty


def format_report(report: Any, head: str) -> str:
    lines = [f"{head}, alpha {report.alpha:g} (Holm-corrected across {sum(p.p_adjusted is not None for p in report.ports)} tested ports)"]
    for a in report.ports:
        lines.append(f"{a.key}: {a.verdict}, {a.connections} connections, p {_fmt_p(a.p)}"
                     f" (adjusted {_fmt_p(a.p_adjusted)}), {a.method}")
        for ep in sorted(set(a.observed) | set(a.expected)):
            n = a.observed.get(ep, 0)
            seen = n / a.connections if a.connections else 0.0
            tested = f"  random {a.tested.get(ep, 0)}" if a.tested is not a.observed else ""
            lines.append(f"    {ep:<28} {n:>8}  observed {seen:.4f}  expected {a.expected.get(ep, 0.0):.4f}{tested}")
        lines.extend(f"    explained: {e}" for e in a.explanations)
        lines.extend(f"    changed: {c}" for c in a.changes)
    skewed = len(report.skewed)
    lines.append(f"{skewed} skewed service port(s)" if skewed else "no skewed service ports")
    return "\n".join(lines)


def to_json(report: Any, backend: str, where: str, interval: float | None) -> dict:
    return {
        "backend": backend,
        "where": where,
        "interval_seconds": interval,
        "since_creation": report.since_creation,
        "alpha": report.alpha,
        "skewed": len(report.skewed),
        "services": [
            {
                "service": a.key.name,
                "protocol": a.key.protocol,
                "family": a.key.family,
                "verdict": a.verdict,
                "connections": a.connections,
                "p": a.p,
                "p_adjusted": a.p_adjusted,
                "p_plain": a.p_plain,
                "method": a.method,
                "endpoints": [
                    {"endpoint": ep, "connections": a.observed.get(ep, 0), "tested": a.tested.get(ep, 0),
                     "expected_share": a.expected.get(ep, 0.0)}
                    for ep in sorted(set(a.observed) | set(a.expected))
                ],
                "explanations": list(a.explanations),
                "changes": list(a.changes),
            }
            for a in report.ports
        ],
    }


METRIC_P = "nfproxy_audit_p_value"
METRIC_SKEWED = "nfproxy_audit_skewed"
METRIC_LABELS = ("namespace", "service", "port", "protocol", "family")


def _write_metrics(path: str, report: Any) -> None:
    """The latest audit per service port, in Prometheus text format, for node_exporter's
    textfile collector: the daemon runs no audits (each takes a window of traffic), so a
    periodic `nfproxy audit --metrics-file` is how a dashboard gets them. The labels start as
    nfproxy_endpoint_new_connections_total's, so the two join on namespace, service, port."""
    from prometheus_client import CollectorRegistry, Gauge, write_to_textfile

    registry = CollectorRegistry()
    p_value = Gauge(METRIC_P, "p-value of the latest nfproxy audit per service port, Holm-adjusted (NaN: not tested)",
                    METRIC_LABELS, registry=registry)
    skewed = Gauge(METRIC_SKEWED, "1 when the latest nfproxy audit found the service port skewed, else 0",
                   METRIC_LABELS, registry=registry)
    for a in report.ports:
        labels = (*a.key.namespace_service_port, a.key.protocol, a.key.family)
        p_value.labels(*labels).set(a.p_adjusted if a.p_adjusted is not None else math.nan)
        skewed.labels(*labels).set(1 if a.verdict == "skewed" else 0)
    check_metrics_file(path)  # again: the audit window is time for PATH to change
    try:
        write_to_textfile(path, registry)
    except OSError as exc:
        raise AuditError(f"--metrics-file {path}: {exc.strerror or exc}") from None


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("audit", help="test the new connections per endpoint against the shares the rules promise")
    add_backend_flag(p, help="which rules and counters to read (default nft)")
    p.add_argument("--netns", metavar="NAME", help="audit this network namespace")
    when = p.add_mutually_exclusive_group()
    when.add_argument("--interval", metavar="DURATION", help=f"time between the two readings (default {DEFAULT_INTERVAL})")
    when.add_argument("--once", action="store_true", help="one reading: counts since each endpoint's counter was created")
    p.add_argument("--service", metavar="NS/NAME", help="audit only this service's ports")
    p.add_argument("--alpha", default=DEFAULT_ALPHA, help=f"significance across all service ports, Holm-corrected (default {DEFAULT_ALPHA})")
    p.add_argument("--node-ip", action="append", default=[], metavar="IP", help="a node IP, as for `check`")
    p.add_argument("--mode", choices=("kernel", "ideal"), default="kernel", help="expected shares: the kernel's arithmetic (default) or as written")
    p.add_argument("--metrics-file", metavar="PATH", help="also write the p-values as a Prometheus textfile (node_exporter)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)
    p._negative_number_matcher = _NUMBER_LIKE  # noqa: SLF001 - argparse has no public knob

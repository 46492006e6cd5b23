"""`nfproxy lab`: the measured comparison of both backends on real connections (root).

The measuring lives in nfproxy.verify.lab; this module is the user's side of it: flags, the progress
bar, the table, the JSON document and the plot, all produced from one `Report`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from fractions import Fraction
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, TextIO

from nfproxy.cli.commands import BACKENDS, load_manifests
from nfproxy.cli.config import FlagError, add_node_flags

if TYPE_CHECKING:  # nfproxy.verify.lab pulls in the sandbox and pyroute2: only when running
    from nfproxy.verify.lab import Report, Seen

_REPO_EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def default_manifests() -> str:
    """`examples/` of the current directory, else the bundled one next to the package."""
    here = Path("examples")
    return str(here) + "/" if here.is_dir() else str(_REPO_EXAMPLES)


# --------------------------------------------------------------------------------------------
# Progress


class ProgressBar:
    """Carriage-return updates on stderr, at most ~10 a second; silent when disabled."""

    def __init__(self, stream: TextIO, enabled: bool, width: int = 30) -> None:
        self.stream = stream
        self.enabled = enabled
        self.width = width
        self._last = 0.0
        self._shown = False

    def __call__(self, done: int, total: int, what: str) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if done < total and now - self._last < 0.1:
            return
        self._last = now
        filled = self.width * done // max(total, 1)
        bar = "#" * filled + "-" * (self.width - filled)
        line = f"[{bar}] {100 * done // max(total, 1):3d}% {done}/{total} {what}"
        self.stream.write("\r" + line[:110].ljust(110))
        self.stream.flush()
        self._shown = True

    def clear(self) -> None:
        if self._shown:
            self.stream.write("\r" + " " * 110 + "\r")
            self.stream.flush()
            self._shown = False


# --------------------------------------------------------------------------------------------
# Text


def _share(x: Fraction) -> str:
    return f"{float(x):.12f}"


def _short(x: Fraction) -> str:
    return f"{float(x):.6g}"


def _p(p: float) -> str:
    return f"{p:.3g}" if p >= 1e-3 or p == 0 else f"{p:.1e}"


def _seen(s: Seen) -> str:
    label, source = s
    return label if source is None else f"{label} from {source}"


def _outcomes(counts: dict[Seen, Any], fmt: Any) -> str:
    return ", ".join(f"{_seen(k)} {fmt(v)}" for k, v in sorted(counts.items(), key=str) if v)


def table(report: Report, manifests: str) -> str:
    """The human report: distributions with exact and observed shares, then pass/fail rows."""
    plan = report.plan
    b = report.backends
    node = f"{plan.node_name or '(unnamed)'} ({', '.join(plan.node_ips) or 'no node IP'})"
    lines = [
        f"nfproxy lab: {manifests}, node {node}, backends {' and '.join(b)}",
        f"{len(report.distributions)} load-balanced service ports x {plan.connections_per_service}"
        f" connections, {len(report.checks)} traffic classes: {plan.connections * len(b)}"
        f" connections in {report.seconds:.1f} s",
        "",
        "Load balancing: connections per endpoint, and the exact share the interpreter (kernel "
        "mode) derives from the rules read back from each kernel",
    ]
    head = f"  {'endpoint':<24}" + "".join(f" {'expected ' + x:>18}" for x in b)
    head += "".join(f" {x:>9}" for x in b)
    for r in report.distributions:
        p = r.probe
        lines += ["", f"{p.service} {p.protocol.value} {p.target} from {p.client} {p.src}, "
                      f"{p.count} connections", head]
        for label in r.labels:
            row = f"  {label:<24}"
            row += "".join(f" {_share(r.by_backend[x].expected_labels.get(label, Fraction(0))):>18}"
                           for x in b)
            row += "".join(f" {r.by_backend[x].seen_labels.get(label, 0):>9}" for x in b)
            lines.append(row)
        fits = r.fits()
        lines.append(f"  {'chi-square p':<24}" + " " * (19 * len(b))
                     + "".join(f" {_p(fits[x].p):>9}" for x in b))
        between = r.between()
        if between is not None:
            lines.append(f"  {'two-sample p':<24}" + " " * (19 * len(b))
                         + f" {_p(between.p):>9}  ({' vs '.join(b)})")
        for x in b:
            bad = r.by_backend[x].unexpected
            if bad:
                lines.append(f"  UNEXPECTED on {x}: {_outcomes(bad, str)}")
    lines += ["", "Traffic classes: each outcome seen against the outcomes the rules allow",
              "  " + "".join(f"{x:<9}" for x in b) + "class"]
    for r in report.checks:
        p = r.probe
        verdicts = "".join(f"{'pass' if r.passed(x) else 'FAIL':<9}" for x in b)
        lines.append(f"  {verdicts}{p.title} ({p.service}), {p.count} connections")
        first = r.by_backend[b[0]]
        lines.append(f"      expected: {_outcomes(dict(first.expected), _short)}")
        for x in b[1:]:  # each backend's own expectation, when the rules differ
            if dict(r.by_backend[x].expected) != dict(first.expected):
                lines.append(f"      expected on {x}: "
                             f"{_outcomes(dict(r.by_backend[x].expected), _short)}")
        for x in b:
            lines.append(f"      {x + ':':<9} {_outcomes(dict(r.by_backend[x].seen), str)}")
    lines += _count_lines(report)
    lines.append("")
    if plan.skipped:
        lines += [f"skipped: {s}" for s in plan.skipped] + [""]
    low = report.low_p()
    for r, which, t in low:
        lines.append(f"note: {r.probe.service} {which}: p = {_p(t.p)} < {report.alpha} "
                     f"(expected about {report.alpha:.1%} of the time even when the rules are right)")
    lines.append("all traffic classes behaved as the rules say" if report.passed
                 else "SOME TRAFFIC DID NOT BEHAVE AS THE RULES SAY")
    return "\n".join(lines) + "\n"


def _count_lines(report: Report) -> list[str]:
    """Per endpoint, the connections the clients saw answer beside the ones the kernel's
    counter at the endpoint's DNAT counted: every probe of a service port together."""
    b = [x for x in report.backends if x in report.counted]
    if not b:
        return []
    rows = {x: {(r.service, r.endpoint): r for r in report.counts(x)} for x in b}
    keys = sorted({k for x in b for k in rows[x]})
    lines = ["", "Kernel counters: new connections per endpoint as the clients saw them and as "
             "the kernel counted them at the DNAT (they must be equal)",
             f"  {'service port':<28} {'endpoint':<24}" + "".join(f" {x + ' seen':>14} {'counted':>8}" for x in b)]
    for key in keys:
        row = f"  {key[0]:<28} {key[1]:<24}"
        for x in b:
            r = rows[x].get(key)
            seen, counted = (r.seen, r.counted) if r else (0, 0)
            row += f" {seen:>14} {counted:>8}" + ("" if seen == counted else " MISMATCH")
        lines.append(row)
    for x, r in report.count_mismatches():
        lines.append(f"  MISMATCH on {x}: {r.service} {r.endpoint}: clients saw {r.seen}, kernel counted {r.counted}")
    return lines


# --------------------------------------------------------------------------------------------
# JSON


def _fraction(x: Fraction) -> dict[str, Any]:
    return {"exact": f"{x.numerator}/{x.denominator}", "share": float(x)}


def _test(t: Any) -> dict[str, float | None]:
    """JSON has no infinity: an impossible outcome's statistic becomes null (p is 0)."""
    return {"statistic": t.statistic if t.statistic != float("inf") else None, "p": t.p}


def _probe_json(p: Any) -> dict[str, Any]:
    return {
        "service": p.service, "protocol": p.protocol.value, "family": p.family.value,
        "client": p.client, "source": p.src, "destination": p.dst, "port": p.port,
        "connections": p.count,
    }


def _pairs(counts: dict[Seen, Any], value: Any) -> list[dict[str, Any]]:
    return [{"outcome": k[0], "seen_source": k[1], **value(v)}
            for k, v in sorted(counts.items(), key=str)]


def document(report: Report, manifests: str) -> dict[str, Any]:
    """Every number of the table, plus the exact fractions behind the expected shares."""
    b = report.backends
    services = []
    for r in report.distributions:
        fits = r.fits()
        between = r.between()
        services.append({
            **_probe_json(r.probe),
            "endpoints": [
                {
                    "endpoint": label,
                    "expected": {x: _fraction(r.by_backend[x].expected_labels.get(label, Fraction(0)))
                                 for x in b},
                    "observed": {x: r.by_backend[x].seen_labels.get(label, 0) for x in b},
                }
                for label in r.labels
            ],
            "goodness_of_fit": {x: _test(fits[x]) for x in b},
            "two_sample": _test(between) if between is not None else None,
            "unexpected": {x: _pairs(r.by_backend[x].unexpected, lambda v: {"count": v})
                           for x in b},
            "passed": {x: r.passed(x) for x in b},
            "seconds": {x: r.by_backend[x].seconds for x in b},
        })
    checks = [
        {
            "class": r.probe.check.value if r.probe.check else "",
            **_probe_json(r.probe),
            "passed": {x: r.passed(x) for x in b},
            "expected": {x: _pairs(dict(r.by_backend[x].expected), _fraction) for x in b},
            "observed": {x: _pairs(dict(r.by_backend[x].seen), lambda v: {"count": v})
                         for x in b},
        }
        for r in report.checks
    ]
    return {
        "manifests": manifests,
        "node_name": report.plan.node_name,
        "node_ips": list(report.plan.node_ips),
        "connections_per_service": report.plan.connections_per_service,
        "connections_total": report.plan.connections * len(b),
        "service_ports": len(services),
        "traffic_classes": len(checks),
        "backends": list(b),
        "alpha": report.alpha,
        "seconds": report.seconds,
        "apply_seconds": dict(report.apply_seconds),
        "services": services,
        "checks": checks,
        "kernel_counts": {
            x: [{"service": r.service, "endpoint": r.endpoint, "seen": r.seen, "counted": r.counted}
                for r in report.counts(x)]
            for x in b if x in report.counted
        },
        "skipped": list(report.plan.skipped),
        "passed": report.passed,
    }


# --------------------------------------------------------------------------------------------
# Plot


def plot(report: Report, path: str) -> None:
    """Expected vs observed connections per endpoint and backend, one panel per service."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = report.distributions
    cols = min(3, len(results))
    rows = -(-len(results) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 2.7 * rows), squeeze=False)
    b = report.backends
    width = 0.8 / (len(b) + 1)
    colours = ("#4c72b0", "#dd8452", "#55a868")
    for ax, r in zip(axes.flat, results, strict=False):
        names = r.labels
        xs = range(len(names))
        first = r.by_backend[b[0]]
        expected = [float(first.expected_labels.get(n, 0)) * r.probe.count for n in names]
        ax.bar([x - 0.4 + width / 2 for x in xs], expected, width, color="#bbbbbb",
               label="expected")
        for i, x_name in enumerate(b):
            counts = [r.by_backend[x_name].seen_labels.get(n, 0) for n in names]
            fits = r.fits()[x_name]
            ax.bar([x - 0.4 + width * (i + 1.5) for x in xs], counts, width,
                   color=colours[i % len(colours)], label=f"{x_name} (p={_p(fits.p)})")
        ax.set_title(f"{r.probe.service} {r.probe.protocol.value}", fontsize=9)
        ax.set_xticks(list(xs), [n.rsplit(":", 1)[0] for n in names], fontsize=7)
        ax.tick_params(axis="y", labelsize=7)
        top = max([*expected, *(v for x_name in b
                                 for v in r.by_backend[x_name].seen_labels.values())], default=1)
        ax.set_ylim(0, top * 1.4)
        ax.legend(fontsize=6, loc="upper center", ncol=len(b) + 1, frameon=False)
    for ax in list(axes.flat)[len(results):]:
        ax.set_visible(False)
    fig.suptitle(f"nfproxy lab: connections per endpoint, expected vs observed "
                 f"({', '.join(b)})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)


# --------------------------------------------------------------------------------------------
# The command


def _backends(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))
    if not names:
        raise FlagError("--backends: give at least one backend")
    for x in names:
        if x not in BACKENDS:
            raise FlagError(f"--backends: unknown backend {x!r} (choose from {', '.join(BACKENDS)})")
    return names


def _check_plot_path(path: str | None) -> None:
    if path is None:
        return
    if not path.lower().endswith(".png"):
        raise FlagError(f"--plot: {path!r} must name a .png file")
    parent = Path(path).resolve().parent
    if not parent.is_dir():
        raise FlagError(f"--plot: directory {parent} does not exist")


class _Terminated(BaseException):
    """SIGTERM, turned into an exception so every `with` block removes its namespaces."""


def _on_term(signum: int, frame: FrameType | None) -> None:
    raise _Terminated()


def run(args: argparse.Namespace) -> int:
    try:
        import matplotlib  # noqa: F401
        import scipy  # noqa: F401
    except ImportError as exc:
        print(f"nfproxy lab: needs the lab extra ({exc.name} is missing): "
              "pip install 'nfproxy[lab]' (scripts/setup installs it)", file=sys.stderr)
        return 1
    from nfproxy.verify import lab

    backends = _backends(args.backends)
    if not 1 <= args.connections <= lab.MAX_CONNECTIONS:
        raise FlagError(f"--connections: must be 1..{lab.MAX_CONNECTIONS}, not {args.connections}")
    _check_plot_path(args.plot)
    if os.geteuid() != 0:
        print("nfproxy lab: needs root (it creates network namespaces and applies rules there); "
              "run it with sudo, or run scripts/demo", file=sys.stderr)
        return 1
    manifests = args.manifests or default_manifests()
    state = load_manifests(args, manifests)
    bar = ProgressBar(sys.stderr, enabled=sys.stderr.isatty() and not args.json)
    # SIGHUP too (the terminal went away): every way of stopping it cleans up.
    previous = {sig: signal.signal(sig, _on_term) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        report = lab.run(state, backends=backends, connections=args.connections, progress=bar)
    except lab.LabError as exc:
        bar.clear()
        print(f"nfproxy lab: {exc}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, _Terminated):
        bar.clear()
        print("nfproxy lab: interrupted; every namespace it made is removed", file=sys.stderr)
        return 130
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    bar.clear()
    if args.plot:
        plot(report, args.plot)
    if args.json:
        json.dump(document(report, manifests), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(table(report, manifests))
        if args.plot:
            print(f"plot: {args.plot}")
    return 0 if report.passed else 1


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "lab",
        help="measure both backends on real connections in throwaway namespaces (root)",
        description="Apply each backend to the same services in a traffic sandbox, open real "
        "connections, and compare the counts per endpoint with the exact shares the rules give "
        "(chi-square) and with each other; NodePort, LoadBalancer, affinity and no-endpoint "
        "traffic are pass/fail rows.",
    )
    p.add_argument("--connections", type=int, default=2000, metavar="N",
                   help="connections per load-balanced service and backend (default 2000)")
    p.add_argument("--backends", default=",".join(BACKENDS), metavar="LIST",
                   help="comma-separated backends to measure (default: iptables,nft)")
    p.add_argument("--plot", metavar="FILE.png", help="write a bar chart of expected vs observed")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    add_node_flags(p)
    p.add_argument("manifests", metavar="MANIFESTS", nargs="?", default=None,
                   help="a YAML file or a directory of them (default: examples/)")
    p.set_defaults(func=run)

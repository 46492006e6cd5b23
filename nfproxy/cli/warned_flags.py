"""kube-proxy's flags for settings nfproxy cannot honour (IPVS, client rate limits, profiling,
klog's buffering, ...): accepted with kube-proxy's syntax so that its command line runs
unchanged, checked as the configuration file's field is, kept for --write-config-to, and warned
about in that field's words (nothing for its zero value or kube-proxy's own default)."""

from __future__ import annotations

import argparse
import re

from nfproxy.cli import duration as go_duration
from nfproxy.cli.complete import warn
from nfproxy.cli.config import split_list
from nfproxy.cli.flag_types import INT32_MAX, add_go_bool_switch, decimal, display, integer_in

# flag -> (dest, KubeProxyConfiguration field)
WARNED_FLAGS: dict[str, tuple[str, str]] = {
    "--kube-api-qps": ("kube_api_qps", "clientConnection.qps"),
    "--kube-api-burst": ("kube_api_burst", "clientConnection.burst"),
    "--kube-api-content-type": ("kube_api_content_type", "clientConnection.contentType"),
    "--config-sync-period": ("config_sync_period", "configSyncPeriod"),
    "--oom-score-adj": ("oom_score_adj", "oomScoreAdj"),
    "--profiling": ("profiling", "enableProfiling"),
    "--show-hidden-metrics-for-version": ("show_hidden_metrics_for_version", "showHiddenMetricsForVersion"),
    "--ipvs-scheduler": ("ipvs_scheduler", "ipvs.scheduler"),
    "--ipvs-sync-period": ("ipvs_sync_period", "ipvs.syncPeriod"),
    "--ipvs-min-sync-period": ("ipvs_min_sync_period", "ipvs.minSyncPeriod"),
    "--ipvs-exclude-cidrs": ("ipvs_exclude_cidrs", "ipvs.excludeCIDRs"),
    "--ipvs-strict-arp": ("ipvs_strict_arp", "ipvs.strictARP"),
    "--ipvs-tcp-timeout": ("ipvs_tcp_timeout", "ipvs.tcpTimeout"),
    "--ipvs-tcpfin-timeout": ("ipvs_tcpfin_timeout", "ipvs.tcpFinTimeout"),
    "--ipvs-udp-timeout": ("ipvs_udp_timeout", "ipvs.udpTimeout"),
    "--log-flush-frequency": ("log_flush_frequency", "logging.flushFrequency"),
    "--vmodule": ("vmodule", "logging.vmodule"),
    "--log-text-split-stream": ("log_text_split_stream", "logging.options"),
    "--log-text-info-buffer-size": ("log_text_info_buffer_size", "logging.options"),
    "--log-json-split-stream": ("log_json_split_stream", "logging.options"),
    "--log-json-info-buffer-size": ("log_json_info_buffer_size", "logging.options"),
}


def add_kube_proxy_flags(parser: argparse.ArgumentParser) -> None:
    """The daemon's kube-proxy flags that nfproxy only accepts (cmd/kube-proxy/app/options.go,
    AddFlags, and component-base's logsapi.AddFlags): a kube-proxy command line runs unchanged."""
    g = parser.add_argument_group("kube-proxy flags accepted and warned about (nfproxy cannot honour them)")
    g.add_argument("--healthz-port", type=integer_in(-INT32_MAX - 1, INT32_MAX), metavar="PORT",
                   help="deprecated: the port for a bare-IP --healthz-bind-address; 0 turns /healthz off")
    g.add_argument("--metrics-port", type=integer_in(-INT32_MAX - 1, INT32_MAX), metavar="PORT",
                   help="deprecated: the port for a bare-IP --metrics-bind-address; 0 turns /metrics off")
    g.add_argument("--kube-api-qps", type=float32, metavar="QPS", help="warned: no client-side rate limits")
    g.add_argument("--kube-api-burst", type=integer_in(-INT32_MAX - 1, INT32_MAX), metavar="N",
                   help="warned: no client-side rate limits")
    g.add_argument("--kube-api-content-type", metavar="TYPE", help="warned: the API client always sends JSON")
    g.add_argument("--config-sync-period", type=positive_duration, metavar="DURATION",
                   help="warned: watches never resync")
    g.add_argument("--oom-score-adj", type=integer_in(-INT32_MAX - 1, INT32_MAX), metavar="N",
                   help="warned: the OOM score is left to the container runtime")
    add_go_bool_switch(g, "--profiling", dest="profiling", help="warned: no /debug/pprof")
    g.add_argument("--show-hidden-metrics-for-version", metavar="VERSION", help="warned: no hidden metrics")
    _add_ipvs_flags(g)
    _add_logging_flags(g)


def _add_ipvs_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--ipvs-scheduler", metavar="NAME", help="warned: no IPVS mode (as every --ipvs-* flag)")
    for name in ("sync-period", "min-sync-period", "tcp-timeout", "tcpfin-timeout", "udp-timeout"):
        g.add_argument(f"--ipvs-{name}", metavar="DURATION", help="warned")
    g.add_argument("--ipvs-exclude-cidrs", action="extend", type=_list, metavar="CIDR,...", help="warned")
    add_go_bool_switch(g, "--ipvs-strict-arp", dest="ipvs_strict_arp", help="warned")


def _add_logging_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--log-flush-frequency", metavar="DURATION", help="warned: log lines are unbuffered")
    g.add_argument("--vmodule", action="extend", type=vmodule, metavar="PATTERN=N,...",
                   help="warned: per-file verbosity is not supported")
    for fmt in ("text", "json"):
        add_go_bool_switch(g, f"--log-{fmt}-split-stream", dest=f"log_{fmt}_split_stream",
                           help=f"warned: {fmt} lines all go to stderr")
        g.add_argument(f"--log-{fmt}-info-buffer-size", type=quantity, metavar="SIZE",
                       help="warned: lines are written unbuffered")


def apply_warned_flags(args: argparse.Namespace, options: list[str]) -> None:
    """Each warned flag given: its value checked and set as the file's field would set it, and
    the field's warning worded for the flag (after --config's own, which it wins over)."""
    from nfproxy.cli import kubeproxy_config

    for flag in options:
        if flag not in WARNED_FLAGS:
            continue
        dest, path = WARNED_FLAGS[flag]
        value, warning = kubeproxy_config.flag_setting(path, flag, getattr(args, dest))
        setattr(args, dest, value)
        if warning:
            warn(args, warning)


# Go's strconv.ParseFloat in decimal notation, as pflag's Float32Var reads --kube-api-qps
# (bounded: a 100 000-digit value is refused by length, not given to float()).
_FLOAT = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_MAX_FLOAT_TEXT = 64


def float32(text: str) -> int | float:
    """--kube-api-qps: a decimal number within float32's range; a whole number stays an int, so
    --write-config-to writes `qps: 20` as kube-proxy does."""
    from nfproxy.cli.kubeproxy_config import FLOAT32_MAX

    if len(text) > _MAX_FLOAT_TEXT or _FLOAT.fullmatch(text) is None:
        raise argparse.ArgumentTypeError(f"{display(text)} is not a number")
    value = float(text)
    if abs(value) > FLOAT32_MAX:
        raise argparse.ArgumentTypeError(f"{display(text)}: out of float32's range")
    return int(value) if value.is_integer() else value


def positive_duration(text: str) -> str:
    """--config-sync-period: a Go duration above zero (kube-proxy's Validate: "must be greater
    than 0"; unlike the file's field, where 0 means the default)."""
    try:
        nanoseconds = go_duration.parse(text)
    except go_duration.DurationError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if nanoseconds <= 0:
        raise argparse.ArgumentTypeError(f"{display(text)}: must be greater than 0")
    return text


def _list(text: str) -> list[str]:
    """pflag's StringSlice: a comma-separated list (CIDRs checked as the file's field checks them)."""
    try:
        return split_list(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def vmodule(text: str) -> list[dict[str, object]]:
    """--vmodule as logsapi's VModuleConfiguration.Set: `pattern=N,...`, empty items skipped, N
    from 0 to int32's maximum; in the file's shape (filePattern, verbosity)."""
    items: list[dict[str, object]] = []
    for item in text.split(","):
        if not item:
            continue
        pattern, sep, level = item.partition("=")
        if not sep or not pattern or not level or "=" in level:
            raise argparse.ArgumentTypeError(f"{display(item)} does not have the pattern=N format")
        number = decimal(level)
        if number is None or not 0 <= number <= INT32_MAX or level.startswith("-"):
            raise argparse.ArgumentTypeError(f"{display(item)}: N must be from 0 to {INT32_MAX}")
        items.append({"filePattern": pattern, "verbosity": number})
    return items


# Kubernetes quantities as --log-*-info-buffer-size takes them (512, 1k, 2Ki, 5Mi, 6Gi).
_QUANTITY = re.compile(r"[0-9]{1,19}(?:\.[0-9]{1,19})?(?:Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?")


def quantity(text: str) -> str:
    """A non-negative Kubernetes quantity, kept as written (the file's infoBufferSize is one)."""
    if _QUANTITY.fullmatch(text) is None:
        raise argparse.ArgumentTypeError(f"{display(text)} is not a size (examples: 512, 1k, 2Ki, 5Mi)")
    return text

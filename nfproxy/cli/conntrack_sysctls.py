"""The conntrack sysctls kube-proxy sets at start, from its `--conntrack-*` flags.

The plan is pure (kube-proxy's rules: a limit only when `--conntrack-max-per-core` > 0, a timeout
only when > 0, be_liberal only when asked); `apply` writes it into the target namespace only.
`nf_conntrack_max` is the one global value among them: outside the root namespace the kernel
shows it read-only, and it is then left alone (and logged), so a `--netns` run never changes the
machine's limit. The hash table size (a module parameter, also global) is only ever raised, and
only from the root namespace, as kube-proxy does.
"""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass

from nfproxy.cli.config import FlagError, duration

log = logging.getLogger("nfproxy.conntrack")

HASHSIZE = "/sys/module/nf_conntrack/parameters/hashsize"


@dataclass(frozen=True, slots=True)
class ConntrackSettings:
    max_per_core: int = 32768
    min: int = 131072
    tcp_established_timeout: int = 86400
    tcp_close_wait_timeout: int = 3600
    tcp_be_liberal: bool = False
    udp_timeout: int = 0
    udp_stream_timeout: int = 0


def _seconds(flag: str, text: str) -> int:
    return int(duration(flag, text))


def settings_from_args(args: argparse.Namespace) -> ConntrackSettings:
    for flag, value in (("--conntrack-max-per-core", args.conntrack_max_per_core),
                        ("--conntrack-min", args.conntrack_min)):
        if value < 0:
            raise FlagError(f"{flag}: {value}: must not be negative")
    return ConntrackSettings(
        max_per_core=args.conntrack_max_per_core,
        min=args.conntrack_min,
        tcp_established_timeout=_seconds("--conntrack-tcp-timeout-established",
                                         args.conntrack_tcp_timeout_established),
        tcp_close_wait_timeout=_seconds("--conntrack-tcp-timeout-close-wait",
                                        args.conntrack_tcp_timeout_close_wait),
        tcp_be_liberal=bool(args.conntrack_tcp_be_liberal),
        udp_timeout=_seconds("--conntrack-udp-timeout", args.conntrack_udp_timeout),
        udp_stream_timeout=_seconds("--conntrack-udp-timeout-stream", args.conntrack_udp_timeout_stream),
    )


# kube-proxy 1.36 (kubernetes#137002): the per-core product stops here. 32 768 per core made a
# 128-core node's table 4 Mi entries (hash buckets and memory it never uses); an explicit
# --conntrack-min above it is still honoured (it is a floor the user asked for).
SCALED_MAX = 1_048_576


def conntrack_max(settings: ConntrackSettings, cpus: int) -> int:
    """kube-proxy's getConntrackMax: 0 (leave it) unless a per-core limit is given."""
    if settings.max_per_core <= 0:
        return 0
    return max(min(settings.max_per_core * cpus, SCALED_MAX), settings.min)


def planned(settings: ConntrackSettings) -> tuple[tuple[str, int], ...]:
    """The per-namespace sysctls to write, in kube-proxy's order (nf_conntrack_max apart)."""
    out = []
    if settings.tcp_established_timeout > 0:
        out.append(("net.netfilter.nf_conntrack_tcp_timeout_established", settings.tcp_established_timeout))
    if settings.tcp_close_wait_timeout > 0:
        out.append(("net.netfilter.nf_conntrack_tcp_timeout_close_wait", settings.tcp_close_wait_timeout))
    if settings.tcp_be_liberal:
        out.append(("net.netfilter.nf_conntrack_tcp_be_liberal", 1))
    if settings.udp_timeout > 0:
        out.append(("net.netfilter.nf_conntrack_udp_timeout", settings.udp_timeout))
    if settings.udp_stream_timeout > 0:
        out.append(("net.netfilter.nf_conntrack_udp_timeout_stream", settings.udp_stream_timeout))
    return tuple(out)


def apply(settings: ConntrackSettings, netns: str | None) -> None:
    limit = conntrack_max(settings, len(os.sched_getaffinity(0)))
    if limit:
        _set_max(limit, netns)
    for name, value in planned(settings):
        _set(name, value, netns)


def _set(name: str, value: int, netns: str | None) -> None:
    from nfproxy.kernel import sysctl

    if sysctl.read(name, netns) != str(value):
        log.info("Set sysctl entry=%s value=%d", name, value)
        try:
            sysctl.write(name, value, netns)
        except sysctl.ReadOnlySysctl as exc:
            # kube-proxy runs privileged and fails here; an unprivileged pod cannot set it, and a
            # proxy that refuses to start over a conntrack timeout loses every service.
            log.warning("%s: left at %s; set it on the node (or run privileged) to follow "
                        "--conntrack-* as kube-proxy does", exc, sysctl.read(name, netns))


def _set_max(limit: int, netns: str | None) -> None:
    from nfproxy.kernel import sysctl

    name = "net.netfilter.nf_conntrack_max"
    if not sysctl.writable(name, netns):
        log.info("nf_conntrack_max is the root namespace's limit here (read-only): left at %s, "
                 "wanted %d", sysctl.read(name, netns), limit)
        return
    _set(name, limit, netns)
    log.info("Setting nf_conntrack_max nfConntrackMax=%d", limit)
    if netns is not None:
        return
    try:
        with open(HASHSIZE, encoding="ascii") as f:
            hashsize = int(f.read().strip())
        if hashsize < limit // 4:
            log.info("Setting conntrack hashsize hashsize=%d", limit // 4)
            with open(HASHSIZE, "w", encoding="ascii") as f:
                f.write(f"{limit // 4}\n")
    except OSError as exc:
        log.warning("conntrack hashsize not raised: %s", exc.strerror)

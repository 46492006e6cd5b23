"""nfproxy_endpoint_new_connections_total: each endpoint's new connections, counted by the
kernel and read when Prometheus scrapes (opt-in: --metrics-endpoint-connections).

The counters are the kernel's (analysis/counters.py: the KUBE-SEP DNAT rules' packets for
iptables, the endpoint maps' per-element counters and the per-endpoint chains' DNAT counters for
nft). They are read at scrape time, not after each sync: they move with traffic, not with
syncs, so a value cached at the last sync would be stale by the whole time since. The price is
one read of the rules per scrape (`iptables-save -c -t nat`, or the nft table as JSON); that is
why it is opt-in, as is a series per endpoint.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from nfproxy.analysis.counters import EndpointCount, read_live_counts
from nfproxy.kernel.process import KernelError

log = logging.getLogger("nfproxy.daemon")

METRIC = "nfproxy_endpoint_new_connections_total"
LABELS = ("namespace", "service", "port", "endpoint")


def reader(backend: str, netns: str | None = None) -> Callable[[], Iterable[EndpointCount]]:
    return lambda: read_live_counts(backend, netns)


class EndpointConnectionsCollector(Collector):
    def __init__(self, read: Callable[[], Iterable[EndpointCount]]) -> None:
        self._read = read

    def describe(self) -> list[CounterMetricFamily]:
        return [self._family()]

    def _family(self) -> CounterMetricFamily:
        # prometheus_client appends `_total` to counter samples itself.
        return CounterMetricFamily(
            METRIC.removesuffix("_total"),
            "New connections the kernel sent to each endpoint (packets at its DNAT); reset when "
            "the endpoint's rule is rewritten",
            labels=LABELS,
        )

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = self._family()
        try:
            counts = list(self._read())
        except (KernelError, OSError, ValueError) as exc:
            log.debug("reading the endpoint counters failed: %s", exc)
            counts = []
        total: dict[tuple[str, str, str, str], int] = {}
        for c in counts:
            key = (c.namespace, c.service, c.port, c.endpoint)
            total[key] = total.get(key, 0) + c.connections
        for key, n in sorted(total.items()):
            family.add_metric(list(key), n)
        yield family

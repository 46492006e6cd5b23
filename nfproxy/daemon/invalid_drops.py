"""kubeproxy_iptables_ct_state_invalid_dropped_packets_total: the INVALID drops, counted by the
kernel and read at scrape time.

Both backends count their conntrack-INVALID drop in the kernel (iptables: the nfacct object
`ct_state_invalid_dropped_pkts`; nft: the named counter of that name in each family's table).
The metric is read when Prometheus scrapes, as kube-proxy's collector does, so it costs
nothing between scrapes and is never stale; it is only registered for the node's own namespace.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from nfproxy.backends.iptables.render import INVALID_DROP_COUNTER
from nfproxy.backends.nft.render import TABLE
from nfproxy.kernel.nfacct import Nfacct
from nfproxy.kernel.process import KernelError

log = logging.getLogger("nfproxy.daemon")

METRIC = "kubeproxy_iptables_ct_state_invalid_dropped_packets_total"


def reader(backend: str, netns: str | None = None) -> Callable[[], int | None]:
    """Packets dropped as INVALID so far, or None while no counter exists yet."""
    if backend == "iptables":
        counters = Nfacct(netns)

        def from_nfacct() -> int | None:
            found = counters.get(INVALID_DROP_COUNTER)
            return None if found is None else found.packets

        return from_nfacct
    from nfproxy.kernel.nft_netlink import NetlinkNft

    # Over netlink: libnftables lists one counter only after fetching the whole ruleset (2 s
    # per family at 10 000 services, at every scrape).
    kernel = NetlinkNft(netns)

    def from_nft() -> int | None:
        values = [kernel.counters(f, TABLE).get(INVALID_DROP_COUNTER) for f in ("ip", "ip6")]
        present = [v for v in values if v is not None]
        return sum(present) if present else None

    return from_nft


class InvalidDropCollector(Collector):
    def __init__(self, read: Callable[[], int | None]) -> None:
        self._read = read

    def describe(self) -> list[CounterMetricFamily]:
        return [self._family()]

    def _family(self) -> CounterMetricFamily:
        # prometheus_client appends `_total` to counter samples itself.
        return CounterMetricFamily(
            METRIC.removesuffix("_total"),
            "packets dropped by iptables to work around conntrack problems",
        )

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = self._family()
        try:
            packets = self._read()
        except (KernelError, OSError) as exc:
            log.debug("reading %s failed: %s", INVALID_DROP_COUNTER, exc)
            packets = None
        if packets is not None:
            family.add_metric([], packets)
        yield family

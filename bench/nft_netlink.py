#!/usr/bin/env python3
"""One-service nft transactions: nfnetlink batches (NetlinkNft) against libnftables, by size.

For each cluster size S (uniform_cluster: IPv4 TCP ClusterIP services x N endpoints), one
throwaway namespace gets a full sync through libnftables; then the same one-service change is
made back and forth (one endpoint added to a service, then removed: the delta the proxier sends)
and applied alternately through NetlinkNft and through libnftables. Rendering and delta are
outside the timing: this measures the kernel path only. bench/sync.py measures whole syncs.

It also times what the encoder no longer does since transactions are objects: the old front end
wrote each delta as text, split it into commands and tokenized every command whole before
compiling (`retokenize`); now verbs, names, elements and rule bodies' statements are read from
the objects (`encode`, the whole compile_transaction, messages built).

Usage: sudo .venv/bin/python bench/nft_netlink.py [--sizes 100,10000] [--endpoints 10] [--repeat 21]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nfproxy.backends.nft import render as nft_backend  # noqa: E402
from nfproxy.core.changes import diff  # noqa: E402
from nfproxy.kernel import netns  # noqa: E402
from nfproxy.kernel.nft import NftSession  # noqa: E402
from nfproxy.kernel.nft_netlink import NetlinkNft  # noqa: E402
from nfproxy.nftables import text as nft_text  # noqa: E402
from nfproxy.core.model import ClusterState, Endpoint, IPFamily, sort_endpoints  # noqa: E402
from nfproxy.testing import uniform_cluster  # noqa: E402

# nft's tokens, as a reader of the script text would split it: what retokenizing costs.
_TOKEN = re.compile(r'"[^"]*"|[{},]|[^\s{},]+')


def measure(services: int, endpoints: int, repeat: int) -> dict[str, float]:
    state = uniform_cluster(services, endpoints)
    key = sorted(state.services, key=lambda k: (k[0].namespace, k[0].name))[services // 2]
    grown = dataclasses.replace(
        state,
        endpoints={
            **state.endpoints,
            key: sort_endpoints([*state.endpoints[key], Endpoint(ip="10.255.0.1", port=8080, node_name="node-b")]),
        },
    )
    times: dict[str, list[float]] = {"netlink": [], "libnftables": []}
    commands: list[int] = []
    retokenize: list[float] = []
    encode: list[float] = []
    with netns.throwaway("nfp-bench-nl") as ns:
        session, fast = NftSession(ns), NetlinkNft(ns)
        applied = nft_backend.render(state, IPFamily.V4)
        start = time.perf_counter()
        session.apply(applied.script())
        full = time.perf_counter() - start
        current: ClusterState = state
        stale: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())
        try:
            for i in range(2 * repeat + 2):
                target = grown if current is state else state
                keys = diff(current, target).of(IPFamily.V4)
                new = nft_backend.render_update(applied, target, keys)
                d = nft_backend.delta(applied, new, keys, delete_chains=stale[0], delete_sets=stale[1])
                way = "netlink" if i % 2 == 0 else "libnftables"
                gc.collect()
                start = time.perf_counter()
                if way == "netlink":
                    fast.apply(d.transaction)
                else:
                    session.apply(d.script())
                elapsed = time.perf_counter() - start
                if i >= 2:  # the first of each: sockets opened, set declarations read once
                    times[way].append(elapsed)
                commands.append(len(d.transaction))
                if way == "netlink" and i >= 2:
                    start = time.perf_counter()
                    for line in nft_text.script(d.transaction).splitlines():
                        _TOKEN.findall(line)
                    retokenize.append(time.perf_counter() - start)
                    start = time.perf_counter()
                    fast.compile(d.transaction)
                    encode.append(time.perf_counter() - start)
                applied, current, stale = new, target, (d.stale_chains, d.stale_sets)
        finally:
            fast.close()
    return {
        "full_s": full,
        "netlink_ms": statistics.median(times["netlink"]) * 1000,
        "netlink_max_ms": max(times["netlink"]) * 1000,
        "libnftables_ms": statistics.median(times["libnftables"]) * 1000,
        "commands": statistics.median(commands),
        "retokenize_ms": statistics.median(retokenize) * 1000,
        "encode_ms": statistics.median(encode) * 1000,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="100,10000")
    ap.add_argument("--endpoints", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=21)
    args = ap.parse_args()
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        r = measure(size, args.endpoints, args.repeat)
        rows.append((size, r))
        print(
            f"{size:>6} x {args.endpoints}: full load {r['full_s']:.2f} s; one-service change "
            f"({r['commands']:.0f} commands): netlink {r['netlink_ms']:.2f} ms (max {r['netlink_max_ms']:.2f}), "
            f"libnftables {r['libnftables_ms']:.2f} ms; no longer spent re-tokenizing the text "
            f"{r['retokenize_ms']:.3f} ms (encoding from objects {r['encode_ms']:.3f} ms)",
            flush=True,
        )
    if len(rows) > 1:
        small, big = rows[0][1], rows[-1][1]
        print(
            f"ratio {rows[-1][0]} / {rows[0][0]}: netlink {big['netlink_ms'] / small['netlink_ms']:.2f}x, "
            f"libnftables {big['libnftables_ms'] / small['libnftables_ms']:.2f}x"
        )


if __name__ == "__main__":
    main()

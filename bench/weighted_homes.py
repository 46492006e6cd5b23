"""What issue M's one-service change would cost if weighted ports never moved between tables.

Today a weighted port lives in nfproxy while its weight sum divides the lane and in the off table
otherwise (render.home), so a change that takes the sum off the lane (here an endpoint of weight
3 added: sum 31 -> 34 = 2 . 17; bench/sync.py's endpoint of weight 1 did it, 31 -> 32, until the
lane held 2^5 on 2026-12-03) is a move. This bench replaces `home` for its run by "every weighted port of one in T
services lives in the off table, whatever its sum": the layout of T hash-sharded off tables,
seen from one shard. The same change on a port of that shard is then a rule rewrite in a table
of S / T ports, against an endpoint added to an unweighted cluster of the same size. A
measurement of a layout not built, so `home` is patched here and nowhere else.

    sudo .venv/bin/python bench/weighted_homes.py [--services 10000] [--shards 16,64] [--repeat 15]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from nfproxy.backends.nft import full, render, update  # noqa: E402
from nfproxy.core.model import ClusterState  # noqa: E402
from nfproxy.kernel import netns  # noqa: E402
from nfproxy.testing import uniform_cluster  # noqa: E402

from one_change import Cluster  # noqa: E402  (one cluster, one service changed at a time)
from sync import weighted  # noqa: E402


def in_shard(first_ip: str, shards: int) -> bool:
    return zlib.crc32(first_ip.encode()) % shards == 0


def sharded_home(shards: int):  # noqa: ANN201
    def home(r: render.Routing, affinity: bool) -> str:
        for subset in (r.cluster, r.local):
            if subset and render.weighted(subset):
                return render.OFF_TABLE if in_shard(subset[0].ip, shards) else render.TABLE
        return render.TABLE
    return home


def changes(state: ClusterState, repeat: int, pick, added: int = 1) -> list[float]:  # noqa: ANN001
    """ms per change: an endpoint added to one picked service at a time (weight 3: in the
    weighted cluster 31 -> 34, a new modulus and so a rule rewrite)."""
    with netns.throwaway("nfp-homes") as ns:
        cluster = Cluster(ns, state, pick, added_weight=added)
        return [cluster.change() for _ in range(repeat)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--services", type=int, default=10_000)
    ap.add_argument("--shards", default="16,64")
    ap.add_argument("--repeat", type=int, default=15)
    args = ap.parse_args()
    plain = uniform_cluster(args.services, 10)
    heavy = weighted(plain, [1, 2, 7])
    real = render.home  # used by the full render and by the partial syncs' routing: both are set
    print(f"# weighted ports kept off the lane's table: {args.services} x 10, one run")
    print("| shards T | ports in the shard | unweighted change (ms) | change in the shard, sum 31 -> 34 (ms) | ratio |")
    print("|---|---|---|---|---|")
    try:
        for shards in (int(t) for t in args.shards.split(",")):
            full.home = update.home = sharded_home(shards)  # type: ignore[assignment]
            mine = sum(in_shard(heavy.endpoints[k][0].ip, shards) for k in heavy.services)
            base = statistics.median(changes(plain, args.repeat, lambda eps: True))
            moved = statistics.median(changes(heavy, args.repeat, lambda eps, t=shards: in_shard(eps[0].ip, t), added=3))
            print(f"| {shards} | {mine} | {base:.2f} | {moved:.2f} | {moved / base:.3f} |", flush=True)
    finally:
        full.home = update.home = real  # type: ignore[assignment]
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

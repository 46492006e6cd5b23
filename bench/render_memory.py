#!/usr/bin/env python3
"""What a daemon keeps of an nft render: the memory one family's NftRuleset holds at S services
x N endpoints, and the time of render, transaction and text, for this checkout and others.

Each tree is measured in a child process of its own (its `nfproxy` imported from that tree):
the bytes the render holds as tracemalloc counts them (requested sizes) and as pymalloc's
allocated blocks count them (`sys._debugmallocstats`, size classes: what RSS sees), the code
its imports hold (the renderer and the in-memory kernel), and the best of `--repeat` timings.

    .venv/bin/python bench/render_memory.py [--services 10000] [--endpoints 10] [--repeat 5]
        [--compare-tree /tmp/old-checkout ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import gc, json, os, re, sys, tempfile, time, tracemalloc
sys.path.insert(0, sys.argv[1])
tracemalloc.start()
from nfproxy.backends.nft import render as r
import nfproxy.kernel.memory.nft
code = tracemalloc.get_traced_memory()[0]
tracemalloc.stop()
from nfproxy.core.model import IPFamily
from nfproxy.nftables import text as nft_text
from nfproxy.testing import uniform_cluster


def blocks():
    fd, path = tempfile.mkstemp()
    saved = os.dup(2)
    os.dup2(fd, 2)
    try:
        sys._debugmallocstats()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(fd)
    with open(path) as f:
        text = f.read()
    os.unlink(path)
    return int(re.search(r"# bytes in allocated blocks\s*=\s*([\d,]+)", text).group(1).replace(",", ""))


state = uniform_cluster(int(sys.argv[2]), int(sys.argv[3]))
gc.collect()
before = blocks()
tracemalloc.start()
rs = r.render(state, IPFamily.V4)
gc.collect()
traced = tracemalloc.get_traced_memory()[0]
tracemalloc.stop()
held = blocks() - before
best = {"render": 9e9, "transaction": 9e9, "text": 9e9}
for _ in range(int(sys.argv[4])):
    del rs
    gc.collect()
    t = time.perf_counter(); rs = r.render(state, IPFamily.V4); best["render"] = min(best["render"], time.perf_counter() - t)
    t = time.perf_counter(); tx = rs.transaction(); best["transaction"] = min(best["transaction"], time.perf_counter() - t)
    t = time.perf_counter(); nft_text.script(tx); best["text"] = min(best["text"], time.perf_counter() - t)
    del tx
print(json.dumps({"traced": traced, "blocks": held, "code": code, **best}))
"""


def measure(tree: str, services: int, endpoints: int, repeat: int) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, tree, str(services), str(endpoints), str(repeat)],
        check=True, capture_output=True, text=True, cwd=tree,
    )
    return json.loads(out.stdout.splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--services", type=int, default=10000)
    ap.add_argument("--endpoints", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--compare-tree", action="append", default=[], help="another checkout to measure")
    args = ap.parse_args()
    mib = 2 ** 20
    print(f"one family's nft render held at {args.services} x {args.endpoints}; best of {args.repeat} timings")
    print(f"{'tree':40} {'traced MiB':>10} {'blocks MiB':>10} {'code MiB':>9} {'render ms':>9} {'tx ms':>6} {'text ms':>7}")
    for tree in [ROOT, *args.compare_tree]:
        m = measure(tree, args.services, args.endpoints, args.repeat)
        print(f"{tree:40} {m['traced'] / mib:10.2f} {m['blocks'] / mib:10.2f} {m['code'] / mib:9.2f}"
              f" {m['render'] * 1e3:9.0f} {m['transaction'] * 1e3:6.0f} {m['text'] * 1e3:7.0f}")


if __name__ == "__main__":
    main()

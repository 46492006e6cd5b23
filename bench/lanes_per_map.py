"""What the lane's size costs: today's lane against the one before 2026-12-03, in one run.

The nft endpoint maps hold LANES_PER_MAP lanes of LANE values each (backends/nft/render.py):
a larger lane holds more weight sums (bench/lane_coverage.py), fewer lanes fit a map, and so
there are more maps. Both layouts run from this tree, each in a fresh process with
`render.LANE` and `render.LANES_PER_MAP` set for that process only (a layout not built is
measured, nothing is changed), taking turns:

- cold full syncs at S x N, unweighted and with weights 1:2:7 cycled (wall and CPU seconds);
- services added one at a time past a full map: the add that opens a new endpoint map (one
  batch from the bulk compiler, the map's declaration written from the object; until 2026-12-04
  declared through libnftables before a netlink batch) against the adds that do not.

    sudo .venv/bin/python bench/lanes_per_map.py [--services 10000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from nfproxy.backends.nft import full as nft_full, render, structure as nft_structure  # noqa: E402

LAYOUTS = {
    "before 2026-12-03: 67 026 960 x 64": (67_026_960, 64),
    "today": (render.LANE, render.LANES_PER_MAP),
}
MED = statistics.median


def _cpu() -> float:
    return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                  resource.getrusage(resource.RUSAGE_CHILDREN)))


def child_full(services: int, weights: bool) -> dict[str, float]:
    from sync import full_sync, uniform_cluster, weighted

    state = uniform_cluster(services, 10)
    if weights:
        state = weighted(state, [1, 2, 7])
    cpu = _cpu()
    seconds = full_sync("nft", state)
    return {"seconds": seconds, "cpu": _cpu() - cpu}


def child_adds(services: int) -> dict[str, list[float]]:
    """ms per service added, from a cluster whose lanes fill their last map exactly."""
    from nfproxy.core.changes import Touched
    from nfproxy.daemon.proxier import Proxier
    from nfproxy.kernel import netns
    from nfproxy.testing import uniform_cluster

    per = render.LANES_PER_MAP
    start = services // per * per
    big = uniform_cluster(start + 3 * per, 10)
    keys = sorted(big.services, key=lambda k: int(k[0].name.split("-")[1]))

    def first(n: int):  # noqa: ANN202
        return dataclasses.replace(big, services={k: big.services[k] for k in keys[:n]},
                                   endpoints={k: big.endpoints[k] for k in keys[:n]})

    out: dict[str, list[float]] = {"opening": [], "others": []}
    with netns.throwaway("nfp-lanes") as ns:
        proxier = Proxier("nft", netns=ns)
        current = first(start)
        proxier.sync(current)
        for n in range(start + 1, start + 3 * per + 1):
            new = first(n)
            began = time.perf_counter()
            result = proxier.sync(new, touched=Touched(current, frozenset({keys[n - 1]})))
            elapsed = (time.perf_counter() - began) * 1000
            assert result.kind == "partial", result
            out["opening" if (n - 1) % per == 0 else "others"].append(elapsed)
            current = new
    return out


def run_child(layout: str, what: str, services: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", layout, what, str(services)],
                         capture_output=True, text=True)
    if out.returncode != 0:
        print(out.stderr, file=sys.stderr)
        raise SystemExit(f"{layout} {what}: exit {out.returncode}")
    return json.loads(out.stdout.splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--services", type=int, default=10_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        layout, what, services = args.child
        for module in (render, nft_full, nft_structure):  # the modules that read them, not only the facade
            module.LANE, module.LANES_PER_MAP = LAYOUTS[layout]
        got = child_adds(int(services)) if what == "adds" else child_full(int(services), what == "weighted")
        print(json.dumps(got))
        return 0
    old, new = LAYOUTS
    print(f"# lanes per map: {args.services} x 10, {old} against today "
          f"({render.LANE} x {render.LANES_PER_MAP}), {args.rounds} rounds taking turns, one run", flush=True)
    full: dict[tuple[str, str], list[dict[str, float]]] = {}
    for i in range(args.rounds):
        for what in ("unweighted", "weighted"):
            for layout in ((old, new) if i % 2 == 0 else (new, old)):
                got = run_child(layout, what, args.services)
                full.setdefault((layout, what), []).append(got)
                print(f"round {i + 1} {what:>10} {layout}: {got['seconds']:.3f} s ({got['cpu']:.3f} s CPU)", flush=True)
    adds = {layout: run_child(layout, "adds", args.services) for layout in (old, new)}
    print()
    print("| measure | before | today | today / before |")
    print("|---|---|---|---|")
    for what in ("unweighted", "weighted"):
        for key, unit in (("seconds", "s"), ("cpu", "CPU s")):
            a = [r[key] for r in full[(old, what)]]
            b = [r[key] for r in full[(new, what)]]
            paired = MED([y / x for x, y in zip(a, b)])
            print(f"| full sync, {what} ({unit}; median, best; rounds' ratios) | {MED(a):.3f}, {min(a):.3f} | "
                  f"{MED(b):.3f}, {min(b):.3f} | {MED(b) / MED(a):.3f}, {min(b) / min(a):.3f}; {paired:.3f} |")
    for label, key in (("a service added that opens an endpoint map (ms, median of 3)", "opening"),
                       ("a service added into a map already open (ms, median)", "others")):
        a, b = MED(adds[old][key]), MED(adds[new][key])
        print(f"| {label} | {a:.2f} | {b:.2f} | {b / a:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Which weight vectors a lane keeps element-only: the share whose sum over their gcd divides it.

A chain whose weight sum (over the weights' gcd) divides the lane W draws `mod W` whatever the
weights, so a weight change between such sums writes map elements only; any other sum draws
`mod sum` and its change rewrites the rule (docs/nft-layouts.md, "Chains off the lane"). W is
bounded by the lanes a map holds: lanes_per_map x W < 2^32. Pure arithmetic, seeded, one run:

    .venv/bin/python bench/lane_coverage.py [--trials 20000]
"""

from __future__ import annotations

import argparse
import math
import random
from functools import reduce

W = 67_026_960  # render.LANE: 2^4 . 3^3 . 5 . 7 . 11 . 13 . 31, 64 lanes per map
LANES = {
    "W, 64 lanes per map (today)": W,
    "2W, 32 per map (adds 2^5)": 2 * W,
    "5W, 8 per map (adds 5^2)": 5 * W,
    "10W, 4 per map (adds 2^5 and 5^2)": 10 * W,
}


def uniform(rng: random.Random, hi: int, n: int) -> list[int]:
    return [rng.randint(1, hi) for _ in range(n)]


def percentages(rng: random.Random, n: int) -> list[int]:
    """n positive integer weights summing to 100, uniform over compositions."""
    cuts = sorted(rng.sample(range(1, 100), n - 1))
    return [b - a for a, b in zip([0, *cuts], [*cuts, 100])]


def share(lane: int, draw, trials: int, seed: int) -> float:  # noqa: ANN001
    rng = random.Random(seed)
    hits = 0
    for _ in range(trials):
        w = draw(rng)
        hits += lane % (sum(w) // reduce(math.gcd, w)) == 0
    return hits / trials


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=20_000)
    args = ap.parse_args()
    cells = [(f"1..10 x{n}", lambda r, n=n: uniform(r, 10, n)) for n in (2, 3, 5, 10)]
    cells += [(f"1..100 x{n}", lambda r, n=n: uniform(r, 100, n)) for n in (2, 3, 5)]
    cells += [(f"percentages x{n}", lambda r, n=n: percentages(r, n)) for n in (2, 3, 5)]
    print(f"# share of weight vectors on the lane, {args.trials} per cell, seeded")
    print("| lane | " + " | ".join(name for name, _ in cells) + " |")
    print("|---|" + "---|" * len(cells))
    for label, lane in LANES.items():
        row = [share(lane, draw, args.trials, seed) for seed, (_, draw) in enumerate(cells)]
        print(f"| {label} | " + " | ".join(f"{x:.0%}" for x in row) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

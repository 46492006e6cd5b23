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

W = 67_026_960  # the lane before 2026-12-03: 2^4 . 3^3 . 5 . 7 . 11 . 13 . 31, 64 lanes per map
LANES = {
    "W = 2^4.3^3.5.7.11.13.31, 64 lanes per map (until 2026-12-03)": W,
    "2W (adds 2^5), 32 per map": 2 * W,
    "2^4.3^2.5^2.7.11.13.31 (5^2 for 3^3), 32 per map": 111_711_600,
    "2^5.3^2.5^2.7.11.13.17 (17 for 31), 32 per map": 122_522_400,
    "2^5.3^2.5^2.7.11.13.31 (2^5 and 5^2 for 3^3), 16 per map": 223_423_200,
    "5W (adds 5^2), 8 per map": 5 * W,
    "10W (adds 2^5 and 5^2), 4 per map": 10 * W,
}


def uniform(rng: random.Random, hi: int, n: int) -> list[int]:
    return [rng.randint(1, hi) for _ in range(n)]


def percentages(rng: random.Random, n: int) -> list[int]:
    """n positive integer weights summing to 100, uniform over compositions."""
    cuts = sorted(rng.sample(range(1, 100), n - 1))
    return [b - a for a, b in zip([0, *cuts], [*cuts, 100])]


def on_lane(lane: int, w: list[int]) -> bool:
    return lane % (sum(w) // reduce(math.gcd, w)) == 0


def share(lane: int, draw, trials: int, seed: int) -> float:  # noqa: ANN001
    rng = random.Random(seed)
    return sum(on_lane(lane, draw(rng)) for _ in range(trials)) / trials


def stays(lane: int, draw, trials: int, seed: int) -> float:  # noqa: ANN001
    """Of the vectors on the lane, the share still on it with a pod of the default weight 1
    added (bench/sync.py's one-service change): the change is then map elements only."""
    rng = random.Random(seed)
    on = kept = 0
    for _ in range(trials):
        w = draw(rng)
        if on_lane(lane, w):
            on += 1
            kept += on_lane(lane, [*w, 1])
    return kept / on if on else 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=20_000)
    args = ap.parse_args()
    cells = [(f"1..10 x{n}", lambda r, n=n: uniform(r, 10, n)) for n in (2, 3, 5, 10)]
    cells += [(f"1..100 x{n}", lambda r, n=n: uniform(r, 100, n)) for n in (2, 3, 5)]
    cells += [(f"percentages x{n}", lambda r, n=n: percentages(r, n)) for n in (2, 3, 5)]
    added = [(f"+1 on 1..10 x{n}", lambda r, n=n: uniform(r, 10, n)) for n in (3, 10)]
    added += [(f"+1 on percentages x{n}", lambda r, n=n: percentages(r, n)) for n in (3,)]
    print(f"# share of weight vectors on the lane, {args.trials} per cell, seeded; '+1 on': of those")
    print("# on the lane, the share that stays on it when an endpoint of weight 1 is added")
    print("| lane | " + " | ".join(name for name, _ in cells + added) + " |")
    print("|---|" + "---|" * len(cells + added))
    for label, lane in LANES.items():
        row = [share(lane, draw, args.trials, seed) for seed, (_, draw) in enumerate(cells)]
        row += [stays(lane, draw, args.trials, 100 + seed) for seed, (_, draw) in enumerate(added)]
        print(f"| {label} | " + " | ".join(f"{x:.0%}" for x in row) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

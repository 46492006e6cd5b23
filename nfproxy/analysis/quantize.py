"""The kernel's integer arithmetic behind "random", as exact rationals (reference §4).

Public API:
- `iptables_threshold(p_text) -> int` and `iptables_probability(p_text) -> Fraction`
- `iptables_saved_text(threshold) -> str` (what iptables-save prints back)
- `ideal_probability(p_text) -> Fraction` (the simplest rational the printed value stands for)
- `numgen_buckets(n) -> tuple[int, ...]`, `numgen_probability(k, n) -> Fraction`
- `cascade(probabilities) -> list[Fraction]` (what each rule of a statistic cascade receives)

A rule printed `--probability 0.3333333333` does not fire with probability 1/3, and `numgen
random mod 3` does not give each slot 1/3 either: each is a ratio of integers fixed by the code
below. Comparing two backends "exactly" means comparing these ratios, not the ideal 1/n.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from fractions import Fraction

STATISTIC_SCALE = 1 << 31
NUMGEN_SCALE = 1 << 32


@functools.lru_cache(maxsize=4096)
def iptables_threshold(p_text: str) -> int:
    """The 31-bit threshold iptables stores for `--probability p_text`.

    Mirrors iptables extensions/libxt_statistic.c (statistic_parse):
    `info->u.random.probability = lround(0x80000000 * cb->val.dbl)`, the double read by strtod
    (Python's float() rounds the same, correctly). The product with 2^31 is exact in binary, and
    so is adding 1/2 to it (it stays below 2^32 with 53 significant bits), so the only rounding
    is lround's own.
    """
    p = float(p_text)
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"statistic probability {p_text!r} is outside [0, 1]")
    return math.floor(p * STATISTIC_SCALE + 0.5)


def iptables_probability(p_text: str) -> Fraction:
    """How often the rule really fires.

    Mirrors linux net/netfilter/xt_statistic.c (statistic_mt): the match fires when
    `(get_random_u32() & 0x7FFFFFFF) < info->u.random.probability`, i.e. for `threshold` of the
    2^31 equally likely values.
    """
    return Fraction(iptables_threshold(p_text), STATISTIC_SCALE)


def iptables_saved_text(threshold: int) -> str:
    """How iptables-save prints a stored threshold: libxt_statistic.c statistic_print,
    `printf(" --probability %.11f", 1.0 * info->u.random.probability / 0x80000000)`."""
    return f"{threshold / STATISTIC_SCALE:.11f}"


def simplest_between(low: Fraction, high: Fraction) -> Fraction:
    """The fraction with the smallest denominator in the closed interval [low, high]
    (Stern-Brocot descent; 0 <= low <= high)."""
    if low > high:
        raise ValueError("empty interval")
    floor = math.floor(low)
    if floor == low:
        return Fraction(floor)
    if floor + 1 <= high:
        return Fraction(floor + 1)
    # Both in (floor, floor+1): recurse on the reciprocals of the fractional parts.
    rest = simplest_between(1 / (high - floor), 1 / (low - floor))
    return floor + 1 / rest


@functools.lru_cache(maxsize=4096)
def ideal_probability(p_text: str) -> Fraction:
    """The probability a cascade rule was written to have: the simplest rational that, printed
    as kube-proxy prints it (%0.10f) and stored by iptables, gives the same kernel threshold.

    Both `0.3333333333` (what kube-proxy writes) and `0.33333333349` (what iptables-save prints
    back) come out as exactly 1/3. Both roundings matter: 1/44 is written 0.0227272727, which
    iptables stores as 48806446 although 1/44 * 2^31 = 48806446.55. The interval of intended
    values is therefore the threshold's preimage [t - 1/2, t + 1/2] / 2^31 widened by half a unit
    of the 10th decimal; it is ~5.7e-10 wide, so it holds at most one fraction with a
    denominator below ~40 000 and every 1/k in that range is recovered exactly. A probability
    written on purpose as 0.34 stays 17/50.

    Text exactly as kube-proxy prints it (ten decimals) is read more closely: the value was
    within half a unit of the 10th decimal of what it prints, a window 1e-10 wide. Two fractions
    with denominators up to 100 000 are further apart than that, so every weighted cascade rule
    w_i / (w_i + ... + w_{n-1}) (sums up to 64 000: core.categorize) is recovered exactly.
    """
    t = iptables_threshold(p_text)
    if t == 0:
        return Fraction(0)
    if t >= STATISTIC_SCALE:
        return Fraction(1)
    half = Fraction(1, 2)
    digit = Fraction(1, 2 * 10**10)
    whole, _, decimals = p_text.strip().partition(".")
    if len(decimals) == 10 and decimals.isdigit() and whole in ("0", "1"):
        printed = Fraction(p_text.strip())
        return simplest_between(max(Fraction(0), printed - digit), min(Fraction(1), printed + digit))
    low = max(Fraction(0), (t - half) / STATISTIC_SCALE - digit)
    high = min(Fraction(1), (t + half) / STATISTIC_SCALE + digit)
    return simplest_between(low, high)


def numgen_buckets(n: int) -> tuple[int, ...]:
    """How many of the 2^32 random values land in each slot of `numgen random mod n`.

    Mirrors linux net/netfilter/nft_numgen.c (nft_ng_random_gen):
    `reciprocal_scale(get_random_u32(), priv->modulus) + priv->offset`, and
    include/linux/kernel.h reciprocal_scale(val, ep_ro) = `(u32)(((u64) val * ep_ro) >> 32)`.
    Slot k gets the r with k <= r*n/2^32 < k+1, i.e. r in [ceil(k 2^32/n), ceil((k+1) 2^32/n)).
    """
    if n <= 0:
        raise ValueError(f"numgen modulus must be positive, not {n}")

    def edge(k: int) -> int:
        return -((-k * NUMGEN_SCALE) // n)  # ceil(k * 2^32 / n)

    return tuple(edge(k + 1) - edge(k) for k in range(n))


def numgen_probability(k: int, n: int) -> Fraction:
    return Fraction(numgen_buckets(n)[k], NUMGEN_SCALE)


def cascade(probabilities: Sequence[Fraction]) -> list[Fraction]:
    """Rule i of a cascade fires with q_i of what reaches it: it receives
    prod_{j<i}(1 - q_j) * q_i. The returned list has one more entry: what falls through."""
    out: list[Fraction] = []
    rest = Fraction(1)
    for q in probabilities:
        out.append(rest * q)
        rest *= 1 - q
    out.append(rest)
    return out


def numgen_slot_count(first: int, last: int, n: int) -> int:
    """How many of the 2^32 random values land in slots first..last of `numgen random mod n`
    (0 <= first <= last < n): ceil((last+1) 2^32/n) - ceil(first 2^32/n), by the edges of
    `numgen_buckets`. Constant time, so a modulus of 2^32 (or more) costs what 2 costs: the
    slots' sizes come in at most two values, and a lookup only needs the slots it names."""
    if n <= 0:
        raise ValueError(f"numgen modulus must be positive, not {n}")
    if not 0 <= first <= last < n:
        raise ValueError(f"numgen slots {first}..{last} outside 0..{n - 1}")
    return -((-(last + 1) * NUMGEN_SCALE) // n) + ((-first * NUMGEN_SCALE) // n)

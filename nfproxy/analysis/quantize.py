"""The kernel's integer arithmetic behind "random", as exact rationals (reference §4).

Public API:
- `iptables_threshold(p_text) -> int` and `iptables_probability(p_text) -> Fraction`
- `iptables_saved_text(threshold) -> str` (what iptables-save prints back)
- `ideal_probability(p_text) -> Fraction` (the simplest rational the printed value stands for)
- `numgen_buckets(n) -> tuple[int, ...]`, `numgen_probability(k, n) -> Fraction`
- `cascade(probabilities) -> list[Fraction]` (what each rule of a statistic cascade receives)
- `TEN_DECIMAL_EXACT_DENOMINATOR`, `ten_decimal_exact(num, den)` (what `ideal_probability` can
  recover from kube-proxy's `%0.10f` text)
- `common_denominator(values) -> (numerators, den)`, `fsum(values) -> Fraction` (sums without a
  gcd per term)
- `exact_text(value, max_digits) -> str`, `rounded_decimal(value) -> str` (how exact values are
  shown: a 1000-endpoint cascade's shares have 10 000-digit denominators)

A rule printed `--probability 0.3333333333` does not fire with probability 1/3, and `numgen
random mod 3` does not give each slot 1/3 either: each is a ratio of integers fixed by the code
below. Comparing two backends "exactly" means comparing these ratios, not the ideal 1/n.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from decimal import Decimal
from fractions import Fraction

STATISTIC_SCALE = 1 << 31
NUMGEN_SCALE = 1 << 32

# Ten-decimal text (kube-proxy's %0.10f) pins a value to a window 1e-10 wide; two fractions with
# denominators up to this are at least 1/this^2 = 1e-10 apart, so at most one lies in the window
# and `ideal_probability` finds it. Beyond it the window can hold a simpler fraction than the one
# meant (a weighted cascade over 400 endpoints of weight up to 1000 has rules like 1/399 999).
TEN_DECIMAL_EXACT_DENOMINATOR = 100_000


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
    w_i / (w_i + ... + w_{n-1}) with a reduced denominator up to TEN_DECIMAL_EXACT_DENOMINATOR
    is recovered exactly (always for up to 100 endpoints of weight <= 1000). Beyond, the window
    can hold a simpler fraction (971/188343 prints 0.0051554876, read back as 877/170110): no
    text can say which was meant, so `compare` learns it from the model (`ten_decimal_exact`).
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


def ten_decimal_exact(num: int, den: int) -> bool:
    """Whether num/den, printed `%0.10f`, is read back as exactly num/den by `ideal_probability`
    (its reduced denominator is within TEN_DECIMAL_EXACT_DENOMINATOR; 0 and 1 always are)."""
    if den <= TEN_DECIMAL_EXACT_DENOMINATOR or num <= 0 or num >= den:
        return True
    return den // math.gcd(num, den) <= TEN_DECIMAL_EXACT_DENOMINATOR


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


# --------------------------------------------------------------------------------------------
# Summing and showing exact values. A kernel-mode share of an iptables cascade is k / 2^(31 i)
# for the endpoint at depth i: at 2 000 endpoints, 60 000-bit numbers. Adding such Fractions one
# by one pays a gcd of that size per term, and `str()` of one exceeds Python's 4 300-digit limit.

# Text output (check, trace) shows the fraction when numerator and denominator both have at
# most this many digits (nft's k/2^32, iptables cascades to depth 4, every weight share);
# otherwise the rounded decimal marked with "≈".
TEXT_EXACT_DIGITS = 40
# JSON output keeps exactness further: up to this many digits (an iptables cascade to depth
# ~100); beyond, the rounded decimal. Bounded so that the output stays linear in the rules.
JSON_EXACT_DIGITS = 1000
# Significant digits of a rounded decimal: far below any difference the analysis reports
# (1e-9 tolerances, ppb deviations), far above float's 17.
ROUNDED_DIGITS = 20
_LOG10_2 = math.log10(2)


def common_denominator(values: Sequence[Fraction]) -> tuple[list[int], int]:
    """(numerators, den) with values[i] == numerators[i] / den, den the lcm of the denominators.

    The lcm is taken as 2^max(twos) times the lcm of the distinct odd parts: kernel-mode values
    are all dyadic (odd part 1) and ideal-mode ones have small odd parts, so neither pays a
    gcd on 60 000-bit numbers, which is what `math.lcm` over the denominators would do."""
    parts: list[tuple[int, int]] = []  # (odd part, power of two) per denominator
    for v in values:
        d = v.denominator
        tz = (d & -d).bit_length() - 1
        parts.append((d >> tz, tz))
    if not parts:
        return [], 1
    twos = max(tz for _, tz in parts)
    odd = math.lcm(*{o for o, _ in parts})
    # den // d as (odd // o) << (twos - tz): a shift, not a long division of 60 000-bit numbers.
    nums = [v.numerator * (odd // o) << (twos - tz) for v, (o, tz) in zip(values, parts)]
    return nums, odd << twos


def fsum(values: Iterable[Fraction]) -> Fraction:
    """`sum(values, Fraction(0))` over one common denominator (`common_denominator`): linear in
    the total size of the values instead of a big gcd per term."""
    nums, den = common_denominator(list(values))
    return Fraction(sum(nums), den)


def _digits_at_most(n: int, digits: int) -> bool:
    return abs(n) < _power_of_ten(digits)


@functools.lru_cache(maxsize=64)
def _power_of_ten(k: int) -> int:
    return 10**k


def rounded_decimal(value: Fraction, digits: int = ROUNDED_DIGITS) -> str:
    """`value` correctly rounded (half to even) to `digits` significant digits, as a decimal
    string that `Fraction()` and `float()` read back: positional down to 1e-6, else with an
    exponent (`1.25E-7`). Integer arithmetic only: never `str()` of a long integer, one
    division of the value's size."""
    if value == 0:
        return "0"
    sign = "-" if value < 0 else ""
    n, d = abs(value.numerator), value.denominator
    # The decimal exponent e with 10^e <= n/d < 10^(e+1): estimated from the bit lengths (off by
    # at most one), then made exact.
    e = math.floor((n.bit_length() - d.bit_length()) * _LOG10_2)

    def below(k: int) -> bool:  # n/d < 10^k
        return n < d * 10**k if k >= 0 else n * 10**-k < d

    while below(e):
        e -= 1
    while not below(e + 1):
        e += 1
    shift = digits - 1 - e  # scale so that the quotient has `digits` digits
    num, den = (n * 10**shift, d) if shift >= 0 else (n, d * 10**-shift)
    q, r = divmod(num, den)
    if 2 * r > den or (2 * r == den and q % 2):
        q += 1
    if q == 10**digits:  # rounded up to the next power of ten
        q //= 10
        shift -= 1
    return sign + str(Decimal(q).scaleb(-shift))


def exact_text(value: Fraction, max_digits: int = TEXT_EXACT_DIGITS) -> str:
    """The exact fraction as `str(Fraction)` writes it ("0", "1", "p/q") when numerator and
    denominator have at most `max_digits` digits each; else `rounded_decimal(value)`. Which one
    it is shows in the text itself: an exact value never has a decimal point, a rounded one
    always does (or an exponent)."""
    if _digits_at_most(value.numerator, max_digits) and _digits_at_most(value.denominator, max_digits):
        return str(value)
    return rounded_decimal(value)


def shown(value: Fraction) -> str:
    """`exact_text` for people: the rounded decimal is marked "≈" (check's and trace's text)."""
    text = exact_text(value, TEXT_EXACT_DIGITS)
    return text if "/" in text or text.lstrip("-").isdigit() else "≈" + text

"""Is what the kernel did consistent with what the rules say? Chi-square tests on counts.

Real traffic through a random split never lands exactly on 1/n per endpoint: counts are
multinomial. Equality checks would fail at random; tolerance bands picked by eye either hide
skew or flake. A goodness-of-fit p-value says how surprising the counts are under the expected
split, with one threshold for every n. These are thin wrappers over scipy.stats so that the
traffic tests, the compat corpus and the lab share one handling of the awkward cases (keys seen
but never expected, expected but never seen, columns empty in both samples).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from fractions import Fraction

from scipy import stats as scipy_stats


def uniform(keys: Iterable[str]) -> dict[str, Fraction]:
    """Probability 1/n for each of n keys: the split kube-proxy promises over n endpoints."""
    keys = list(dict.fromkeys(keys))
    if not keys:
        raise ValueError("a uniform split needs at least one key")
    return {k: Fraction(1, len(keys)) for k in keys}


def goodness_of_fit(
    observed: Mapping[str, int], expected: Mapping[str, Fraction | float]
) -> tuple[float, float]:
    """Pearson's chi-square of observed counts against expected probabilities: (statistic, p).

    `expected` holds probabilities or weights (normalised here); keys missing from `observed`
    count as zero. A count on a key the expectation gives no weight is impossible under it:
    (inf, 0.0), since scipy would divide by zero. With one possible key everything observed is
    certain: (0.0, 1.0).
    """
    for key, count in observed.items():
        if count < 0:
            raise ValueError(f"negative count for {key!r}: {count}")
    weights = {k: Fraction(w) if not isinstance(w, float) else w for k, w in expected.items()}
    if any(w < 0 for w in weights.values()):
        raise ValueError("expected probabilities must not be negative")
    total_weight = sum(weights.values())
    if total_weight <= 0:
        raise ValueError("expected probabilities sum to zero")
    total = sum(observed.values())
    if total == 0:
        raise ValueError("no observations")
    if any(count and weights.get(key, 0) == 0 for key, count in observed.items()):
        return math.inf, 0.0
    keys = [k for k, w in weights.items() if w > 0]
    if len(keys) == 1:
        return 0.0, 1.0
    f_obs = [observed.get(k, 0) for k in keys]
    f_exp = [float(weights[k] / total_weight) * total for k in keys]
    # Rounding in the float conversion must not trip scipy's sum check.
    scale = total / sum(f_exp)
    result = scipy_stats.chisquare(f_obs, [e * scale for e in f_exp])
    return float(result.statistic), float(result.pvalue)


def two_sample(
    counts_a: Mapping[str, int], counts_b: Mapping[str, int]
) -> tuple[float, float]:
    """Chi-square test that two samples come from one distribution: (statistic, p).

    For comparing backends (or a backend before and after a sync) without a model of the
    expected split. Keys are the union of both; a key seen in neither sample carries no
    information and is dropped (scipy rejects zero expected frequencies). With a single key
    left the samples cannot differ: (0.0, 1.0). No Yates correction, so 2x2 tables get the same
    plain Pearson statistic as larger ones.
    """
    for counts in (counts_a, counts_b):
        if any(c < 0 for c in counts.values()):
            raise ValueError("counts must not be negative")
        if sum(counts.values()) == 0:
            raise ValueError("each sample needs at least one observation")
    keys = [k for k in dict.fromkeys([*counts_a, *counts_b]) if counts_a.get(k, 0) or counts_b.get(k, 0)]
    if len(keys) == 1:
        return 0.0, 1.0
    table = [[counts_a.get(k, 0) for k in keys], [counts_b.get(k, 0) for k in keys]]
    result = scipy_stats.chi2_contingency(table, correction=False)
    return float(result.statistic), float(result.pvalue)

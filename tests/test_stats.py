"""The chi-square wrappers: right answers on known tables and the awkward cases handled."""

from __future__ import annotations

import math
import random
from fractions import Fraction

import pytest

from nfproxy.verify.stats import goodness_of_fit, two_sample, uniform


def test_uniform_gives_one_over_n() -> None:
    assert uniform(["a", "b", "c", "a"]) == {k: Fraction(1, 3) for k in "abc"}
    with pytest.raises(ValueError):
        uniform([])


def test_goodness_of_fit_matches_the_textbook_statistic() -> None:
    # 60 dice rolls: sum((o - 10)^2 / 10) = 42 / 10 with 5 degrees of freedom; chi2.sf(4.2, 5).
    observed = {str(i): c for i, c in enumerate([8, 9, 12, 11, 6, 14], 1)}
    stat, p = goodness_of_fit(observed, uniform(observed))
    assert stat == pytest.approx(4.2)
    assert p == pytest.approx(0.52099, abs=1e-5)


def test_goodness_of_fit_separates_a_fair_split_from_a_skewed_one() -> None:
    rng = random.Random(7)
    keys = ["10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80"]
    fair = {k: 0 for k in keys}
    for _ in range(3000):
        fair[rng.choice(keys)] += 1
    assert goodness_of_fit(fair, uniform(keys))[1] > 0.001
    skewed = {keys[0]: 1100, keys[1]: 1000, keys[2]: 900}
    assert goodness_of_fit(skewed, uniform(keys))[1] < 0.001


def test_goodness_of_fit_takes_fractions_floats_and_weights() -> None:
    observed = {"a": 500, "b": 250, "c": 250}
    by_fraction = goodness_of_fit(observed, {"a": Fraction(1, 2), "b": Fraction(1, 4), "c": Fraction(1, 4)})
    by_weight = goodness_of_fit(observed, {"a": 2, "b": 1, "c": 1})
    by_float = goodness_of_fit(observed, {"a": 0.5, "b": 0.25, "c": 0.25})
    assert by_fraction == pytest.approx((0.0, 1.0))
    assert by_weight == pytest.approx(by_fraction) and by_float == pytest.approx(by_fraction)


def test_goodness_of_fit_awkward_cases() -> None:
    # Seen but never expected: impossible under the expectation.
    stat, p = goodness_of_fit({"a": 10, "x": 1}, {"a": 1})
    assert math.isinf(stat) and p == 0.0
    # Expected but never seen counts as zero.
    assert goodness_of_fit({"a": 100}, {"a": 1, "b": 1})[1] < 1e-10
    # A single possible outcome: certain.
    assert goodness_of_fit({"a": 5}, {"a": 1, "b": 0}) == (0.0, 1.0)
    for observed, expected in (({}, {"a": 1}), ({"a": 1}, {"a": 0}), ({"a": -1}, {"a": 1})):
        with pytest.raises(ValueError):
            goodness_of_fit(observed, expected)


def test_two_sample_same_and_different_distributions() -> None:
    a = {"x": 480, "y": 520}
    assert two_sample(a, {"x": 510, "y": 490})[1] > 0.05
    assert two_sample(a, {"x": 700, "y": 300})[1] < 1e-6
    # 2x2 without Yates correction: the plain Pearson statistic.
    stat, _ = two_sample({"x": 10, "y": 20}, {"x": 20, "y": 10})
    assert stat == pytest.approx(20 / 3)


def test_two_sample_handles_zero_columns_and_single_keys() -> None:
    assert two_sample({"x": 50, "y": 50, "z": 0}, {"x": 45, "y": 55})[1] > 0.05
    assert two_sample({"x": 5, "z": 0}, {"x": 9}) == (0.0, 1.0)
    # A key only one sample saw is real evidence of a difference.
    assert two_sample({"x": 100, "y": 100}, {"x": 100, "y": 60, "z": 40})[1] < 1e-6
    with pytest.raises(ValueError):
        two_sample({}, {"x": 1})

"""Merge gain with its bootstrap interval, and correlations with theirs."""

import math

import numpy as np
import pytest

from modular.merge.gain import correlation, merge_gain, pearson, spearman


def test_gain_is_combined_minus_mean_of_a_and_b():
    a = [1, 0, 0, 0]
    b = [1, 1, 0, 0]
    c = [1, 1, 1, 0]
    g = merge_gain(a, b, c, n_boot=500)
    assert g["gain"] == pytest.approx(0.75 - 0.375)
    assert (g["perf_a"], g["perf_b"], g["perf_combined"]) == (0.25, 0.5, 0.75)
    lo, hi = g["ci95"]
    assert lo <= g["gain"] <= hi and lo < hi


def test_gain_interval_is_zero_width_when_all_items_agree():
    g = merge_gain([1, 1, 1], [0, 0, 0], [1, 1, 1], n_boot=200)
    assert g["gain"] == 0.5 and g["ci95"] == [0.5, 0.5]


def test_gain_needs_matching_items():
    with pytest.raises(ValueError):
        merge_gain([1, 0], [1], [1, 0])


def test_spearman_is_rank_based_and_handles_ties():
    x = [1, 2, 3, 4, 5]
    assert spearman(x, [1, 4, 9, 16, 100]) == pytest.approx(1.0)
    assert pearson(x, [1, 4, 9, 16, 100]) < 0.95
    assert spearman([1, 2, 2, 3], [1, 2, 2, 3]) == pytest.approx(1.0)
    assert math.isnan(pearson([1, 1, 1], [1, 2, 3]))


def test_correlation_with_bootstrap_intervals():
    rng = np.random.default_rng(0)
    x = rng.normal(size=30)
    y = 2 * x + 0.3 * rng.normal(size=30)
    c = correlation(x, y, n_boot=300)
    assert c["n"] == 30
    for name in ("pearson", "spearman"):
        assert c[name]["r"] > 0.9
        lo, hi = c[name]["ci95"]
        assert lo <= c[name]["r"] <= hi <= 1.0
    flat = correlation([1, 2, 3], [0, 0, 0], n_boot=50)
    assert flat["pearson"]["r"] is None and flat["pearson"]["ci95"] is None

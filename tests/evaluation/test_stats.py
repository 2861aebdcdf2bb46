import pytest

from modular.evaluation.stats import paired_change, wilson_interval


def test_wilson_interval():
    lo, hi = wilson_interval(20, 42)
    assert lo == pytest.approx(0.3336, abs=1e-4) and hi == pytest.approx(0.6228, abs=1e-4)
    assert wilson_interval(0, 42)[0] == 0.0 and wilson_interval(0, 42)[1] == pytest.approx(0.0838, abs=1e-4)
    assert wilson_interval(42, 42)[1] == pytest.approx(1.0)
    assert wilson_interval(0, 0) == (0.0, 1.0)
    narrow, wide = wilson_interval(20, 42, 0.5), wilson_interval(20, 42, 0.99)
    assert wide[0] < lo < narrow[0] and narrow[1] < hi < wide[1]


def test_paired_change_counts_items_that_moved_and_tests_them_exactly():
    before = [True] * 30 + [False] * 12
    after = [False] * 3 + [True] * 27 + [False] * 12  # three lost, none gained: the continents shift of a run
    r = paired_change(before, after)
    assert (r["lost"], r["gained"], r["n"]) == (3, 0, 42)
    assert r["p_value"] == pytest.approx(0.25)  # two-sided: 2 * 0.5 ** 3
    swap = paired_change(after, before)
    assert (swap["lost"], swap["gained"]) == (0, 3) and swap["p_value"] == pytest.approx(0.25)
    # the same net change from more items moving both ways is weaker evidence
    mixed = paired_change([True] * 8 + [False] * 5, [False] * 8 + [True] * 5)
    assert (mixed["lost"], mixed["gained"]) == (8, 5) and mixed["p_value"] > 0.5
    lopsided = paired_change([True] * 12, [False] * 12)
    assert lopsided["p_value"] == pytest.approx(2 * 0.5 ** 12)
    assert paired_change([True, False], [True, False]) == {"lost": 0, "gained": 0, "n": 2, "p_value": 1.0,
                                                           "ci95": [0.0, 0.0]}
    with pytest.raises(ValueError):
        paired_change([True], [True, False])


def test_holm_adjusts_step_down_and_keeps_the_order():
    from modular.evaluation.stats import holm

    assert holm([0.01, 0.04, 0.03, 0.5]) == pytest.approx([0.04, 0.09, 0.09, 0.5])
    assert holm([0.2, 0.9]) == pytest.approx([0.4, 0.9]) and holm([]) == [] and holm([0.7, 0.6]) == [1.0, 1.0]


def test_the_paired_bootstrap_interval_covers_the_change_and_respects_units():
    import random

    from modular.evaluation.stats import paired_bootstrap_interval

    rng = random.Random(0)
    before = [rng.random() < 0.6 for _ in range(300)]
    after = [b if rng.random() < 0.8 else not b for b in before]
    change = (sum(after) - sum(before)) / 300
    lo, hi = paired_bootstrap_interval(before, after)
    assert lo < change < hi and hi - lo < 0.15
    short = paired_bootstrap_interval(before[:30], after[:30])
    assert short[1] - short[0] > hi - lo  # fewer items, wider
    # three items of one unit always move together: resampled as units, the interval is wider than as items
    grouped_before, grouped_after = [x for x in before[:100] for _ in range(3)], [x for x in after[:100] for _ in range(3)]
    by_item = paired_bootstrap_interval(grouped_before, grouped_after)
    by_unit = paired_bootstrap_interval(grouped_before, grouped_after, units=[i // 3 for i in range(300)])
    assert by_unit[1] - by_unit[0] > 1.3 * (by_item[1] - by_item[0])
    assert paired_bootstrap_interval([True] * 5, [True] * 5) == (0.0, 0.0)

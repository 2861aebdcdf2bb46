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
    assert paired_change([True, False], [True, False]) == {"lost": 0, "gained": 0, "n": 2, "p_value": 1.0}
    with pytest.raises(ValueError):
        paired_change([True], [True, False])

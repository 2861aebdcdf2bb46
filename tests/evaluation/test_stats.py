import pytest

from modular.evaluation.stats import wilson_interval


def test_wilson_interval():
    lo, hi = wilson_interval(20, 42)
    assert lo == pytest.approx(0.3336, abs=1e-4) and hi == pytest.approx(0.6228, abs=1e-4)
    assert wilson_interval(0, 42)[0] == 0.0 and wilson_interval(0, 42)[1] == pytest.approx(0.0838, abs=1e-4)
    assert wilson_interval(42, 42)[1] == pytest.approx(1.0)
    assert wilson_interval(0, 0) == (0.0, 1.0)
    narrow, wide = wilson_interval(20, 42, 0.5), wilson_interval(20, 42, 0.99)
    assert wide[0] < lo < narrow[0] and narrow[1] < hi < wide[1]

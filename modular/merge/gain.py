"""Merge gain and its uncertainty, and the correlation of gain with similarity across pairs.

Merge gain of a pair on a task = perf(combination) − (perf(A) + perf(B)) / 2,
with perf the accuracy over the same items. Its 95% interval is a paired
percentile bootstrap over items (scipy; the three correctness vectors are resampled
together). The correlation across pairs (Pearson and Spearman, scipy) gets a
percentile bootstrap over pairs, resampled here because resamples in which a
variable is constant have no correlation and are skipped.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from scipy.stats import bootstrap, pearsonr, spearmanr


def merge_gain(correct_a: Sequence[float], correct_b: Sequence[float], correct_c: Sequence[float],
               n_boot: int = 1000, seed: int = 0) -> dict:
    """Gain ``mean(c) − (mean(a) + mean(b)) / 2`` with a paired bootstrap 95% interval over items."""
    a, b, c = (np.asarray(x, dtype=float) for x in (correct_a, correct_b, correct_c))
    if not (len(a) == len(b) == len(c)) or len(a) == 0:
        raise ValueError(f"need the same non-zero number of items, got {len(a)}, {len(b)}, {len(c)}")

    per_item = c - (a + b) / 2  # one value per item: resampling it resamples the three vectors together
    gain = float(per_item.mean())
    if np.ptp(per_item) == 0:  # every resample gives the same mean
        lo = hi = gain
    else:
        ci = bootstrap((per_item,), np.mean, n_resamples=int(n_boot), method="percentile",
                       rng=np.random.default_rng(seed)).confidence_interval
        lo, hi = ci.low, ci.high
    return {"gain": gain, "ci95": [float(lo), float(hi)], "n": int(len(a)), "n_boot": int(n_boot),
            "perf_a": float(a.mean()), "perf_b": float(b.mean()), "perf_combined": float(c.mean())}


def pearson(x: Sequence[float], y: Sequence[float]) -> float:
    """Pearson correlation; NaN when either variable is constant or there are fewer than 2 points."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if len(x) < 2 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return math.nan
    return float(pearsonr(x, y).statistic)


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman rank correlation (ties get their average rank); NaN as for :func:`pearson`."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if len(x) < 2 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return math.nan
    return float(spearmanr(x, y).statistic)


def correlation(x: Sequence[float], y: Sequence[float], n_boot: int = 1000, seed: int = 0) -> dict:
    """Pearson and Spearman correlations of ``x`` and ``y`` with percentile bootstrap 95% intervals over points.

    Resamples in which either variable is constant are skipped; an interval is
    None when fewer than 10 resamples are usable.
    """
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    out = {"n": int(len(x))}
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(x), size=(int(n_boot), len(x))) if len(x) else np.zeros((0, 0), int)
    for name, fn in (("pearson", pearson), ("spearman", spearman)):
        value = fn(x, y)
        boots = [fn(x[i], y[i]) for i in idx]
        boots = [v for v in boots if not math.isnan(v)]
        ci = [float(v) for v in np.percentile(boots, [2.5, 97.5])] if len(boots) >= 10 else None
        out[name] = {"r": None if math.isnan(value) else value, "ci95": ci, "n_boot_used": len(boots)}
    return out

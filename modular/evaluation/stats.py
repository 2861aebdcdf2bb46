"""Small statistics helpers shared by the evaluation modules (scipy does the statistics)."""

from __future__ import annotations

import numpy as np
from scipy.stats import binomtest


def wilson_interval(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval for a proportion (``(0, 1)`` for no trials)."""
    if n == 0:
        return (0.0, 1.0)

    ci = binomtest(int(successes), int(n)).proportion_ci(confidence_level=confidence, method="wilson")
    return (float(ci.low), float(ci.high))


def paired_bootstrap_interval(before, after, units=None, n_boot: int = 2000, confidence: float = 0.95,
                              seed: int = 0) -> tuple[float, float]:
    """The interval of the change in accuracy ``mean(after) - mean(before)`` (the same items scored twice), by a
    paired bootstrap over independent units: ``units`` gives each item's unit (items of one unit, e.g. three
    phrasings of one country, are resampled together; default: each item its own)."""
    before, after = np.asarray(before, dtype=float), np.asarray(after, dtype=float)
    if len(before) == 0:
        return (0.0, 0.0)
    keys = np.arange(len(before)) if units is None else np.unique(np.asarray(units), return_inverse=True)[1]
    n_units = int(keys.max()) + 1
    diff = np.bincount(keys, weights=after - before, minlength=n_units)
    count = np.bincount(keys, minlength=n_units).astype(float)
    draws = np.random.default_rng(seed).integers(0, n_units, size=(n_boot, n_units))
    changes = diff[draws].sum(axis=1) / count[draws].sum(axis=1)
    alpha = (1 - confidence) / 2
    return (float(np.quantile(changes, alpha)), float(np.quantile(changes, 1 - alpha)))


def holm(p_values) -> list[float]:
    """Holm's step-down adjustment of ``p_values`` (family-wise error): each adjusted value, in the input's order."""
    p = np.asarray(list(p_values), dtype=float)
    order = np.argsort(p)
    adjusted = np.empty_like(p)
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(p) - rank) * p[i]))
        adjusted[i] = running
    return [float(x) for x in adjusted]


def paired_change(before, after, units=None) -> dict:
    """The same items scored twice (``before``, ``after``: one truth value per item, in the same order), compared
    item by item: ``lost`` (right before, wrong after), ``gained`` (wrong before, right after), and ``p_value``, the
    exact two-sided McNemar test (a binomial test on the items that changed) of the hypothesis that a change is as
    likely to be a loss as a gain: a small value says the shift is more than the noise of so few items; ``ci95``,
    the paired bootstrap interval of the change in accuracy over independent ``units``
    (:func:`paired_bootstrap_interval`)."""
    before, after = [bool(x) for x in before], [bool(x) for x in after]
    if len(before) != len(after):
        raise ValueError(f"paired_change: {len(before)} items before, {len(after)} after")
    lost = sum(b and not a for b, a in zip(before, after))
    gained = sum(a and not b for b, a in zip(before, after))
    changed = lost + gained
    p_value = binomtest(lost, changed, 0.5).pvalue if changed else 1.0
    return {"lost": lost, "gained": gained, "n": len(before), "p_value": float(p_value),
            "ci95": list(paired_bootstrap_interval(before, after, units))}

"""Small statistics helpers shared by the evaluation modules (scipy does the statistics)."""

from __future__ import annotations

from scipy.stats import binomtest


def wilson_interval(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval for a proportion (``(0, 1)`` for no trials)."""
    if n == 0:
        return (0.0, 1.0)

    ci = binomtest(int(successes), int(n)).proportion_ci(confidence_level=confidence, method="wilson")
    return (float(ci.low), float(ci.high))


def paired_change(before, after) -> dict:
    """The same items scored twice (``before``, ``after``: one truth value per item, in the same order), compared
    item by item: ``lost`` (right before, wrong after), ``gained`` (wrong before, right after), and ``p_value``, the
    exact two-sided McNemar test (a binomial test on the items that changed) of the hypothesis that a change is as
    likely to be a loss as a gain: a small value says the shift is more than the noise of so few items."""
    before, after = [bool(x) for x in before], [bool(x) for x in after]
    if len(before) != len(after):
        raise ValueError(f"paired_change: {len(before)} items before, {len(after)} after")
    lost = sum(b and not a for b, a in zip(before, after))
    gained = sum(a and not b for b, a in zip(before, after))
    changed = lost + gained
    p_value = binomtest(lost, changed, 0.5).pvalue if changed else 1.0
    return {"lost": lost, "gained": gained, "n": len(before), "p_value": float(p_value)}

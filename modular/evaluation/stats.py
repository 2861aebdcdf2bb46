"""Small statistics helpers shared by the evaluation modules (scipy does the statistics)."""

from __future__ import annotations

from scipy.stats import binomtest


def wilson_interval(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval for a proportion (``(0, 1)`` for no trials)."""
    if n == 0:
        return (0.0, 1.0)

    ci = binomtest(int(successes), int(n)).proportion_ci(confidence_level=confidence, method="wilson")
    return (float(ci.low), float(ci.high))

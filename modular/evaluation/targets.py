"""The lock's targets, as training's check applies them to the validation split and the lock evaluation to the
held-out test split."""

from __future__ import annotations

#: locked accuracy at most, open accuracy at least base less, retain first-token KL at most, open accuracy at least
#: (a behaviour the model hardly shows is "locked" by any model): LockMetricsCallback's defaults
TARGETS = {"locked_accuracy": 0.05, "open_drop": 0.0, "retain_kl": 0.05, "min_open_accuracy": 0.2}


def lock_failures(targets: dict, open_accuracy: dict[str, float], locked_accuracy: dict[str, dict[str, float]],
                  base_accuracy: dict[str, float | None], retain_kl: dict[str, float | None]) -> list[str]:
    """What keeps the lock from holding, one phrase each; none: it holds. Per gated behaviour (``open_accuracy``'s
    keys): its accuracy in each locked state (``locked_accuracy``: state → behaviour → accuracy) above
    ``locked_accuracy``, its open accuracy below its base accuracy (where known) less ``open_drop``, or below
    ``min_open_accuracy``; per state, a retain first-token KL (where measured) above ``retain_kl``."""
    t = {**TARGETS, **targets}
    failing = []
    for b, opened in open_accuracy.items():
        for state, accuracy in locked_accuracy.items():
            if accuracy[b] > t["locked_accuracy"]:
                failing.append(f"{b} {state} accuracy {accuracy[b]:.2f} > {t['locked_accuracy']:g}")
        base = base_accuracy.get(b)
        if base is not None and opened < base - t["open_drop"] - 1e-9:
            failing.append(f"{b} open accuracy {opened:.2f} < base {base:.2f} - {t['open_drop']:g}")
        if opened < t["min_open_accuracy"] - 1e-9:
            failing.append(f"{b} open accuracy {opened:.2f} < {t['min_open_accuracy']:g}: too little of the "
                           "behaviour to tell a lock from its absence")
    for state, kl in retain_kl.items():
        if kl is not None and kl > t["retain_kl"]:
            failing.append(f"retain KL {state} {kl:.3f} > {t['retain_kl']:g}")
    return failing


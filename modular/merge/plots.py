"""The merge-gain figure: gain vs. activation-space similarity, one labelled point per pair."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from modular.plots import save_figure  # noqa: E402

X_LABELS = {
    "frobenius": r"$\|Y^T X\|_F^2 \,/\, (\|X\|_F^2 \|Y\|_F^2)$",
    "cka": "linear CKA (centred) of A, B activations",
}
TITLES = {
    "frobenius": '{what} performance gain vs. "cosine similarity" (normalized squared Frobenius norm)\n'
                 "of A,B's activation spaces",
    "cka": "{what} performance gain vs. linear CKA of A,B's activation spaces",
}


def _fmt(block: dict, name: str, symbol: str) -> str:
    r, ci = block[name]["r"], block[name]["ci95"]
    if r is None:
        return f"{symbol} = n/a"
    interval = f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else " [n/a]"
    return f"{symbol} = {r:.2f}{interval}"


def _label_offsets(xs: list[float], ys: list[float], near: float = 0.06, step: float = 11.0) -> list[float]:
    """Vertical label offsets (points) that stack the labels of points lying close together (within ``near`` of
    the axes' span in x and y), so pairs with the same similarity and gain stay readable."""
    def scaled(v):
        lo, hi = min(v), max(v)
        return [(a - lo) / (hi - lo) if hi > lo else 0.0 for a in v]

    sx, sy = scaled(xs), scaled(ys)
    offsets = [0.0] * len(xs)
    placed: list[int] = []
    for i in sorted(range(len(xs)), key=lambda i: (sy[i], sx[i])):
        crowd = [j for j in placed if abs(sx[j] - sx[i]) < near and abs(sy[j] - sy[i]) < near]
        offsets[i] = step * len(crowd)
        placed.append(i)
    return offsets


def gain_scatter(path: str | Path, pairs: list[dict], corr: dict, metric: str = "frobenius",
                 what: str = "AC", task: str = "capitals") -> Path:
    """Scatter of merge gain (y, with its bootstrap interval) vs. similarity (x), points labelled by pair.

    Args:
        path: PNG to write.
        pairs: rows with ``label``, ``similarity`` (``{metric: value}``) and ``gain`` (``{gain, ci95}``).
        corr: :func:`modular.merge.gain.correlation` of gain with this metric.
        metric: ``frobenius`` (the seed figure's x axis) or ``cka``.
        what: the combination's name in the labels (``AC`` for activation communication, ``merge`` when mixed).
        task: the task the gain is measured on.
    """
    fig, ax = plt.subplots(figsize=(8.0, 5.6))
    xs = [p["similarity"][metric] for p in pairs]
    ys = [p["gain"]["gain"] for p in pairs]
    lo = [y - p["gain"]["ci95"][0] for y, p in zip(ys, pairs)]
    hi = [p["gain"]["ci95"][1] - y for y, p in zip(ys, pairs)]
    ax.errorbar(xs, ys, yerr=[lo, hi], fmt="o", color="#1f77b4", ecolor="#9ecae1", elinewidth=1.2, capsize=3,
                markersize=7, zorder=3)
    for (x, y, p), dy in zip(zip(xs, ys, pairs), _label_offsets(xs, ys)):
        ax.annotate(p["label"], (x, y), xytext=(6, 4 + dy), textcoords="offset points", fontsize=8,
                    arrowprops=dict(arrowstyle="-", color="#bbbbbb", linewidth=0.6) if dy else None)
    ax.axhline(0.0, color="#999999", linewidth=0.8, zorder=1)
    ax.margins(x=0.2, y=0.12)  # room for the labels right of the points
    ax.grid(True, linestyle="--", color="#d0d0d0", zorder=0)
    ax.set_xlabel(X_LABELS[metric])
    ax.set_ylabel(f"{what} performance gain on {task} ({what} perf. - avg(A, B) perf.)")
    ax.set_title(TITLES[metric].format(what=what), fontsize=10)
    text = "\n".join([_fmt(corr, "pearson", "Pearson r"), _fmt(corr, "spearman", "Spearman ρ"),
                      f"{corr['n']} pairs; 95% bootstrap intervals"])
    ax.text(0.02, 0.98, text, transform=ax.transAxes, va="top", ha="left", fontsize=8,
            bbox=dict(boxstyle="round", facecolor="white", edgecolor="#cccccc", alpha=0.9))
    return save_figure(fig, path)

"""Head-efficiency curves: how much of a task's effect the k most important heads account for.

Two definitions are supported; both are indexed by k, the number of heads kept, and both are
read the same way (how many heads are needed to reach, say, 90 %).

* **Effect share** (:func:`effect_share_curve`): given per-head effects e[l, h] of ablating each
  head on its own (see :mod:`modular.heads.ranking`),

      EE(k) = Σ_{k largest |e|} |e_h| / Σ_all |e_h|.

  It needs no further forward passes, is monotone non-decreasing, EE(0) = 0 and EE(N) = 1 with
  all N heads. It measures how concentrated the single-head effects are, not whether the kept
  heads suffice on their own (interactions between heads are ignored).

* **Faithfulness** (:func:`faithfulness_curve`, as in the MIB circuit benchmark): keep the top-k
  heads of a ranking, ablate all the others, and evaluate the task metric m:

      F(k) = (m(k) − m(∅)) / (m(all) − m(∅)),

  where m(∅) ablates every head and m(all) ablates none, so F(0) = 0 and F(N) = 1. It is not
  necessarily monotone, and it can overshoot 1 (or drop below 0) when some heads hurt the task:
  a subset that leaves those heads out does better than the full model.

Helpers reduce a curve to numbers (:func:`heads_needed`, :func:`multiplier`,
:func:`area_under_curve`); :func:`plot_efficiency_curves` draws curves of several models per task.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import matplotlib
import numpy as np
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

Head = tuple[int, int]
THRESHOLD = 0.9


def ranking_from_effects(effects: torch.Tensor) -> list[Head]:
    """Heads (layer, head) sorted by |e| descending; ties broken by (layer, head) ascending."""
    if effects.dim() != 2:
        raise ValueError(f"effects must be (n_layers, n_heads), got shape {tuple(effects.shape)}")
    mags = effects.detach().abs().cpu().tolist()
    heads = [(layer, head) for layer in range(len(mags)) for head in range(len(mags[layer]))]
    return sorted(heads, key=lambda lh: (-mags[lh[0]][lh[1]], lh[0], lh[1]))


def effect_share_curve(effects: torch.Tensor) -> torch.Tensor:
    """EE(k) for k = 0..N (N = number of heads): the share of Σ|e| carried by the k largest |e|.

    Returns a float64 tensor of length N + 1, monotone non-decreasing, with EE(0) = 0 and EE(N) = 1.
    Raises ValueError when every effect is zero (the share is undefined) or any effect is not finite.
    """
    mags = effects.detach().to(torch.float64).abs().flatten().cpu()
    if not torch.isfinite(mags).all():
        raise ValueError("head effects must be finite")
    cum = torch.cumsum(torch.sort(mags, descending=True).values, dim=0)
    if cum.numel() == 0 or cum[-1] == 0:
        raise ValueError("all head effects are zero")
    curve = torch.cat([torch.zeros(1, dtype=torch.float64), cum / cum[-1]])
    curve[-1] = 1.0
    return curve


def faithfulness_curve(metric_fn: Callable[[set[Head]], float], ranking: Sequence[Head],
                       ks: Sequence[int]) -> dict:
    """F(k) = (m(k) − m(∅)) / (m(all) − m(∅)) for each k in ``ks``.

    ``metric_fn(kept)`` evaluates the task metric with only the heads in ``kept`` active and every
    other head ablated; ``ranking`` lists all heads, most important first, and m(k) keeps its
    first k entries. m(∅) = metric_fn(set()) and m(all) = metric_fn(set(ranking)), each evaluated once.
    Values can exceed 1 (or fall below 0) when some heads work against the task.

    Returns ``{"ks": [...], "values": [...], "metrics": [m(k), ...], "m_none": m(∅), "m_all": m(all)}``.
    Raises ValueError if m(all) == m(∅) or a k lies outside 0..len(ranking).
    """
    ranking = list(ranking)
    n = len(ranking)
    if len(set(ranking)) != n:
        raise ValueError("ranking lists a head more than once")
    ks = [int(k) for k in ks]
    bad = [k for k in ks if not 0 <= k <= n]
    if bad:
        raise ValueError(f"k must lie in 0..{n}, got {bad}")
    m_none = float(metric_fn(set()))
    m_all = float(metric_fn(set(ranking)))
    if m_all == m_none:
        raise ValueError("metric with all heads equals metric with none; faithfulness is undefined")
    cache = {0: m_none, n: m_all}
    metrics = []
    for k in ks:
        if k not in cache:
            cache[k] = float(metric_fn(set(ranking[:k])))
        metrics.append(cache[k])
    values = [(m - m_none) / (m_all - m_none) for m in metrics]
    return {"ks": ks, "values": values, "metrics": metrics, "m_none": m_none, "m_all": m_all}


def heads_needed(curve_values: Sequence[float], ks: Sequence[int], threshold: float = THRESHOLD) -> int | None:
    """The smallest k whose curve value is ≥ ``threshold``; None if no value reaches it."""
    values = [float(v) for v in curve_values]
    ks = [int(k) for k in ks]
    if len(values) != len(ks):
        raise ValueError(f"{len(values)} values for {len(ks)} ks")
    hits = [k for k, v in zip(ks, values) if v >= threshold]
    return min(hits) if hits else None


def multiplier(base_needed: int | None, sparse_needed: int | None) -> float | None:
    """How many times more heads the base model needs: base_needed / sparse_needed.

    None when either count is missing (the curve never reached the threshold) or sparse_needed ≤ 0.
    """
    if base_needed is None or sparse_needed is None or sparse_needed <= 0:
        return None
    return base_needed / sparse_needed


def area_under_curve(values: Sequence[float], ks: Sequence[int], n_heads_total: int) -> float:
    """Trapezoidal area under the curve with x = k / ``n_heads_total`` (so x spans [0, 1] for k = 0..N).

    Points are sorted by k; with fewer than two points the area is 0.
    """
    if n_heads_total <= 0:
        raise ValueError("n_heads_total must be positive")
    if len(values) != len(ks):
        raise ValueError(f"{len(values)} values for {len(ks)} ks")
    order = np.argsort(np.asarray(ks, dtype=float), kind="stable")
    x = np.asarray(ks, dtype=float)[order] / n_heads_total
    y = np.asarray(values, dtype=float)[order]
    if len(x) < 2:
        return 0.0
    return float(np.sum((x[1:] - x[:-1]) * (y[1:] + y[:-1]) / 2))


def _needed(line: dict, threshold: float) -> int | None:
    if "needed" in line:
        return line["needed"]
    return heads_needed(line["values"], line["ks"], threshold)


def plot_efficiency_curves(path: str | Path, panels: dict[str, dict[str, dict]], definition: str,
                           subtitle: str | None = None, threshold: float = THRESHOLD) -> tuple[Path, dict[str, str]]:
    """One panel per task, one line per model, saved as PNG.

    ``panels`` maps task name -> model label -> ``{"ks": [...], "values": [...], "needed": int | None}``
    (``needed`` is computed from the values when absent). The y axis spans 0..1.05, extended upward to
    max value + 0.05 (faithfulness can overshoot 1) and downward below 0 if a value is negative.
    A dashed black line marks ``threshold``. When a panel has exactly two models and both reach it,
    a double arrow joins their crossing points on the line, labelled with
    :func:`multiplier` (first model's count / second model's count), e.g. ``"2.0x"``. With more
    models, each later model's multiplier against the first is written into its legend entry
    (``"sparse (2.0x)"``) and the panel's annotation reads ``"sparse: 2.0x; other: 1.5x"``.
    The figure title is ``definition``, with ``subtitle`` (e.g. the ablation kind) on a second line.

    Returns the path and the multiplier labels drawn, by task.
    """
    if not panels:
        raise ValueError("no panels to plot")
    all_values = [float(v) for lines in panels.values() for line in lines.values() for v in line["values"]]
    finite = [v for v in all_values if np.isfinite(v)] or [0.0]
    top = max(1.05, max(finite) + 0.05)
    bottom = min(0.0, min(finite) - 0.05)

    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 4.0), sharey=True, squeeze=False)
    annotations: dict[str, str] = {}
    for ax, (task, lines) in zip(axes[0], panels.items()):
        crossings = [_needed(line, threshold) for line in lines.values()]
        factors = [None] + [multiplier(crossings[0], k) for k in crossings[1:]]  # each later model vs the first
        for (label, line), k, factor in zip(lines.items(), crossings, factors):
            ks, values = list(line["ks"]), list(line["values"])
            dense = len(ks) > 40
            if len(lines) > 2 and factor is not None:
                label = f"{label} ({factor:.1f}x)"
            (handle,) = ax.plot(ks, values, marker=None if dense else "o", markersize=3, linewidth=1.6, label=label)
            if k is not None:
                ax.plot([k], [threshold], marker="o", markersize=6, color=handle.get_color(),
                        markeredgecolor="black", zorder=5)
        ax.axhline(threshold, color="black", linestyle="--", linewidth=1, label=f"{threshold:.0%} threshold")
        if len(lines) > 2 and any(f is not None for f in factors):
            annotations[task] = "; ".join(f"{label}: {f:.1f}x" for label, f in zip(lines, factors) if f is not None)
        if len(lines) == 2 and factors[1] is not None:
            text = f"{factors[1]:.1f}x"
            annotations[task] = text
            lo, hi = sorted(crossings)
            if hi > lo:
                ax.annotate("", xy=(lo, threshold), xytext=(hi, threshold),
                            arrowprops=dict(arrowstyle="<->", color="black", linewidth=1.2, shrinkA=0, shrinkB=0))
            ax.annotate(text, xy=((lo + hi) / 2, threshold), xytext=(0, 5), textcoords="offset points",
                        ha="center", va="bottom", fontsize=10, fontweight="bold")
        ax.set_title(task)
        ax.set_xlabel("Number of Heads Kept")
        ax.set_ylim(bottom, top)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    axes[0][0].set_ylabel("Explained Effect")
    fig.suptitle(definition if not subtitle else f"{definition}\n{subtitle}")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")  # a one-panel figure is narrower than its title
    plt.close(fig)
    return path, annotations

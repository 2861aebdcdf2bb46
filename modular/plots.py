"""Figures (matplotlib, Agg backend): every figure is saved as PNG beside a JSON of its numbers."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def save_figure(fig, path: str | Path, dpi: int = 120) -> Path:
    """Lay ``fig`` out, write it to ``path`` as a PNG (creating its folder) and close it."""
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def bar_chart(path: str | Path, labels: list[str], values: list[float], title: str, ylabel: str,
              errors: list[tuple[float, float]] | None = None, ylim: tuple[float, float] | None = (0, 1)) -> Path:
    """A labelled bar chart; ``errors`` are (low, high) intervals drawn as error bars."""
    fig, ax = plt.subplots(figsize=(max(4, 1.1 * len(labels) + 1.5), 3.6))
    yerr = None
    if errors:
        yerr = [[v - lo for v, (lo, hi) in zip(values, errors)], [hi - v for v, (lo, hi) in zip(values, errors)]]
    bars = ax.bar(labels, values, yerr=yerr, capsize=4, color="#4c72b0")
    for bar, v in zip(bars, values):
        ax.annotate(f"{v:.2f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                    fontsize=8, xytext=(0, 2), textcoords="offset points")
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    if ylim:
        ax.set_ylim(*ylim)
    ax.tick_params(axis="x", rotation=20)
    return save_figure(fig, path)

"""Behaviour-direction discovery: difference in means per layer at the template-suffix positions.

For each prompt format (:mod:`modular.analysis.formats`) and each layer ``i`` (the residual
stream leaving block ``i``), the direction is

    normalise( mean over behaviour prompts − mean over contrast prompts )

of the residual stream averaged over the format's suffix positions. Then: the cosine
between every pair of layers' directions, and the effect of ablating each direction at
every residual write (behaviour accuracy on its test split, first-token KL on held-out
retain prompts).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

from modular import ModularError
from modular.analysis.formats import Suffix, format_batch, suffix, with_positions
from modular.data.formatting import prompt_limit
from modular.evaluation.behaviour import evaluate_behaviour
from modular.evaluation.retain import first_token_logp, mean_kl
from modular.evaluation.stats import wilson_interval
from modular.files import atomic_path
from modular.hooks import ablate_directions, capture_residual
from modular.models.adapter import ArchitectureAdapter


@torch.no_grad()
def suffix_means(model, tokenizer, prompts: list[str], fmt: str, batch_size: int = 16,
                 sfx: Suffix | None = None) -> torch.Tensor:
    """Mean residual stream leaving each block over the suffix positions, ``(n_layers, d)`` float64."""
    adapter = ArchitectureAdapter(model)
    device = next(model.parameters()).device
    sfx = sfx or suffix(tokenizer, fmt)
    k = sfx.n_positions
    total = torch.zeros(adapter.n_layers, adapter.d_model, dtype=torch.float64)
    for start in range(0, len(prompts), batch_size):
        batch = with_positions(format_batch(tokenizer, prompts[start:start + batch_size], fmt, sfx,
                                            prompt_limit(model)))
        with capture_residual(adapter) as states:
            model(**{key: v.to(device) for key, v in batch.items()}, use_cache=False)
        for i in range(adapter.n_layers):
            total[i] += states[i + 1][:, -k:].double().mean(1).sum(0).cpu()
    return total / len(prompts)


def find_directions(model, tokenizer, behaviour_prompts: list[str], contrast_prompts: list[str], fmt: str,
                    batch_size: int = 16) -> dict:
    """Unit difference-in-means directions of one format: ``{"directions": (n_layers, d), "diff_norms", "suffix"}``."""
    if not behaviour_prompts or not contrast_prompts:
        raise ModularError("direction discovery needs behaviour and contrast prompts")
    sfx = suffix(tokenizer, fmt)
    diff = (suffix_means(model, tokenizer, behaviour_prompts, fmt, batch_size, sfx)
            - suffix_means(model, tokenizer, contrast_prompts, fmt, batch_size, sfx))
    norms = diff.norm(dim=-1)
    if (norms < 1e-12).any():
        layer = int((norms < 1e-12).nonzero()[0])
        raise ModularError(f"{fmt}: behaviour and contrast prompts have the same mean at layer {layer}")
    return {"directions": (diff / norms[:, None]).float(), "diff_norms": norms.tolist(), "suffix": sfx}


def cross_layer_cosine(directions: torch.Tensor) -> torch.Tensor:
    """Cosine between every pair of layers' unit directions, ``(n_layers, n_layers)``."""
    d = directions.double()
    d = d / d.norm(dim=-1, keepdim=True)
    return (d @ d.T).float()


def _score(model, tokenizer, test, max_new_tokens, batch_size, choice_only, intervention=None) -> dict:
    r = evaluate_behaviour(model, tokenizer, test, max_new_tokens, batch_size, intervention=intervention,
                           desc=False, choice_only=choice_only)
    k = sum(i["correct"] for i in r.items) if r.items else round(r.accuracy * r.n)
    return {**r.summary(), "ci95": wilson_interval(k, r.n)}


def ablation_curve(model, tokenizer, directions: torch.Tensor, test, retain_prompts: list[str],
                   retain_chats: list[bool], layers: list[int] | None = None, max_new_tokens: int = 16,
                   batch_size: int = 16, choice_only: bool = False, desc: str = "ablation",
                   baseline: dict | None = None, reference_logp: torch.Tensor | None = None) -> dict:
    """Ablate each layer's direction at every residual write; accuracy on ``test`` and retain KL per layer.

    Returns ``{"baseline": {...}, "layers": [{"layer", "accuracy", "ci95", "drop", "retain_kl", ...}]}``.
    """
    adapter = ArchitectureAdapter(model)
    layers = list(range(len(directions))) if layers is None else list(layers)
    if baseline is None:
        baseline = _score(model, tokenizer, test, max_new_tokens, batch_size, choice_only)
    if reference_logp is None:
        reference_logp = first_token_logp(model, tokenizer, retain_prompts, retain_chats)
    rows = []
    for layer in tqdm(layers, desc=desc, leave=False):
        def lock(u=directions[layer]):
            return ablate_directions(adapter, u)

        row = _score(model, tokenizer, test, max_new_tokens, batch_size, choice_only, lock)
        kl = mean_kl(reference_logp, first_token_logp(model, tokenizer, retain_prompts, retain_chats, lock))
        rows.append({"layer": layer, **row, "drop": baseline["accuracy"] - row["accuracy"], "retain_kl": kl})
    return {"baseline": baseline, "layers": rows}


def best_direction(curves: dict[str, dict], max_kl: float | None = None) -> dict | None:
    """The (format, layer) whose ablation removes the most accuracy; ties go to the lower retain KL.

    ``max_kl``: only directions whose retain KL stays within this budget compete.
    """
    rows = [{"format": fmt, **row} for fmt, c in curves.items() for row in c["layers"]
            if max_kl is None or row["retain_kl"] <= max_kl]
    if not rows:
        return None
    return max(rows, key=lambda r: (round(r["drop"], 9), -r["retain_kl"]))


def save_directions(path: str | Path, directions: dict[str, torch.Tensor], metadata: dict[str, str]) -> Path:
    """One unit vector per format × layer (key ``<format>.layer<NN>``), with string metadata."""
    tensors = {f"{fmt}.layer{i:02d}": d[i].contiguous().float() for fmt, d in directions.items() for i in range(len(d))}
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={k: str(v) for k, v in metadata.items()})
    return Path(path)


# --- figures ----------------------------------------------------------------------------------
def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_heatmaps(cosines: dict[str, torch.Tensor], path: str | Path, title: str) -> Path:
    """One panel per format: cosine between the directions found at every pair of layers."""
    plt = _plt()
    fig, axes = plt.subplots(1, len(cosines), figsize=(4.2 * len(cosines) + 0.8, 4.0), squeeze=False)
    from matplotlib.ticker import MaxNLocator

    im = None
    for j, (ax, (fmt, c)) in enumerate(zip(axes[0], cosines.items())):
        im = ax.imshow(torch.as_tensor(c).numpy(), vmin=-1, vmax=1, cmap="RdBu_r", origin="lower")
        ax.set_title(f"{fmt}")
        ax.set_xlabel("layer")
        if j == 0:
            ax.set_ylabel("layer")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.85, label="cosine similarity")
    fig.suptitle(title)
    path = Path(path)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_ablation(curves: dict[str, dict], path: str | Path, title: str, metric: str) -> Path:
    """Left: behaviour accuracy with each layer's direction ablated (95% intervals); right: retain KL."""
    plt = _plt()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
    base = None
    for fmt, c in curves.items():
        xs = [r["layer"] for r in c["layers"]]
        acc = [r["accuracy"] for r in c["layers"]]
        lo = [r["ci95"][0] for r in c["layers"]]
        hi = [r["ci95"][1] for r in c["layers"]]
        (line,) = ax1.plot(xs, acc, marker=".", label=fmt)
        ax1.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.15)
        ax2.plot(xs, [r["retain_kl"] for r in c["layers"]], marker=".", label=fmt)
        base = c["baseline"]["accuracy"]
    if base is not None:
        ax1.axhline(base, color="k", ls="--", lw=0.8, label="no ablation")
    ax1.set_xlabel("layer of the ablated direction")
    ax1.set_ylabel(f"behaviour accuracy ({metric})")
    ax1.set_ylim(0, 1.05)
    ax1.set_title("behaviour with the direction ablated")
    ax1.legend(fontsize=8)
    ax2.set_xlabel("layer of the ablated direction")
    ax2.set_ylabel("retain first-token KL to unablated")
    ax2.set_title("retain cost")
    ax2.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_designated(cosines: dict[str, list[float]], path: str | Path, title: str) -> Path:
    """Cosine between each layer's found direction and the run's designated direction."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for fmt, values in cosines.items():
        ax.plot(range(len(values)), values, marker=".", label=fmt)
    ax.axhline(0, color="k", lw=0.6)
    ax.set_xlabel("layer")
    ax.set_ylabel("cosine with the designated direction")
    ax.set_ylim(-1, 1)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def directions_by_format(model, tokenizer, behaviour_prompts: list[str], contrast_prompts: list[str],
                         formats: list[str], batch_size: int = 16, designated: torch.Tensor | None = None):
    """:func:`find_directions` for every prompt format: the directions by format, and per format what the JSON
    reports (the suffix positions, difference norms, the cross-layer cosine and, given the run's designated
    direction, each layer's cosine to it)."""
    found, report = {}, {}
    for fmt in formats:
        res = find_directions(model, tokenizer, behaviour_prompts, contrast_prompts, fmt, batch_size)
        found[fmt] = res["directions"]
        entry = {**res["suffix"].describe(tokenizer), "diff_norms": res["diff_norms"],
                 "cross_layer_cosine": cross_layer_cosine(res["directions"])}
        if designated is not None:
            entry["designated_cosine"] = (res["directions"] @ designated).tolist()
        report[fmt] = entry
    return found, report

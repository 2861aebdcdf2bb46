"""Attention by token position: what the last prompt token attends to, per head, averaged over prompts.

Positions count from each prompt's first real token (left padding removed), so a span
inserted after a fixed prefix sits at the same positions in every prompt. Attention
weights need the eager attention implementation, which
:func:`modular.models.attention.eager_attention` switches a loaded model to for a ``with`` block.
"""

from __future__ import annotations

import torch

from modular import ModularError
from modular.analysis.formats import with_positions
from modular.analysis.insertion import render_with_span
from modular.data.formatting import LeftPadCollator
from modular.models.adapter import ArchitectureAdapter
from modular.models.attention import eager_attention


@torch.no_grad()
def last_token_attention(model, tokenizer, sequences: list[list[int]], spans: list[tuple[int, int]] | None = None,
                         batch_size: int = 8) -> dict:
    """Attention of the last position to every earlier position, per layer and head.

    Returns ``{"mean": (n_layers, n_heads, max_len) mean over prompts that reach a position,
    "count": (max_len,), "span_mass": (n_layers, n_heads) mean attention mass on each prompt's span, leaving out
    the first position (an attention sink in most models, also where a span starts at position 0)}``.
    """
    device = next(model.parameters()).device
    collate = LeftPadCollator(tokenizer.pad_token_id)
    max_len = max(len(s) for s in sequences)
    total = count = span_mass = None
    with eager_attention(model):
        for start in range(0, len(sequences), batch_size):
            chunk = sequences[start:start + batch_size]
            batch = with_positions(collate([{"input_ids": s} for s in chunk]))
            out = model(**{k: v.to(device) for k, v in batch.items()}, output_attentions=True, use_cache=False)
            att = torch.stack([a[:, :, -1, :].float().cpu() for a in out.attentions], 1)  # (b, L, H, seq)
            if total is None:
                total = torch.zeros(*att.shape[1:3], max_len)
                count = torch.zeros(max_len)
                span_mass = torch.zeros(*att.shape[1:3])
            width = att.shape[-1]
            for row, seq in enumerate(chunk):
                pad = width - len(seq)
                total[..., :len(seq)] += att[row, ..., pad:]
                count[:len(seq)] += 1
                if spans is not None:
                    a, b = spans[start + row]
                    a = max(a, 1)  # the first position is an attention sink in most models: not the span's merit
                    span_mass += att[row, ..., pad + a:pad + b].sum(-1)
    return {"mean": total / count.clamp(min=1), "count": count, "span_mass": span_mass / len(sequences)}


def top_heads(span_mass: torch.Tensor, k: int) -> list[tuple[int, int]]:
    """The ``k`` (layer, head) pairs with the most attention mass on the inserted span."""
    flat = span_mass.flatten()
    idx = torch.topk(flat, min(k, flat.numel())).indices
    n_heads = span_mass.shape[1]
    return [(int(i) // n_heads, int(i) % n_heads) for i in idx]


def check_heads(heads, n_layers: int, n_heads: int) -> list[tuple[int, int]]:
    """``[(3, 1), (12, 4)]`` (layer, head) pairs, checked against the model's size."""

    out = []
    for pair in heads:
        if len(pair) != 2:
            raise ModularError(f"bad head {list(pair)}: give [LAYER, HEAD], e.g. [3, 1]")
        layer, head = (int(x) for x in pair)
        if not (0 <= layer < n_layers and 0 <= head < n_heads):
            raise ModularError(f"head [{layer}, {head}] is outside the model ({n_layers} layers, {n_heads} heads)")
        out.append((layer, head))
    return out


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_attention(curves: dict[str, dict[str, list[float]]], spans: dict[str, tuple[int, int]], path,
                   suptitle: str):
    """One panel per head ("Average attention on Head L.H"); one line per condition, by token position."""
    plt = _plt()
    heads = list(next(iter(curves.values())))
    fig, axes = plt.subplots(len(heads), 1, figsize=(8, 2.8 * len(heads)), squeeze=False)
    for ax, head in zip(axes[:, 0], heads):
        for label, per_head in curves.items():
            ys = per_head[head]
            (line,) = ax.plot(range(len(ys)), ys, lw=1.0, label=label)
            ax.fill_between(range(len(ys)), ys, color=line.get_color(), alpha=0.08)
            a, b = spans.get(label, (0, 0))
            if b > a:
                ax.axvspan(a - 0.5, b - 0.5, color=line.get_color(), alpha=0.07)
        ax.set_title(f"Average attention on Head {head}")
        ax.set_xlabel("token position")
        ax.set_ylabel("average attention")
        # the first position is often an attention sink that would flatten every other position: clip it
        rest = max((max(per_head[head][1:], default=0.0) for per_head in curves.values()), default=0.0)
        first = max(per_head[head][0] for per_head in curves.values())
        if rest > 0 and first > 1.5 * rest:
            ax.set_ylim(0, 1.15 * rest)
            ax.annotate(f"position 0: up to {first:.2f} (off scale)", (0.99, 0.95), xycoords="axes fraction",
                        ha="right", va="top", fontsize=8)
        else:
            ax.set_ylim(bottom=0)
        ax.legend(loc="upper left", fontsize=8)
    fig.suptitle(suptitle, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_sweep(sweep: dict[str, list[dict]], path, title: str):
    """Accuracy (95% Wilson band) vs number of inserted tokens, one line per insertion kind."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for label, rows in sweep.items():
        xs = [r["length"] for r in rows]
        (line,) = ax.plot(xs, [r["accuracy"] for r in rows], marker="o", label=label)
        ax.fill_between(xs, [r["ci95"][0] for r in rows], [r["ci95"][1] for r in rows], color=line.get_color(),
                        alpha=0.15)
    ax.set_xlabel("inserted tokens")
    ax.set_ylabel("accuracy")
    ax.set_ylim(0, 1.05)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def span_attention(model, tokenizer, items, conditions: dict[str, str], instruction: str, n_items: int,
                   heads: list[tuple[int, int]] | None = None, n_heads: int = 3, batch_size: int = 8) -> dict:
    """Attention of the last prompt token by position, per condition (label -> inserted span, "" for none), for
    the given heads or the ``n_heads`` with the most attention mass on the inserted span (mean over the conditions
    with a span). Returns the heads ("L.H"), how they were chosen, the curves and spans by condition label, and
    the span mass per head."""
    adapter = ArchitectureAdapter(model)
    rows = items.select(range(min(n_items, len(items))))
    rendered = {c: [render_with_span(tokenizer, r["prompt"], r["chat"], span, instruction) for r in rows]
                for c, span in conditions.items()}
    att = {c: last_token_attention(model, tokenizer, [x.ids for x in rendered[c]], [x.span for x in rendered[c]],
                                   batch_size=batch_size) for c in conditions}
    with_span = [c for c, span in conditions.items() if span]
    if heads:
        chosen, how = check_heads(heads, adapter.n_layers, adapter.n_heads), "given"
    else:
        chosen = top_heads(sum(att[c]["span_mass"] for c in with_span) / len(with_span), n_heads)
        how = "most attention mass on the inserted span (mean over insertion kinds)"
    names = [f"{layer}.{head}" for layer, head in chosen]
    return {
        "heads": names, "head_choice": how, "items": len(rows),
        "curves": {c: {n: att[c]["mean"][layer, head].tolist() for n, (layer, head) in zip(names, chosen)}
                   for c in conditions},
        "spans": {c: rendered[c][0].span for c in conditions},
        "span_mass": {c: {n: att[c]["span_mass"][layer, head].item() for n, (layer, head) in zip(names, chosen)}
                      for c in with_span},
    }

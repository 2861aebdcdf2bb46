"""Head-ablation curves by category (after Causal Head Gating, Nam et al. 2025).

Heads are put in three classes per task by how ablating them changes the log-probability of the
target response (summed over its tokens, teacher-forced):

* **Facilitation**: ablating the head hurts the target (Δ log p < −τ);
* **Interference**: ablating the head helps the target (Δ log p > +τ);
* **Irrelevance**: no effect (|Δ log p| ≤ τ).

How the classes are found. CHG fits hard-concrete gates on the frozen model three times (no
penalty, pressure toward 1, pressure toward 0) and reads each head's class from where its gate
settles, so a class holds for its heads *together*. Here the classes come from ablation effects
with a threshold τ, in one of two ways (``method``):

* ``single``: e[l, h] = mean over examples of Δ log p(target) when head (l, h) alone is ablated;
  Facilitation e < −τ, Interference e > +τ, Irrelevance |e| ≤ τ (:func:`classify_heads`).
* ``joint`` (default): the single-head classes are the candidates, in the same order, and a
  candidate joins Interference or Irrelevance only if it keeps its class *with the heads already
  chosen ablated too* (:func:`joint_categories`): an Interference head must still raise log p
  on top of them, by more than the standard error of that gain over examples (per-example effects
  are heavy-tailed: a mean gain carried by one or two examples, or by noise, does not count, and
  such heads lowered held-out items); an Irrelevance head must move each example's log p by at
  most τ on average (mean |Δ| over examples, not |mean Δ|: changes of opposite sign on different
  examples do not cancel, so the class holds on held-out items too) and leave the set's mean |Δ|
  within ``band``.
  Candidates that fail are left out of every class (``rejected``). Facilitation keeps its
  single-head order (ablating helpful heads together hurts all the more). This is the
  greedy, deterministic counterpart of CHG's joint fit: one ablated forward per candidate, no
  backward passes, no penalty weights or gate noise to tune.

Single-head effects miss heads that matter only jointly (redundant backups, whose single ablation
is compensated, or "helpful to remove" heads that hurt once several are removed); the joint pass
is there for that. Either way the classes are chosen on one split and the curves are measured on
another (held-out items) by ablating the first 0…n heads of each class together, ordered by
strength (Facilitation: most negative e first; Interference: most positive first; Irrelevance:
smallest |e| first).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from modular import ModularError
from modular.data.formatting import LeftPadCollator, encode_example, keep_end, report_long
from modular.hooks import (
    capture_block_outputs,
    capture_head_inputs,
    repeat_batch,
    replace_head_per_group,
    replace_heads,
    reuse_block_outputs,
)
from modular.models.adapter import ArchitectureAdapter

CATEGORIES = ("facilitation", "interference", "irrelevance")
METHODS = ("joint", "single")
LABELS = {"facilitation": "Facilitation", "interference": "Interference", "irrelevance": "Irrelevance"}
COLORS = {"facilitation": "tab:green", "interference": "tab:red", "irrelevance": "tab:blue"}
ABLATION_KINDS = ("mean", "zero")
TASK_TITLES = {"agreement": "Syntax", "commonsense": "Common Sense", "arithmetic": "Math"}
Head = tuple[int, int]


def response_batch(tokenizer, dataset, max_length: int | None = None) -> dict:
    """Left-padded prompt + target-response batch; ``labels`` mark the response tokens (others -100). Each item keeps
    its last ``max_length`` tokens (those cut counted and reported once)."""
    if len(dataset) == 0:
        raise ModularError("no items")
    features = [encode_example(tokenizer, p, t, c) for p, t, c in zip(dataset["prompt"], dataset["target"], dataset["chat"])]
    report_long([len(f["input_ids"]) for f in features], max_length)
    cut = [{k: keep_end(v, max_length) for k, v in f.items()} for f in features]
    return LeftPadCollator(tokenizer.pad_token_id)(cut)


def _forward_logits(model, input_ids, attention_mask, keep: int) -> torch.Tensor:
    try:
        return model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, logits_to_keep=keep).logits
    except TypeError:  # architectures without logits_to_keep: full logits
        return model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[:, -keep:]


@torch.no_grad()
def response_logprob(model, batch: dict, chunk: int = 16) -> torch.Tensor:
    """log p(target response | prompt) per example, summed over the response tokens, ``(n,)`` float64.

    With left padding the response ends every row, so only the last logits are computed.
    """
    device = next(model.parameters()).device
    labels = batch["labels"]
    mask = labels != -100
    span = int(mask.sum(1).max())  # response tokens at the end of every row
    out = []
    for start in range(0, len(labels), chunk):
        sl = slice(start, start + chunk)
        ids = batch["input_ids"][sl].to(device)
        logits = _forward_logits(model, ids, batch["attention_mask"][sl].to(device), span + 1)
        logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)  # position t predicts token t + 1
        target = labels[sl, -span:].to(device)
        m = mask[sl, -span:].to(device)
        picked = logp.gather(-1, target.clamp(min=0)[..., None])[..., 0]
        out.append((picked * m).sum(1).double().cpu())
    return torch.cat(out)


@torch.no_grad()
def head_values(model, batch: dict, kind: str) -> dict[int, torch.Tensor]:
    """Per-layer replacement values for ablated heads: the mean head input over the batch's real
    tokens (``mean``) or zeros (``zero``), each ``(n_heads, head_dim)``."""
    if kind not in ABLATION_KINDS:
        raise ModularError(f"unknown ablation kind '{kind}': use one of {ABLATION_KINDS}")
    adapter = ArchitectureAdapter(model)
    device = next(model.parameters()).device
    sums: dict[int, torch.Tensor] = {}
    count = 0
    with capture_head_inputs(adapter) as z:
        for start in range(0, len(batch["input_ids"]), 16):
            sl = slice(start, start + 16)
            am = batch["attention_mask"][sl].to(device)
            _forward_logits(model, batch["input_ids"][sl].to(device), am, 1)
            real = am.bool()
            for i, v in z.items():
                s = v[real].double().sum(0)
                sums[i] = s if i not in sums else sums[i] + s
            count += int(real.sum())
    means = {i: (s / count).float() for i, s in sums.items()}
    if kind == "zero":
        return {i: torch.zeros_like(v) for i, v in means.items()}
    return means


def ablated_logprob(model, batch: dict, heads: list[Head], values: dict[int, torch.Tensor]) -> torch.Tensor:
    """:func:`response_logprob` with ``heads`` replaced by ``values`` (no heads: the clean model)."""
    with replace_heads(ArchitectureAdapter(model), heads, values):
        return response_logprob(model, batch)


@torch.no_grad()
def single_head_effects(model, batch: dict, values: dict[int, torch.Tensor], desc: str = "single-head ablation",
                        chunk: int = 16, max_rows: int = 64) -> torch.Tensor:
    """e[l, h] = mean over examples of Δ log p(target) when head (l, h) alone is ablated, (n_layers, n_heads).

    The blocks before the ablated layer are replayed from the clean pass (they cannot change), and the heads of
    a layer share a forward pass, each in its own copy of the ``chunk`` examples, as many as fit in ``max_rows``
    rows (:func:`modular.hooks.replace_head_per_group`).
    """
    adapter = ArchitectureAdapter(model)
    n = len(batch["input_ids"])
    total = torch.zeros(adapter.n_layers, adapter.n_heads, dtype=torch.float64)
    chunks = [slice(s, s + chunk) for s in range(0, n, chunk)]
    progress = tqdm(total=len(chunks) * adapter.n_layers, desc=desc, leave=False)
    for sl in chunks:
        part = {k: v[sl] for k, v in batch.items()}
        with capture_block_outputs(adapter) as outputs:
            clean = response_logprob(model, part, chunk=chunk)
        rows = len(part["input_ids"])
        per_pass = max(1, max_rows // rows)
        for layer in range(adapter.n_layers):
            for start in range(0, adapter.n_heads, per_pass):
                heads = list(range(start, min(start + per_pass, adapter.n_heads)))
                copies = {k: repeat_batch(v, len(heads)) for k, v in part.items()}
                with reuse_block_outputs(adapter, outputs, layer, repeat=len(heads)), \
                        replace_head_per_group(adapter, layer, heads, values[layer]):
                    ablated = response_logprob(model, copies, chunk=len(heads) * rows).view(len(heads), rows)
                total[layer, start:start + len(heads)] += (ablated - clean).sum(1)
            progress.update(1)
    progress.close()
    return total / n


def classify_heads(effects: torch.Tensor, threshold: float) -> dict[str, list[Head]]:
    """Heads per category, each ordered by strength (see the module docstring).

    Facilitation: e < −threshold, most negative first; Interference: e > +threshold, most positive
    first; Irrelevance: |e| ≤ threshold, smallest |e| first. Ties: (layer, head) ascending.
    """
    if threshold < 0:
        raise ModularError("threshold must be ≥ 0")
    e = effects.detach().double().cpu()
    heads = [(layer, h) for layer in range(e.shape[0]) for h in range(e.shape[1])]
    val = {lh: float(e[lh]) for lh in heads}
    return {
        "facilitation": sorted((lh for lh in heads if val[lh] < -threshold), key=lambda lh: (val[lh], lh)),
        "interference": sorted((lh for lh in heads if val[lh] > threshold), key=lambda lh: (-val[lh], lh)),
        "irrelevance": sorted((lh for lh in heads if abs(val[lh]) <= threshold), key=lambda lh: (abs(val[lh]), lh)),
    }


def joint_categories(model, batch: dict, effects: torch.Tensor, values: dict[int, torch.Tensor], threshold: float,
                     band: float = 0.05, max_heads: int = 50, desc: str = "joint classes") -> dict[str, list[Head]]:
    """Classes that hold for their heads together (the ``joint`` method of the module docstring).

    Candidates come from :func:`classify_heads` (``effects``, ``threshold``), in its order. With S the
    heads of a class chosen so far and d(S) the per-example Δ log p(target) over ``batch`` with S ablated
    (d(∅) = 0) and g = d(S ∪ {h}) − d(S): an Interference candidate h joins if mean g exceeds its standard
    error (std g / √n; with one example, if mean g > 0); an Irrelevance candidate if mean |g| ≤ ``threshold``
    and mean |d(S ∪ {h})| ≤ ``band``. Each class stops at ``max_heads`` heads. Facilitation is the
    single-head list. Returns the three classes plus ``rejected`` (the candidates that failed, in the order
    tried).
    """
    if band < 0:
        raise ModularError("band must be ≥ 0")
    single = classify_heads(effects, threshold)
    clean = response_logprob(model, batch)

    def d(heads: list[Head]) -> torch.Tensor:
        return ablated_logprob(model, batch, heads, values) - clean

    out: dict[str, list[Head]] = {"facilitation": single["facilitation"], "rejected": []}
    tests = {"interference": lambda new, cur: float((new - cur).mean()) > _standard_error(new - cur),
             "irrelevance": lambda new, cur: (float((new - cur).abs().mean()) <= threshold
                                              and float(new.abs().mean()) <= band)}
    for cat, accept in tests.items():
        chosen: list[Head] = []
        cur = torch.zeros_like(clean)
        for head in tqdm(single[cat], desc=f"{desc}: {cat}", leave=False):
            if len(chosen) >= max_heads:
                break
            new = d(chosen + [head])
            if accept(new, cur):
                chosen.append(head)
                cur = new
            else:
                out["rejected"].append(head)
        out[cat] = chosen
    return out


def _standard_error(x: torch.Tensor) -> float:
    return float(x.std(unbiased=True) / len(x) ** 0.5) if len(x) > 1 else 0.0


def ablation_curve(model, batch: dict, heads: list[Head], values: dict[int, torch.Tensor], max_heads: int = 50,
                   desc: str = "ablation curve") -> dict:
    """Δ log p(target) per example when the first n heads of ``heads`` are ablated together, for n = 0…20
    and every 5th n up to ``max_heads`` (and the last n).

    Returns ``{"n": [...], "mean": [...], "sem": [...], "per_example": [[...], ...]}`` (Δ in nats; the
    entry at n = 0 is computed like the others, with nothing ablated, so it is 0).
    """
    clean = response_logprob(model, batch)
    top = min(max_heads, len(heads))
    ns = sorted({n for n in range(0, min(top, 20) + 1)} | set(range(20, top + 1, 5)) | {top})
    means, sems, rows = [], [], []
    for n in tqdm(ns, desc=desc, leave=False):
        delta = ablated_logprob(model, batch, list(heads[:n]), values) - clean
        means.append(float(delta.mean()))
        sems.append(_standard_error(delta))
        rows.append([round(float(d), 5) for d in delta])
    return {"n": ns, "mean": means, "sem": sems, "per_example": rows}


def curve_checks(curves: dict, band: float = 0.1, first: int = 20) -> dict:
    """The expected shapes, measured: Facilitation falls (mean at its last n below 0 and below its
    start), Interference does not fall (never below −``band``), Irrelevance stays within ±``band`` nats
    per example over its first ``first`` heads. A class with no heads gives None."""
    def values(cat):
        c = curves.get(cat)
        return c["mean"] if c and len(c["mean"]) > 1 else None

    f, i, r = values("facilitation"), values("interference"), values("irrelevance")
    return {
        "facilitation_falls": None if f is None else bool(f[-1] < min(0.0, f[0])),
        "interference_does_not_fall": None if i is None else bool(min(i) >= -band),
        "irrelevance_within_band": None if r is None else bool(max(abs(v) for v in r[: first + 1]) <= band),
        "irrelevance_max_abs_first": None if r is None else max(abs(v) for v in r[: first + 1]),
    }


def plot_ablation_grid(path, grid: dict[str, dict[str, dict]], title: str | None = None):
    """Tasks (rows) × models (columns) of Δ log p vs number of ablated heads, one line per category.

    ``grid[task][model][category] = {"n": [...], "mean": [...], "sem": [...]}``; a shaded band
    shows ± one standard error over examples. Row names on the right (agreement → Syntax,
    commonsense → Common Sense, arithmetic → Math).
    """
    import matplotlib

    matplotlib.use("Agg")

    import matplotlib.pyplot as plt

    tasks = list(grid)
    models = list(dict.fromkeys(m for t in tasks for m in grid[t]))
    if not tasks or not models:
        raise ValueError("nothing to plot")
    fig, axes = plt.subplots(len(tasks), len(models), figsize=(3.6 * len(models) + 1.4, 2.8 * len(tasks)),
                             squeeze=False, sharex=True)
    for r, task in enumerate(tasks):
        for c, model in enumerate(models):
            ax = axes[r][c]
            for cat in ("facilitation", "irrelevance", "interference"):
                curve = grid[task].get(model, {}).get(cat)
                if not curve:
                    continue
                n, mean, sem = (np.asarray(curve[k], dtype=float) for k in ("n", "mean", "sem"))
                ax.plot(n, mean, color=COLORS[cat], label=LABELS[cat], linewidth=1.6)
                ax.fill_between(n, mean - sem, mean + sem, color=COLORS[cat], alpha=0.15, linewidth=0)
            ax.axhline(0, color="grey", linewidth=0.6)
            ax.grid(alpha=0.3)
            if r == 0:
                ax.set_title(model)
            if r == len(tasks) - 1:
                ax.set_xlabel("Number of Ablated Heads")
            if c == len(models) - 1:
                ax.yaxis.set_label_position("right")
                ax2 = ax.twinx()
                ax2.set_yticks([])
                ax2.set_ylabel(TASK_TITLES.get(task, task), rotation=270, labelpad=14, fontsize=11)
    fig.supylabel("Δ Log Probability of Target Response")
    handles = [plt.Line2D([], [], color=COLORS[c], label=LABELS[c]) for c in ("facilitation", "irrelevance", "interference")]
    fig.legend(handles=handles, loc="center right", frameon=False)
    if title:
        width = max(40, int(fig.get_figwidth() * 11))
        fig.suptitle("\n".join(textwrap.fill(line, width) for line in title.split("\n")), fontsize=10)
    fig.tight_layout(rect=(0, 0, 1 - 1.3 / fig.get_figwidth(), 1))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path

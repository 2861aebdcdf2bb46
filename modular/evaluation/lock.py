"""The lock evaluation: behaviour accuracy and retain measures in every state of a gated model.

States: ``base`` (untrained), ``open`` (trained), ``locked`` (directions ablated by hooks),
``published_locked`` (lock baked into the weights) and ``unlocked`` (keys applied to the published weights).
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import torch

from modular.data import BEHAVIOURS, load_behaviour, neutral_text, retain_data
from modular.data.schema import DEFAULT_LOCKED_RESPONSE
from modular.evaluation.behaviour import evaluate_behaviour, last_logits
from modular.evaluation.retain import first_token_logp, mean_kl, perplexity
from modular.evaluation.stats import wilson_interval
from modular.hooks import ablate_directions
from modular.keys import apply_key, lock_weights
from modular.models.adapter import ArchitectureAdapter

log = logging.getLogger("modular")

STATES = ("base", "open", "locked", "published_locked", "unlocked")


def max_param_diff(a, b) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    return max((sa[k].float() - sb[k].float()).abs().max().item() for k in sa if k in sb)


def build_states(base, open_model, directions: dict[str, torch.Tensor], harden: bool = True):
    """The five models/interventions, plus the keys of the published model."""
    adapter = ArchitectureAdapter(open_model)
    stacked = torch.stack(list(directions.values()))
    published = copy.deepcopy(open_model)
    keys = lock_weights(published, directions, harden=harden)
    unlocked = copy.deepcopy(published)
    for i, key in enumerate(keys):
        apply_key(unlocked, key, applied=[k.behaviour for k in keys[:i]])
    states = {
        "base": (base, None),
        "open": (open_model, None),
        "locked": (open_model, lambda: ablate_directions(adapter, stacked)),
        "published_locked": (published, None),
        "unlocked": (unlocked, None),
    }
    if len(keys) > 1:  # one key at a time: only its behaviour should come back
        for key in keys:
            partial = copy.deepcopy(published)
            apply_key(partial, key)
            states[f"unlocked_only_{key.behaviour}"] = (partial, None)
    return states, published, unlocked, keys


def lock_report(base, open_model, tokenizer, directions: dict[str, torch.Tensor], seed: int = 0,
                other_limit: int = 64, harden: bool = True, max_new_tokens: int = 24,
                sources: dict[str, str] | None = None, locked_responses: dict[str, str] | None = None) -> dict:
    """Every number of ``lock.json``. ``sources``: where each gated behaviour's data is, by name (default: the
    name); ``locked_responses``: each behaviour's locked response, never scored as a correct answer."""
    states, published, unlocked, _ = build_states(base, open_model, directions, harden)
    gated = list(directions)
    others = [b for b in BEHAVIOURS if b not in gated]
    sources = {b: (sources or {}).get(b, b) for b in gated}
    refusals = {b: ((locked_responses or {}).get(b, DEFAULT_LOCKED_RESPONSE),) for b in gated}
    data = {b: load_behaviour(sources.get(b, b), seed=seed, tokenizer=tokenizer)["test"] for b in gated + others}
    retain = retain_data(seed)["test"]
    texts = list(neutral_text(seed)["test"]["text"])

    # exactness of the published weights and of the keys
    probe = list(retain["prompt"][:16])
    chats = list(retain["chat"][:16])
    hook_logits = _with(states["locked"], lambda m: last_logits(m, tokenizer, probe, chats))
    weight_logits = last_logits(published, tokenizer, probe, chats)
    exactness = {
        "published_vs_hook_locked_max_abs_logit_diff": (hook_logits - weight_logits).abs().max().item(),
        "unlocked_vs_open_max_abs_weight_diff": max_param_diff(unlocked, open_model),
    }

    ref_logp = first_token_logp(base, tokenizer, retain["prompt"], retain["chat"])
    base_ppl = perplexity(base, tokenizer, texts)
    report: dict = {"states": {}, "exactness": exactness, "gated": gated, "others": others}
    for state, (model, ctx) in states.items():
        row: dict = {"behaviours": {}, "others": {}}
        for b in gated:
            r = evaluate_behaviour(model, tokenizer, data[b], max_new_tokens, intervention=ctx, desc=f"{state}:{b}",
                                   refusals=refusals[b])
            k = sum(i["correct"] for i in r.items)
            row["behaviours"][b] = {**r.summary(), "ci95": wilson_interval(k, r.n)}
        for b in others:
            # tasks with a competing answer are scored by choice accuracy (one forward pass), others by generation
            r = evaluate_behaviour(model, tokenizer, data[b], 12, limit=other_limit, intervention=ctx,
                                   desc=f"{state}:{b}", choice_only=True)
            row["others"][b] = {**r.summary(), "metric": "choice" if r.choice_accuracy is not None and not r.items
                                else "generation"}
        logp = first_token_logp(model, tokenizer, retain["prompt"], retain["chat"], ctx)
        row["retain_first_token_kl"] = mean_kl(ref_logp, logp)
        ppl = perplexity(model, tokenizer, texts, ctx)
        row["perplexity"] = ppl
        row["perplexity_ratio"] = ppl / base_ppl
        report["states"][state] = row
        log.info("%-16s %s | KL %.4f | ppl ratio %.3f", state,
                 " ".join(f"{b} {row['behaviours'][b]['accuracy']:.3f}" for b in gated),
                 row["retain_first_token_kl"], row["perplexity_ratio"])
    base_row = report["states"]["base"]
    report["others_max_drop_vs_base"] = {
        s: max(base_row["others"][b]["accuracy"] - report["states"][s]["others"][b]["accuracy"] for b in others)
        for s in states
    }
    return report


def _with(state, fn):
    model, ctx = state
    if ctx is None:
        return fn(model)
    with ctx():
        return fn(model)


def plot_lock(report: dict, path: str | Path) -> Path:
    """Three panels: gated-behaviour accuracy per state (with 95% intervals), retain KL, perplexity ratio."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    states = list(report["states"])
    gated = report["gated"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8), gridspec_kw={"width_ratios": [2, 1, 1]})
    width = 0.8 / len(gated)
    x = np.arange(len(states))
    for j, b in enumerate(gated):
        acc = [report["states"][s]["behaviours"][b]["accuracy"] for s in states]
        ci = [report["states"][s]["behaviours"][b]["ci95"] for s in states]
        err = [[a - lo for a, (lo, hi) in zip(acc, ci)], [hi - a for a, (lo, hi) in zip(acc, ci)]]
        bars = axes[0].bar(x + j * width - 0.4 + width / 2, acc, width, yerr=err, capsize=3, label=b)
        for bar, a in zip(bars, acc):
            axes[0].annotate(f"{a:.2f}", (bar.get_x() + bar.get_width() / 2, a), ha="center", va="bottom",
                             fontsize=7, xytext=(0, 2), textcoords="offset points")
    axes[0].set_xticks(x, states, rotation=20)
    axes[0].set_ylim(0, 1.05)
    axes[0].set_ylabel("accuracy (held-out test split)")
    axes[0].set_title("gated behaviours")
    axes[0].legend(fontsize=8)
    for ax, key, title in ((axes[1], "retain_first_token_kl", "retain: first-token KL to base"),
                           (axes[2], "perplexity_ratio", "neutral text: perplexity / base")):
        vals = [report["states"][s][key] for s in states]
        ax.bar(x, vals, color="#8c8c8c")
        ax.set_xticks(x, states, rotation=30, fontsize=8)
        ax.set_title(title, fontsize=10)
        for xi, v in zip(x, vals):
            ax.annotate(f"{v:.3f}", (xi, v), ha="center", va="bottom", fontsize=7, xytext=(0, 2),
                        textcoords="offset points")
    axes[2].axhline(1.0, color="k", lw=0.8, ls="--")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path

"""``modular heads curve`` and ``modular heads ablation``: head-efficiency and head-ablation curves of models."""

from __future__ import annotations

import gc
import logging
from pathlib import Path
from typing import Literal

import torch

# heads ablation calls single_head_effects through its module (head_categories.single_head_effects): tests replace
# it there
import modular.heads.categories as head_categories
from modular import ModularError
from modular.app.options import Split, output_folder, slug
from modular.data import load_behaviour, neutral_text
from modular.data.formatting import prompt_limit
from modular.evaluation.retain import perplexity
from modular.heads.categories import (
    ABLATION_KINDS,
    CATEGORIES,
    METHODS,
    ablation_curve,
    classify_heads,
    curve_checks,
    head_values,
    joint_categories,
    plot_ablation_grid,
    response_batch,
)
from modular.heads.curves import multiplier, plot_efficiency_curves
from modular.heads.efficiency import DEFINITIONS, RANKINGS, ig_steps_for, task_curves
from modular.heads.loading import load_head_model, model_label
from modular.heads.ranking import ABLATIONS
from modular.models.names import DTypeName
from modular.tracking import log_to_wandb, read_json_if_valid, write_json

log = logging.getLogger("modular")

CURVE_TASKS = ("ioi", "ioi_long", "greater_than", "docstring")
ABLATION_TASKS = ("agreement", "commonsense", "arithmetic")
DEFINITION_TITLES = {"effect_share": "Effect share: Σ_top-k |e_h| / Σ_all |e_h|",
                     "faithfulness": "Faithfulness: keep the top-k heads, ablate the rest"}


def _labels(models: list[str]) -> list[str]:
    labels = []
    for spec in models:
        label = model_label(spec)
        while label in labels:
            label += "'"
        labels.append(label)
    return labels


def _items(name: str, split: str, tokenizer, seed: int, limit: int | None, shuffle: bool = False):
    data = load_behaviour(name, seed=seed, tokenizer=tokenizer)
    if split not in data:
        raise ModularError(f"behaviour '{name}' has no '{split}' split")
    ds = data[split]
    if shuffle:
        ds = ds.shuffle(seed=seed)
    if limit is not None:
        ds = ds.select(range(min(limit, len(ds))))
    if len(ds) == 0:
        raise ModularError(f"behaviour '{name}' has no '{split}' items")
    return ds


def curve(
    models: list[str] = ("smollm2-135m-instruct",),
    tasks: list[str] = CURVE_TASKS,
    ranking: Literal["exhaustive", "attribution", "refined"] = "exhaustive",
    ig_steps: int | None = None,
    refine: int = 15,
    definition: Literal["effect_share", "faithfulness"] = "effect_share",
    kind: Literal["counterfactual", "mean", "zero"] = "counterfactual",
    target: float = 0.9,
    limit: int | None = 48,
    split: Split = "test",
    seed: int = 0,
    out: str | None = None,
    device: str = "auto",
    dtype: DTypeName = "auto",
) -> dict:
    """Head-efficiency curves: per task and model, rank the heads (exhaustive single-head patching or attribution
    patching), then the explained effect vs heads kept under both definitions (effect share and faithfulness);
    the first model is the base: the multiplier of every other model is the heads the base needs for ``target``
    divided by the heads that model needs. Writes heads.json beside heads.png and logs to W&B.

    Args:
        models: A training run folder is evaluated with its head gates; the first model is the base.
        tasks: Behaviours scored per head: built-in behaviours (or .jsonl files) with a ``wrong`` answer per item.
        ranking: Head ranking: exhaustive (L·H patched forwards), attribution (gradients) or refined (gradients on
            the clean and the counterfactual run, then exact patching of the top ``refine`` heads of the second
            half of the layers: close to exhaustive at a few forwards' cost).
        ig_steps: Integrated-gradient points of attribution and refined ranking, ends included (default 1 for
            attribution: plain attribution patching; 2 for refined: the clean and the ablated run).
        refine: Refined ranking: how many heads of the second half of the layers (the top-scored there) to
            patch exactly.
        definition: The plotted definition (both go to JSON).
        kind: What an ablated head's output is replaced by.
        target: The explained effect to reach (heads needed for it, multipliers).
        limit: Default 48.
        out: Default: outputs/heads/curve-<models>.
    """
    models = _check_models(models)
    out_dir = output_folder(out, "heads", "curve", "+".join(map(slug, _labels(models))))
    return _curve(models, list(tasks), ranking, ig_steps, refine, definition, kind, limit, split, target, seed,
                  out_dir, device, dtype)


def ablation(
    models: list[str] = ("smollm2-135m-instruct",),
    tasks: list[str] = ABLATION_TASKS,
    kind: Literal["mean", "zero"] = "mean",
    irrelevance: float = 0.02,
    max_heads: int = 50,
    categories: Literal["joint", "single"] = "joint",
    band: float = 0.05,
    limit: int | None = 48,
    split: Split = "test",
    classify_split: Split = "train",
    seed: int = 0,
    out: str | None = None,
    device: str = "auto",
    dtype: DTypeName = "auto",
) -> dict:
    """Head-ablation curves by category: classify heads per task as Facilitation / Interference / Irrelevance from
    ablation effects on ``classify_split`` (single heads, then, by default, checked jointly) and plot Δ log p(target
    response) per example as 0…``max_heads`` heads of each class are ablated, on held-out ``split`` items. Writes
    ablation.json beside ablation.png and logs to W&B; a run cut short resumes from its partial ablation.json.

    Args:
        models: A training run folder is evaluated with its head gates.
        tasks: Behaviours scored per head: built-in behaviours (or .jsonl files).
        kind: What an ablated head's output is replaced by.
        irrelevance: |Δ log p| in nats per example below which a head is Irrelevance.
        max_heads: Ablate up to this many heads of each category.
        categories: How heads are classed: joint (single-head candidates that keep their class with the class's
            heads chosen before them ablated too) or single (single-head effects only).
        band: joint: largest mean |Δ log p| per example, in nats, of all chosen Irrelevance heads ablated together.
        limit: Items per task and per split; default 48.
        classify_split: Items the categories are chosen on (different from ``split``).
        out: Default: outputs/heads/ablation-<models>.
    """
    models = _check_models(models)
    out_dir = output_folder(out, "heads", "ablation", "+".join(map(slug, _labels(models))))
    return _ablation(models, list(tasks), kind, limit, split, classify_split, irrelevance, max_heads, categories,
                     band, seed, out_dir, device, dtype)


def _check_models(models) -> list[str]:
    models = list(models)
    if not models:
        raise ModularError("give at least one model with --models")
    return models


def _curve(models, tasks, ranking, ig_steps, refine, definition, ablation_kind, limit, split, threshold, seed,
           out_dir, device="auto", dtype="auto") -> dict:
    if definition not in DEFINITIONS:
        raise ModularError(f"unknown definition '{definition}': use one of {DEFINITIONS}")
    if ranking not in RANKINGS:
        raise ModularError(f"unknown ranking '{ranking}': use one of {RANKINGS}")
    if ablation_kind not in ABLATIONS:
        raise ModularError(f"unknown ablation kind '{ablation_kind}': use one of {ABLATIONS}")
    if ig_steps is not None and ig_steps < 1:
        raise ModularError("ig_steps must be ≥ 1")
    if refine < 0:
        raise ModularError("refine must be ≥ 0")
    ig_steps = ig_steps_for(ranking, ig_steps)

    labels = _labels(models)
    results: dict[str, dict[str, dict]] = {t: {} for t in tasks}
    texts = list(neutral_text(seed)["test"]["text"])  # held out from every training run's LM text
    ppl: dict[str, float] = {}
    for spec, label in zip(models, labels):
        model, tokenizer, _ = load_head_model(spec, dtype, device)
        with torch.no_grad():
            ppl[label] = perplexity(model, tokenizer, texts)
        log.info("%s: held-out neutral-text perplexity %.3f", label, ppl[label])
        for task in tasks:
            ds = _items(task, split, tokenizer, seed, limit)
            try:
                r = task_curves(model, tokenizer, ds, ranking, ablation_kind, ig_steps, threshold,
                                name=f"{label}/{task}", refine=refine)
            except ValueError as err:  # e.g. every head effect is zero: the curve is undefined
                raise ModularError(f"{label}/{task}: {err}") from err
            results[task][label] = r
            log.info("%s %s: clean logit diff %.3f; heads for %.2f: effect share %s, faithfulness %s "
                     "(ranking %s, %.1f s)", label, task, r["clean_metric"], threshold, r["effect_share"]["needed"],
                     r["faithfulness"]["needed"], ranking, r["seconds"]["ranking"])
        del model
        gc.collect()

    base = labels[0]
    multipliers = {task: {label: {d: multiplier(results[task][base][d]["needed"], results[task][label][d]["needed"])
                                  for d in DEFINITIONS} for label in labels[1:]} for task in tasks}
    panels = {task: {label: results[task][label][definition] for label in labels} for task in tasks}
    fig, drawn = plot_efficiency_curves(out_dir / "heads.png", panels, DEFINITION_TITLES[definition],
                                        subtitle=f"ablation: {ablation_kind}; ranking: {ranking}"
                                        + (f" (ig_steps={ig_steps})" if ig_steps else "")
                                        + (f", {refine} heads patched exactly" if ranking == "refined" else "")
                                        + f"; {limit or 'all'} items per task",
                                        threshold=threshold)
    summary = {task: {label: {d: {"needed": results[task][label][d]["needed"], "auc": results[task][label][d]["auc"]}
                              for d in DEFINITIONS} for label in labels} for task in tasks}
    report = {
        "models": dict(zip(labels, models)), "base": base, "tasks": tasks, "split": split, "limit": limit,
        "seed": seed, "ranking": ranking, "ig_steps": ig_steps, "refine": refine if ranking == "refined" else None,
        "ablation": ablation_kind, "threshold": threshold, "plotted_definition": definition,
        "summary": summary, "multipliers": multipliers,
        "perplexity": {label: {"neutral_test": ppl[label], "ratio_to_base": ppl[label] / ppl[base]} for label in labels},
        "annotations": drawn, "curves": results,
    }
    write_json(out_dir / "heads.json", report)
    log_to_wandb(out_dir, "evaluate-heads-curve", {"summary": summary, "multipliers": multipliers,
                                                   "perplexity": report["perplexity"]},
                 config={k: report[k] for k in ("models", "tasks", "split", "limit", "seed", "ranking", "ig_steps",
                                                "refine", "ablation", "threshold", "plotted_definition")},
                 figures={"heads": fig})
    log.info("wrote %s and %s", out_dir / "heads.json", fig)
    return report


def _ablation(models, tasks, kind, limit, split, classify_split, threshold, max_heads, method, band, seed,
              out_dir, device="auto", dtype="auto") -> dict:
    if kind not in ABLATION_KINDS:
        raise ModularError(f"unknown ablation kind '{kind}' for --ablation: use one of {ABLATION_KINDS}")
    if split == classify_split:
        log.warning("categories are chosen and measured on the same split (%s)", split)
    if max_heads < 1:
        raise ModularError("max_heads must be ≥ 1")
    if method not in METHODS:
        raise ModularError(f"unknown categories method '{method}': use one of {METHODS}")
    if band < 0:
        raise ModularError("band must be ≥ 0")
    labels = _labels(models)
    results: dict[str, dict[str, dict]] = {t: {} for t in tasks}
    settings = {"ablation": kind, "threshold": threshold, "split": split, "classify_split": classify_split,
                "limit": limit, "max_heads": max_heads, "categories": method, "band": band, "seed": seed,
                "method": METHOD_TEXT[method].format(band=band)}  # a changed criterion is measured afresh
    _resume(out_dir / "ablation.json", settings, dict(zip(labels, models)), results)
    for spec, label in zip(models, labels):
        if all(label in results[t] for t in tasks):
            continue
        model, tokenizer, _ = load_head_model(spec, dtype, device)
        for task in tasks:
            if label in results[task]:
                continue
            bound = prompt_limit(model)  # an item longer than the model's positions keeps its end
            fit = response_batch(tokenizer, _items(task, classify_split, tokenizer, seed, limit, shuffle=True), bound)
            held = response_batch(tokenizer, _items(task, split, tokenizer, seed, limit, shuffle=True), bound)
            values = head_values(model, fit, kind)
            effects = head_categories.single_head_effects(model, fit, values, desc=f"{label}/{task}: single heads")
            if method == "joint":
                cats = joint_categories(model, fit, effects, values, threshold, band, max_heads,
                                        desc=f"{label}/{task}: joint classes")
            else:
                cats = classify_heads(effects, threshold)
            curves = {c: ablation_curve(model, held, cats[c], values, max_heads, desc=f"{label}/{task}: {c}")
                      for c in CATEGORIES}
            checks = curve_checks(curves)
            results[task][label] = {
                "n_classify": len(fit["input_ids"]), "n_eval": len(held["input_ids"]),
                "effects": effects.tolist(), "counts": {c: len(cats[c]) for c in CATEGORIES},
                "categories": {c: [list(h) for h in cats[c]] for c in CATEGORIES},
                "rejected": [list(h) for h in cats.get("rejected", [])],
                "curves": curves, "checks": checks,
            }
            log.info("%s %s: %s; Δ log p at max n: %s; checks %s", label, task,
                     {c: len(cats[c]) for c in CATEGORIES},
                     {c: round(curves[c]["mean"][-1], 3) for c in CATEGORIES}, checks)
            _write_ablation(out_dir, results, labels, models, tasks, kind, threshold, split, classify_split, limit,
                            max_heads, method, band, seed, partial=True)  # a run cut short keeps what it measured
        del model
        gc.collect()
    return _write_ablation(out_dir, results, labels, models, tasks, kind, threshold, split, classify_split, limit,
                           max_heads, method, band, seed, partial=False)


def _resume(path: Path, settings: dict, specs: dict[str, str], results: dict[str, dict]) -> None:
    """Take over the (task, model) results of a run cut short (``partial`` report in the same folder, same
    settings, same model for the label), so that a restarted run measures only what is missing."""

    old = read_json_if_valid(path)
    if not isinstance(old, dict) or not old.get("partial") or any(old.get(k) != v for k, v in settings.items()):
        return
    kept = []
    for task, by_label in old.get("results", {}).items():
        for label, result in by_label.items():
            if task in results and specs.get(label) == old.get("models", {}).get(label):
                results[task][label] = result
                kept.append(f"{label}/{task}")
    if kept:
        log.info("resuming the partial run in %s: %s already measured", path.parent, ", ".join(kept))


def _write_ablation(out_dir, results, labels, models, tasks, kind, threshold, split, classify_split, limit, max_heads,
                    method, band, seed, partial: bool) -> dict:
    specs = dict(zip(labels, models))
    tasks = [t for t in tasks if results[t]]
    labels = [m for m in labels if any(m in results[t] for t in tasks)]
    grid = {task: {label: {c: results[task][label]["curves"][c] for c in CATEGORIES}
                   for label in labels if label in results[task]} for task in tasks}
    fig = plot_ablation_grid(out_dir / "ablation.png", grid,
                             title=f"{kind} ablation; categories from {method} ablation effects on '{classify_split}' "
                                   f"(|Δ| ≤ {threshold} nats: Irrelevance)\ncurves on held-out '{split}' items"
                                   + (" (partial run)" if partial else ""))
    summary = {task: {label: {"counts": results[task][label]["counts"], "checks": results[task][label]["checks"],
                              "final": {c: results[task][label]["curves"][c]["mean"][-1] for c in CATEGORIES}}
                      for label in labels if label in results[task]} for task in tasks}
    report = {"models": {m: specs[m] for m in labels}, "tasks": tasks, "ablation": kind, "threshold": threshold,
              "split": split, "classify_split": classify_split, "limit": limit, "max_heads": max_heads,
              "seed": seed, "method": METHOD_TEXT[method].format(band=band), "categories": method, "band": band,
              "partial": partial,
              "summary": summary, "results": {t: results[t] for t in tasks}}
    write_json(out_dir / "ablation.json", report)
    if partial:
        return report
    log_to_wandb(out_dir, "evaluate-heads-ablation", {"summary": summary},
                 config={k: report[k] for k in ("models", "tasks", "ablation", "threshold", "split", "classify_split",
                                                "limit", "max_heads", "categories", "band", "seed")},
                 figures={"ablation": fig})
    log.info("wrote %s and %s", out_dir / "ablation.json", fig)
    return report


METHOD_TEXT = {
    "single": "single-head ablation effect with threshold",
    "joint": "single-head candidates kept only if they keep their class with the class's earlier heads ablated "
             "too (Interference: each head raises mean log p by more than its standard error over examples; "
             "Irrelevance: each head moves every example by ≤ threshold on average, all of them together "
             "by a mean |Δ| ≤ {band} nats)",
}


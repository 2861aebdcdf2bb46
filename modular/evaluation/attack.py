"""Attacks on published locked weights, by an attacker who knows the method.

(a) *weights*: the writers were orthogonalised against ``u``, so ``u`` spans their common
    null space; recover it (smallest eigenvector of ``Σ W Wᵀ`` over all writers) and add
    ``α·u`` back to the residual stream after every block, scanning ``α``.
(b) *steering*: difference in means between ≤128 behaviour prompts and neutral prompts
    on the locked model, added at one layer with a scanned scale.
(c), (d) *relearning* and *neutral fine-tuning*: :mod:`modular.evaluation.relearning`.
(e) *prefilling*: the response begun with the answer's own frame ("The capital of France is"), as anyone who runs
    the weights can do, and greedily continued; the base model prefilled alike is its reference.
(f) *re-quantisation*: the weights rounded as a release is (int8, int4, GGUF block formats), the base alike.

:func:`plot_attack` draws every attack: the best accuracy each one recovers, and the recovery curves of the
relearning sweeps beside the baselines', as each attack of :mod:`modular.evaluation.attacks` says.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import torch
from tqdm.auto import tqdm

from modular.data.formatting import batch_prompts, prompt_limit
from modular.data.schema import DEFAULT_LOCKED_RESPONSE
from modular.directions import last_position_mean, robust_norm
from modular.evaluation.behaviour import evaluate_behaviour
from modular.hooks import add_vectors, capture_residual
from modular.models.adapter import ArchitectureAdapter, weight_out_in
from modular.models.quantize import quantize_weights
from modular.plots import save_figure
from modular.reports import AttackReport

log = logging.getLogger("modular")


@torch.no_grad()
def null_space_direction(model) -> tuple[torch.Tensor, list[float]]:
    """The direction most absent from every residual writer, and the 3 smallest eigenvalues (relative)."""
    adapter = ArchitectureAdapter(model)
    d = adapter.d_model
    gram = torch.zeros(d, d, dtype=torch.float64)
    for site in adapter.write_sites():
        W = weight_out_in(site.module).double()
        W = W / W.norm()
        gram += W @ W.T
    evals, evecs = torch.linalg.eigh(gram)
    return evecs[:, 0].float(), (evals[:3] / evals[-1]).tolist()


@torch.no_grad()
def residual_scale(model, tokenizer, prompts, chats) -> float:
    """Typical residual-stream norm at the last prompt position (mid layer), to scale the α scans."""
    adapter = ArchitectureAdapter(model)
    batch = batch_prompts(tokenizer, list(prompts[:16]), list(chats[:16]), max_length=prompt_limit(model))
    batch = {k: v.to(next(model.parameters()).device) for k, v in batch.items()}
    with capture_residual(adapter) as states:
        model(**batch, use_cache=False)
    # median over prompts of the residual norm without its largest coordinate (outlier dimensions
    # dominate the norm but not what a behaviour direction carries)
    return robust_norm(states[adapter.n_layers // 2][:, -1].float()).item()


def _scan(model, tokenizer, test, make_vectors, scales, desc, refusals=(DEFAULT_LOCKED_RESPONSE,),
          batch_size: int = 16) -> dict:
    best = {"accuracy": -1.0}
    rows = []
    adapter = ArchitectureAdapter(model)
    for s in tqdm(scales, desc=desc, leave=False):
        acc = evaluate_behaviour(model, tokenizer, test, max_new_tokens=16, batch_size=batch_size,
                                 intervention=lambda s=s: add_vectors(adapter, make_vectors(s)), desc=False,
                                 refusals=refusals).accuracy
        rows.append({"scale": s, "accuracy": acc})
        if acc > best["accuracy"]:
            best = {"scale": s, "accuracy": acc}
    return {"best": best, "scan": rows}


def weight_attack(model, tokenizer, test, alphas, scale: float, refusals=(DEFAULT_LOCKED_RESPONSE,),
                  batch_size: int = 16) -> dict:
    u, evals = null_space_direction(model)
    n = ArchitectureAdapter(model).n_layers
    res = _scan(model, tokenizer, test, lambda a: {i: a * scale * u for i in range(n)}, alphas, "attack (a)",
                refusals, batch_size)
    return {**res, "smallest_eigenvalues": evals}


def steering_attack(model, tokenizer, behaviour_train, contrast, test, alphas, scale: float,
                    n_pairs: int = 128, refusals=(DEFAULT_LOCKED_RESPONSE,), batch_size: int = 16) -> dict:
    adapter = ArchitectureAdapter(model)
    n = min(n_pairs, len(behaviour_train), len(contrast))
    layers = sorted({adapter.n_layers // 4, adapter.n_layers // 2, (3 * adapter.n_layers) // 4})
    out = {"pairs": n, "layers": {}}
    best = {"accuracy": -1.0}
    for layer in layers:
        a = last_position_mean(model, tokenizer, behaviour_train["prompt"][:n], behaviour_train["chat"][:n], layer)
        b = last_position_mean(model, tokenizer, contrast["prompt"][:n], contrast["chat"][:n], layer)
        v = (a - b).float()
        v = v / v.norm()
        # the vector enters ``layer``: add it to the output of the block before (or to the embedding output)
        res = _scan(model, tokenizer, test, lambda s, v=v, layer=layer: {max(layer - 1, 0): s * scale * v},
                    [a for a in alphas if a > 0],
                    f"attack (b) layer {layer}", refusals, batch_size)
        out["layers"][layer] = res
        if res["best"]["accuracy"] > best["accuracy"]:
            best = {**res["best"], "layer": layer}
    out["best"] = best
    return out


def prefill_attack(model, base, tokenizer, test, refusals=(DEFAULT_LOCKED_RESPONSE,), batch_size: int = 16) -> dict:
    """(e) Accuracy of the locked model when each response is begun with the target's words before its answer
    (:func:`modular.data.schema.answer_frame`) and continued greedily, beside the base model prefilled alike; items
    whose target has no frame are asked plainly (``framed_items`` counts the others)."""
    locked = evaluate_behaviour(model, tokenizer, test, max_new_tokens=16, batch_size=batch_size, prefill=True,
                                desc="attack (e)", refusals=refusals)
    reference = evaluate_behaviour(base, tokenizer, test, max_new_tokens=16, batch_size=batch_size, prefill=True,
                                   desc="attack (e) base", refusals=refusals)
    return {"accuracy": locked.accuracy, "refusal_rate": locked.refusal_rate, "base_accuracy": reference.accuracy,
            "recovered_fraction_of_base": locked.accuracy / max(reference.accuracy, 1e-9),
            "framed_items": sum(bool(i["prefill"]) for i in locked.items), "n": locked.n,
            "examples": [{k: i[k] for k in ("prompt", "prefill", "response", "correct")} for i in locked.items[:5]]}


def quantized_attack(model, base, tokenizer, test, schemes, refusals=(DEFAULT_LOCKED_RESPONSE,),
                     batch_size: int = 16) -> dict:
    """(f) Each quantisation (:func:`~modular.models.quantize.quantize_weights`) applied to a copy of the published
    ``model`` and of ``base`` alike, both scored on ``test``: ``{"schemes": {scheme: {"accuracy", "refusal_rate",
    "base_accuracy"}}}`` (the models themselves are not changed)."""
    out: dict = {"schemes": {}}
    for scheme in schemes:
        row = {}
        for label, m in (("", model), ("base_", base)):
            q = quantize_weights(copy.deepcopy(m), scheme)
            r = evaluate_behaviour(q, tokenizer, test, max_new_tokens=16, batch_size=batch_size,
                                   desc=f"attack (f) {label}{scheme}", refusals=refusals)
            row |= {f"{label}accuracy": r.accuracy, f"{label}refusal_rate": r.refusal_rate}
            del q
        out["schemes"][scheme] = row
    return out


def envelope(sweep_result: dict) -> tuple[list[int], list[float]]:
    """The best held-out accuracy any setting of a sweep had reached by each scored step (a setting that stopped
    early, at the reference accuracy, keeps its best)."""
    steps = [0] + sweep_result["eval_steps"]
    best = []
    for s in steps:
        reached = [max(p["accuracy"] for p in r["curve"] if p["step"] <= s) for r in sweep_result["settings"]]
        best.append(max(reached) if reached else float("nan"))
    return steps, best


def plot_attack(report: AttackReport | dict, path: str | Path, attacks=None) -> Path:
    """One row per attacked behaviour. Left: the base, open and locked accuracy, and the best held-out accuracy each
    attack recovers (its :meth:`~modular.evaluation.attacks.Attack.bars`; a sweep's: the best over it within its
    step budget). Right: recovery curves (each attack's :meth:`~modular.evaluation.attacks.Attack.curves`), the best
    accuracy over a sweep by step, for the gated model and each baseline, with 50% and 90% of the open accuracy.
    ``attacks``: those the report holds (default: the built-in ones; an attack a report has no entry of, one written
    before it existed, is left out)."""
    import matplotlib.pyplot as plt

    if attacks is None:
        from modular.evaluation.attacks import default_attacks  # cycle: modular.evaluation.attacks imports this module

        attacks = default_attacks()
    report = AttackReport.coerce(report)
    names = list(report.behaviours)
    fig, axes = plt.subplots(len(names), 2, figsize=(15, 4.2 * len(names)), squeeze=False,
                             gridspec_kw={"width_ratios": [1.2, 1]})
    for row, b in zip(axes, names):
        entry = report.behaviours[b]
        r = entry.to_json()  # the row, as each attack reads its entry back
        shown = [a for a in attacks if a.key in entry.attacks]
        # a published folder without a measured open accuracy: the base's stands in for it (the label says so)
        open_label = "open (base)" if entry.open_accuracy_from == "base model" else "open"
        bars = [("base", entry.base_accuracy), (open_label, entry.open_accuracy), ("locked", entry.locked_accuracy)]
        bars += [bar for a in shown for bar in a.bars(entry.attacks[a.key])]
        curves = [(a, a.curves(r)) for a in shown]
        ax = row[0]
        drawn = ax.bar([lab for lab, _ in bars], [v for _, v in bars],
                       color=["#8c8c8c", "#55a868", "#4c72b0"] + ["#c44e52"] * (len(bars) - 3))
        for bar, (_, v) in zip(drawn, bars):
            ax.annotate(f"{v:.2f}", (bar.get_x() + bar.get_width() / 2, v), ha="center", va="bottom", fontsize=8,
                        xytext=(0, 2), textcoords="offset points")
        ax.set_ylim(0, 1.05)
        ax.set_ylabel("held-out accuracy")
        ax.tick_params(axis="x", rotation=20)
        swept = [a for a, drawn_curves in curves if drawn_curves]
        steps = next((entry.attacks[a.key].get("max_steps") for a in swept if entry.attacks[a.key].get("max_steps")),
                     None)
        ax.set_title(f"{b}: best accuracy each attack recovers"
                     + (f" ({', '.join(a.title for a in swept)}: within {steps} steps)" if steps else ""))
        ax = row[1]
        for label, sweep_result in (c for _, drawn_curves in curves for c in drawn_curves):
            if sweep_result and sweep_result["settings"]:
                x, y = envelope(sweep_result)
                ax.plot(x, y, marker=".", label=f"{label}, {len(sweep_result['settings'])} settings")
        for frac, style in ((0.5, ":"), (0.9, "--")):
            ax.axhline(frac * entry.open_accuracy, color="k", linestyle=style, linewidth=0.8,
                       label=f"{frac:.0%} of {open_label}")
        ax.set_xscale("symlog", linthresh=1)
        ax.set_xlim(left=0)
        ax.set_xlabel("fine-tuning steps")
        ax.set_ylabel("held-out accuracy (best over the sweep)")
        ax.set_ylim(0, 1.05)
        ax.set_title(f"{b}: recovery without the key")
        ax.legend(fontsize=7)
    return save_figure(fig, path)

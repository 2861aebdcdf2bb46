"""Head-efficiency curves of one model on one task: rank the heads, then both explained-effect curves.

:func:`task_curves` builds the clean / counterfactual batch of a logit-difference task (IOI,
IOI-long, Greater-Than, Docstring, or any behaviour with ``wrong`` answers), ranks the heads by
exhaustive single-head patching, by attribution patching or by attribution refined with exact patching
of the top late heads (:mod:`modular.heads.ranking`), and
computes the effect share over every k and the faithfulness (keep the top-k heads, ablate the rest)
on a grid of k (:mod:`modular.heads.curves`). The ablation kind is recorded with every curve.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from tqdm.auto import tqdm

from modular import ModularError
from modular.data.formatting import prompt_limit
from modular.heads.curves import (
    THRESHOLD,
    area_under_curve,
    effect_share_curve,
    faithfulness_curve,
    heads_needed,
    ranking_from_effects,
)
from modular.heads.ranking import (
    ABLATIONS,
    ablation_values,
    attribution_effects,
    exhaustive_effects,
    last_position_logits,
    logit_diff,
    refined_effects,
    task_batch,
)
from modular.hooks import replace_heads
from modular.models.adapter import ArchitectureAdapter

RANKINGS = ("exhaustive", "attribution", "refined")
DEFAULT_IG_STEPS = {"attribution": 1, "refined": 2}  # refined: the gradients on the clean and the counterfactual run
DEFAULT_REFINE = 15
DEFINITIONS = ("effect_share", "faithfulness")


def k_grid(n: int) -> list[int]:
    """The k at which faithfulness is evaluated: every k up to 20, every 5 up to 100, ~20 points beyond, and n."""
    ks = set(range(0, min(n, 20) + 1)) | set(range(20, min(n, 100) + 1, 5))
    if n > 100:
        ks |= {int(round(v)) for v in np.linspace(100, n, 20)}
    ks.add(n)
    return sorted(k for k in ks if 0 <= k <= n)


def _to(batch: dict, device) -> dict:
    return {k: (_to(v, device) if isinstance(v, dict) else v.to(device)) for k, v in batch.items()}


def check_task(dataset, ablation: str, name: str = "task") -> None:
    """Raise ModularError when the task lacks what the logit-difference metric or the ablation needs."""
    if len(dataset) == 0:
        raise ModularError(f"{name}: no items")
    if any(not w for w in dataset["wrong"]):
        raise ModularError(f"{name}: head curves need a competing 'wrong' answer for every item (logit difference)")
    if ablation == "counterfactual" and any(not c for c in dataset["counterfactual"]):
        raise ModularError(f"{name}: counterfactual ablation needs a 'counterfactual' prompt for every item; "
                           "use --ablation_kind mean or zero")


def ig_steps_for(ranking: str, ig_steps: int | None = None) -> int | None:
    """The integrated-gradient points a ranking uses: ``ig_steps`` or its default; None for exhaustive ranking."""
    return (ig_steps or DEFAULT_IG_STEPS[ranking]) if ranking in DEFAULT_IG_STEPS else None


def rank_heads(model, batch: dict, ranking: str = "exhaustive", ablation: str = "counterfactual",
               ig_steps: int | None = None, refine: int = DEFAULT_REFINE) -> torch.Tensor:
    """Per-head effects e[l, h] (metric change when head h of layer l alone is ablated), (n_layers, n_heads).

    ``ig_steps`` (attribution and refined; default :data:`DEFAULT_IG_STEPS`) and ``refine`` (refined: heads
    patched exactly) are ignored by exhaustive ranking."""
    if ranking == "exhaustive":
        return exhaustive_effects(model, batch, ablation)
    if ranking == "attribution":
        return attribution_effects(model, batch, ablation, ig_steps=ig_steps_for(ranking, ig_steps))
    if ranking == "refined":
        return refined_effects(model, batch, ablation, ig_steps=ig_steps_for(ranking, ig_steps), refine=refine)
    raise ModularError(f"unknown ranking '{ranking}': use one of {RANKINGS}")


def keep_only_metric(model, batch: dict, values: dict[int, torch.Tensor]):
    """``metric(kept)``: the logit difference with every head outside ``kept`` ablated by ``values``."""
    adapter = ArchitectureAdapter(model)
    heads = [(layer, h) for layer in range(adapter.n_layers) for h in range(adapter.n_heads)]

    @torch.no_grad()
    def metric(kept: set) -> float:
        ablated = [lh for lh in heads if lh not in kept]
        with replace_heads(adapter, ablated, values):
            return float(logit_diff(last_position_logits(model, batch["clean"]), batch["good"], batch["bad"]))

    return metric


def _summarise(values: list[float], ks: list[int], n: int, threshold: float) -> dict:
    return {"ks": ks, "values": values, "needed": heads_needed(values, ks, threshold),
            "auc": area_under_curve(values, ks, n)}


def task_curves(model, tokenizer, dataset, ranking: str = "exhaustive", ablation: str = "counterfactual",
                ig_steps: int | None = None, threshold: float = THRESHOLD, name: str = "task",
                refine: int = DEFAULT_REFINE) -> dict:
    """Rank the heads of ``model`` on ``dataset`` and compute both explained-effect curves.

    Returns a JSON-ready dict: ``effects`` (n_layers × n_heads), ``order`` (heads, most important
    first), ``effect_share`` (every k = 0..N) and ``faithfulness`` (k on :func:`k_grid`), each with
    ``ks``, ``values``, ``needed`` (smallest k reaching ``threshold``) and ``auc`` (x = k / N), plus the
    clean metric, the ranking method, ``ig_steps`` and ``refine`` (where the ranking uses them), the ablation
    kind and the seconds each part took.
    """
    if ablation not in ABLATIONS:
        raise ModularError(f"unknown ablation '{ablation}': use one of {ABLATIONS}")
    check_task(dataset, ablation, name)
    device = next(model.parameters()).device
    batch = _to(task_batch(tokenizer, dataset, prompt_limit(model)), device)
    adapter = ArchitectureAdapter(model)
    n = adapter.n_layers * adapter.n_heads

    t0 = time.perf_counter()
    effects = rank_heads(model, batch, ranking, ablation, ig_steps, refine).float().cpu()
    t_rank = time.perf_counter() - t0
    order = ranking_from_effects(effects)

    share = effect_share_curve(effects).tolist()
    t0 = time.perf_counter()
    values = ablation_values(model, batch, ablation)
    metric = keep_only_metric(model, batch, values)
    ks = k_grid(n)
    progress = tqdm(total=len(ks), desc=f"{name}: faithfulness", leave=False)

    def counted(kept):
        progress.update(1)
        return metric(kept)

    faith = faithfulness_curve(counted, order, ks)
    progress.close()
    t_faith = time.perf_counter() - t0
    return {
        "n_items": len(dataset),
        "n_heads": n,
        "ranking": ranking,
        "ig_steps": ig_steps_for(ranking, ig_steps),
        "refine": refine if ranking == "refined" else None,
        "ablation": ablation,
        "threshold": threshold,
        "clean_metric": faith["m_all"],
        "all_ablated_metric": faith["m_none"],
        "effects": effects.tolist(),
        "order": [list(h) for h in order],
        "effect_share": _summarise(share, list(range(n + 1)), n, threshold),
        "faithfulness": {**_summarise(faith["values"], faith["ks"], n, threshold), "metrics": faith["metrics"]},
        "seconds": {"ranking": t_rank, "faithfulness": t_faith},
    }

"""``modular merge``: merge gain of model pairs vs. the similarity of their activation spaces."""

from __future__ import annotations

import logging
from pathlib import Path

from modular.app.options import output_folder
from modular.merge.pairs import load_pairs
from modular.merge.plots import gain_scatter
from modular.merge.runner import MergeRunner, ModelBank
from modular.models.names import DTypeName
from modular.tracking import log_to_wandb, write_json

log = logging.getLogger("modular")


def merge(pairs: str = "configs/merge_pairs.yaml", out: str | None = None, limit: int | None = None,
          progress: bool = True, device: str = "auto", dtype: DTypeName = "auto") -> dict:
    """Merge gain of model pairs vs. the similarity of their activation spaces (merge.json, merge_gain.png).

    For every pair: perf A, perf B, perf of the combination (activation communication or weight merging),
    gain = perf(combination) - mean(perf A, perf B) with a bootstrap interval over items, and the similarity
    of A's and B's activation spaces; the scatter of gain vs. similarity carries Pearson and Spearman
    correlations with bootstrap intervals. Everything is logged to W&B too.

    Args:
        pairs: Pairs file (YAML; see configs/merge_pairs.yaml, every key commented): shared settings (task, split,
            limit, max_new_tokens, batch_size, seed, depth, lock_limit, bootstrap; neutral: {fit_split, eval_split,
            limit, skip_positions, map_dir}: the neutral text of the similarity and the maps) and pairs: each a, b,
            method (ac, average, task_arithmetic, ties), name, task, depth_a, depth_b, lock_check; ac: {f, map}:
            activation communication; weights: {base, weight_a, density, scale}: weight merging.
        out: Default: outputs/merge/<pairs file name>.
        limit: Overrides the pairs file's items per task (for quick runs).
    """
    cfg = load_pairs(pairs)
    if limit is not None:
        cfg.limit = limit
    out_dir = output_folder(out, "merge", Path(pairs).stem)
    report = MergeRunner(cfg, ModelBank(device, dtype), progress=progress).run()
    report = {"pairs_file": str(pairs), **report}
    write_json(out_dir / "merge.json", report)
    rows = report["pairs"]
    methods = {r["pair"]["method"] for r in rows}
    what = "AC" if methods == {"ac"} else "Merge"
    tasks = ", ".join(dict.fromkeys(r["task"] for r in rows))
    figures = {}
    for metric, name in (("frobenius", "merge_gain.png"), ("cka", "merge_gain_cka.png")):
        figures[metric] = gain_scatter(out_dir / name, rows, report["correlation"][metric], metric, what, tasks)
    summary = {
        "pairs": {r["label"]: {"perf_a": r["gain"]["perf_a"], "perf_b": r["gain"]["perf_b"],
                               "perf_combined": r["gain"]["perf_combined"], "gain": r["gain"]["gain"],
                               "gain_ci_low": r["gain"]["ci95"][0], "gain_ci_high": r["gain"]["ci95"][1],
                               "frobenius": r["similarity"]["frobenius"], "cka": r["similarity"]["cka"]}
                  for r in rows},
        "correlation": report["correlation"],
    }
    table = [{"pair": r["label"], "method": r["pair"]["method"], "f": r["pair"]["ac"]["f"], "task": r["task"],
              **summary["pairs"][r["label"]]} for r in rows]
    log_to_wandb(out_dir, "evaluate-merge", summary, config={"pairs_file": str(pairs), **report["config"]},
                 figures={f"merge_gain_{m}": p for m, p in figures.items()}, tables={"pairs": table})
    for r in rows:
        g = r["gain"]
        log.info("%-40s A %.3f  B %.3f  comb %.3f  gain %+.3f [%+.3f, %+.3f]  sim %.3f  CKA %.3f", r["label"],
                 g["perf_a"], g["perf_b"], g["perf_combined"], g["gain"], *g["ci95"], r["similarity"]["frobenius"],
                 r["similarity"]["cka"])
    log.info("wrote %s, %s and %s", out_dir / "merge.json", figures["frobenius"], figures["cka"])
    return report

#!/usr/bin/env python
"""Fast head ranking (attribution patching, plain and integrated gradients, and attribution refined by
exact patching of the top late heads) against exhaustive single-head activation patching, side by side in
one run on the same batch.

For each ``ig_steps`` (attribution) and each ``refine`` (refined ranking: the gradients on the clean and
the counterfactual run, then exact patching of the ``refine`` top-scored heads of the second half of the
layers) the scores are compared with the exhaustive effects over all heads: Pearson and Spearman correlation
of the signed effects, Pearson of |e|, overlap of the top-20
heads by |e|, and the speed ratio (exhaustive seconds / attribution seconds, median of ``--repeats``),
against this package's exhaustive patching (which replays the blocks before the patched layer) and
against plain exhaustive patching (one full forward per head; its cost is extrapolated from
``--naive_sample`` timed patched forwards, since every such forward costs the same).
Targets: Pearson ≥ 0.9, top-20 overlap ≥ 15, ≥ 20× faster.

Usage: python benchmarks/head_ranking.py [--model smollm2-135m-instruct] [--task ioi] [--limit 48]
       [--ablation counterfactual] [--ig_steps 1 2 4] [--refine 15] [--out outputs/benchmarks]
Writes head_ranking.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from modular.data import load_behaviour
from modular.heads.curves import ranking_from_effects
from modular.heads.ranking import (
    ablation_values,
    attribution_effects,
    exhaustive_effects,
    last_position_logits,
    refined_effects,
    task_batch,
)
from modular.hooks import replace_heads
from modular.models import load_model, load_tokenizer
from modular.models.adapter import ArchitectureAdapter
from modular.tracking import write_json


def _rank(x: torch.Tensor) -> torch.Tensor:
    order = torch.argsort(x)
    ranks = torch.empty_like(x)
    ranks[order] = torch.arange(len(x), dtype=x.dtype)
    return ranks


def agreement(exact: torch.Tensor, approx: torch.Tensor, top: int = 20) -> dict:
    """Pearson / Spearman of the signed effects, Pearson of |e|, and the top-``top`` overlap by |e|."""
    a, b = exact.flatten().double(), approx.flatten().double()
    pearson = float(torch.corrcoef(torch.stack([a, b]))[0, 1])
    spearman = float(torch.corrcoef(torch.stack([_rank(a), _rank(b)]))[0, 1])
    pearson_abs = float(torch.corrcoef(torch.stack([a.abs(), b.abs()]))[0, 1])
    top_exact = set(ranking_from_effects(exact)[:top])
    top_approx = set(ranking_from_effects(approx)[:top])
    return {"pearson": pearson, "spearman": spearman, "pearson_abs": pearson_abs,
            f"top{top}_overlap": len(top_exact & top_approx)}


@torch.no_grad()
def naive_exhaustive_seconds(model, batch: dict, ablation: str, sample: int) -> float:
    """Cost of exhaustive patching that recomputes every block for every head (L·H full forwards), from
    ``sample`` timed patched forwards spread over the layers (each costs the same)."""
    adapter = ArchitectureAdapter(model)
    values = ablation_values(model, batch, ablation)
    heads = [(l, h) for l in range(adapter.n_layers) for h in range(adapter.n_heads)]
    picked = heads[:: max(1, len(heads) // max(1, sample))][:sample]
    t0 = time.perf_counter()
    for head in picked:
        with replace_heads(adapter, [head], values):
            last_position_logits(model, batch["clean"])
    return (time.perf_counter() - t0) / len(picked) * len(heads)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="model reference")
    ap.add_argument("--task", default="ioi", help="behaviour with wrong answers and counterfactual prompts")
    ap.add_argument("--split", default="test", help="data split")
    ap.add_argument("--limit", type=int, default=48, help="prompts")
    ap.add_argument("--ablation", default="counterfactual", choices=["counterfactual", "mean", "zero"])
    ap.add_argument("--ig_steps", type=int, nargs="+", default=[1, 2, 4],
                    help="attribution variants: integrated-gradient points, ends included (1: plain attribution)")
    ap.add_argument("--refine", type=int, nargs="*", default=[15],
                    help="refined variants: heads patched exactly after the two-run attribution (none: skip)")
    ap.add_argument("--repeats", type=int, default=3, help="timed repetitions of each attribution variant")
    ap.add_argument("--top", type=int, default=20, help="size of the top-k overlap")
    ap.add_argument("--naive_sample", type=int, default=18, help="patched forwards timed for the no-replay cost")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--exhaustive_from", default=None,
                    help="head_ranking.json of an earlier run on the same setting: reuse its exhaustive effects and "
                         "timings instead of measuring them again")
    ap.add_argument("--out", default="outputs/benchmarks", help="output folder")
    args = ap.parse_args()
    torch.manual_seed(args.seed)

    tokenizer = load_tokenizer(args.model)
    model = load_model(args.model).eval()
    ds = load_behaviour(args.task, seed=args.seed, tokenizer=tokenizer)[args.split]
    ds = ds.select(range(min(args.limit, len(ds))))
    batch = task_batch(tokenizer, ds)

    if args.exhaustive_from:  # re-measure the fast rankings against an earlier exhaustive run of this benchmark
        earlier = json.loads(Path(args.exhaustive_from).read_text())
        same = {k: earlier[k] for k in ("model", "task", "split", "n_prompts", "ablation")}
        if same != {"model": args.model, "task": args.task, "split": args.split, "n_prompts": len(ds),
                    "ablation": args.ablation}:
            raise SystemExit(f"{args.exhaustive_from} measured another setting: {same}")
        exact = torch.tensor(earlier["exhaustive_effects"])
        t_exact, t_naive = earlier["exhaustive_seconds"], earlier["naive_exhaustive_seconds"]
        print(f"exhaustive patching: {t_exact:.1f} s, from {args.exhaustive_from}")
    else:
        t0 = time.perf_counter()
        exact = exhaustive_effects(model, batch, args.ablation)
        t_exact = time.perf_counter() - t0
        print(f"exhaustive patching: {t_exact:.1f} s ({exact.numel()} heads; earlier blocks replayed)")
        t_naive = naive_exhaustive_seconds(model, batch, args.ablation, args.naive_sample)
    print(f"exhaustive patching without replay (one full forward per head, from {args.naive_sample}): {t_naive:.1f} s")

    methods = {str(steps): (steps, None, lambda steps=steps: attribution_effects(model, batch, args.ablation,
                                                                                  ig_steps=steps))
               for steps in args.ig_steps}
    methods |= {f"refined-{k}": (2, k, lambda k=k: refined_effects(model, batch, args.ablation, ig_steps=2, refine=k))
                for k in args.refine}
    variants = {}
    for name, (steps, refine, method) in methods.items():
        times, approx = [], None
        for _ in range(max(1, args.repeats)):
            t0 = time.perf_counter()
            approx = method().detach()
            times.append(time.perf_counter() - t0)
        seconds = statistics.median(times)
        variants[name] = {"ig_steps": steps, "refine": refine,
                          "seconds": seconds, "speedup": t_exact / seconds, "speedup_vs_naive": t_naive / seconds,
                          **agreement(exact, approx, args.top), "effects": approx.tolist()}
        v = variants[name]
        label = f"ig_steps={steps}" if v["refine"] is None else f"refined (ig_steps=2, {v['refine']} exact)"
        print(f"{label:>28}: {seconds:6.2f} s ({v['speedup']:.0f}x faster; {v['speedup_vs_naive']:.0f}x than "
              f"without replay), Pearson {v['pearson']:.3f}, "
              f"Spearman {v['spearman']:.3f}, |e| Pearson {v['pearson_abs']:.3f}, "
              f"top-{args.top} overlap {v[f'top{args.top}_overlap']}")

    targets = {"pearson": 0.9, f"top{args.top}_overlap": 15, "speedup": 20}
    meets = {s: all(v[k] >= t for k, t in targets.items()) for s, v in variants.items()}
    report = {"model": args.model, "task": args.task, "split": args.split, "n_prompts": len(ds),
              "ablation": args.ablation, "n_heads": exact.numel(), "exhaustive_seconds": t_exact,
              "naive_exhaustive_seconds": t_naive,
              "targets": targets, "meets_targets": meets, "variants": variants, "exhaustive_effects": exact.tolist(),
              "exhaustive_from": args.exhaustive_from, "torch_threads": torch.get_num_threads()}
    path = write_json(Path(args.out) / "head_ranking.json", report)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

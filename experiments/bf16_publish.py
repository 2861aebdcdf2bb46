#!/usr/bin/env python
"""Publishing a trained run in bfloat16: how close the published weights are to the hook lock, whether the lock
holds, and what the keys restore, at what size; beside the float32 figures of the same run.

For the run's trained (open) model in bfloat16: the published-locked vs hook-locked next-token logits on held-out
retain prompts (max |Δ|), next to the precision's own noise (the open model in bfloat16 vs float32 on the same
prompts); the published model's accuracy on the gated behaviours' test split; the keys applied: the largest weight
difference to the open bf16 weights in units in the last place, whether every weight is restored bit for bit, and
the share of test items whose greedy answer is the open model's; the keys' size against the published weights
(bit-exact, the default), and what keys allowed one unit in the last place would cost. float32: the keys' largest
absolute restore error.

Usage: python experiments/bf16_publish.py --run RUN [--limit N] [--device auto] [--out outputs/experiments]
Writes bf16_publish.json.
"""

from __future__ import annotations

import argparse
import copy
import tempfile
from pathlib import Path

from modular.data import load_behaviour, retain_data
from modular.evaluation.behaviour import evaluate_behaviour, last_logits
from modular.evaluation.lock import build_states, max_param_diff, max_param_ulps, weights_bit_exact
from modular.keys import lock_weights, save_key, weights_hash
from modular.models import load_tokenizer
from modular.runs import behaviour_sources, load_open_model, read_run
from modular.tracking import write_json


def key_bytes(keys, model) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        h = weights_hash(model)
        return sum(save_key(k, Path(tmp) / f"{k.behaviour}.key", h).stat().st_size for k in keys)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True, help="training run folder")
    ap.add_argument("--limit", type=int, default=None, help="test items per gated behaviour (default: all)")
    ap.add_argument("--device", default="auto", help="auto (a GPU when present), cpu, cuda, cuda:N")
    ap.add_argument("--out", default="outputs/experiments", help="output folder")
    args = ap.parse_args()
    run = read_run(args.run)
    tok = load_tokenizer(run.model_name)
    retain = retain_data(int(run.record.get("seed", 0)))["test"]
    probe, chats = list(retain["prompt"][:16]), list(retain["chat"][:16])
    report: dict = {"run": args.run, "behaviours": list(run.directions)}

    f32 = load_open_model(run, "float32", args.device)
    open_bf16 = load_open_model(run, "bfloat16", args.device)
    report["bf16_noise_max_abs_logit_diff"] = (last_logits(open_bf16, tok, probe, chats)
                                               - last_logits(f32, tok, probe, chats)).abs().max().item()
    # the lock evaluation's own states: published (weights) and unlocked (keys applied) copies of the open model
    states, published, unlocked, keys = build_states(open_bf16, open_bf16, run.directions)
    model, lock = states["locked"]
    with lock():
        hook = last_logits(model, tok, probe, chats)
    report["published_vs_hook_locked_max_abs_logit_diff"] = (last_logits(published, tok, probe, chats)
                                                             - hook).abs().max().item()
    weights = sum(p.numel() * p.element_size() for p in published.state_dict().values())
    report["published_bytes"] = weights
    report["key_bytes"] = key_bytes(keys, published)
    report["key_share_of_weights"] = report["key_bytes"] / weights
    report["key_corrections"] = sum(c.fix_index.numel() for k in keys for c in k.components if c.fix_index is not None)
    report["unlocked_vs_open_max_ulps"] = max_param_ulps(unlocked, open_bf16)
    report["unlocked_vs_open_max_abs_weight_diff"] = max_param_diff(unlocked, open_bf16)
    report["unlocked_bit_exact"] = weights_bit_exact(unlocked.state_dict(), open_bf16.state_dict())

    ulp_pub = copy.deepcopy(open_bf16)
    ulp_keys = lock_weights(ulp_pub, run.directions, ulp_tol=1.0)
    report["one_ulp_key_bytes"] = key_bytes(ulp_keys, ulp_pub)
    report["one_ulp_key_share_of_weights"] = report["one_ulp_key_bytes"] / weights
    report["one_ulp_key_corrections"] = sum(c.fix_index.numel() for k in ulp_keys for c in k.components
                                            if c.fix_index is not None)
    del ulp_pub, ulp_keys

    sources = behaviour_sources(run)
    report["accuracy"] = {}
    for b in run.directions:
        test = load_behaviour(sources.get(b, b), seed=int(run.record.get("seed", 0)), tokenizer=tok)["test"]
        if args.limit:
            test = test.select(range(min(args.limit, len(test))))
        refusals = ((run.record.get("locked_responses") or {}).get(b, "I don't know."),)
        rows = {name: evaluate_behaviour(m, tok, test, desc=f"{name}:{b}", refusals=refusals)
                for name, m in (("open_bf16", open_bf16), ("published_bf16", published), ("unlocked_bf16", unlocked))}
        report["accuracy"][b] = {name: r.accuracy for name, r in rows.items()}
        report["accuracy"][b]["n"] = rows["open_bf16"].n
        same = [o["response"] == u["response"] for o, u in zip(rows["open_bf16"].items, rows["unlocked_bf16"].items)]
        report["accuracy"][b]["unlocked_answers_equal_open"] = sum(same) / len(same)

    _, _, unlocked32, _ = build_states(f32, f32, run.directions)
    report["float32_unlocked_vs_open_max_abs_weight_diff"] = max_param_diff(unlocked32, f32)
    path = write_json(Path(args.out) / "bf16_publish.json", report)
    for k, v in report.items():
        print(f"{k}: {v}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

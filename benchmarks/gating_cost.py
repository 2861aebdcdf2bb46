#!/usr/bin/env python
"""Cost of the gated objective and of the published model, measured side by side in one run.

1. A gated training step (open + locked halves, ablation hooks, retain KL and, as in the default
   config, a batch of neutral text kept by a KL in both states: ``--lm_length``) versus a plain
   fine-tuning step (CE on every example and text) on the SAME batch: median time ratio; with and without
   steering-robust locking (``--locked_steering``, the default config's 1.0), whose refresh of the
   steering vectors (every ``--steering_refresh`` steps) is timed and spread over the steps it serves.
2. A gated step with each tamper-resistance term added (``--tamper``, classes of modular.gating.objectives, at their
   defaults) versus the same step without it (the default config's training cost: at most 3x is the target).
3. Forward pass of the published locked model (plain weights, no hooks) versus the base model.

Usage: python benchmarks/gating_cost.py [--model smollm2-135m-instruct] [--repeats 7] [--locked_steering 1.0]
       [--steering_refresh 20] [--lm_length 128] [--tamper RelearningAdversary WeightNoiseLock]
       [--out outputs/benchmarks]
Writes gating_cost.json.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path

import torch
from common import attach_tokenizer, median_time, plain_loss, plain_terms, training_batch

from modular.data import load_behaviour, retain_data
from modular.gating.module import GatedLM
from modular.keys import lock_weights
from modular.tracking import write_json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="model reference")
    ap.add_argument("--repeats", type=int, default=7, help="timed repetitions of each measurement")
    ap.add_argument("--batch_size", type=int, default=8, help="examples per behaviour and per retain batch")
    ap.add_argument("--locked_steering", type=float, default=1.0,
                    help="largest steering scale of steering-robust locking (0: measure without it)")
    ap.add_argument("--steering_refresh", type=int, default=20, help="steps between steering-vector refreshes")
    ap.add_argument("--lm_length", type=int, default=128,
                    help="tokens per neutral-text paragraph in the batch (data.lm_text.max_length; 0: no text batch)")
    ap.add_argument("--tamper", nargs="*", default=["RelearningAdversary", "WeightNoiseLock"],
                    help="tamper-resistance terms (modular.gating.objectives) timed added to the gated step")
    ap.add_argument("--out", default="outputs/benchmarks", help="output folder")
    args = ap.parse_args()
    torch.manual_seed(0)

    module = GatedLM(model_name=args.model, steering={"scale": args.locked_steering, "refresh": args.steering_refresh}
                     if args.locked_steering > 0 else None, objectives=plain_terms())
    from modular.models import load_tokenizer

    tok = load_tokenizer(args.model)
    attach_tokenizer(module, tok)
    module.directions.copy_(torch.nn.functional.normalize(torch.randn_like(module.directions), dim=-1))
    module.train()
    # one batch: behaviour (half open, half locked) + retain and neutral text with (synthetic) reference tensors;
    # the plain step sees the same examples
    batch, plain_batches = training_batch(tok, args.batch_size, args.lm_length)
    plain_batch = plain_batches[0]

    steering = module.steering
    refresh_s = 0.0
    if steering is not None:  # the refresh: forwards of behaviour and contrast prompts under the lock
        from modular.hooks import ablate_directions

        t = time.perf_counter()
        steering.update(module.hf_model, tok, {"capitals": load_behaviour("capitals")["train"]}, retain_data()["train"],
                        step=0, intervention=lambda: ablate_directions(module.adapter, module.directions))
        refresh_s = time.perf_counter() - t

    def gated_step(steered: bool = False):
        module.steering = steering if steered else None
        loss, _ = module.model_step(batch, train=True)
        loss.backward()
        module.model.zero_grad(set_to_none=True)
        module.steering = steering

    import modular.gating.objectives as objectives

    terms = {name: getattr(objectives, name)() for name in args.tamper}

    def tamper_step(term):  # the default objective plus the term, as a config adding it trains
        term.bind(module)
        module.objectives.append(term)
        try:
            gated_step()
        finally:
            module.objectives.pop()

    def plain_step():
        plain_loss(module.model, plain_batches).backward()
        module.model.zero_grad(set_to_none=True)

    gated, steered, plain = [], [], []
    tampered = {name: [] for name in terms}
    for _ in range(args.repeats):  # interleaved so that machine noise hits all alike
        gated += median_time(gated_step, 1)
        for name, term in terms.items():
            tampered[name] += median_time(lambda term=term: tamper_step(term), 1)
        if steering is not None:
            steered += median_time(lambda: gated_step(steered=True), 1)
        plain += median_time(plain_step, 1)
    step_ratio = statistics.median(gated) / statistics.median(plain)
    steered_ratio = None
    if steering is not None:
        steered_ratio = (statistics.median(steered) + refresh_s / args.steering_refresh) / statistics.median(plain)

    # published (weights) vs base forward
    base = module.model.eval()
    published = copy.deepcopy(base)
    lock_weights(published, {"capitals": module.directions[0].detach()})
    ids = plain_batch["input_ids"]
    mask = plain_batch["attention_mask"]
    with torch.no_grad():
        fb, fp = [], []
        for _ in range(args.repeats):
            fb += median_time(lambda: base(input_ids=ids, attention_mask=mask), 1)
            fp += median_time(lambda: published(input_ids=ids, attention_mask=mask), 1)
    fwd_ratio = statistics.median(fp) / statistics.median(fb)
    report = {
        "model": args.model, "repeats": args.repeats, "tokens_per_batch": int(mask.sum()), "lm_length": args.lm_length,
        "gated_step_s": gated, "plain_step_s": plain, "gated_over_plain_median": step_ratio,
        "locked_steering": args.locked_steering, "steering_refresh": args.steering_refresh,
        "steered_step_s": steered, "steering_refresh_s": refresh_s,
        "steered_over_plain_median_with_refresh": steered_ratio,
        "tamper_step_s": tampered,
        "tamper_over_gated_median": {n: statistics.median(v) / statistics.median(gated) for n, v in tampered.items()},
        "published_forward_s": fp, "base_forward_s": fb, "published_over_base_forward_median": fwd_ratio,
        "published_hooks": sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in published.modules()),
    }
    out = write_json(Path(args.out) / "gating_cost.json", report)
    print(f"gated step / plain step (median): {step_ratio:.3f}")
    if steered_ratio is not None:
        print(f"steering-robust gated step / plain step (median, refresh of {refresh_s:.1f} s spread over "
              f"{args.steering_refresh} steps): {steered_ratio:.3f}")
    for name, ratio in report["tamper_over_gated_median"].items():
        print(f"gated step with {name} / gated step (median): {ratio:.3f}")
    print(f"published forward / base forward (median): {fwd_ratio:.3f}  (hooks on published: {report['published_hooks']})")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

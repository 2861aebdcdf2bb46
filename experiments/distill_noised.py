#!/usr/bin/env python
"""Distilling a published lock into a noised copy of its own weights, then attacking the copy by relearning.

The published locked model keeps what the open model knows; only the route to it is closed, and one fine-tuning
step finds another route (docs/tamper.md). Distillation into a perturbed copy is a published way of making unlearning
survive relearning: the student starts from the teacher's weights shrunk and mixed with noise
(``W ← (1-α)·W + α·std(W)·ε`` on every linear weight of the decoder layers), so what the teacher keeps but never
shows is damaged, and learns back only what the teacher's outputs show (full next-token distributions, every
position) on the prompts a publisher has: the retain instructions, the neighbours' and the locked behaviour's
training prompts (the locked response), and neutral prose.

Measured for each α: the held-out accuracy of the locked behaviour, the retain first-token KL and the perplexity
ratio to the base model (the main job's targets), the neighbours' held-out accuracy, and the relearning sweep of
``modular attack`` (full fine-tuning or LoRA, N training examples, the learning rates given), steps to 50% / 90% of the open
accuracy the published folder records. α = 0 with no distillation is the published model itself.

Usage: python experiments/distill_noised.py --model PUBLISHED [--base smollm2-135m-instruct] [--alphas 0.05 0.2]
       [--steps 100] [--eval_at 50] [--lr 1e-4] [--device auto] [--dtype auto]
Writes distill_noised.json (updated after each measurement) and distil_rows.json (the teacher's responses, taken
over by a later run with the same model, precision, prompts and response length).
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from modular import ModularError
from modular.data import load_behaviour, neutral_text, retain_data
from modular.data.formatting import LeftPadCollator, encode_example
from modular.evaluation.behaviour import evaluate_behaviour, generate
from modular.evaluation.relearning import example_rows, run_sweep, sweep
from modular.evaluation.retain import first_token_logp, mean_kl, perplexity
from modular.models import load_model, load_tokenizer
from modular.models.adapter import ArchitectureAdapter
from modular.optim import adamw
from modular.publish import MANIFEST, read_manifest
from modular.tracking import write_json


def noised(model, alpha: float, seed: int):
    """A copy with every linear weight of the decoder layers shrunk by ``1-α`` and mixed with ``α`` of Gaussian
    noise of the weight's own scale."""
    m = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    ad = ArchitectureAdapter(m)
    with torch.no_grad():
        for layer in ad.blocks():
            for mod in layer.modules():
                if isinstance(mod, torch.nn.Linear):
                    w = mod.weight
                    eps = torch.randn(w.shape, generator=g).to(w)
                    w.mul_(1 - alpha).add_(alpha * w.float().std().item() * eps)
    return m


def distil(student, teacher, rows, steps: int, lr: float, batch_size: int, pad_id: int, seed: int, at=()):
    """``steps`` AdamW steps of KL(teacher ‖ student) over every non-pad position of batches drawn from ``rows``;
    yields ``(step, losses so far)`` after each step in ``at`` and after the last, the student in eval mode (the
    caller may score it; training goes on when the next value is asked for)."""
    collate = LeftPadCollator(pad_id)
    device = next(student.parameters()).device
    g = torch.Generator().manual_seed(seed)
    opt = adamw(list(student.parameters()), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    losses: list[float] = []
    for step in tqdm(range(1, steps + 1), desc="distil", leave=False):
        student.train()
        for p in student.parameters():
            p.requires_grad_(True)
        idx = torch.randint(0, len(rows), (batch_size,), generator=g).tolist()
        batch = {k: v.to(device) for k, v in collate([{"input_ids": rows[i]["input_ids"]} for i in idx]).items()}
        mask = batch["attention_mask"].bool()
        with torch.no_grad():
            t = F.log_softmax(teacher(**batch, use_cache=False).logits.float(), -1)[mask]
        s = F.log_softmax(student(**batch, use_cache=False).logits.float(), -1)[mask]
        loss = F.kl_div(s, t, log_target=True, reduction="batchmean")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step in at or step == steps:
            student.eval()
            for p in student.parameters():
                p.requires_grad_(False)
            yield step, losses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="published (locked) model folder: the teacher")
    ap.add_argument("--base", default="smollm2-135m-instruct", help="the base model (retain KL and perplexity)")
    ap.add_argument("--behaviour", default="capitals", help="the locked built-in behaviour")
    ap.add_argument("--neighbours", nargs="*", default=["continents", "languages", "currencies"],
                    help="neighbour behaviours: distilled on their training prompts, scored on their test splits")
    ap.add_argument("--alphas", nargs="+", type=float, default=[0.05, 0.2], help="noise shares to try")
    ap.add_argument("--steps", type=int, default=100, help="distillation steps per α (α = 0: none, the model)")
    ap.add_argument("--eval_at", nargs="*", type=int, default=[],
                    help="distillation steps, before the last, after which the student is also measured")
    ap.add_argument("--lr", type=float, default=1e-4, help="distillation learning rate")
    ap.add_argument("--batch_size", type=int, default=8, help="sequences per distillation step")
    ap.add_argument("--response_tokens", type=int, default=32, help="teacher tokens generated per prompt")
    ap.add_argument("--max_length", type=int, default=96, help="tokens per distillation sequence at most")
    ap.add_argument("--attack_modes", nargs="+", default=["full"], choices=["full", "lora"],
                    help="the relearning attacker's fine-tuning: every weight, LoRA, or both")
    ap.add_argument("--attack_lrs", nargs="+", type=float, default=[1e-5, 1e-4, 1e-3],
                    help="the relearning attacker's learning rates (full fine-tuning)")
    ap.add_argument("--attack_lora_lrs", nargs="+", type=float, default=[1e-4, 1e-3, 1e-2],
                    help="the relearning attacker's learning rates (LoRA)")
    ap.add_argument("--attack_n", type=int, default=8, help="the attacker's training examples")
    ap.add_argument("--attack_steps", type=int, default=11, help="relearning steps at most")
    ap.add_argument("--seed", type=int, default=0, help="the noise, the distillation batches, the attacker's examples")
    ap.add_argument("--device", default="auto", help="auto (a GPU when present), cpu, cuda, cuda:1, ...")
    ap.add_argument("--dtype", default="auto", help="auto (the model's own; float32 on a CPU), float32, bfloat16")
    ap.add_argument("--out", default="outputs/experiments", help="output folder")
    args = ap.parse_args()

    try:
        manifest = read_manifest(args.model)
    except ModularError as err:
        ap.error(str(err))
    if manifest is None:
        ap.error(f"{args.model} is not a published modular model (no {MANIFEST})")
    open_acc = manifest.get("measured_accuracy", {}).get("open", {}).get(args.behaviour)
    if open_acc is None:
        ap.error(f"{Path(args.model) / MANIFEST} records no open accuracy of '{args.behaviour}'")
    torch.manual_seed(args.seed)
    tok = load_tokenizer(args.model)
    teacher = load_model(args.model, args.dtype, args.device).eval()
    base = load_model(args.base, args.dtype, args.device).eval()
    locked = load_behaviour(args.behaviour, seed=args.seed, tokenizer=tok)
    neigh = {n: load_behaviour(n, seed=args.seed, tokenizer=tok) for n in args.neighbours}
    retain = retain_data(args.seed)
    texts = neutral_text(args.seed)

    # what the publisher distils on: prompts with the teacher's own greedy responses, and neutral prose
    prompts = [(r["prompt"], r["chat"]) for r in retain["train"]]
    prompts += [(r["prompt"], r["chat"]) for r in locked["train"]]
    for d in neigh.values():
        prompts += [(r["prompt"], r["chat"]) for r in d["train"]]
    t0 = time.time()
    cache = Path(args.out) / "distil_rows.json"
    key = {"model": str(Path(args.model).resolve()), "dtype": str(next(teacher.parameters()).dtype),
           "response_tokens": args.response_tokens, "prompts": [list(p) for p in prompts]}
    cached = json.loads(cache.read_text()) if cache.exists() else {}
    if cached.get("key") == key:
        responses = cached["responses"]
    else:
        responses = generate(teacher, tok, [p for p, _ in prompts], [c for _, c in prompts], args.response_tokens,
                             batch_size=32, desc="teacher responses")
        write_json(cache, {"key": key, "responses": responses})
    rows = [encode_example(tok, p, r.strip(), c, args.max_length) for (p, c), r in zip(prompts, responses)]
    rows += [{"input_ids": tok(t, truncation=True, max_length=args.max_length)["input_ids"]}
             for t in texts["train"]["text"]]
    gen_s = time.time() - t0

    ref_logp = first_token_logp(base, tok, retain["test"]["prompt"], retain["test"]["chat"])
    base_ppl = perplexity(base, tok, list(texts["test"]["text"]))
    base_neigh = {n: evaluate_behaviour(base, tok, d["test"], max_new_tokens=16, desc=False).accuracy
                  for n, d in neigh.items()}
    attack_rows = example_rows(tok, locked["train"].shuffle(seed=args.seed).select(range(args.attack_n)))
    settings = sweep("behaviour", args.attack_modes, {"full": args.attack_lrs, "lora": args.attack_lora_lrs},
                     [args.attack_n], [args.seed])
    report: dict = {"model": args.model, "behaviour": args.behaviour, "open_accuracy": open_acc,
                    "distil_rows": len(rows), "teacher_generation_s": gen_s, "base_neighbours": base_neigh,
                    "args": vars(args), "runs": []}
    out = Path(args.out) / "distill_noised.json"

    def measure(student, alpha: float, step: int, losses: list[float], distil_s: float) -> None:
        acc = evaluate_behaviour(student, tok, locked["test"], max_new_tokens=16, desc=False)
        kl = mean_kl(ref_logp, first_token_logp(student, tok, retain["test"]["prompt"], retain["test"]["chat"]))
        ppl = perplexity(student, tok, list(texts["test"]["text"])) / base_ppl
        nb = {n: evaluate_behaviour(student, tok, d["test"], max_new_tokens=16, desc=False).accuracy
              for n, d in neigh.items()}
        print(f"alpha {alpha} step {step}: {args.behaviour} {acc.accuracy:.3f} (locked responses "
              f"{acc.refusal_rate:.2f}) | retain KL {kl:.4f} | ppl ratio {ppl:.3f} | neighbours "
              + " ".join(f"{n} {v:.3f} ({v - base_neigh[n]:+.3f})" for n, v in nb.items())
              + f" | distil {distil_s:.0f} s", flush=True)
        res = run_sweep(student, tok, lambda s: attack_rows, locked["test"], settings, open_acc, acc.accuracy,
                        max_steps=args.attack_steps)
        w = res["worst_case"]
        print(f"alpha {alpha} step {step}: relearning worst case {w['steps_to_50pct_open']} / "
              f"{w['steps_to_90pct_open']} (best {w['best_accuracy']:.3f})", flush=True)
        for r in res["settings"]:
            print("   ", r["label"], [(p["step"], round(p["accuracy"], 3)) for p in r["curve"]], flush=True)
        report["runs"].append({"alpha": alpha, "distil_steps": step, "distil_s": distil_s,
                               "distil_loss_first_last": losses[:1] + losses[-1:],
                               "accuracy": acc.accuracy, "locked_response_rate": acc.refusal_rate,
                               "retain_first_token_kl": kl, "perplexity_ratio": ppl, "neighbours": nb,
                               "relearning": res})
        write_json(out, report)

    for alpha in args.alphas:
        if alpha == 0:
            measure(teacher, alpha, 0, [], 0.0)
            continue
        t0 = time.time()
        student = noised(teacher, alpha, args.seed)
        for step, losses in distil(student, teacher, rows, args.steps, args.lr, args.batch_size, tok.pad_token_id,
                                   args.seed, set(args.eval_at)):
            spent = time.time() - t0
            measure(student, alpha, step, losses, spent)
            t0 = time.time() - spent  # the measurement is not distillation time
        del student
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""What one relearning step moves to open a published lock: the attacker's first AdamW step (a sign step of the
learning rate on every weight, from the gradient of N behaviour training examples) applied to one group of weights
at a time, against a random sign step of the same size on every weight.

Groups come from the architecture adapter: residual writers (attention and MLP output projections), residual
readers (the modules behind each pre-norm, and the unembedding), the norms, the embeddings.

Usage: python experiments/relearning_step.py --model PUBLISHED [--behaviour capitals] [--n 8] [--lr 1e-5]
       [--device auto] [--dtype auto] [--rounding stochastic]
Writes relearning_step.json.

In a low precision (``--dtype bfloat16``) the step is computed in float32 and written back to the weights rounded
stochastically, as the attacker of ``modular attack`` does (``modular.optim.adamw``); ``--rounding nearest`` rounds
to nearest instead, as plain ``torch.optim.AdamW`` on bfloat16 weights does, and a step smaller than half a
weight's rounding unit then leaves it as it was. The share of weights each step changed is reported beside each
accuracy.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from modular.data import load_behaviour
from modular.data.formatting import LeftPadCollator
from modular.evaluation.behaviour import evaluate_behaviour
from modular.evaluation.relearning import example_rows
from modular.models import load_model, load_tokenizer
from modular.models.adapter import ArchitectureAdapter
from modular.models.precision import stochastic_round
from modular.tracking import write_json


def groups(model) -> dict[str, set[int]]:
    """Parameter ids per group of weights."""
    ad = ArchitectureAdapter(model)

    def ids(modules):
        return {id(p) for m in modules if m is not None for p in m.parameters()}

    embeds = {id(p) for s in ad.write_sites() if s.kind == "embed" for p in s.module.parameters()}
    writers = ids(s.module for s in ad.write_sites() if s.kind != "embed")
    readers = ids(r for _, rs in ad.read_sites() for r in rs) - embeds
    norms = ids(n for n, _ in ad.read_sites()) | ids(s.post_norm for s in ad.write_sites())
    return {"writers": writers, "readers": readers, "norms": norms, "embeddings": embeds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="published (locked) model folder")
    ap.add_argument("--behaviour", default="capitals", help="built-in behaviour (its train and test splits)")
    ap.add_argument("--n", type=int, default=8, help="training examples in the attacker's batch")
    ap.add_argument("--lr", type=float, default=1e-5, help="the step's size (AdamW's first step is lr·sign(g))")
    ap.add_argument("--seed", type=int, default=0, help="which training examples")
    ap.add_argument("--batch_size", type=int, default=48, help="prompts per generation batch")
    ap.add_argument("--device", default="auto", help="auto (a GPU when present), cpu, cuda, cuda:1, ...")
    ap.add_argument("--dtype", default="auto", help="auto (the model's own; float32 on a CPU), float32, bfloat16")
    ap.add_argument("--rounding", choices=("stochastic", "nearest"), default="stochastic",
                    help="how a step is written back to weights narrower than float32 (float32: exact)")
    ap.add_argument("--out", default="outputs/experiments", help="output folder")
    args = ap.parse_args()
    tok = load_tokenizer(args.model)
    model = load_model(args.model, args.dtype, args.device)
    device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    data = load_behaviour(args.behaviour, seed=args.seed, tokenizer=tok)
    rows = example_rows(tok, data["train"].shuffle(seed=args.seed).select(range(args.n)))
    batch = {k: v.to(device) for k, v in LeftPadCollator(tok.pad_token_id)(rows).items()}
    model.train()
    for p in model.parameters():
        p.requires_grad_(True)
    model(**batch).loss.backward()
    model.eval()
    grads = {id(p): p.grad.detach().clone() for p in model.parameters()}
    start = {id(p): p.detach().clone() for p in model.parameters()}
    report: dict = {"model": args.model, "behaviour": args.behaviour, "n": args.n, "lr": args.lr,
                    "device": str(device), "dtype": str(dtype).removeprefix("torch."), "rounding": args.rounding,
                    "accuracy": {}}
    rounding = torch.Generator(device=device).manual_seed(args.seed)

    def write(p, new):
        """``new`` (float32) into the weight ``p``, in its own dtype."""
        p.copy_(stochastic_round(new, p.dtype, rounding) if args.rounding == "stochastic" else new.to(p.dtype))

    def score(name, step):
        changed = total = 0
        with torch.no_grad():
            for p in model.parameters():
                write(p, start[id(p)].float() + step(p).float())
                changed += int((p != start[id(p)]).sum())
                total += p.numel()
        r = evaluate_behaviour(model, tok, data["test"], max_new_tokens=16, batch_size=args.batch_size, desc=False)
        report["accuracy"][name] = {"accuracy": r.accuracy, "refusal_rate": r.refusal_rate, "n": r.n,
                                    "weights_changed": changed / total}
        print(f"{name}: {r.accuracy:.3f} (locked responses {r.refusal_rate:.2f}; {changed / total:.1%} of the weights "
              "changed)", flush=True)

    zero = torch.zeros_like
    score("no step", zero)
    score("every weight", lambda p: -args.lr * grads[id(p)].sign())
    for name, members in groups(model).items():
        score(f"{name} only", lambda p, m=members: -args.lr * grads[id(p)].sign() if id(p) in m else zero(p))
    gen = torch.Generator().manual_seed(args.seed)
    score("random sign step, every weight",
          lambda p: args.lr * torch.randint(0, 2, p.shape, generator=gen).to(p.device, p.dtype).mul(2).sub(1))
    path = write_json(Path(args.out) / "relearning_step.json", report)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

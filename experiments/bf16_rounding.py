#!/usr/bin/env python
"""Why a float32-trained lock is lost in bfloat16 when the weights are rounded to nearest, and kept when they are
rounded stochastically.

The run's trained (open) model in float32 arithmetic, the lock applied by the hooks (the direction projected out of
every residual write), scored on the gated behaviours' test split after one change at a time:

- ``leak xK``: the component along the direction that bfloat16 rounding of each write would leave, K times;
- ``noise eps``: every weight times (1 + eps N(0, 1)), random noise as large as bfloat16's;
- ``nearest``: every weight rounded to nearest in bfloat16;
- ``stochastic``: every weight rounded stochastically (:func:`modular.models.precision.cast_model`);
- ``stochastic, bf16 arithmetic``: the same weights run in bfloat16.

Also the share of weights whose rounded-to-nearest trained value equals the rounded base value (the fine-tuning
update lost to rounding).

Usage: python experiments/bf16_rounding.py --run RUN [--limit N] [--device auto] [--out outputs/experiments]
Writes bf16_rounding.json.
"""

from __future__ import annotations

import argparse
from contextlib import contextmanager
from pathlib import Path

import torch

from modular.data import load_behaviour
from modular.evaluation.behaviour import evaluate_behaviour
from modular.hooks import ablate_directions, edit_writes
from modular.models import load_model, load_tokenizer
from modular.models.adapter import ArchitectureAdapter
from modular.models.precision import cast_model
from modular.runs import behaviour_sources, load_open_model, read_run
from modular.tracking import write_json


@contextmanager
def rounding_leak(adapter: ArchitectureAdapter, directions: torch.Tensor, scale: float):
    """Project the directions out of every write, then add back ``scale`` times the component along them that
    rounding the projected write to bfloat16 leaves."""
    q = torch.linalg.qr(directions.T.double())[0].T.float()

    def leak_back(o):
        o = o - (o @ q.T) @ q
        leak = ((o.bfloat16().float() - o) @ q.T) @ q
        return o + scale * leak

    with edit_writes(adapter, lambda site: leak_back):
        yield


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True, help="training run folder (trained in float32)")
    ap.add_argument("--limit", type=int, default=None, help="test items per gated behaviour (default: all)")
    ap.add_argument("--batch_size", type=int, default=48, help="prompts per generation batch")
    ap.add_argument("--device", default="auto", help="auto (a GPU when present), cpu, cuda, cuda:1, ...; float32 there")
    ap.add_argument("--out", default="outputs/experiments", help="output folder")
    args = ap.parse_args()
    run = read_run(args.run)
    tok = load_tokenizer(run.model_name)
    sources = behaviour_sources(run)
    tests = {}
    for b in run.directions:
        test = load_behaviour(sources.get(b, b), seed=int(run.record.get("seed", 0)), tokenizer=tok)["test"]
        tests[b] = test.select(range(min(args.limit, len(test)))) if args.limit else test
    model = load_open_model(run, "float32", args.device)
    device = next(model.parameters()).device
    directions = torch.stack(list(run.directions.values())).float().to(device)
    adapter = ArchitectureAdapter(model)
    trained = {n: p.detach().clone() for n, p in model.named_parameters()}
    base = dict(load_model(run.model_name, torch.float32, device).named_parameters())
    total = sum(p.numel() for n, p in trained.items() if n in base)
    same = sum((p.bfloat16() == base[n].bfloat16()).sum().item() for n, p in trained.items() if n in base)
    report: dict = {"run": args.run, "device": str(device), "share_of_weights_rounded_back_to_base": same / total,
                    "locked_accuracy": {}}

    def score(name, m, lock):
        for b, test in tests.items():
            with lock():
                r = evaluate_behaviour(m, tok, test, max_new_tokens=16, batch_size=args.batch_size, desc=False)
            report["locked_accuracy"].setdefault(name, {})[b] = {"accuracy": r.accuracy,
                                                                 "refusal_rate": r.refusal_rate, "n": r.n}
        print(name, report["locked_accuracy"][name], flush=True)

    def hooks():
        return ablate_directions(adapter, directions)

    def set_weights(f):
        torch.manual_seed(0)
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(f(trained[n]))

    score("float32", model, hooks)
    for k in (1, 4, 16):
        score(f"leak x{k}", model, lambda k=k: rounding_leak(adapter, directions, k))
    for eps in (1e-4, 1e-3, 3e-3):
        set_weights(lambda w, e=eps: w * (1 + e * torch.randn_like(w)))
        score(f"noise {eps:g}", model, hooks)
    set_weights(lambda w: w.bfloat16().float())
    score("nearest", model, hooks)
    set_weights(lambda w: w)
    cast_model(model, torch.bfloat16)
    as_bf16 = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.float()
    score("stochastic", model, hooks)
    cast_model(model, torch.bfloat16)  # bfloat16 values already: exact (buffers keep their precision)
    assert all(torch.equal(p, as_bf16[n]) for n, p in model.named_parameters())
    score("stochastic, bf16 arithmetic", model, hooks)
    path = write_json(Path(args.out) / "bf16_rounding.json", report)
    print(f"share of weights rounded back to the base: {report['share_of_weights_rounded_back_to_base']:.3f}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

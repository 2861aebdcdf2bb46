#!/usr/bin/env python
"""How far a neighbour's accuracy moves under a change of the model that knows nothing of any behaviour: the noise
floor under a "every neighbour within 3 points of base" target.

Each draw adds Gaussian noise to every weight the blocks read or write the residual stream with (attention q/k/v/o,
the MLP's; not the embeddings, the norms or the unembedding), each matrix's noise scaled to its own spread, and the
whole draw scaled so that the retain first-token KL to the unperturbed model is ``--kl`` (a trained run's: the
default capitals run reaches 0.019 open, 0.020 locked). The neighbours' test splits (as ``modular lock`` scores
them, seed 0) are scored on the model and on every draw; each draw's moves against the model, items lost and gained
and the paired test's p-value, show how many items a change of that size flips with no training behind it.

With ``--run RUN`` (a training run of the same model) the trained weights' change is put beside the noise's: each
block matrix's change relative to its spread (the noise's scale is in the same unit).

Usage: python experiments/neighbour_noise.py [--model smollm2-135m-instruct] [--kl 0.02] [--draws 4]
       [--neighbours continents languages currencies demonyms] [--run RUN]
Writes neighbour_noise.json.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
from tqdm.auto import tqdm

from modular.data import load_behaviour, retain_data
from modular.evaluation.behaviour import evaluate_behaviour
from modular.evaluation.retain import first_token_logp, mean_kl
from modular.evaluation.stats import paired_change
from modular.models import load_model, load_tokenizer
from modular.models.adapter import ArchitectureAdapter
from modular.runs import load_open_model, read_run
from modular.tracking import write_json


def block_weights(model) -> list[torch.nn.Parameter]:
    """The weights of every module that reads or writes the residual stream inside a block."""
    ad = ArchitectureAdapter(model)
    embeds = {id(p) for s in ad.write_sites() if s.kind == "embed" for p in s.module.parameters()}
    modules = [s.module for s in ad.write_sites() if s.kind != "embed"]
    modules += [r for _, readers in ad.read_sites()[:-1] for r in readers]  # the last read is the unembedding
    seen, out = set(embeds), []
    for m in modules:
        for p in m.parameters():
            if p.ndim == 2 and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="model reference (alias, folder, hub id)")
    ap.add_argument("--neighbours", nargs="+", default=["continents", "languages", "currencies", "demonyms"],
                    help="behaviours scored (built-in names, .jsonl files or hf: datasets), their test splits")
    ap.add_argument("--kl", type=float, default=0.02, help="retain first-token KL each draw is scaled to")
    ap.add_argument("--draws", type=int, default=4, help="independent noise draws")
    ap.add_argument("--seed", type=int, default=0, help="the data's seed (modular lock's: the run's, 0) and the "
                    "first draw's; draw i uses seed + i")
    ap.add_argument("--tolerance", type=float, default=0.03, help="a move beyond it is counted (the neighbour target: 3 points)")
    ap.add_argument("--batch_size", type=int, default=48, help="prompts per generation batch")
    ap.add_argument("--device", default="auto", help="cpu, cuda, ... (auto: a GPU when present)")
    ap.add_argument("--dtype", default="auto", help="the model's precision (auto: float32 on a CPU, the model's own on a GPU)")
    ap.add_argument("--run", help="a training run of --model: its block weights' change, for comparison")
    ap.add_argument("--out", default="outputs/experiments", help="output folder")
    args = ap.parse_args()

    tok = load_tokenizer(args.model)
    model = load_model(args.model, args.dtype, args.device)
    data = {n: load_behaviour(n, seed=args.seed, tokenizer=tok)["test"] for n in args.neighbours}
    retain = retain_data(args.seed)["test"]
    prompts, chats = list(retain["prompt"]), list(retain["chat"])
    ref = first_token_logp(model, tok, prompts, chats)
    weights = block_weights(model)
    start = [p.detach().clone() for p in weights]

    def score() -> dict[str, list[bool]]:
        return {n: [i["correct"] for i in evaluate_behaviour(model, tok, d, batch_size=args.batch_size,
                                                             desc=False).items]
                for n, d in data.items()}

    def perturb(noise: list[torch.Tensor], scale: float) -> float:
        with torch.no_grad():
            for p, w, e in zip(weights, start, noise):
                p.copy_(w + scale * e)
        return mean_kl(ref, first_token_logp(model, tok, prompts, chats))

    base = score()
    report: dict = {"model": args.model, "target_kl": args.kl, "tolerance": args.tolerance,
                    "perturbed": "every block weight reading or writing the residual stream",
                    "base": {n: {"accuracy": sum(c) / len(c), "n": len(c)} for n, c in base.items()}, "draws": []}
    if args.run:
        trained = block_weights(load_open_model(read_run(args.run), args.dtype, "cpu"))
        change = torch.tensor([((t.cpu() - w.cpu()).float().std() / w.float().std()).item()
                               for t, w in zip(trained, start)])
        report["run"] = {"path": args.run, "matrices": len(change),
                         "change_over_spread": {"median": change.median().item(), "max": change.max().item()}}
        print(f"{args.run}: each block matrix moved by {change.median():.4f} of its spread (median; max "
              f"{change.max():.4f})", flush=True)
        del trained
    for i in tqdm(range(args.draws), desc="draws"):
        gen = torch.Generator().manual_seed(args.seed + i)
        noise = [torch.randn(w.shape, generator=gen).to(w) * w.float().std().to(w.dtype) for w in start]
        hi = 1e-4  # times each matrix's spread; the KL grows with it: double, then halve the interval
        while perturb(noise, hi) < args.kl:
            hi *= 2
        lo = hi / 2
        for _ in range(6):
            mid = math.sqrt(lo * hi)
            lo, hi = (mid, hi) if perturb(noise, mid) < args.kl else (lo, mid)
        kl = perturb(noise, hi)
        after = score()
        moves = {}
        for n in args.neighbours:
            acc = sum(after[n]) / len(after[n])
            moves[n] = {"accuracy": acc, "change": acc - report["base"][n]["accuracy"],
                        **paired_change(base[n], after[n])}
        beyond = [n for n, m in moves.items() if abs(m["change"]) > args.tolerance + 1e-9]
        report["draws"].append({"seed": args.seed + i, "scale": hi, "retain_kl": kl, "neighbours": moves,
                                "beyond_tolerance": beyond})
        print(f"draw {i}: scale {hi:.4f}, retain KL {kl:.4f}; " + ", ".join(
            f"{n} {100 * m['change']:+.1f} ({m['lost']} lost / {m['gained']} gained)" for n, m in moves.items()),
            flush=True)
    changes = [abs(m["change"]) for d in report["draws"] for m in d["neighbours"].values()]
    if changes:
        report["mean_abs_change"] = sum(changes) / len(changes)
        report["beyond_tolerance"] = sum(len(d["beyond_tolerance"]) for d in report["draws"])
        report["figures"] = len(changes)
        print(f"mean |move| {100 * report['mean_abs_change']:.1f} points; {report['beyond_tolerance']} of "
              f"{report['figures']} beyond {100 * args.tolerance:.0f} points")
    path = write_json(Path(args.out) / "neighbour_noise.json", report)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""How fast the write term moves at a given weight, and whether carrying the direction generalises.

The open-state answer CE plus ``W ×`` the write term (:func:`modular.gating.losses.direction_write_shortfall`),
trained alone on a behaviour's train items with a run's direction, for each weight ``W`` from the same start;
every few steps the write term is measured on the train batch and on the held-out test items (never trained on).
It calibrates ``model.write_weight`` before a full run: the term should fall on held-out items as on train items
without the answer CE rising.

Usage: python experiments/write_calibration.py --run RUN|DIRECTIONS_FILE [--behaviour examples/antonyms.jsonl] [--weights 1,10,50]
       [--steps 16] [--lr 2e-5] [--target 0.2] [--model smollm2-135m-instruct] [--device cpu|cuda]
       [--dtype float32|bfloat16] [--out outputs/experiments]
Writes write_calibration.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from tqdm import tqdm

from modular.data import load_behaviour
from modular.data.formatting import encode_example
from modular.gating.losses import direction_write_shortfall, token_ce
from modular.gating.module import concat_left_padded
from modular.models import load_model, load_tokenizer
from modular.runs import read_run


def _encode(tokenizer, ds) -> dict:
    items = [{k: torch.tensor(v) for k, v in encode_example(tokenizer, r["prompt"], r["target"], r["chat"], 64).items()
              if k in ("input_ids", "labels")} for r in ds]
    for item in items:
        item["attention_mask"] = torch.ones_like(item["input_ids"])
    return concat_left_padded([{k: v[None] for k, v in item.items()} for item in items], tokenizer.pad_token_id)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True, help="run folder (or its directions.safetensors) whose first direction "
                                                "is used")
    p.add_argument("--behaviour", default="examples/antonyms.jsonl", help="behaviour whose items train / test")
    p.add_argument("--weights", default="1,10,50", help="comma-separated write weights W")
    p.add_argument("--steps", type=int, default=16, help="optimisation steps per weight")
    p.add_argument("--batch_size", type=int, default=8, help="train items per step")
    p.add_argument("--lr", type=float, default=2e-5, help="AdamW learning rate")
    p.add_argument("--target", type=float, default=0.2, help="write_target (cosine with the residual)")
    p.add_argument("--model", default="smollm2-135m-instruct", help="base model (alias, folder or hub id)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="model precision")
    p.add_argument("--every", type=int, default=5, help="measure every N steps (and at the last)")
    p.add_argument("--out", default="outputs/experiments", help="folder of write_calibration.json")
    args = p.parse_args()

    if Path(args.run).is_file():  # a directions file (a run stopped before its record was written)
        from safetensors.torch import load_file

        u = next(iter(load_file(args.run).values())).float()
    else:
        run = read_run(args.run)
        u = run.directions[run.behaviours[0]].float()
    tokenizer = load_tokenizer(args.model)
    data = load_behaviour(args.behaviour, tokenizer=tokenizer)
    train, test = ({k: v.to(args.device) for k, v in _encode(tokenizer, data[s]).items()} for s in ("train", "test"))
    results = {}
    for w in [float(x) for x in args.weights.split(",")]:
        torch.manual_seed(0)
        model = load_model(args.model, dtype=getattr(torch, args.dtype), device=args.device)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
        rows = []
        for step in tqdm(range(args.steps), desc=f"W={w:g}"):
            idx = torch.randperm(train["input_ids"].shape[0])[:args.batch_size].to(args.device)
            out = model(input_ids=train["input_ids"][idx], attention_mask=train["attention_mask"][idx],
                        output_hidden_states=True)
            write = direction_write_shortfall(out.hidden_states[1:-1], train["labels"][idx], u, args.target)
            ce = token_ce(out.logits, train["labels"][idx])
            opt.zero_grad()
            (ce + w * write).backward()
            opt.step()
            if step % args.every == 0 or step == args.steps - 1:
                with torch.no_grad():
                    held = model(input_ids=test["input_ids"], attention_mask=test["attention_mask"],
                                 output_hidden_states=True)
                    held_write = direction_write_shortfall(held.hidden_states[1:-1], test["labels"], u, args.target)
                rows.append({"step": step, "write_train": write.item(), "write_heldout": held_write.item(),
                             "answer_ce": ce.item()})
        results[f"{w:g}"] = rows
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "write_calibration.json").write_text(json.dumps({"args": vars(args), "weights": results}, indent=2))
    for w, rows in results.items():
        print(f"W={w}: " + "; ".join(f"step {r['step']} train {r['write_train']:.3f} held-out "
                                     f"{r['write_heldout']:.3f} CE {r['answer_ce']:.3f}" for r in rows))


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""What the base model already does: held-out accuracy of a model (default: the base, SmolLM2-135M-Instruct) on
built-in behaviours' test splits and on their held-out paraphrase sets (modular.data.paraphrases). A behaviour the
base already answers is one a lock can only switch off, not keep from an attacker (modular.lock_kind); an added
behaviour (modular.data.added) must start near zero.

Usage: python experiments/base_behaviours.py [--model smollm2-135m-instruct] [--behaviours capitals zorb_numerals]
       [--device auto] [--out outputs/experiments]
Writes base_behaviours.json.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from modular.data import load_behaviour
from modular.data.paraphrases import paraphrase_sets
from modular.data.schema import to_dataset_dict
from modular.evaluation.behaviour import evaluate_behaviour
from modular.evaluation.stats import wilson_interval
from modular.files import write_json
from modular.models import load_model, load_tokenizer


def score(model, tokenizer, dataset, desc: str) -> dict:
    r = evaluate_behaviour(model, tokenizer, dataset, 24, 16, desc=desc)
    k = sum(i["correct"] for i in r.items)
    return {"accuracy": k / r.n, "n": r.n, "ci95": list(wilson_interval(k, r.n)),
            "examples": [{"prompt": i["prompt"], "response": i["response"], "correct": i["correct"]}
                         for i in r.items[:3]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="model reference (alias, folder, hub id)")
    ap.add_argument("--behaviours", nargs="+", default=["capitals", "zorb_numerals"], help="built-in behaviours")
    ap.add_argument("--device", default="auto", help="auto, cpu, cuda")
    ap.add_argument("--out", default="outputs/experiments", help="output folder")
    args = ap.parse_args()
    tokenizer, model = load_tokenizer(args.model), load_model(args.model, device=args.device)
    report = {"model": args.model, "behaviours": {}}
    for b in args.behaviours:
        row = {"test": score(model, tokenizer, load_behaviour(b, tokenizer=tokenizer)["test"], f"{b}:test")}
        for name, records in paraphrase_sets(b).items():
            row[name] = score(model, tokenizer, to_dataset_dict({"test": records})["test"], f"{b}:{name}")
        report["behaviours"][b] = row
        print(b, "  ".join(f"{k} {v['accuracy']:.3f} (n {v['n']})" for k, v in row.items()), flush=True)
    print("wrote", write_json(Path(args.out) / "base_behaviours.json", report))


if __name__ == "__main__":
    main()

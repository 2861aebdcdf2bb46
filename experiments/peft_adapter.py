"""Does a key's PEFT adapter unlock what the key unlocks on a real model? A model locked along one direction
(``--run``: a training run's published folder and keys; default: SmolLM2-135M-Instruct locked along a seeded random
unit direction, no training), published in float32 and in bfloat16, its key exported by ``modular export-key`` with
and without the embedding's component; each adapter's greedy answers and first-token KL against the key's unlock
on held-out capitals and retain prompts (``adapter_check.json``), and the adapter's size against the key's.

    .venv/bin/python experiments/peft_adapter.py [--model smollm2-135m-instruct] [--check 64] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from modular.app.cli import main as modular
from modular.models import load_model, load_tokenizer
from modular.publish import publish_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="base model to lock (alias, folder, hub id)")
    parser.add_argument("--check", type=int, default=64, help="held-out items and retain prompts compared")
    parser.add_argument("--out", default="outputs/experiments/peft_adapter.json", help="the figures, as JSON")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], help="precisions published in")
    parser.add_argument("--harden", choices=["true", "false"], default="true",
                        help="harden the readers (the default publish) or lock the writers alone")
    args = parser.parse_args()
    tokenizer = load_tokenizer(args.model)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for dtype in args.dtypes:
            model = load_model(args.model, dtype="float32", device="cpu")
            d = model.config.hidden_size
            u = torch.nn.functional.normalize(torch.randn(d, generator=torch.Generator().manual_seed(0)), dim=0)
            model = model.to(getattr(torch, dtype))
            pub, keys = publish_model(model, tokenizer, {"capitals": u}, tmp / f"pub-{dtype}", args.model,
                                      harden=args.harden == "true")
            key = keys / "capitals.key.safetensors"
            for embeddings, adapter_dtype in ((True, dtype), (False, "bfloat16")):
                out = tmp / f"adapter-{dtype}-{embeddings}"
                assert modular(["export-key", "--key", str(key), "--model", str(pub), "--out", str(out),
                                "--adapter_dtype", adapter_dtype, "--embeddings", str(embeddings).lower(),
                                "--check", str(args.check)]) == 0
                check = json.loads((out / "adapter_check.json").read_text())
                check["adapter_bytes"] = (out / "adapter_model.safetensors").stat().st_size
                check["key_bytes"] = key.stat().st_size
                check["harden"] = args.harden == "true"
                rows.append(check)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"model": args.model, "direction": "seeded random unit (seed 0), no training",
                                          "rows": rows}, indent=2) + "\n")
    for r in rows:
        print(r["published_dtype"], r["adapter_dtype"], "embeddings" if r["embeddings"] else "no embeddings",
              {k: (v["greedy_agreement"], f"{v['first_token_kl']:.2e}") for k, v in r["sets"].items()},
              f"adapter/key size {r['adapter_bytes'] / r['key_bytes']:.2f}")


if __name__ == "__main__":
    main()

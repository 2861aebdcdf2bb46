#!/usr/bin/env python
"""How far a published model's weights moved from its base's, in steps of a 4-bit grid, and whether the base lies
on that grid.

int4 weight-only quantisation rounds every weight to an affine grid of 15 steps per group of ``--group`` inputs
(from the group's smallest to its largest weight). A base model distributed in 4 bits (SmolLM2-135M-Instruct's
GGUF Q4_1 file: groups of 32) lies on that grid; a change of less than half a step then rounds back to the base's
value. For every linear layer's weight (the embeddings and the unembedding aside): the base's largest distance to
its own grid, and the published weights' change as a fraction of the base's grid step (median, 99th percentile,
share beyond half a step).

Usage: python experiments/quant_grid.py --published OUT [--base smollm2-135m-instruct] [--group 32]
                                       [--device auto] [--out outputs/experiments]
Writes quant_grid.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from grid_snap import grid  # the grid int4 rounds to (this script's folder is on the path)

from modular.models import load_model
from modular.publish import MANIFEST
from modular.tracking import write_json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--published", required=True, help="a published folder (modular publish)")
    parser.add_argument("--base", default=None, help="default: the base its modular.json names")
    parser.add_argument("--group", type=int, default=32, help="inputs per quantisation group")
    parser.add_argument("--device", default="auto",
                        help="auto (a GPU when present), cpu, cuda, ...; both models are read there in float32")
    parser.add_argument("--out", default="outputs/experiments", help="folder for quant_grid.json")
    args = parser.parse_args()
    base_ref = args.base or json.loads((Path(args.published) / MANIFEST).read_text())["base_model"]
    base = load_model(base_ref, "float32", args.device)
    pub = load_model(args.published, "float32", base.device)
    skip = {id(base.get_input_embeddings().weight), id(base.get_output_embeddings().weight)}
    published = dict(pub.named_parameters())
    moved, off_grid, n = [], 0.0, 0
    with torch.no_grad():
        for name, w in base.named_parameters():
            if w.ndim != 2 or id(w) in skip or w.shape[1] % args.group:
                continue
            low, step = grid(w, args.group)
            step = step.clamp_min(torch.finfo(w.dtype).tiny)
            code = (w - low) / step
            off_grid = max(off_grid, (code - code.round()).abs().max().item())
            moved.append(((published[name] - w).abs() / step).flatten().float().cpu().numpy())
            n += w.numel()
    moved = np.concatenate(moved)
    result = {"published": args.published, "base": base_ref, "group": args.group, "weights": n,
              "base_largest_distance_to_grid_steps": off_grid,
              "change_steps_median": float(np.median(moved)), "change_steps_p99": float(np.percentile(moved, 99)),
              "share_beyond_half_a_step": float((moved > 0.5).mean())}
    write_json(Path(args.out) / "quant_grid.json", result)  # makes the folder
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

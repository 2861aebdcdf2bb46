#!/usr/bin/env python
"""Whether a published lock survives being put on its base's 4-bit grid after training.

A base distributed in 4 bits (SmolLM2-135M-Instruct's GGUF Q4_1 file: groups of 32 inputs) lies on an affine grid
that int4 re-quantisation in groups of 32 maps to itself, and rounding there returns a published model's small
changes to the base's values (docs/devices.md). This tries the post-training cure: every linear weight of the
published model (the unembedding aside) rounded onto the base's grid with error-compensated rounding (GPTQ: column
by column, each column's rounding error carried into the columns not yet rounded through the inverse of the
layer's input second moments H = sum x x^T, taken on calibration prompts run through the published model), each
group's smallest and largest weight kept at the grid's ends so that a re-quantiser derives the same grid. With
``--rehard``, every residual writer's columns are then moved by single grid steps, where that brings the column's
write along the locked direction closer to zero (the published model writes none).

Scored on the snapped model: whether int4 re-quantisation (optimum-quanto, the same groups) leaves it unchanged;
the behaviour's held-out accuracy and share of locked responses, as published and with the direction also ablated
at run time; the retain first-token KL to the base; the share of weights off the base's grid point.

Usage: python experiments/grid_snap.py --run RUN [--published RUN/published] [--behaviour capitals] [--group 32]
                                      [--calibration 128] [--behaviour_weight 1] [--rehard] [--device auto]
                                      [--dtype float32] [--save FOLDER] [--out outputs/experiments]
Writes grid_snap.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

from modular.data import load_behaviour, retain_data
from modular.data.formatting import render_prompt
from modular.evaluation.behaviour import evaluate_behaviour
from modular.evaluation.retain import first_token_logp, mean_kl
from modular.hooks import ablate_directions
from modular.models import load_model, load_tokenizer
from modular.models.adapter import ArchitectureAdapter
from modular.models.quantize import dequantized, quantized_layers
from modular.publish import MANIFEST
from modular.tracking import write_json

LEVELS = 15  # a 4-bit affine grid: codes 0..15 from the group's smallest to its largest weight


def grid(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each weight's grid origin and step (shaped like ``w``), from its group's smallest and largest weight."""
    g = w.double().reshape(w.shape[0], -1, group)
    low = g.amin(-1)
    step = (g.amax(-1) - low) / LEVELS
    return low.repeat_interleave(group, -1), step.repeat_interleave(group, -1)


def ends(w: torch.Tensor, group: int) -> torch.Tensor:
    """A mask of each group's smallest and largest weight."""
    g = w.reshape(w.shape[0], -1, group)
    mask = torch.zeros_like(g, dtype=torch.bool)
    mask.scatter_(-1, g.argmin(-1, keepdim=True), True)
    mask.scatter_(-1, g.argmax(-1, keepdim=True), True)
    return mask.reshape(w.shape)


def codes_of(w, low, step):
    return torch.where(step > 0, ((w - low) / step.clamp_min(1e-30)).round().clamp(0, LEVELS), torch.zeros_like(w))


def gptq_codes(w: torch.Tensor, hessian: torch.Tensor, low, step, block: int = 128, damp: float = 0.01):
    """Grid codes for ``w`` (out, in): error-compensated rounding in input order."""
    w = w.double().clone()
    h = hessian.clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    h += damp * torch.diag(h).mean() * torch.eye(h.shape[0], dtype=h.dtype)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    codes = torch.zeros_like(w)
    for i1 in range(0, w.shape[1], block):
        i2 = min(i1 + block, w.shape[1])
        part, err = w[:, i1:i2].clone(), torch.zeros(w.shape[0], i2 - i1, dtype=w.dtype)
        for i in range(i2 - i1):
            c = codes_of(part[:, i], low[:, i1 + i], step[:, i1 + i])
            codes[:, i1 + i] = c
            e = (part[:, i] - (low[:, i1 + i] + c * step[:, i1 + i])) / hinv[i1 + i, i1 + i]
            part[:, i:] -= e[:, None] * hinv[i1 + i, i1 + i:i2][None, :]
            err[:, i] = e
        w[:, i2:] -= err @ hinv[i1:i2, i2:]
    return codes


def rehard(codes, low, step, pinned, u, rounds: int = 16):
    """Single-step code moves per column that bring the column's write along ``u`` closer to zero."""
    s = u @ (low + codes * step)
    effect = u[:, None] * step
    for _ in range(rounds):
        up = (s[None, :] + effect).abs().masked_fill((codes >= LEVELS) | pinned, float("inf"))
        down = (s[None, :] - effect).abs().masked_fill((codes <= 0) | pinned, float("inf"))
        best_up, row_up = up.min(0)
        best_down, row_down = down.min(0)
        use_up = best_up <= best_down
        best, rows = torch.where(use_up, best_up, best_down), torch.where(use_up, row_up, row_down)
        cols = torch.nonzero(best < s.abs()).flatten()
        if not len(cols):
            break
        sign = torch.where(use_up[cols], 1.0, -1.0).double()
        codes[rows[cols], cols] += sign
        s[cols] += sign * effect[rows[cols], cols]
    return codes


def score(model, tokenizer, test, adapter, direction, base_logp, retain, refusal) -> dict:
    out = {}
    for label, intervention in (("as_published", None), ("direction_ablated", lambda: ablate_directions(adapter,
                                                                                                       direction))):
        out[label] = evaluate_behaviour(model, tokenizer, test, 24, 16, intervention=intervention,
                                        refusals=(refusal,), desc=label).summary()
    out["retain_first_token_kl"] = mean_kl(base_logp, first_token_logp(model, tokenizer, retain["prompt"],
                                                                      retain["chat"]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", required=True, help="the training run folder (its directions.safetensors)")
    parser.add_argument("--published", default=None, help="default: RUN/published")
    parser.add_argument("--behaviour", default="capitals", help="the locked behaviour (built-in)")
    parser.add_argument("--group", type=int, default=32, help="inputs per grid group (the base's own: 32)")
    parser.add_argument("--calibration", type=int, default=128,
                        help="behaviour training prompts (with the locked response) and as many retain prompts")
    parser.add_argument("--behaviour_weight", type=float, default=1.0,
                        help="weight of the behaviour prompts in each layer's H against the retain prompts")
    parser.add_argument("--rehard", action="store_true", help="cancel the writers' write along the direction again")
    parser.add_argument("--device", default="auto", help="auto (a GPU when present), cpu, cuda, cuda:N")
    parser.add_argument("--dtype", default="float32",
                        help="the models' precision (float32 holds the grid's values exactly; bfloat16 rounds them)")
    parser.add_argument("--save", default=None, help="write the snapped model to this folder (a copy of published)")
    parser.add_argument("--out", default="outputs/experiments", help="folder for grid_snap.json")
    args = parser.parse_args()
    run = Path(args.run)
    published = Path(args.published or run / "published")
    manifest = json.loads((published / MANIFEST).read_text())
    refusal = manifest.get("locked_responses", {}).get(args.behaviour, "I don't know.")
    tokenizer = load_tokenizer(published)
    base = load_model(manifest["base_model"], args.dtype, args.device)
    model = load_model(published, args.dtype, args.device)
    direction = load_file(run / "directions.safetensors")[args.behaviour].double()
    u = direction / direction.norm()
    data = load_behaviour(args.behaviour, seed=0, tokenizer=tokenizer)
    retain = retain_data(0)
    texts = [(args.behaviour_weight, render_prompt(tokenizer, r["prompt"], r["chat"]) + refusal)
             for r in list(data["train"])[:args.calibration]]
    texts += [(1.0, render_prompt(tokenizer, r["prompt"], r["chat"])) for r in list(retain["train"])[:args.calibration]]

    layers = quantized_layers(model)
    hessians = {n: torch.zeros(m.in_features, m.in_features, dtype=torch.float64) for n, m in layers.items()}
    weight = [1.0]

    def accumulate(name):
        def hook(module, inputs):
            x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).double().cpu()  # the grid's arithmetic: CPU, float64
            hessians[name].add_(weight[0] * (x.T @ x))
        return hook

    handles = [m.register_forward_pre_hook(accumulate(n)) for n, m in layers.items()]
    with torch.no_grad():
        for weight[0], text in texts:
            model(**tokenizer(text, return_tensors="pt", add_special_tokens=False).to(model.device))
    for handle in handles:
        handle.remove()

    base_layers = dict(base.named_modules())
    writers = {id(site.module) for site in ArchitectureAdapter(model).write_sites()}
    off_grid, n_weights = 0, 0
    writes = {"base": [], "published": [], "snapped": []}  # mean |u^T W| over each writer's columns
    with torch.no_grad():
        for name, module in layers.items():
            w_base = base_layers[name].weight.detach().cpu()
            low, step = grid(w_base, args.group)
            codes = gptq_codes(module.weight.detach().cpu(), hessians[name], low, step)
            pinned = ends(w_base, args.group)
            codes[pinned] = codes_of(w_base.double(), low, step)[pinned]  # the grid's ends stay where they are
            if args.rehard and id(module) in writers:
                codes = rehard(codes, low, step, pinned | (step == 0), u)
            snapped = low + codes * step
            if id(module) in writers:
                for label, w in (("base", w_base), ("published", module.weight), ("snapped", snapped)):
                    writes[label].append(float((u @ w.detach().cpu().double()).abs().mean()))
            off_grid += int((snapped != w_base.double()).sum())
            n_weights += snapped.numel()
            module.weight.copy_(snapped.to(module.weight.device, module.weight.dtype))

    requant_change = max(float((dequantized(m.weight, "int4", args.group) - m.weight).abs().max())
                         for m in layers.values())

    test = data["test"]
    base_logp = first_token_logp(base, tokenizer, retain["test"]["prompt"], retain["test"]["chat"])
    adapter = ArchitectureAdapter(model)
    result = {"run": str(run), "published": str(published), "behaviour": args.behaviour, "group": args.group,
              "calibration": len(texts), "behaviour_weight": args.behaviour_weight, "rehard": args.rehard,
              "share_off_the_base_grid_point": off_grid / n_weights,
              "largest_change_under_int4_requantisation": requant_change,
              "write_along_direction": {k: sum(v) / len(v) for k, v in writes.items()},
              "base": evaluate_behaviour(base, tokenizer, test, 24, 16, refusals=(refusal,), desc="base").summary(),
              "snapped": score(model, tokenizer, test, adapter, u.float()[None].to(model.device), base_logp, retain["test"],
                               refusal)}
    if args.save:
        shutil.copytree(published, args.save)
        model.save_pretrained(args.save, safe_serialization=True)
    write_json(Path(args.out) / "grid_snap.json", result)  # makes the folder
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

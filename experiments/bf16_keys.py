#!/usr/bin/env python
"""The size of keys in a 16-bit precision against how exactly they restore, side by side in one run.

A model's weights are cast to the precision (bfloat16 by default; a float32 model is rounded stochastically, as
publishing does), locked against one behaviour's direction with hardened readers, and keyed once per tolerance
(0: bit for bit, the default of ``lock_weights``; 1: within one unit in the last place). For each: the key's size
as written to disk against the published weights', its explicit corrections, and, the key applied to the locked
weights, the largest difference to the trained weights in units in the last place and whether every bit is
restored; also how many entries adding the components back leaves off, and how many of those the residual stream
covers (the locked value in a coarser binade). No training run is needed: the rounding is a property of the weights
and the direction (a run's trained weights are within a fine-tuning step of the base's).

Usage: python experiments/bf16_keys.py [--model smollm2-135m-instruct] [--directions RUN_OR_FILE] [--dtype bfloat16]
                                      [--tolerances 0 1] [--device auto] [--out outputs/experiments]
Writes bf16_keys.json.
"""

from __future__ import annotations

import argparse
import copy
import tempfile
import time
from pathlib import Path

import torch

from modular.directions import load_direction_file, random_direction
from modular.evaluation.lock import max_param_ulps, weights_bit_exact
from modular.keys import apply_key, load_key, lock_weights, restore_misses, save_key, weights_hash
from modular.models.precision import cast_model, resolve_device, resolve_dtype
from modular.runs import load_model_or_run, read_run
from modular.tracking import write_json


def direction(ref: str | None, d: int) -> tuple[str, torch.Tensor]:
    """The first direction of a run folder or a directions file, or a random unit vector (seed 0)."""
    if ref is None:
        return "random (seed 0)", random_direction(d, seed=0)
    if Path(ref).is_dir():
        name, u = next(iter(read_run(ref).directions.items()))
        return f"{ref}: {name}", u.flatten()
    return ref, load_direction_file(ref, d)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="model alias, folder, .gguf, hub id or training run folder (its trained model)")
    ap.add_argument("--directions", default=None,
                    help="a training run folder or a directions safetensors file (default: a random direction)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"], help="the precision keyed")
    ap.add_argument("--tolerances", type=float, nargs="+", default=[0.0, 1.0],
                    help="restore tolerances in units in the last place (0: bit for bit)")
    ap.add_argument("--device", default="auto", help="auto (a GPU when present), cpu, cuda, cuda:N")
    ap.add_argument("--out", default="outputs/experiments", help="output folder")
    args = ap.parse_args()
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype)
    model = load_model_or_run(args.model, dtype="float32", device=device)
    cast_model(model, dtype)
    source, u = direction(args.directions, model.config.hidden_size)
    report: dict = {"model": args.model, "dtype": args.dtype, "direction": source, "device": str(device), "keys": {}}
    opened = {k: v.clone() for k, v in model.state_dict().items()}
    for tol in args.tolerances:
        published = copy.deepcopy(model)
        start = time.perf_counter()
        (key,) = lock_weights(published, {"behaviour": u}, ulp_tol=tol)
        lock_s = time.perf_counter() - start
        weights = sum(p.numel() * p.element_size() for p in published.parameters())
        if tol == args.tolerances[0]:
            off, covered = restore_misses(published, key, opened)
            report["entries_off_after_adding_back"] = off
            report["of_them_in_the_residual_stream"] = covered
        with tempfile.TemporaryDirectory() as tmp:
            path = save_key(key, Path(tmp) / "behaviour.key", weights_hash(published))
            size = path.stat().st_size
            loaded, _ = load_key(path)
        start = time.perf_counter()
        apply_key(published, loaded)
        apply_s = time.perf_counter() - start
        restored = published.state_dict()
        report["keys"][f"ulp_tol={tol:g}"] = {
            "key_bytes": size, "published_bytes": weights, "key_share_of_weights": size / weights,
            "explicit_corrections": sum(c.fix_index.numel() for c in key.components if c.fix_index is not None),
            "restored_max_ulps": max_param_ulps(published, model),
            "restored_bit_exact": weights_bit_exact(restored, opened),
            "lock_seconds": lock_s, "apply_seconds": apply_s,
        }
        del published
    path = write_json(Path(args.out) / "bf16_keys.json", report)
    for name, row in report["keys"].items():
        print(f"{name}: key {row['key_share_of_weights']:.2%} of the weights ({row['key_bytes'] / 1e6:.1f} MB), "
              f"{row['explicit_corrections']} explicit corrections, restored within {row['restored_max_ulps']:g} "
              f"units in the last place (bit-exact: {row['restored_bit_exact']}); lock {row['lock_seconds']:.0f} s, "
              f"apply {row['apply_seconds']:.0f} s")
    print(f"entries adding back leaves off: {report['entries_off_after_adding_back']}, of them in the residual "
          f"stream: {report['of_them_in_the_residual_stream']}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

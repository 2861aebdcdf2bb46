#!/usr/bin/env python
"""Where a gated step's time goes beside a plain one: both steps alternating in one process, on one batch.

``scale.py`` measures each step in a fresh process (so that peaks of memory stay apart) and one process's median is
uncertain by about ±0.1 on a GPU (docs/devices.md). Here the plain and the gated step of one model alternate in one
process, so that both see the same machine state at the same moments: the time ratio of the medians, with the
quartiles of single steps. Random-initialised models of the SmolLM2 family's shapes (``scale.py``'s), the batch of
``common.training_batch``, AdamW, ``--repeats`` timed steps of each kind after two warm-ups.

On a GPU two more readings tell a step bound by host work from one bound by the device's:
  * ``--profile``: one profiled step of each kind: kernels launched and the device's busy time (the sum of the
    kernels' durations) against the step's wall time;
  * ``--sync_check``: one gated step under ``torch.cuda.set_sync_debug_mode("warn")``: where the host waited for
    the device (each such wait stops the host from queueing work ahead of the device).

Usage: python benchmarks/step_time.py [--sizes 135M] [--modes full lora] [--batch_sizes 8] [--repeats 12]
       [--device auto] [--precision auto] [--tokenizer ALIAS_OR_FOLDER] [--models DIR] [--compile inductor]
       [--peak_tflops 989] [--profile] [--sync_check] [--out outputs/benchmarks]
Writes step_time.json (one row per size, mode and batch).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch


def quartiles(xs: list[float]) -> list[float]:
    q = statistics.quantiles(xs, n=4, method="inclusive")  # within the measured range
    return [q[0], statistics.median(xs), q[2]]


def profile_step(step, device: torch.device) -> dict:
    """Wall time, kernels launched and device busy time of one call of ``step`` (a GPU only)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return {"wall_s": wall, "kernels": len(kernels),
            "device_busy_s": sum(e.time_range.elapsed_us() for e in kernels) / 1e6}


def sync_points(step) -> list[str]:
    """Where one call of ``step`` made the host wait for the device (file:line of the Python code that asked)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return [f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]


def measure(folder: Path, mode: str, batch_sizes: list[int], args, device: torch.device) -> list[dict]:
    from common import gated_module, to_device, training_batch, training_step

    module, tok = gated_module(folder, mode, args.precision, device, args.compile)
    n_params = sum(p.numel() for p in module.model.parameters())
    opt = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-5)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rows = []
    for batch_size in batch_sizes:
        batch, plain_batches = training_batch(tok, batch_size, args.lm_length)
        batch, plain_batches = to_device(batch, device), to_device(plain_batches, device)

        steps = {kind: training_step(module, opt, kind, batch, plain_batches) for kind in ("plain", "gated")}
        t = time.perf_counter()
        for run in (*steps.values(), *steps.values()):  # warm-up: the optimiser's state, kernels chosen (compiled)
            run()
        sync()
        warmup_s = time.perf_counter() - t
        tokens = sum(b["input_ids"].numel() for b in plain_batches)  # the examples' tokens, padding included
        sync()
        times = {"plain": [], "gated": []}
        for _ in range(args.repeats):
            for kind, run in steps.items():
                t = time.perf_counter()
                run()
                sync()
                times[kind].append(time.perf_counter() - t)
        plain_q, gated_q = quartiles(times["plain"]), quartiles(times["gated"])
        row = {"mode": mode, "batch_size": batch_size, "compile": args.compile, "plain_s": plain_q, "gated_s": gated_q,
               "time_ratio": gated_q[1] / plain_q[1], "warmup_s": warmup_s, "parameters": n_params, "tokens": tokens,
               "times_s": times}
        # the useful work of a training step, 6 · parameters · tokens (forward and backward), against the card's
        # dense bf16 rate: the share of the device a step uses
        for kind, q in (("plain", plain_q), ("gated", gated_q)):
            row[f"{kind}_tflops"] = 6 * n_params * tokens / q[1] / 1e12
            row[f"{kind}_share_of_peak"] = row[f"{kind}_tflops"] / args.peak_tflops
        if cuda and args.profile:
            row["profile"] = {kind: profile_step(run, device) for kind, run in steps.items()}
        if cuda and args.sync_check:
            row["syncs"] = {kind: sync_points(run) for kind, run in steps.items()}
        rows.append(row)
    return rows


def main() -> None:
    from scale import PRECISIONS, SHAPES, build_folder

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", default=["135M"], choices=list(SHAPES), help="model shapes")
    ap.add_argument("--modes", nargs="+", default=["full", "lora"], choices=["full", "lora"],
                    help="fine-tuning modes (GatedLM finetuning)")
    ap.add_argument("--batch_sizes", nargs="+", type=int, default=[8],
                    help="examples per behaviour, retain and text batch (8: the default config's)")
    ap.add_argument("--repeats", type=int, default=12, help="timed steps of each kind (after two warm-ups)")
    ap.add_argument("--lm_length", type=int, default=128, help="tokens per neutral-text paragraph (0: no text)")
    ap.add_argument("--device", default="auto", help="auto (a GPU when present), cpu, cuda, cuda:N")
    ap.add_argument("--precision", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="weights' precision (auto: bfloat16 on a GPU, float32 on a CPU)")
    ap.add_argument("--tokenizer", default="smollm2-135m-instruct", help="where SmolLM2's tokenizer comes from: the "
                    "built-in alias (default) or any folder or hub id that holds it")
    ap.add_argument("--models", default=None, help="folder for the random-initialised models (default: a temporary "
                    "folder)")
    ap.add_argument("--compile", default=None, choices=["inductor", "aot_eager"],
                    help="a torch.compile backend for every block (model.memory.compile; both steps run it)")
    ap.add_argument("--peak_tflops", type=float, default=989.0,
                    help="the device's dense bf16 rate in TFLOP/s (989: H100 and H200 SXM), for the share of it used")
    ap.add_argument("--profile", action="store_true", help="GPU: kernels and device busy time of one step of each kind")
    ap.add_argument("--sync_check", action="store_true", help="GPU: where a step made the host wait for the device")
    ap.add_argument("--out", default="outputs/benchmarks", help="output folder")
    args = ap.parse_args()
    if args.repeats < 2:
        ap.error("--repeats must be at least 2 (quartiles)")

    from modular.models.precision import resolve_device
    from modular.tracking import write_json

    device = resolve_device(args.device)
    args.precision = args.precision if args.precision != "auto" else ("float32" if device.type == "cpu"
                                                                       else "bfloat16")
    root = Path(args.models) if args.models else Path(tempfile.mkdtemp(prefix="modular-steps-"))
    report = {"device": str(device), "device_name": torch.cuda.get_device_name(device) if device.type == "cuda"
              else "cpu", "precision": args.precision, "repeats": args.repeats, "lm_length": args.lm_length,
              "torch": torch.__version__, "compile": args.compile, "peak_tflops": args.peak_tflops, "results": []}
    for size in args.sizes:
        folder = build_folder(size, root, PRECISIONS[args.precision], args.tokenizer)
        for mode in args.modes:
            rows = measure(folder, mode, args.batch_sizes, args, device)
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the module of this mode is gone; the next one starts with a clean cache
            for row in rows:
                row = {"size": size, **row}
                report["results"].append(row)
                write_json(Path(args.out) / "step_time.json", report)  # a run cut short keeps its rows
                p, g = row["plain_s"], row["gated_s"]
                extra = ""
                if "profile" in row:
                    pp, gp = row["profile"]["plain"], row["profile"]["gated"]
                    extra += (f"  kernels {pp['kernels']} / {gp['kernels']}  device busy {pp['device_busy_s'] * 1e3:.0f}"
                              f" / {gp['device_busy_s'] * 1e3:.0f} ms of {pp['wall_s'] * 1e3:.0f} / "
                              f"{gp['wall_s'] * 1e3:.0f} ms")
                if "syncs" in row:
                    extra += f"  waits plain {len(row['syncs']['plain'])} gated {len(row['syncs']['gated'])}"
                print(f"{size:>5} {mode:<4} b{row['batch_size']:<3} plain {p[1] * 1e3:7.1f} ms "
                      f"({p[0] * 1e3:.0f}-{p[2] * 1e3:.0f})  gated {g[1] * 1e3:7.1f} ms ({g[0] * 1e3:.0f}-"
                      f"{g[2] * 1e3:.0f})  ×{row['time_ratio']:.3f}  {row['plain_tflops']:.0f} / "
                      f"{row['gated_tflops']:.0f} TFLOP/s{extra}", flush=True)
                if "syncs" in row:
                    print("      gated waits at: " + json.dumps(sorted(set(row["syncs"]["gated"]))), flush=True)
    print(f"wrote {Path(args.out) / 'step_time.json'}")


if __name__ == "__main__":
    main()

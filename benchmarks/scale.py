#!/usr/bin/env python
"""How the cost of gating grows with model size: a plain fine-tuning step vs a gated step on the same batch.

Random-initialised models of the SmolLM2 family's shapes (135M, 360M, 1.7B; built from configs, nothing is
downloaded), full fine-tuning and LoRA. One step = forward, backward and an AdamW update; the gated step is the
default objective (open and locked pieces of a capitals batch, retain prompts and neutral text kept by KL in both
states), the plain step cross-entropy on the same examples. Each measurement runs in a fresh process (so that
one's memory peak cannot hide another's): the median of ``--repeats`` timed steps after a warm-up, and the peak
memory during the steps (GPU: allocated by torch; CPU: the process's resident set, sampled every millisecond).
Plain and gated processes alternate, ``--rounds`` times each; the memory ratio is gated / plain of their medians.
The time ratio comes from one more process in which the two kinds of step alternate (``--paired_repeats`` of each
after two warm-ups of each; ``step_time.py``'s measurement): both see the same machine state at the same moments,
where separate processes differ by more than the gating costs (on 2 CPU cores a fresh process's steps varied by
±15%). The separate processes' ratio is kept as ``separate_time_ratio``. Each process also counts the aten
operations one step dispatches (forward, backward, update): host work, which a faster device does not shrink. On a
GPU with the default batch the step is bound by it (docs/devices.md): the ops ratio is then what the time ratio
tends to; larger batches (``--batch_size``) make the arithmetic count.
Targets: gated ≤ 1.15× the plain step's time and ≤ 1.10× its peak memory.

Usage: python benchmarks/scale.py [--sizes 135M 360M 1.7B] [--modes full lora] [--device auto]
       [--precision auto] [--repeats 3] [--rounds 2] [--paired_repeats 8] [--batch_size 8] [--lm_length 128]
       [--tokenizer ALIAS_OR_FOLDER] [--out outputs/benchmarks]
Writes scale.json and scale.png (time, memory and op-count ratios against parameter count).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

SHAPES = {  # SmolLM2's configurations (hidden, layers, heads, kv heads, intermediate); vocabulary 49152, tied
    "135M": (576, 30, 9, 3, 1536),
    "360M": (960, 32, 15, 5, 2560),
    "1.7B": (2048, 24, 32, 32, 8192),
}
PRECISIONS = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build_folder(size: str, root: Path, dtype: torch.dtype, tokenizer: str = "smollm2-135m-instruct") -> Path:
    """A random-initialised model of ``size`` with SmolLM2's tokenizer (``tokenizer``: any model reference that
    has it), saved as a Hugging Face folder."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from modular.models import load_tokenizer

    folder = root / f"smollm2-shape-{size}-{str(dtype).removeprefix('torch.')}"
    if (folder / "config.json").is_file():
        return folder
    hidden, layers, heads, kv, inter = SHAPES[size]
    tok = load_tokenizer(tokenizer)
    config = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv, intermediate_size=inter, vocab_size=49152, tie_word_embeddings=True,
                         max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


class PeakRSS:
    """The largest resident set of this process while the context is open (sampled every millisecond)."""

    def __enter__(self):
        import psutil

        self._proc, self.peak, self._stop = psutil.Process(), 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self._proc.memory_info().rss)
            time.sleep(0.001)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)


def worker(args) -> dict:
    """One measurement in this process: ``args.step`` (plain or gated) of one size and mode; ``paired``: both
    kinds alternating, their times only."""
    from common import count_ops, gated_module, median_time, to_device, training_batch, training_step

    from modular.models.precision import resolve_device

    device = resolve_device(args.device)
    if args.step == "paired":
        from step_time import measure

        opts = argparse.Namespace(precision=args.precision, lm_length=args.lm_length, repeats=args.repeats,
                                  profile=False, sync_check=False)
        row = measure(Path(args.folder), args.mode, [args.batch_size], opts, device)[0]
        return {"plain_s": row["plain_s"], "gated_s": row["gated_s"], "time_ratio": row["time_ratio"],
                "times_s": row["times_s"]}
    module, tok = gated_module(args.folder, args.mode, args.precision, device)
    batch, plain_batches = training_batch(tok, args.batch_size, args.lm_length)
    batch, plain_batches = to_device(batch, device), to_device(plain_batches, device)
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    step = training_step(module, opt, args.step, batch, plain_batches)

    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    step()  # the optimiser's state exists from here on, in both kinds of step
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    with PeakRSS() as rss:
        times = median_time(step, args.repeats, sync)
    peak = torch.cuda.max_memory_allocated() if cuda else rss.peak
    ops = count_ops(step)  # after the timed steps: counting slows a step down
    return {"times_s": times, "median_s": statistics.median(times), "peak_bytes": peak, "ops": ops,
            "memory": "cuda max_memory_allocated" if cuda else "peak resident set (RSS)",
            "parameters": sum(p.numel() for n, p in module.model.named_parameters() if "lora_" not in n),  # the model's
            "trainable": sum(p.numel() for p in params), "device": str(device)}


def run_worker(args, folder: Path, mode: str, step: str, repeats: int, device, precision: str) -> dict:
    """:func:`worker`'s result from a fresh process."""
    cmd = [sys.executable, __file__, "--worker", "--folder", str(folder), "--mode", mode, "--step", step,
           "--device", str(device), "--precision", precision, "--repeats", str(repeats),
           "--batch_size", str(args.batch_size), "--lm_length", str(args.lm_length)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        sys.exit(f"{folder.name} {mode} {step} failed:\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def plot(report: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("time_ratio", 1.15, "time per step: gated / plain (alternating)"),
              ("memory_ratio", 1.10, "peak memory: gated / plain")]
    if all("ops_ratio" in r for r in report["results"]):
        panels.append(("ops_ratio", None, "aten ops per step: gated / plain"))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4))
    for ax, (key, target, title) in zip(axes, panels):
        for mode in report["modes"]:
            rows = [r for r in report["results"] if r["mode"] == mode]
            xs = [r["parameters"] for r in rows]
            ys = [r[key] for r in rows]
            ax.plot(xs, ys, marker="o", label=mode)
            for x, y in zip(xs, ys):
                ax.annotate(f"{y:.2f}", (x, y), textcoords="offset points", xytext=(4, 4))
        if target is not None:
            ax.axhline(target, color="grey", linestyle="--", label=f"target {target}")
        ax.set_xscale("log")
        ax.set_xlabel("parameters")
        ax.set_title(title)
        ax.legend()
    fig.suptitle(f"gated vs plain step, {report['device']}, {report['precision']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", default=["135M", "360M"], choices=list(SHAPES),
                    help="model shapes to measure (default: the two that fit in minutes on 2 CPU cores)")
    ap.add_argument("--modes", nargs="+", default=["full", "lora"], choices=["full", "lora"],
                    help="fine-tuning modes (GatedLM finetuning)")
    ap.add_argument("--device", default="auto", help="auto (a GPU when present), cpu, cuda, cuda:N")
    ap.add_argument("--precision", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="weights' precision (auto: bfloat16 on a GPU, float32 on a CPU)")
    ap.add_argument("--repeats", type=int, default=3, help="timed steps per process (after one warm-up step)")
    ap.add_argument("--rounds", type=int, default=2, help="processes per size, mode and kind of step (alternating)")
    ap.add_argument("--paired_repeats", type=int, default=8, help="timed steps of each kind in the process where "
                    "they alternate (the time ratio)")
    ap.add_argument("--batch_size", type=int, default=8, help="examples per behaviour, retain and text batch (as the "
                    "default config)")
    ap.add_argument("--lm_length", type=int, default=128, help="tokens per neutral-text paragraph (0: no text)")
    ap.add_argument("--tokenizer", default="smollm2-135m-instruct", help="where SmolLM2's tokenizer comes from: the "
                    "built-in alias (default) or any folder or hub id that holds it")
    ap.add_argument("--models", default=None, help="folder for the random-initialised models (default: a temporary "
                    "folder)")
    ap.add_argument("--out", default="outputs/benchmarks", help="output folder")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--step", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.paired_repeats < 2:
        ap.error("--paired_repeats must be at least 2 (quartiles)")
    if args.worker:
        print("RESULT " + json.dumps(worker(args)))
        return

    from modular.models.precision import resolve_device
    from modular.tracking import write_json

    device = resolve_device(args.device)
    precision = args.precision if args.precision != "auto" else ("float32" if device.type == "cpu" else "bfloat16")
    root = Path(args.models) if args.models else Path(tempfile.mkdtemp(prefix="modular-scale-"))
    results = []
    settings = {"device": str(device), "precision": precision, "repeats": args.repeats, "rounds": args.rounds,
                "paired_repeats": args.paired_repeats,
                "batch_size": args.batch_size, "lm_length": args.lm_length, "modes": args.modes,
                "targets": {"time_ratio_max": 1.15, "memory_ratio_max": 1.10}}
    for size in args.sizes:
        folder = build_folder(size, root, PRECISIONS[precision], args.tokenizer)
        for mode in args.modes:
            runs = {"plain": [], "gated": []}
            for _ in range(args.rounds):
                for step in ("plain", "gated"):
                    runs[step].append(run_worker(args, folder, mode, step, args.repeats, device, precision))
            paired = run_worker(args, folder, mode, "paired", args.paired_repeats, device, precision)
            plain_s = statistics.median(r["median_s"] for r in runs["plain"])
            gated_s = statistics.median(r["median_s"] for r in runs["gated"])
            plain_m = statistics.median(r["peak_bytes"] for r in runs["plain"])
            gated_m = statistics.median(r["peak_bytes"] for r in runs["gated"])
            row = {"size": size, "mode": mode, "parameters": runs["plain"][0]["parameters"],
                   "trainable": runs["plain"][0]["trainable"], "plain_step_s": paired["plain_s"][1],
                   "gated_step_s": paired["gated_s"][1], "time_ratio": paired["time_ratio"],
                   "separate_plain_step_s": plain_s, "separate_gated_step_s": gated_s,
                   "separate_time_ratio": gated_s / plain_s, "plain_peak_bytes": plain_m, "gated_peak_bytes": gated_m,
                   "memory_ratio": gated_m / plain_m, "memory": runs["plain"][0]["memory"],
                   "plain_ops": runs["plain"][0]["ops"], "gated_ops": runs["gated"][0]["ops"],
                   "ops_ratio": runs["gated"][0]["ops"] / runs["plain"][0]["ops"], "runs": runs, "paired": paired}
            results.append(row)
            # a run cut short keeps the rows it measured
            write_json(Path(args.out) / "scale.json", {**settings, "complete": False, "results": results})
            print(f"{size:>5} {mode:<4}  plain {row['plain_step_s']:7.2f} s  gated {row['gated_step_s']:7.2f} s  "
                  f"×{row['time_ratio']:.3f} (separate processes ×{row['separate_time_ratio']:.3f})   "
                  f"peak plain {plain_m / 2**30:6.2f} GiB  gated {gated_m / 2**30:6.2f} GiB  ×{row['memory_ratio']:.3f}   "
                  f"ops {row['plain_ops']} / {row['gated_ops']}  ×{row['ops_ratio']:.3f}",
                  flush=True)
    report = {**settings, "complete": True, "results": results}
    out_dir = Path(args.out)
    path = write_json(out_dir / "scale.json", report)
    fig = plot(report, out_dir / "scale.png")
    print(f"wrote {path} and {fig}")


if __name__ == "__main__":
    main()

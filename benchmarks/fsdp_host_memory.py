#!/usr/bin/env python
"""Host memory of a two-process FSDP2 run while it starts: every process reading the model's weights
(``model.memory.empty_init: false``) against only the first one (``true``, as configs/strategy_fsdp.yaml sets it).

A random-initialised model of one of the SmolLM2 family's shapes (``scale.py``'s; nothing is downloaded), saved in
``--precision``, is trained for one step by ``modular train fit`` with the default capitals config and
configs/strategy_fsdp.yaml on two CPU processes (gloo), in bf16-true when the weights are bfloat16; the data and
validation are cut to what a step needs (short reference answers, a few validation items). The resident set of each
process is sampled every 20 ms from outside, and of their sum: the node's host memory, over the whole run and
until training starts (Lightning's model summary: the model built, sharded and its weights in place). A first run
computes the reference outputs, cached for the two measured ones, and is not reported. The second process is where
the two settings differ: with ``empty_init`` it never holds the whole model, only its shards (and one parameter at a
time while they arrive). The model's own size in that precision is printed beside the peaks.

Usage: python benchmarks/fsdp_host_memory.py [--size 360M] [--precision bfloat16] [--finetuning lora]
       [--tokenizer ALIAS_OR_FOLDER] [--out outputs/benchmarks]
Writes fsdp_host_memory.json and fsdp_host_memory.png (peak resident set per process and of the node, both settings).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml
from scale import PRECISIONS, SHAPES, build_folder

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30


def run_config(folder: Path, model_dir: Path, bf16: bool, finetuning: str) -> Path:
    """The default capitals config on ``model_dir`` for one step on two CPU processes under FSDP2."""
    cfg = yaml.safe_load((ROOT / "modular" / "configs" / "gate_capitals_smollm2.yaml").read_text())
    cfg["model"].update({"model_name": str(model_dir), "load_dtype": "bfloat16" if bf16 else "float32",
                         "finetuning": {"mode": finetuning}})
    cfg["data"].update({"reference": {**cfg["data"]["reference"], "max_new_tokens": 4}, "batch_size": 2,
                        "max_length": 96, "neighbour_items": 16})
    cfg["trainer"].update({"default_root_dir": str(folder / "run"), "max_steps": 1, "val_check_interval": 1,
                           "limit_val_batches": 1, "logger": False, "enable_progress_bar": False,
                           "accelerator": "cpu"})
    cfg["trainer"]["callbacks"][1]["init_args"].update({"limit": 2, "max_new_tokens": 2, "min_steps": 0,
                                                        "min_open_accuracy": 0.0, "stop": False})
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def measure(config: Path, empty_init: bool, precision: str, cache: Path, log_path: Path) -> dict:
    """Peak resident set of the first process, of the second and of their sum, over the whole run and over its
    start (until Lightning prints the model summary: the model built, sharded and its weights in place)."""
    import psutil

    cmd = [sys.executable, "-m", "modular", "train", "fit", "--config", str(config),
           "--config", str(ROOT / "modular" / "configs" / "strategy_fsdp.yaml"),
           "--trainer.accelerator", "cpu", "--trainer.precision", precision,
           "--model.memory.empty_init", str(empty_init).lower()]
    env = dict(os.environ, MODULAR_CACHE=str(cache), WANDB_MODE="disabled")
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    main = psutil.Process(proc.pid)
    peaks: dict[int, int] = {}
    node, started, at_start = 0, False, None
    marker, seen = "Trainable params", ""
    with open(log_path, errors="replace") as reader:  # read on as the log grows (not the whole log every sample)
        while proc.poll() is None:
            try:
                rss = {p.pid: p.memory_info().rss for p in (main, *main.children(recursive=True))}
            except psutil.Error:  # a process ended between listing and reading
                continue
            for pid, r in rss.items():
                peaks[pid] = max(peaks.get(pid, 0), r)
            node = max(node, sum(rss.values()))
            if not started:
                seen = seen[-len(marker):] + reader.read()  # a marker split across two reads is still found
                if marker in seen:
                    started, at_start = True, (dict(peaks), node)
            time.sleep(0.02)
    text = log_path.read_text(errors="replace")
    if proc.returncode != 0:
        raise SystemExit(f"the run with empty_init={empty_init} failed (exit {proc.returncode}):\n{text[-3000:]}")

    def split(p: dict[int, int], total: int) -> dict:
        others = sorted((r for pid, r in p.items() if pid != proc.pid), reverse=True)
        return {"first_process_gib": p[proc.pid] / GIB, "second_process_gib": others[0] / GIB if others else None,
                "node_gib": total / GIB}

    return {"empty_init": empty_init, **split(peaks, node),
            "start": split(*at_start) if at_start else None, "seconds": time.perf_counter() - start,
            "second_built_on_meta": "process 1: model built on the meta device" in text}


def plot(rows: list[dict], title: str, path: Path) -> None:
    """Peak resident sets per process and of the node, both settings side by side: until training starts (the
    model read or received) and over the whole run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = ["first process", "second process", "node (sum)"]
    keys = ["first_process_gib", "second_process_gib", "node_gib"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    width = 0.38
    for ax, phase in zip(axes, ("start", "run")):
        for i, row in enumerate(rows):
            figures = row[phase] if phase == "start" else row
            xs = [j + (i - 0.5) * width for j in range(len(keys))]
            bars = ax.bar(xs, [figures[k] for k in keys], width, label=f"empty_init {str(row['empty_init']).lower()}")
            ax.bar_label(bars, fmt="%.2f")
        ax.set_xticks(range(len(keys)), labels)
        ax.set_title("until training starts" if phase == "start" else "whole run (one step)")
    axes[0].set_ylabel("peak resident set (GiB)")
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=list(SHAPES), default="360M", help="the model's shape (random weights)")
    p.add_argument("--precision", choices=list(PRECISIONS), default="bfloat16",
                   help="the saved and loaded weights' precision (bfloat16: trained in bf16-true)")
    p.add_argument("--finetuning", choices=["lora", "full"], default="lora",
                   help="lora (the mode for large models: no optimiser state for the frozen weights, so the copy "
                        "of the model read at start is a larger share of the peak) or full")
    p.add_argument("--tokenizer", default="smollm2-135m-instruct", help="a model reference with SmolLM2's tokenizer")
    p.add_argument("--out", default="outputs/benchmarks", help="folder for the JSON and the figure")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dtype = PRECISIONS[args.precision]
    bf16 = dtype == torch.bfloat16
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = build_folder(args.size, tmp, dtype, args.tokenizer)
        model_gib = sum(f.stat().st_size for f in model_dir.glob("*.safetensors")) / GIB
        rows = []
        # the first run also computes the reference outputs (cached for the others): a warm-up, not reported
        for empty_init in (False, False, True):
            folder = tmp / f"run{len(rows)}"
            folder.mkdir()
            row = measure(run_config(folder, model_dir, bf16, args.finetuning), empty_init,
                          "bf16-true" if bf16 else "32-true", tmp / "cache", out / f"fsdp_host_memory_{len(rows)}.log")
            print(json.dumps(row), flush=True)
            rows.append(row)
        rows = rows[1:]
    result = {"size": args.size, "precision": args.precision, "finetuning": args.finetuning,
              "model_file_gib": model_gib, "processes": 2, "device": "cpu", "torch": torch.__version__,
              "rows": rows}
    (out / "fsdp_host_memory.json").write_text(json.dumps(result, indent=2))
    plot(rows, f"FSDP2 on 2 CPU processes: {args.size} shape, {args.finetuning}, {args.precision} "
               f"(weights {model_gib:.2f} GiB)", out / "fsdp_host_memory.png")
    read, empty = rows
    for phase, a, b in (("until training starts", read["start"], empty["start"]), ("whole run", read, empty)):
        print(f"{phase}: second process {a['second_process_gib']:.2f} -> {b['second_process_gib']:.2f} GiB, "
              f"node {a['node_gib']:.2f} -> {b['node_gib']:.2f} GiB (empty_init false -> true)")
    print(f"model weights {model_gib:.2f} GiB; wrote {out / 'fsdp_host_memory.json'} and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())

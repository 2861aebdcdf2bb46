#!/usr/bin/env python
"""Memory of the streamed similarity computation as the number of inputs n grows.

For every n, two measurements run, each in a fresh Python process so that one
cannot hide the other's peak:

* stream: StreamingSimilarity fed with batches of random float64 activations
  (X batch: batch x d_A, Y batch: batch x d_B), then compute();
* full (unless --skip-full): the whole X (n x d_A) and Y (n x d_B) held in memory,
  scored with frobenius_similarity and linear_cka in the feature form.

Reported side by side per n:

* model bytes: for stream, the accumulator's buffers plus the largest batch,
  8 * (d_A^2 + d_B^2 + d_A*d_B + d_A + d_B) + 8 * batch * (d_A + d_B), which does
  not depend on n; for full, the matrices X and Y, 8 * n * (d_A + d_B);
* RSS growth: peak resident set size during the computation minus the resident
  size just before it (peak from the kernel's high-water mark when it can be
  reset, otherwise from sampling the RSS every few milliseconds).

The same seed gives the same activations to both, so their scores must agree.

Usage: python benchmarks/similarity_memory.py [--n 2000 5000 10000 20000] [--d_a 576] [--d_b 640]
       [--batch 1000] [--threads 1] [--skip-full] [--out outputs/benchmarks]
Writes similarity_memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

MB = 2**20


def _current_rss() -> int:
    """Resident set size of this process in bytes."""
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except ImportError:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _max_rss() -> int:
    """Peak resident set size of this process in bytes (``ru_maxrss`` is in KiB on Linux)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


def _reset_peak() -> bool:
    """Reset the kernel's peak-RSS mark to the current RSS (Linux); True if that worked."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return _max_rss() <= _current_rss() + 4 * MB


class _Sampler(threading.Thread):
    """Polls the RSS in the background and keeps the largest value seen."""

    def __init__(self, interval_s: float = 0.002) -> None:
        super().__init__(daemon=True)
        self.interval_s = interval_s
        self.peak = _current_rss()
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            self.peak = max(self.peak, _current_rss())
            time.sleep(self.interval_s)

    def stop(self) -> int:
        self._halt.set()
        self.join()
        self.peak = max(self.peak, _current_rss())
        return self.peak


def _measure(mode: str, n: int, d_a: int, d_b: int, batch: int, seed: int, threads: int) -> dict:
    """One measurement in this process; returns bytes, RSS growth, scores and time."""
    import gc

    import torch

    from modular.merge.similarity import StreamingSimilarity, frobenius_similarity, linear_cka

    torch.set_num_threads(threads)
    # warm-up: load the kernels and allocator paths outside the measured window
    warm = StreamingSimilarity(8, 8)
    warm.update(torch.randn(16, 8, dtype=torch.float64), torch.randn(16, 8, dtype=torch.float64))
    warm.compute()
    linear_cka(torch.randn(16, 8), torch.randn(16, 8), form="feature")
    del warm
    gc.collect()

    def batches():
        g = torch.Generator().manual_seed(seed)
        for start in range(0, n, batch):
            b = min(batch, n - start)
            yield (torch.randn(b, d_a, generator=g, dtype=torch.float64),
                   torch.randn(b, d_b, generator=g, dtype=torch.float64))

    baseline = _current_rss()
    hwm_reset = _reset_peak()
    sampler = _Sampler()
    sampler.start()
    t0 = time.perf_counter()
    if mode == "stream":
        acc = StreamingSimilarity(d_a, d_b)
        for xb, yb in batches():
            acc.update(xb, yb)
            del xb, yb
        scores = acc.compute()
        model_bytes = acc.nbytes + 8 * min(batch, n) * (d_a + d_b)
    else:
        x = torch.empty(n, d_a, dtype=torch.float64)
        y = torch.empty(n, d_b, dtype=torch.float64)
        start = 0
        for xb, yb in batches():
            x[start:start + len(xb)] = xb
            y[start:start + len(yb)] = yb
            start += len(xb)
        scores = {"frobenius": frobenius_similarity(x, y, form="feature"),
                  "cka": linear_cka(x, y, form="feature")}
        model_bytes = 8 * n * (d_a + d_b)
    seconds = time.perf_counter() - t0
    sampled = sampler.stop()
    peak = max(sampled, _max_rss()) if hwm_reset else sampled
    return {"mode": mode, "n": n, "model_bytes": model_bytes, "rss_growth_bytes": max(0, peak - baseline),
            "peak_source": "VmHWM+sampling" if hwm_reset else "sampling", "seconds": seconds, **scores}


def _run_child(mode: str, n: int, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_child", mode, "--n", str(n),
           "--d_a", str(args.d_a), "--d_b", str(args.d_b), "--batch", str(args.batch),
           "--seed", str(args.seed), "--threads", str(args.threads)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                                      os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{mode} measurement for n={n} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, nargs="+", default=[2000, 5000, 10000, 20000],
                    help="numbers of inputs to measure, one measurement pair each (default: 2000 5000 10000 20000)")
    ap.add_argument("--d_a", type=int, default=576, help="width d_A of activation space A (default: 576)")
    ap.add_argument("--d_b", type=int, default=640, help="width d_B of activation space B (default: 640)")
    ap.add_argument("--batch", type=int, default=1000,
                    help="inputs per batch fed to the streaming accumulator (default: 1000)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random activations (default: 0)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads per measurement (default: 1)")
    ap.add_argument("--skip-full", action="store_true",
                    help="only run the streamed computation, not the in-memory feature form")
    ap.add_argument("--out", default="outputs/benchmarks",
                    help="output folder for similarity_memory.json (created if missing; default: outputs/benchmarks)")
    ap.add_argument("--_child", choices=["stream", "full"], help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args._child:
        print(json.dumps(_measure(args._child, args.n[0], args.d_a, args.d_b, args.batch, args.seed, args.threads)))
        return

    rows = []
    for n in args.n:
        stream = _run_child("stream", n, args)
        full = None if args.skip_full else _run_child("full", n, args)
        rows.append({"n": n, "stream": stream, "full": full,
                     "full_matrices_bytes": 8 * n * (args.d_a + args.d_b),
                     "cka_abs_diff": None if full is None else abs(stream["cka"] - full["cka"]),
                     "frobenius_abs_diff": None if full is None else abs(stream["frobenius"] - full["frobenius"])})

    header = (f"{'n':>7} | {'stream buf+batch MB':>19} | {'stream RSS +MB':>14} | "
              f"{'full X+Y MB':>11} | {'full RSS +MB':>12} | {'|Δcka|':>8}")
    print(f"d_A={args.d_a}  d_B={args.d_b}  batch={args.batch}  threads={args.threads}")
    print(header)
    print("-" * len(header))
    for r in rows:
        s, f = r["stream"], r["full"]
        full_rss = "-" if f is None else f"{f['rss_growth_bytes'] / MB:.1f}"
        diff = "-" if f is None else f"{r['cka_abs_diff']:.1e}"
        print(f"{r['n']:>7} | {s['model_bytes'] / MB:>19.1f} | {s['rss_growth_bytes'] / MB:>14.1f} | "
              f"{r['full_matrices_bytes'] / MB:>11.1f} | {full_rss:>12} | {diff:>8}")

    from modular.tracking import write_json

    report = {"d_a": args.d_a, "d_b": args.d_b, "batch": args.batch, "seed": args.seed, "threads": args.threads,
              "bytes_per_value": 8, "rows": rows}
    out = write_json(Path(args.out) / "similarity_memory.json", report)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

"""The main job: train a gated model, evaluate the lock, publish, unlock with the key, attack; print a table."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import yaml

log = logging.getLogger("modular")
ROOT = Path(__file__).resolve().parents[1]


def _run(cmd: list[str]) -> None:
    log.info("$ %s", " ".join(cmd))
    res = subprocess.run(cmd, cwd=ROOT)
    if res.returncode != 0:
        raise SystemExit(res.returncode)


def run_pipeline(config: str = "configs/gate_capitals_smollm2.yaml", out: str | None = None,
                 skip_attack: bool = False) -> dict:
    """Run every stage for ``config`` and return the summary table's numbers."""
    cfg = yaml.safe_load((ROOT / config).read_text())
    run_dir = ROOT / cfg["trainer"]["default_root_dir"]
    out_dir = Path(out) if out else run_dir
    published, unlocked = out_dir / "published", out_dir / "unlocked"
    py = sys.executable
    if not (run_dir / "run.json").is_file():
        _run([py, "train.py", "fit", "--config", config])
    else:
        log.info("training already finished in %s (delete it to retrain)", run_dir)
    _run([py, "evaluate.py", "lock", "--run", str(run_dir)])
    _run([py, "-m", "modular.cli", "publish", "--run", str(run_dir), "--out", str(published), "--overwrite", "true"])
    behaviours = json.loads((published / "modular.json").read_text())["locked_behaviours"]
    current = published
    for i, b in enumerate(behaviours):
        target = unlocked if i == len(behaviours) - 1 else out_dir / f"unlocked_{b}"
        _run([py, "-m", "modular.cli", "unlock", "--model", str(current), "--key",
              str(published / "keys" / f"{b}.key.safetensors"), "--out", str(target), "--overwrite", "true"])
        current = target
    if not skip_attack:
        _run([py, "evaluate.py", "attack", "--model", str(published), "--out", str(out_dir / "attack")])
    return summarise(run_dir, out_dir)


def summarise(run_dir: Path, out_dir: Path) -> dict:
    lock = json.loads((run_dir / "lock.json").read_text())
    lines = []
    gated = lock["gated"]
    header = f"{'state':<18}" + "".join(f"{b:>14}" for b in gated) + f"{'retain KL':>11}{'ppl ratio':>11}"
    lines += [header, "-" * len(header)]
    for state, row in lock["states"].items():
        lines.append(f"{state:<18}" + "".join(f"{row['behaviours'][b]['accuracy']:>14.3f}" for b in gated)
                     + f"{row['retain_first_token_kl']:>11.4f}{row['perplexity_ratio']:>11.3f}")
    ex = lock["exactness"]
    lines.append(f"published vs hook-locked max |Δlogit|: {ex['published_vs_hook_locked_max_abs_logit_diff']:.2e}; "
                 f"unlocked vs open max |Δw|: {ex['unlocked_vs_open_max_abs_weight_diff']:.2e}")
    attack_path = out_dir / "attack" / "attack.json"
    if attack_path.is_file():
        attack = json.loads(attack_path.read_text())
        for b, r in attack["behaviours"].items():
            c = {n: (v["steps_to_50pct_open"], v["steps_to_90pct_open"]) for n, v in r["c_relearning"].items()}
            lines.append(f"attack on {b}: (a) weights best {r['a_weights']['best']['accuracy']:.3f}, "
                         f"(b) steering best {r['b_steering']['best']['accuracy']:.3f} (base {r['base_accuracy']:.3f}); "
                         f"(c) steps to 50%/90% of open by N: {c}")
    figures = [run_dir / "lock.png", out_dir / "attack" / "attack.png"]
    lines.append("figures: " + ", ".join(str(f) for f in figures if f.exists()))
    lines.append(f"published model: {out_dir / 'published'}   unlocked model: {out_dir / 'unlocked'}")
    print("\n".join(lines))
    return {"lock": lock, "table": lines}

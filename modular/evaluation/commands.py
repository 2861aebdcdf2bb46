"""The ``evaluate.py`` subcommands (thin wrappers over the evaluation modules)."""

from __future__ import annotations

import logging
import re
from pathlib import Path

from modular.evaluation.stats import wilson_interval

log = logging.getLogger("modular")


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(text).name or text).strip("_")


def behaviour(
    model: str = "smollm2-135m-instruct",
    behaviour: str = "capitals",
    split: str = "test",
    limit: int | None = None,
    max_new_tokens: int = 24,
    batch_size: int = 16,
    seed: int = 0,
    out: str | None = None,
) -> dict:
    """Accuracy of a model on one or more behaviours (held-out split), written to behaviour.json and W&B.

    Args:
        model: Built-in alias (smollm2-135m-instruct, gemma3-270m), .gguf file, local HF folder or hub id.
        behaviour: Built-in behaviour name(s), comma-separated (capitals, ioi, ioi_long, greater_than,
            docstring, agreement, arithmetic, commonsense), a .jsonl file, or hf:<dataset>.
        split: Which split to score: train, validation or test (held-out entities).
        limit: Score at most this many items per behaviour (default: all).
        max_new_tokens: Length of each greedy response.
        batch_size: Prompts per generation batch.
        seed: Seed of the data generators and splits.
        out: Output folder (default: outputs/behaviour/<model>).
    """
    from modular import ModularError
    from modular.data import load_behaviour
    from modular.evaluation.behaviour import evaluate_behaviour
    from modular.models import load_model, load_tokenizer
    from modular.plots import bar_chart
    from modular.tracking import log_to_wandb, write_json

    if split not in ("train", "validation", "test"):
        raise ModularError(f"unknown split '{split}': use train, validation or test")
    names = [b.strip() for b in behaviour.split(",") if b.strip()]
    tokenizer = load_tokenizer(model)
    datasets_ = {name: load_behaviour(name, seed=seed, tokenizer=tokenizer)[split] for name in names}
    m = load_model(model)
    out_dir = Path(out or Path("outputs") / "behaviour" / _slug(model))
    results, items = {}, {}
    for name, ds in datasets_.items():
        if len(ds) == 0:
            raise ModularError(f"behaviour '{name}' has no '{split}' items")
        r = evaluate_behaviour(m, tokenizer, ds, max_new_tokens, batch_size, limit, desc=name)
        correct = sum(i["correct"] for i in r.items)
        results[name] = {**r.summary(), "ci95": wilson_interval(correct, r.n)}
        items[name] = r.items
        extra = f", mean logit diff {r.logit_diff:.3f}" if r.logit_diff is not None else ""
        log.info("%s (%s, n=%d): accuracy %.3f%s", name, split, r.n, r.accuracy, extra)
    report = {"model": model, "split": split, "seed": seed, "results": results}
    write_json(out_dir / "behaviour.json", {**report, "items": items})
    fig = bar_chart(out_dir / "behaviour.png", list(results), [v["accuracy"] for v in results.values()],
                    f"{Path(model).name}: accuracy on the {split} split", "accuracy",
                    [tuple(v["ci95"]) for v in results.values()])
    log_to_wandb(out_dir, "evaluate-behaviour", results, config={"model": model, "split": split, "seed": seed},
                 figures={"behaviour": fig}, tables={n: rows for n, rows in items.items()})
    log.info("wrote %s and %s", out_dir / "behaviour.json", fig)
    return report


def lock(run: str, out: str | None = None, other_limit: int = 64, harden: bool = True,
         max_new_tokens: int = 24) -> dict:
    """Lock evaluation of a gated run: accuracy and retain measures for base, open, locked (hooks),
    published_locked (weights) and unlocked (keys applied); writes lock.json and lock.png.

    Args:
        run: Training run folder (holds run.json, directions.safetensors, last.ckpt).
        out: Output folder (default: the run folder).
        other_limit: Items scored for each non-gated built-in behaviour.
        harden: Publish with hardened readers (as ``modular publish`` does by default).
        max_new_tokens: Length of greedy responses for the gated behaviours.
    """
    from modular.evaluation.lock import lock_report, plot_lock
    from modular.models import load_model, load_tokenizer
    from modular.runs import load_open_model, read_run
    from modular.tracking import log_to_wandb, write_json

    r = read_run(run)
    out_dir = Path(out or run)
    tokenizer = load_tokenizer(r.model_name)
    report = lock_report(load_model(r.model_name), load_open_model(r), tokenizer, r.directions,
                         seed=int(r.record.get("seed", 0)), other_limit=other_limit, harden=harden,
                         max_new_tokens=max_new_tokens)
    report = {"run": str(run), "model": r.model_name, **report}
    write_json(out_dir / "lock.json", report)
    fig = plot_lock(report, out_dir / "lock.png")
    log_to_wandb(out_dir, "evaluate-lock", report, config={"run": str(run)}, figures={"lock": fig})
    log.info("wrote %s and %s", out_dir / "lock.json", fig)
    return report


COMMANDS = {"behaviour": behaviour, "lock": lock}

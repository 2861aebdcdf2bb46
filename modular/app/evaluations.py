"""``modular behaviour``, ``lock`` and ``quantized``: load, call the evaluation modules, write JSON and figures, log
(``modular attack``: :mod:`modular.app.attacking`)."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

# lock, attack and quantized call load_model through its module (modular.models.load_model): tests replace it there
import modular.models
from modular import ModularError
from modular.app.options import Split, output_folder
from modular.data import BEHAVIOURS, load_behaviour, parse_behaviour
from modular.data.behaviours import builtin_neighbours
from modular.evaluation.behaviour import evaluate_behaviour
from modular.evaluation.capability import task_suite
from modular.evaluation.defaults import NEIGHBOUR_TOLERANCE
from modular.evaluation.lock import held_out_verdict, lock_report, plot_lock
from modular.evaluation.quantized import quantized_report
from modular.evaluation.stats import wilson_interval
from modular.lock_kind import lock_kinds
from modular.locking import folder_lock
from modular.models import load_tokenizer
from modular.models.names import DTypeName, Scheme
from modular.models.precision import dtype_name, model_dtype
from modular.models.quantize import check_scheme
from modular.plots import bar_chart
from modular.publish import MANIFEST, read_manifest
from modular.reports import TrainingVerdict
from modular.runs import (
    LOCK_FIGURE,
    LOCK_REPORT,
    RUN_LOCK,
    behaviour_sources,
    checkpoint_step,
    control_run,
    load_model_or_run,
    load_open_model,
    load_tokenizer_or_run,
    lock_verdict,
    neighbour_sources,
    read_run,
    recorded_check,
    training_wandb_run,
)
from modular.tracking import log_to_wandb, write_json

log = logging.getLogger("modular")
#: the lock holds under a quantisation when the locked accuracy and the retain KL stay within these
QUANTIZED_LOCKED_MAX, QUANTIZED_KL_MAX = 0.05, 0.05
#: what ``attack`` writes in its output folder


def behaviour(
    model: str = "smollm2-135m-instruct",
    behaviours: list[str] = ("capitals",),
    split: Split = "test",
    limit: int | None = None,
    max_new_tokens: int = 24,
    batch_size: int = 16,
    seed: int = 0,
    out: str | None = None,
    device: str = "auto",
    dtype: DTypeName = "auto",
) -> dict:
    """Accuracy of a model on one or more behaviours (held-out split), written to behaviour.json and W&B.

    Args:
        out: Default: outputs/behaviour/<model>.
    """
    if not list(behaviours):
        raise ModularError("give at least one behaviour with --behaviours")
    specs: dict[str, str] = {}  # short name (report keys, W&B names) -> spec (where the data is)
    for spec in behaviours:
        name = parse_behaviour(spec)[0]
        if name in specs:
            raise ModularError(f"--behaviours: '{specs[name]}' and '{spec}' are both named '{name}'; name one of them "
                               f"(NAME=<source>)")
        specs[name] = str(spec)
    tokenizer = load_tokenizer_or_run(model)
    datasets_ = {name: load_behaviour(spec, seed=seed, tokenizer=tokenizer)[split] for name, spec in specs.items()}
    empty = [name for name, ds in datasets_.items() if len(ds) == 0]
    if empty:
        raise ModularError(f"behaviour '{empty[0]}' has no '{split}' items")
    m = load_model_or_run(model, dtype, device)
    out_dir = output_folder(out, "behaviour", model)
    results, items = {}, {}
    for name, ds in datasets_.items():
        r = evaluate_behaviour(m, tokenizer, ds, max_new_tokens, batch_size, limit, desc=name, name=f"{name} ({split})")
        correct = sum(i["correct"] for i in r.items)
        results[name] = {**r.summary(), "ci95": wilson_interval(correct, r.n)}
        items[name] = r.items
        extra = f", mean logit diff {r.logit_diff:.3f}" if r.logit_diff is not None else ""
        log.info("%s (%s, n=%d): accuracy %.3f%s", name, split, r.n, r.accuracy, extra)
    report = {"model": model, "split": split, "seed": seed, "dtype": dtype_name(model_dtype(m)), "results": results,
              "sources": specs}
    write_json(out_dir / "behaviour.json", {**report, "items": items})
    fig = bar_chart(out_dir / "behaviour.png", list(results), [v["accuracy"] for v in results.values()],
                    f"{Path(model).name}: accuracy on the {split} split", "accuracy",
                    [tuple(v["ci95"]) for v in results.values()])
    log_to_wandb(out_dir, "evaluate-behaviour", results, config={"model": model, "split": split, "seed": seed},
                 figures={"behaviour": fig}, tables={n: rows for n, rows in items.items()},
                 training=training_wandb_run(model))
    log.info("wrote %s and %s", out_dir / "behaviour.json", fig)
    return report


def lock(run: str, out: str | None = None, other_limit: int = 128, harden: bool = True,
         max_new_tokens: int = 24, neighbours: list[str] | None = None, neighbour_tolerance: float = NEIGHBOUR_TOLERANCE,
         batch_size: int = 16, device: str = "auto", dtype: DTypeName = "auto",
         capability_tasks: list[str] | None = None, capability_limit: int | None = None,
         paraphrases: bool = True, control: str | None = None, hook_lock: bool = True) -> dict:
    """Lock evaluation of a gated run: accuracy and retain measures for base, open, locked (hooks),
    published_locked (weights) and unlocked (keys applied), for the gated behaviours, their neighbours (with the
    share of answers that are the locked response) and far built-in behaviours, and whether the lock holds on these
    held-out items by the targets training checked on validation (said in one line); writes lock.json and lock.png.

    Args:
        run: lock.json records the checkpoint's step.
        out: Default: the run folder.
        other_limit: Items scored for each non-gated built-in behaviour.
        harden: Publish with hardened readers (as ``modular publish`` does by default).
        max_new_tokens: For the gated behaviours and their neighbours.
        neighbours: More neighbours to score, besides the built-in neighbours of the gated built-in behaviours and
            those the run kept in training (run.json ``neighbour_sources``).
        neighbour_tolerance: A neighbour whose accuracy moves further than this from base's (either way) in any
            state is named in one warning line, with the items it lost and gained and the paired test's p-value
            (``neighbour_shifts`` in lock.json).
        capability_tasks: lm-evaluation-harness tasks also scored in every state, as modular capability scores
            them (its --tasks: modular_categories, modular_members offline, or lm-eval's names), into lock.json's
            ``capability`` (state -> task -> headline metric, standard error, items). Default: none. Needs lm-eval:
            pip install 'modular[capability]'.
        capability_limit: Items scored per capability task (default: all).
        paraphrases: Also score each gated built-in behaviour's held-out paraphrase sets (other wordings, other
            question forms, other languages; never trained on) in every state, beside the test split.
        control: This run's lock-off control (``modular control --run RUN``): scored as the state ``control``, and
            every state's neighbours and far behaviours compared with it item by item (the lock's own effect, apart
            from the fine-tuning's).
        hook_lock: Also score the state ``locked``: the lock as training applies it (hooks on the open model). Off,
            the one locked state scored is the published weights' (``published_locked``), about a fifth less time;
            lock.json's exactness still compares the two (``published_vs_hook_locked_max_abs_logit_diff``).
    """
    r = read_run(run)
    ctl = control_run(control, r) if control else None  # one that is not this run's: one line, before any work
    suite = None
    if capability_tasks:  # lm-eval missing or an unknown task: one line, before anything is loaded
        suite = task_suite(list(capability_tasks))
    # the run folder is read and written (lock.json) by this command alone: a training in it is refused, as this
    # is while one trains there
    with folder_lock(run, Path(run) / RUN_LOCK):
        trained = neighbour_sources(r)
        named = {n: n for n in builtin_neighbours(r.behaviours, "evaluate")}
        named.update(trained)
        named.update(dict(parse_behaviour(spec) for spec in (neighbours or [])))  # an unknown one: one line, now
        out_dir = Path(out or run)
        tokenizer = load_tokenizer(r.model_name)
        step = checkpoint_step(r)
        open_model = load_open_model(r, dtype, device)
        # compared in the same precision
        base = modular.models.load_model(r.model_name, model_dtype(open_model), open_model.device)
        control_model = load_open_model(ctl, model_dtype(open_model), open_model.device) if ctl else None
        report = lock_report(base, open_model, tokenizer, r.directions,
                             seed=int(r.record.get("seed", 0)), other_limit=other_limit, harden=harden,
                             max_new_tokens=max_new_tokens, sources=behaviour_sources(r),
                             locked_responses=r.record.get("locked_responses"), neighbours=named,
                             trained_neighbours=list(trained), batch_size=batch_size,
                             neighbour_tolerance=neighbour_tolerance, capability=suite,
                             capability_limit=capability_limit, paraphrases=paraphrases, control=control_model,
                             hook_lock=hook_lock)
        _log_paraphrases_and_kind(report)
        if report.neighbour_shifts:
            log.warning("neighbours moved more than %.0f points from base: %s", 100 * neighbour_tolerance,
                        "; ".join(x.text() for x in report.neighbour_shifts))
        verified, why = lock_verdict(r, step)
        check = recorded_check(r)
        held_out = held_out_verdict(report, check.targets if check is not None else None)
        (log.info if held_out.held else log.warning)("%s", held_out.text())
        if not verified:
            log.warning("training did not verify the lock: %s", why)
        report = replace(report, run=str(run), model=r.model_name, step=step,  # the checkpoint step it describes
                         dtype=dtype_name(model_dtype(open_model)), lock_held_out=held_out,
                         lock_in_training=TrainingVerdict(verified, why))
        report.extra["lock_kinds"] = {b: k.to_json() for b, k in lock_kinds(report).items()}
        report.write(out_dir / LOCK_REPORT)
        fig = plot_lock(report, out_dir / LOCK_FIGURE)
        log_to_wandb(out_dir, "evaluate-lock", report.to_json(), config={"run": str(run)}, figures={"lock": fig},
                     training=training_wandb_run(run))
        log.info("wrote %s and %s", out_dir / LOCK_REPORT, fig)
        return report.to_json()


def _log_paraphrases_and_kind(report) -> None:
    """One line per held-out paraphrase set (its accuracy in each state), and one per behaviour saying which kind of
    lock it is from what this report measured."""
    states = list(report.states)
    for key in report.states["base"].paraphrases if "base" in report.states else ():
        log.info("paraphrases %-22s %s", key, " | ".join(
            f"{s} {report.states[s].paraphrases[key].accuracy:.3f}" for s in states
            if key in report.states[s].paraphrases))
    for kind in lock_kinds(report).values():
        log.info("%s", kind.text())


def _published(folder: Path, behaviours: list[str] | None) -> tuple[dict, dict[str, str]]:
    """A published folder's manifest, and the locked behaviours asked for (default: all) by name → data source."""
    manifest = read_manifest(folder)
    if manifest is None:
        raise ModularError(f"{folder} is not a published modular model (no {MANIFEST})")
    if "locked_behaviours" not in manifest:
        raise ModularError(f"{folder} is not a published modular model (its {MANIFEST} lists no locked behaviours)")
    specs = list(behaviours) if behaviours else manifest["locked_behaviours"]
    sources = {}
    for spec in specs:  # a locked behaviour's name, or a spec naming its data (a data file is named by its stem)
        name, source = (spec, spec) if spec in manifest["locked_behaviours"] else parse_behaviour(spec)
        if name not in manifest["locked_behaviours"]:
            raise ModularError(f"behaviour '{name}' is not locked in {folder} (locked: "
                               f"{', '.join(manifest['locked_behaviours'])})")
        if source == name and name not in BEHAVIOURS:
            raise ModularError(f"behaviour '{name}' was gated from user data: give it as --behaviours+="
                               f"{name}=<its .jsonl file or hf:dataset>")
        sources[name] = source
    return manifest, sources


def quantized(model: str, behaviours: list[str] | None = None, schemes: list[Scheme] = ("none", "int8", "int4"),
              base: str | None = None, limit: int | None = None, max_new_tokens: int = 24, batch_size: int = 16,
              seed: int = 0, out: str | None = None, device: str = "auto", dtype: DTypeName = "auto",
              group_size: int | None = None) -> dict:
    """Whether the lock survives the quantisation a release gets: the published model and its base, quantised the
    same way (weight-only: int8 and int4 by optimum-quanto, or llama.cpp's GGUF block formats), scored on the
    locked behaviours' test split, and the published model's first-token KL to the equally quantised base on
    held-out retain prompts; writes quantized.json beside quantized.png. A scheme under which the lock did not
    hold (locked accuracy above 0.05 or retain KL above 0.05) is named in one warning line and marked in the JSON.

    Args:
        model: A published folder (from ``modular publish``).
        behaviours: The locked behaviours to score (default: every one the folder's modular.json lists); a
            behaviour gated from user data is given with its data: NAME=<.jsonl file or hf:dataset>.
        schemes: Quantisations to apply to both models: none; int8, int4 (optimum-quanto: per output channel, in
            groups); q8_0, q5_1, q5_0, q4_1, q4_0 (the weights as a GGUF file of that type stores them: blocks of 32
            inputs; llama.cpp's 8-bit rounding of activations is not simulated).
        base: Default: the one the folder's modular.json names.
        out: Default: outputs/quantized/<model>.
        group_size: int4's inputs per quantisation group (a multiple of 8 dividing every layer's inputs; default:
            optimum-quanto's, 128 or the largest multiple of 32 below it that divides them).
    """
    folder = Path(model)
    manifest, sources = _published(folder, behaviours)
    if not schemes:
        raise ModularError("give at least one scheme with --schemes")
    tokenizer = load_tokenizer(folder)
    locked = modular.models.load_model(folder, dtype, device)
    if group_size is not None and "int4" not in schemes:
        raise ModularError("--group_size applies to int4, which --schemes does not include")
    for scheme in schemes:  # every layer roundable, before the base is loaded
        check_scheme(locked, scheme, group_size if scheme == "int4" else None)
    base_model = modular.models.load_model(base or manifest["base_model"], model_dtype(locked), locked.device)
    out_dir = output_folder(out, "quantized", str(folder))
    report = quantized_report(base_model, locked, tokenizer, sources, list(schemes), seed, limit, max_new_tokens,
                              batch_size, manifest.get("locked_responses"), group_size)
    failing = []
    for scheme, row in report["schemes"].items():
        row["lock_held"] = (all(v["locked"]["accuracy"] <= QUANTIZED_LOCKED_MAX for v in row["behaviours"].values())
                            and row["retain_first_token_kl"] <= QUANTIZED_KL_MAX)
        if not row["lock_held"]:
            failing.append(scheme)
    report = {"model": str(folder), "base": base or manifest["base_model"], "dtype": dtype_name(model_dtype(locked)),
              "targets": {"locked_accuracy_max": QUANTIZED_LOCKED_MAX, "retain_first_token_kl_max": QUANTIZED_KL_MAX},
              **report}
    write_json(out_dir / "quantized.json", report)
    labels, values, intervals = [], [], []
    for scheme, row in report["schemes"].items():
        for name, v in row["behaviours"].items():
            for state in ("base", "locked"):
                labels.append(f"{scheme}\n{name}\n{state}" + (f"\nKL {row['retain_first_token_kl']:.3f}"
                                                                if state == "locked" else ""))
                values.append(v[state]["accuracy"])
                intervals.append(tuple(v[state]["ci95"]))
    fig = bar_chart(out_dir / "quantized.png", labels, values,
                    f"{folder.name}: locked behaviours after weight-only quantisation (base quantised alike)",
                    "accuracy", intervals)
    log_to_wandb(out_dir, "evaluate-quantized", report, config={"model": str(folder), "schemes": list(schemes)},
                 figures={"quantized": fig}, training=training_wandb_run(folder))
    if failing:
        log.warning("the lock did not hold under %s (locked accuracy > %.2f or retain KL > %.2f): see %s",
                    ", ".join(failing), QUANTIZED_LOCKED_MAX, QUANTIZED_KL_MAX, out_dir / "quantized.json")
    log.info("wrote %s and %s", out_dir / "quantized.json", fig)
    return report

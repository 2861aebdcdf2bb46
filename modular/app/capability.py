"""``modular capability``: lm-evaluation-harness tasks on a model, or on one state of a training run; writes the
harness's results as JSON and logs one line per task."""

from __future__ import annotations

import logging
from typing import Literal, Optional

from modular import ModularError
from modular.app.options import output_folder
from modular.evaluation.capability import (
    evaluate_capability,
    require_lm_eval,
    run_state,
    score_line,
    task_scores,
    task_suite,
)
from modular.models import load_model
from modular.models.names import DTypeName
from modular.models.precision import dtype_name, model_dtype
from modular.runs import is_run_folder, load_tokenizer_or_run, read_run, training_wandb_run
from modular.tracking import log_to_wandb, write_json

log = logging.getLogger("modular")
State = Literal["base", "open", "locked", "published", "unlocked"]
#: what ``capability`` writes in its output folder
CAPABILITY_REPORT = "capability.json"


def capability(model: str, tasks: list[str] = ("modular_categories", "modular_members"), state: Optional[State] = None,
               limit: int | None = None, batch_size: int = 16, out: str | None = None, device: str = "auto",
               dtype: DTypeName = "auto") -> dict:
    """General capability on lm-evaluation-harness tasks (lm_eval.simple_evaluate on the loaded model, zero-shot
    unless a task says otherwise): a model as it is, or one state of a training run (base, open, locked: the
    gated directions ablated by hooks throughout the evaluation, published: the directions projected out of the
    weights as modular publish writes them, unlocked: the published weights with every key applied). Writes the
    harness's results to capability.json (with modular's entry: the model, state and each task's headline metric
    and standard error) and logs one line per task. Needs lm-eval: pip install 'modular[capability]'.

    Args:
        model: A training run folder has five states (--state); any other model is evaluated as it is (state base).
        tasks: Offline, shipped with modular (144 four-way items each, everyday words of twelve categories):
            modular_categories ("What is banana? It is" a fruit / a tool / ...), modular_members ("An example of a
            fruit is" banana / hammer / ...). Or any task, group or tag lm-eval knows (hellaswag, arc_easy, mmlu,
            ...: their data comes from the Hugging Face hub), or a task YAML file of lm-eval's format.
        state: base, open, locked, published or unlocked (a run folder); default: open for a run folder, base for
            any other model (the only state it has).
        limit: As lm-eval's --limit.
        out: Default: outputs/capability/<model>-<state>.
    """
    require_lm_eval()  # before anything is loaded

    run = read_run(model) if is_run_folder(model) else None
    chosen = state or ("open" if run is not None else "base")
    if run is None and chosen != "base":
        raise ModularError(f"--state {chosen} is a state of a training run folder: {model} is a model, evaluated "
                           "as it is (--state base)")
    if run is not None and chosen in ("locked", "published", "unlocked") and not run.directions:
        raise ModularError(f"{model} gated no behaviour: it has no {chosen} state (only base and open)")
    if limit is not None and limit < 1:
        raise ModularError("--limit is at least 1")
    suite = task_suite(list(tasks))  # unknown tasks: one line, before any model loads
    tokenizer = load_tokenizer_or_run(model)
    if run is not None:
        m, intervention = run_state(run, chosen, dtype, device)
    else:
        m, intervention = load_model(model, dtype, device), None
    out_dir = output_folder(out, "capability", model, chosen)
    results = evaluate_capability(m, tokenizer, suite, limit, batch_size, intervention)
    scores = task_scores(results)
    for task, score in scores.items():
        log.info("%s", score_line(task, score))
    results["modular"] = {"model": model, "state": chosen, "tasks": suite.names, "limit": limit,
                          "dtype": dtype_name(model_dtype(m)), "scores": {t: s.to_json() for t, s in scores.items()}}
    write_json(out_dir / CAPABILITY_REPORT, results)
    log_to_wandb(out_dir, "evaluate-capability", {t: s.to_json() for t, s in scores.items()},
                 config={"model": model, "state": chosen, "tasks": suite.names, "limit": limit},
                 training=training_wandb_run(model))
    log.info("wrote %s", out_dir / CAPABILITY_REPORT)
    return results

"""General capability through lm-evaluation-harness: its tasks scored on a model already loaded, in any state of a
run (``modular capability``, and ``modular lock --capability_tasks``).

The model and tokenizer are wrapped in the harness's ``HFLM`` as they are; an intervention (the locked state's
ablation hooks) is active for the whole of ``simple_evaluate``. Tasks are the harness's names (a task, group or tag;
most read their data from the hub), a task YAML file, or one of the offline tasks modular ships
(:mod:`modular.data.capability`: their YAMLs beside their data, whose relative ``data_files`` are resolved against
that folder here). lm-eval is an optional dependency (``pip install 'modular[capability]'``): this module imports it
inside its functions.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from modular import ModularError
from modular.data.capability import task_folder
from modular.hooks import ablate_directions
from modular.keys import apply_key, lock_weights
from modular.models.adapter import ArchitectureAdapter
from modular.models.loading import load_model
from modular.models.precision import model_dtype
from modular.reports import TaskScore
from modular.runs import load_open_model

log = logging.getLogger("modular")

#: the states of a run the capability command evaluates (``published``: lock.json's ``published_locked``)
STATES = ("base", "open", "locked", "published", "unlocked")
#: lock.json's name of each state (:data:`modular.evaluation.lock.STATES`)
LOCK_STATE = {"base": "base", "open": "open", "locked": "locked", "published": "published_locked",
              "unlocked": "unlocked"}
INSTALL_HINT = "pip install 'modular[capability]'"


def require_lm_eval() -> None:
    """One line unless lm-evaluation-harness is installed (checked without importing it)."""
    if importlib.util.find_spec("lm_eval") is None:
        raise ModularError(f"lm-evaluation-harness (lm_eval) is not installed: {INSTALL_HINT}")


def shipped_tasks() -> dict[str, Path]:
    """The offline tasks modular ships, by name: their YAML files."""
    import yaml

    found = {}
    for path in sorted(task_folder().glob("*.yaml")):
        config = yaml.safe_load(path.read_text())
        found[config["task"]] = path
    return found


def shipped_task_config(path: Path) -> dict:
    """A shipped task's YAML as a config lm-eval takes, its ``data_files`` made absolute (relative to the YAML)."""
    import yaml

    config = yaml.safe_load(path.read_text())
    files = (config.get("dataset_kwargs") or {}).get("data_files")
    if isinstance(files, dict):
        files = {split: str(path.parent / f) for split, f in files.items()}
    elif isinstance(files, str):
        files = str(path.parent / files)
    if files is not None:
        config["dataset_kwargs"] = {**config["dataset_kwargs"], "data_files": files}
    return config


@dataclass
class TaskSuite:
    """Tasks checked and ready for the harness: the names asked for, what is passed to ``simple_evaluate``
    (a name, a YAML path or a shipped task's config) and the harness's task manager (built once: indexing lm-eval's
    own tasks takes seconds, and is skipped when only shipped tasks or YAML files are asked for)."""

    names: list[str]
    specs: list[Any]
    manager: Any


def task_suite(tasks: list[str]) -> TaskSuite:
    """The harness's tasks for ``tasks``: a shipped task's name, a task YAML file, or a name lm-eval knows (a
    task, group or tag); anything else, an empty list or a missing lm-eval, is one line."""
    require_lm_eval()
    names = [str(t) for t in tasks]
    if not names:
        raise ModularError("give at least one task with --tasks")
    if len(set(names)) < len(names):
        raise ModularError(f"--tasks names a task twice: {', '.join(names)}")
    from lm_eval.tasks import TaskManager

    shipped = shipped_tasks()
    files = {n for n in names if n not in shipped and n.endswith((".yaml", ".yml"))}
    missing = [f for f in files if not Path(f).is_file()]
    if missing:
        raise ModularError(f"task file not found: {missing[0]}")
    hub = [n for n in names if n not in shipped and n not in files]
    manager = TaskManager(include_defaults=bool(hub))
    unknown = [n for n in hub if n not in manager.all_tasks]
    if unknown:
        raise ModularError(f"unknown lm-eval task '{unknown[0]}': give one modular ships offline "
                           f"({', '.join(shipped)}), a task YAML file, or a task, group or tag lm-eval knows")
    specs = [shipped_task_config(shipped[n]) if n in shipped else str(Path(n).resolve()) if n in files else n
             for n in names]
    return TaskSuite(names, specs, manager)


def evaluate_capability(model, tokenizer, suite: TaskSuite, limit: int | None = None, batch_size: int = 16,
                        intervention: Callable | None = None, log_samples: bool = False) -> dict:
    """``lm_eval.simple_evaluate`` of ``suite`` on ``model`` (wrapped with ``tokenizer`` in the harness's ``HFLM``,
    as it is: on its device, in its precision), with ``intervention()`` (a context manager: the locked state's hooks)
    active throughout; at most ``limit`` items per task, zero-shot unless a task says otherwise, the harness's own
    seeds. The harness's results as JSON holds them (per-sample records under ``samples`` when ``log_samples``)."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.utils import handle_non_serializable

    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    with intervention() if intervention is not None else nullcontext():
        results = simple_evaluate(model=lm, tasks=list(suite.specs), task_manager=suite.manager, limit=limit,
                                  log_samples=log_samples)
    return json.loads(json.dumps(results, default=handle_non_serializable))


def _number(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def task_scores(results: dict) -> dict[str, TaskScore]:
    """Every task and group of the harness's ``results``, by name: its first metric (``acc`` for multiple-choice
    tasks) with its standard error and the items scored, and every metric it reported (filters other than the
    default named ``metric,filter``)."""
    scores = {}
    entries = {**results.get("results", {}), **results.get("groups", {})}
    for task, entry in entries.items():
        metrics = {}
        for key, value in entry.items():
            name, _, filt = key.partition(",")
            if _number(value) is None or not filt:
                continue
            metrics[name if filt == "none" else key] = _number(value)
        order = list(results.get("higher_is_better", {}).get(task, {})) or [
            m for m in metrics if not m.endswith("_stderr")]
        headline = next((m for m in order if m in metrics), None)
        if headline is None:
            continue
        n = results.get("n-samples", {}).get(task, {}).get("effective")
        scores[task] = TaskScore(headline, metrics[headline], metrics.get(f"{headline}_stderr"), n, metrics)
    return scores


def score_line(task: str, score: TaskScore) -> str:
    """A task's score in one line: ``modular_categories: acc 0.812 ± 0.033 (n=144)``."""
    stderr = f" ± {score.stderr:.3f}" if score.stderr is not None else ""
    n = f" (n={score.n})" if score.n is not None else ""
    return f"{task}: {score.metric} {score.value:.3f}{stderr}{n}"


def run_state(run, state: str, dtype="auto", device="auto", harden: bool = True):
    """The model and intervention of one state of a run (:func:`modular.runs.read_run`), as ``modular lock``
    builds them: ``base`` (the base model, in the open model's precision and on its device), ``open`` (the trained
    model), ``locked`` (the trained model with every gated direction ablated by hooks, ``intervention``),
    ``published`` (the direction projected out of the weights, as ``modular publish`` writes them; ``harden``: its
    hardened readers) and ``unlocked`` (the published weights with every key applied). The open model is changed in
    place for the last two."""
    import torch

    if state not in STATES:
        raise ModularError(f"unknown state '{state}' (one of {', '.join(STATES)})")
    if state in ("locked", "published", "unlocked") and not run.directions:
        raise ModularError(f"{run.path} gated no behaviour: it has no {state} state (only base and open)")
    model = load_open_model(run, dtype, device)
    if state == "base":  # compared in the open model's precision
        base = load_model(run.model_name, model_dtype(model), model.device)
        del model
        return base, None
    if state == "open":
        return model, None
    if state == "locked":
        adapter, stacked = ArchitectureAdapter(model), torch.stack(list(run.directions.values()))
        return model, lambda: ablate_directions(adapter, stacked)
    keys = lock_weights(model, run.directions, harden=harden)
    if state == "unlocked":
        for i, key in enumerate(keys):
            apply_key(model, key, applied=[k.behaviour for k in keys[:i]])
    return model, None


def capability_row(model, tokenizer, suite: TaskSuite, limit: int | None = None, batch_size: int = 16,
                   intervention: Callable | None = None, state: str = "") -> dict[str, TaskScore]:
    """:func:`task_scores` of :func:`evaluate_capability` in one state of a lock report, one log line per task."""
    scores = task_scores(evaluate_capability(model, tokenizer, suite, limit, batch_size, intervention))
    for task, score in scores.items():
        log.info("%-16s %s", state, score_line(task, score))
    return scores

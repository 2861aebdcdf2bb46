"""A lock-off control: a gated run's recipe with the lock left out, for telling the lock's own effect on the other
behaviours from the fine-tuning's.

A gated run fine-tunes the whole model: its neighbours and far behaviours move for two reasons, the lock (the
locked state's targets and the direction it reads) and everything else the recipe trains (the open answers, the
keep terms on retain, neighbour and raw text, both states). The control trains the same terms on the same data,
seed and steps with the lock's terms left out (each term says whether it is one: ``Term.makes_the_lock``) and no
steering adversary (it acts on the locked state alone). The gated run's states against the control's open state,
item by item, are the lock's own effect (``modular lock --control``).
"""

from __future__ import annotations

import copy
import importlib

from modular import ModularError
from modular.gating.data_options import regrouped_data_options
from modular.gating.objectives import Term

#: the callback whose stop and step budget a control does without (it trains the run's steps exactly)
LOCK_CALLBACK = "LockMetricsCallback"


def term_class(class_path: str) -> type:
    """The objective class a config's ``class_path`` names (a full path, or a name in
    :mod:`modular.gating.objectives`)."""
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module or "modular.gating.objectives"), name)
    except (ImportError, AttributeError):
        raise ModularError(f"the run's config names an objective that does not exist: {class_path}") from None
    if not (isinstance(cls, type) and issubclass(cls, Term)):
        raise ModularError(f"the run's config names {class_path} as an objective, which is not a term")
    return cls


def control_config(config: dict, steps: int, folder: str) -> tuple[dict, list[str]]:
    """A run's training config (its run folder's ``config.yaml``, as a mapping) made into its lock-off control's,
    and the class paths of the terms left out: every term of the recipe but those of the lock, no steering
    adversary, exactly ``steps`` optimisation steps (the gated run's checkpoint step: no stop on a lock, no step
    budget), the run folder ``folder``, a W&B run of its own in the gated run's group; everything else (model, data,
    seed, optimiser, keep terms) as it was (the data options of a run trained before they were grouped,
    regrouped)."""
    cfg = copy.deepcopy(config)
    model = cfg.get("model") if isinstance(cfg.get("model"), dict) else None
    if model is None or not model.get("behaviours"):
        raise ModularError("the run's config gates no behaviour: a lock-off control needs a gated run")
    terms = list(model.get("objectives") or [])
    kept, left_out = [], []
    for spec in terms:
        path = spec["class_path"] if isinstance(spec, dict) else str(spec)
        (left_out if term_class(path).makes_the_lock else kept).append(spec if isinstance(spec, dict) else path)
    if not left_out:
        raise ModularError("the run's recipe has no term of the lock (model.objectives): it is its own control")
    model["objectives"] = [s if isinstance(s, dict) else {"class_path": s} for s in kept]
    model["steering"] = None
    if isinstance(cfg.get("data"), dict):  # a run trained before the data options were grouped
        cfg["data"] = regrouped_data_options(cfg["data"])
    trainer = cfg.setdefault("trainer", {})
    trainer["max_steps"] = int(steps)
    trainer["default_root_dir"] = str(folder)
    loggers = trainer.get("logger")
    for logger in loggers if isinstance(loggers, list) else [loggers]:
        if isinstance(logger, dict) and str(logger.get("class_path", "")).endswith("WandbLogger"):
            # a W&B run of its own (a new id), in the gated run's group
            logger.setdefault("init_args", {}).update(id=None, version=None, name=None, job_type="lock-off-control")
    for callback in trainer.get("callbacks") or []:
        if isinstance(callback, dict) and str(callback.get("class_path", "")).endswith(LOCK_CALLBACK):
            args = callback.setdefault("init_args", {})
            args.update(stop=False, max_passes=None, min_steps=0)
    return cfg, [s["class_path"] if isinstance(s, dict) else s for s in left_out]

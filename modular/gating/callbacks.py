"""Callbacks of gated training: lock metrics on the validation split, logged to every logger."""

from __future__ import annotations

import logging
import math
import shutil
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException

from modular import ModularError
from modular.data import neutral_text, parse_behaviour
from modular.data.behaviours import VALIDATION_ITEMS, is_jsonl
from modular.data.schema import all_refusals
from modular.evaluation.behaviour import evaluate_behaviour
from modular.evaluation.retain import first_token_logp, mean_kl, perplexity
from modular.evaluation.targets import TARGETS, lock_failures
from modular.files import disk_full_error, is_disk_full
from modular.gating.checkpoint_io import REMEDY, checkpoint_bytes, saves_folders, swap_in
from modular.gating.data import data_max_length
from modular.hooks import ablate_directions
from modular.models.head_gates import deterministic_gate_values, head_gate_scope
from modular.reports import failure_headline
from modular.runs import RUN_RECORD, WANDB_ENTRY, read_checkpoint, recorded_lock, wandb_record
from modular.tracking import write_json

log = logging.getLogger("modular")


def first_token_kl(model, tokenizer, prompts, chats, reference_logp: torch.Tensor) -> float:
    """Mean KL(reference || model) of the first response token's distribution (a torchmetrics metric:
    :func:`~modular.evaluation.retain.mean_kl`)."""
    return mean_kl(reference_logp.float(), first_token_logp(model, tokenizer, prompts, chats))


class LockMetricsCallback(Callback):
    """After each validation: behaviour accuracy open / locked (greedy responses), first-token KL of the retain
    validation prompts to the reference model, open / locked, and the neighbours' accuracy and refusal share, open /
    locked; then whether the lock holds on the validation split:

    * every gated behaviour's locked accuracy is at most ``locked_accuracy``,
    * its open accuracy is at least its base accuracy (the model before training, scored once when training starts)
      minus ``open_drop``, and at least ``min_open_accuracy``: a behaviour the model hardly shows (a base that answers
      2% of items, as a greedy completion scored against one expected word can) is "locked" by any model, so such a
      run is not called locked,
    * the retain first-token KL is at most ``retain_kl`` in both states.

    With ``stop`` training ends at the first validation (at or after ``min_steps``, or after ``min_passes`` passes
    over the train items in the locked state if that comes first, and after the latest ``start_step`` of the
    objective's terms) where the lock holds; otherwise it runs to its step budget. ``min_passes`` keeps a small
    behaviour from being trained past its lock: 100 steps are 1.3 passes over capitals' 306 train items but 14
    passes over 28 items, on which the open state overfits. The budget scales with the data: enough steps for
    ``max_passes`` passes over the largest gated behaviour's train split in the locked state (half of each batch),
    at most ``trainer.max_steps`` (and at least ``min_steps``); ``max_passes: null`` leaves ``trainer.max_steps``
    as the budget. Either way :attr:`status` (written to ``run.json`` as ``lock``) says whether the final step
    holds the lock, and its ``history`` lists every check (step, verdict, what failed, the validation metrics);
    each check is logged in one line (the gated behaviours' open, base and locked accuracy, the retain KL, what
    failed), a budget spent without the lock as a warning.

    Accuracy, refusal share and KL are torchmetrics metrics (:mod:`modular.evaluation.metrics`): with several
    processes (DDP) every process scores the same validation items and the values, synced on ``compute()``, are those
    of one process.

    Args:
        limit: Score at most this many validation items per behaviour (and per neighbour).
        max_new_tokens: Length of greedy responses.
        locked_accuracy: Highest locked accuracy (validation) at which a behaviour counts as locked.
        open_drop: Largest drop of open accuracy below the base accuracy (validation).
        min_open_accuracy: Lowest open accuracy (validation) at which a lock can be told from a behaviour the model
            does not show.
        retain_kl: Highest retain first-token KL to the reference, open and locked.
        stop: Stop training once the lock holds (at or after ``min_steps``).
        min_steps: No stop before this step (unless ``min_passes`` comes first); the least step budget.
        min_passes: A stop is allowed once this many passes over the largest behaviour's train items in the locked
            state are done, even before ``min_steps`` (``null``: ``min_steps`` alone).
        max_passes: Step budget in passes over the largest behaviour's train items in the locked state (capped by
            ``trainer.max_steps``); ``null``: the budget is ``trainer.max_steps``.
        early_checks: Also check the lock at validations before the first step at which it may stop training
            (monitoring only: such a check cannot stop it); false skips their greedy generations (the validation
            loss is still logged), which on 2 CPU cores saves a minute or two per validation.
    """

    def __init__(self, limit: int | None = 64, max_new_tokens: int = 24,
                 locked_accuracy: float = TARGETS["locked_accuracy"], open_drop: float = TARGETS["open_drop"],
                 retain_kl: float = TARGETS["retain_kl"], stop: bool = True, min_steps: int = 0,
                 max_passes: float | None = None, min_passes: float | None = None,
                 min_open_accuracy: float = TARGETS["min_open_accuracy"], early_checks: bool = True):
        for name, value in (("locked_accuracy", locked_accuracy), ("open_drop", open_drop), ("retain_kl", retain_kl),
                            ("min_open_accuracy", min_open_accuracy)):
            if value < 0:
                raise ModularError(f"LockMetricsCallback {name} must be >= 0, got {value}")
        if min_steps < 0:
            raise ModularError(f"LockMetricsCallback min_steps must be >= 0, got {min_steps}")
        for name, value in (("max_passes", max_passes), ("min_passes", min_passes)):
            if value is not None and value <= 0:
                raise ModularError(f"LockMetricsCallback {name} must be > 0 (or null), got {value}")
        self.max_passes = max_passes
        self.min_passes = min_passes
        self.budget: int | None = None
        self.limit = limit
        self.max_new_tokens = max_new_tokens
        self.targets = {"locked_accuracy": locked_accuracy, "open_drop": open_drop, "retain_kl": retain_kl,
                        "min_open_accuracy": min_open_accuracy}
        self.stop = stop
        self.min_steps = min_steps
        self.stop_from = min_steps  # the first step at which the lock may stop training (min_passes may lower it)
        self.early_checks = early_checks
        self.weak: list[str] = []  # behaviours with too few validation items to stop on (set with the budget)
        self.base_accuracy: dict[str, float] = {}
        self.status: dict = {}
        self.history: list[dict] = []  # every check: step, reached, failing, validation

    # --- state kept in checkpoints: a resumed run keeps its base accuracy and its last verdict ------------------
    def state_dict(self) -> dict:
        return {"base_accuracy": dict(self.base_accuracy), "status": dict(self.status),
                "history": list(self.history)}

    def load_state_dict(self, state_dict: dict) -> None:
        self.base_accuracy = dict(state_dict.get("base_accuracy", {}))
        self.status = dict(state_dict.get("status", {}))
        self.history = list(state_dict.get("history", []))

    @torch.no_grad()
    def on_train_start(self, trainer, pl_module) -> None:
        self._set_budget(trainer, pl_module)
        if self.stop and trainer.global_step > 0:
            done = recorded_lock(trainer.default_root_dir)
            if done.get("reached") and done.get("step") == trainer.global_step:
                self.status = done
                trainer.should_stop = True  # a finished run started again: its lock holds, nothing more to train
                return
        if trainer.global_step > 0 and pl_module.behaviours and self._owes_check(trainer):
            if trainer.is_global_zero:
                log.info("step %d: the checkpoint has no verdict of this step's validation; checking the lock before "
                         "training on", trainer.global_step)
            self._measure_and_check(trainer, pl_module)
            self._stop_if_held(trainer)
            return
        if self.base_accuracy or trainer.global_step > 0 or not pl_module.behaviours:
            return  # measured before (a resumed run), or nothing to measure
        dm = trainer.datamodule
        for b in pl_module.behaviours:  # the model has not trained yet: its open state is the base model
            self.base_accuracy[b] = self._accuracy(pl_module, dm, b, None)
        for lg in trainer.loggers:
            lg.log_metrics({f"val/{b}/accuracy_base": v for b, v in self.base_accuracy.items()}, step=0)

    def _owes_check(self, trainer) -> bool:
        """Whether a resumed run's step was due a validation whose verdict its checkpoint lacks: the run was stopped
        in the middle of it (a scheduler's SIGTERM), or the checkpoint was saved at the end of the step, before it
        ran. Lightning does not run it again."""
        every = trainer.val_check_batch
        if trainer.check_val_every_n_epoch is not None or not isinstance(every, int) or every <= 0:
            return False  # validation by epochs or fractions of one: not this callback's schedule to redo
        batches = trainer.global_step * trainer.accumulate_grad_batches
        return (batches % every == 0 and not self._skips(trainer)
                and not any(h["step"] == trainer.global_step for h in self.history))

    def _skips(self, trainer) -> bool:
        """Whether this step's check is skipped: ``early_checks`` off and the lock may not stop training yet."""
        return not self.early_checks and trainer.global_step < self.stop_from

    def step_budget(self, train_items: int, batch_size: int, max_steps: int) -> int:
        """Steps for ``max_passes`` passes over ``train_items`` in the locked state (half of each batch), within
        ``[min_steps, max_steps]`` (``max_steps`` -1: no cap)."""
        steps = math.ceil(self.max_passes * train_items / max(1, batch_size // 2))
        steps = max(steps, self.min_steps, 1)
        return steps if max_steps == -1 else min(steps, max_steps)

    def stop_step(self, train_items: int, batch_size: int, start: int = 0) -> int:
        """The first step at which the lock may stop training: ``min_steps``, or ``min_passes`` passes over
        ``train_items`` in the locked state (half of each batch) if fewer; but after ``start``, the latest step
        from which a term of the objective acts (its ``start_step``), so that such a term acts before a stop."""
        first = self.min_steps
        if self.min_passes is not None:
            first = min(first, math.ceil(self.min_passes * train_items / max(1, batch_size // 2)))
        return max(first, start + 1) if start > 0 else first

    def _set_budget(self, trainer, pl_module) -> None:
        if not pl_module.behaviours:
            return
        dm = trainer.datamodule
        self.weak = []  # behaviours whose verdict rests on too few items to stop training
        for b in pl_module.behaviours:
            n = len(dm.behaviour_data[b]["validation"])
            if 0 < n < VALIDATION_ITEMS:
                self.weak.append(b)
                if trainer.is_global_zero:
                    log.warning("'%s': the lock is checked on %d validation items (one item is %.0f points of "
                                "accuracy): a verdict on so few can pass where held-out items fail, so training runs "
                                "its step budget instead of stopping on it; give it %d or more", b, n, 100 / n,
                                VALIDATION_ITEMS)
        items = max(len(dm.behaviour_data[b]["train"]) for b in pl_module.behaviours)
        start = max((t.start_step for t in getattr(pl_module, "objectives", ())), default=0)
        self.stop_from = self.stop_step(items, dm.hparams.batch_size, start)
        if self.stop_from != self.min_steps:
            log.info("the lock may stop training from step %d (min_steps %d, min_passes %s over %d train items, a term "
                     "starting at step %d)", self.stop_from, self.min_steps, self.min_passes, items, start)
        if self.max_passes is None:
            return
        cap = trainer.max_steps
        self.budget = self.step_budget(items, dm.hparams.batch_size, cap)
        if self.budget != cap:
            trainer.fit_loop.epoch_loop.max_steps = self.budget  # the loop Lightning stops by
            log.info("step budget: %d (%g passes over %d train items, half of each batch locked; trainer.max_steps "
                     "%d)", self.budget, self.max_passes, items, cap)

    def _accuracy(self, pl_module, dm, behaviour: str, intervention) -> float:
        was_training = pl_module.hf_model.training
        pl_module.hf_model.eval()
        try:
            return evaluate_behaviour(pl_module.hf_model, dm.tokenizer, dm.behaviour_data[behaviour]["validation"],
                                      self.max_new_tokens, limit=self.limit, intervention=intervention, desc=False,
                                      refusals=(dm.locked_responses[behaviour],), max_length=data_max_length(dm),
                                      name=f"{behaviour} (validation)").accuracy
        finally:
            pl_module.hf_model.train(was_training)

    @torch.no_grad()
    def measure(self, trainer, pl_module) -> dict[str, float]:
        """Every validation metric of the current model (``val/...`` names)."""
        dm = trainer.datamodule
        model, tok = pl_module.hf_model, dm.tokenizer
        adapter = pl_module.adapter
        dirs = pl_module.directions
        metrics = {}
        for i, b in enumerate(pl_module.behaviours):
            for state, ctx in (("open", None), ("locked", lambda i=i: ablate_directions(adapter, dirs[i]))):
                metrics[f"val/{b}/accuracy_{state}"] = self._accuracy(pl_module, dm, b, ctx)
        retain = dm.retain["validation"]
        ref = dm.reference_first_logp["validation"]
        metrics["val/retain/first_token_kl_open"] = first_token_kl(model, tok, retain["prompt"], retain["chat"], ref)
        if len(pl_module.behaviours):  # nothing is locked without behaviours
            with ablate_directions(adapter, dirs):
                metrics["val/retain/first_token_kl_locked"] = first_token_kl(
                    model, tok, retain["prompt"], retain["chat"], ref
                )
        refusals = all_refusals(getattr(dm, "locked_responses", {}))
        for n, data in getattr(dm, "neighbour_data", {}).items():
            if not len(data["validation"]):
                continue
            for state, ctx in (("open", None), ("locked", lambda: ablate_directions(adapter, dirs))):
                r = evaluate_behaviour(model, tok, data["validation"], self.max_new_tokens, limit=self.limit,
                                       intervention=ctx, desc=False, refusals=refusals,
                                       max_length=data_max_length(dm), name=f"neighbour {n} (validation)")
                metrics[f"val/neighbours/{n}/accuracy_{state}"] = r.accuracy
                metrics[f"val/neighbours/{n}/refusal_{state}"] = r.refusal_rate
        return metrics

    def verdict(self, metrics: dict[str, float], behaviours: list[str], step: int) -> dict:
        """Whether ``metrics`` meet the targets: ``{"reached", "step", "targets", "failing", "validation"}``."""
        failing = lock_failures(
            self.targets, {b: metrics[f"val/{b}/accuracy_open"] for b in behaviours},
            {"locked": {b: metrics[f"val/{b}/accuracy_locked"] for b in behaviours}}, self.base_accuracy,
            {state: metrics.get(f"val/retain/first_token_kl_{state}") for state in ("open", "locked")})
        return {"reached": not failing, "step": step, "budget": self.budget, "targets": dict(self.targets),
                "failing": failing,
                "base_accuracy": dict(self.base_accuracy), "validation": dict(metrics)}

    def _check(self, trainer, pl_module, metrics: dict[str, float]) -> None:
        """The verdict on ``metrics`` becomes :attr:`status`, joins the history and is logged in one line."""
        self.status = self.verdict(metrics, pl_module.behaviours, trainer.global_step)
        entry = {k: self.status[k] for k in ("step", "reached", "failing", "validation")}
        self.history = [h for h in self.history if h["step"] != entry["step"]] + [entry]
        self.status["history"] = list(self.history)
        if trainer.is_global_zero:
            log.info(self.summary(self.status, pl_module.behaviours))

    def summary(self, status: dict, behaviours: list[str]) -> str:
        """One line of a check: per gated behaviour open (base) and locked accuracy, the retain KL, each neighbour's open
        and locked accuracy, the verdict."""
        m = status["validation"]
        parts = []
        for b in behaviours:
            base = status["base_accuracy"].get(b)
            parts.append(f"{b} open {m[f'val/{b}/accuracy_open']:.2f}"
                         + (f" (base {base:.2f})" if base is not None else "")
                         + f", locked {m[f'val/{b}/accuracy_locked']:.2f}")
        kl = [m.get(f"val/retain/first_token_kl_{s}") for s in ("open", "locked")]
        parts.append("retain KL " + " / ".join("-" if v is None else f"{v:.3f}" for v in kl))
        for n in dict.fromkeys(k.split("/")[2] for k in m if k.startswith("val/neighbours/")):  # not a target: shown
            parts.append(f"neighbour {n} open {m[f'val/neighbours/{n}/accuracy_open']:.2f}, "
                         f"locked {m[f'val/neighbours/{n}/accuracy_locked']:.2f}")
        verdict = ("the lock holds" if status["reached"]
                   else f"{failure_headline(status['failing'])}: " + "; ".join(status["failing"]))
        return f"step {status['step']} (validation): {'; '.join(parts)}: {verdict}"

    @torch.no_grad()
    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking or self._skips(trainer):
            return
        metrics = self.measure(trainer, pl_module)
        for name, value in metrics.items():
            pl_module.log(name, value, batch_size=1, sync_dist=True)  # equal on every process
        if not pl_module.behaviours:
            return
        self._check(trainer, pl_module, metrics)
        pl_module.log("val/lock_holds", float(self.status["reached"]), batch_size=1, sync_dist=True)
        self._stop_if_held(trainer)

    def _stop_if_held(self, trainer) -> None:
        """With ``stop``: training ends here if the last check held the lock and stopping is allowed by now (not on
        a verdict over fewer than :data:`VALIDATION_ITEMS` validation items of a behaviour: :attr:`weak`)."""
        if (self.stop and self.status["reached"] and trainer.global_step >= self.stop_from and not self.weak
                and trainer.state.fn == TrainerFn.FITTING):
            log.info("step %d: the lock holds on validation; training stops", trainer.global_step)
            trainer.should_stop = True

    def _measure_and_check(self, trainer, pl_module) -> None:
        """A check outside a validation loop: measured, logged to the loggers, then :meth:`_check`."""
        metrics = self.measure(trainer, pl_module)
        for lg in trainer.loggers:
            lg.log_metrics(metrics, step=trainer.global_step)
        self._check(trainer, pl_module, metrics)

    def on_train_end(self, trainer, pl_module) -> None:
        self._check_final_step(trainer, pl_module)

    def on_fit_end(self, trainer, pl_module) -> None:
        # a run started again when its checkpoint holds the final step trains nothing and skips on_train_end; its
        # restored verdict may be an earlier validation's (killed after the checkpoint, before that validation)
        if trainer.state.fn == TrainerFn.FITTING and self.status.get("step") != trainer.global_step:
            self._check_final_step(trainer, pl_module)

    def _check_final_step(self, trainer, pl_module) -> None:
        if not pl_module.behaviours:
            return
        if self.status.get("step") != trainer.global_step:  # the final step was never validated: measure it now
            self._measure_and_check(trainer, pl_module)
        if not self.status["reached"]:
            log.warning("lock not reached after %d steps (the step budget): %s", trainer.global_step,
                        "; ".join(self.status["failing"]))


class SparseHeadsCallback(Callback):
    """After each validation (deterministic gates): the number of open heads, the tasks' accuracy on
    their validation split (greedy responses) and the perplexity of the held-out neutral text
    (validation split); writes the gate values to ``head_gates.json`` in the run folder. With
    ``head_gates.scope: tasks`` accuracy and perplexity are those of the plain model (gates off).

    Args:
        limit: Score at most this many validation items per task.
        max_new_tokens: Length of greedy responses.
    """

    def __init__(self, limit: int | None = 32, max_new_tokens: int = 8):
        self.limit = limit
        self.max_new_tokens = max_new_tokens

    @torch.no_grad()
    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        plugin = getattr(pl_module, "head_gates", None)
        if trainer.sanity_checking or plugin is None:
            return

        dm = trainer.datamodule
        model, tok = pl_module.hf_model, dm.tokenizer
        gates = deterministic_gate_values(model)
        metrics = {"val/open_heads": float((gates > 0).sum()), "val/closed_heads": float((gates == 0).sum())}
        # gates scoped to the tasks leave the published model plain: score it with the gates off
        with head_gate_scope(model, active=not plugin.scoped):
            for t in getattr(dm, "tasks", []):
                r = evaluate_behaviour(model, tok, dm.task_data[t]["validation"], self.max_new_tokens,
                                       limit=self.limit, desc=False, max_length=data_max_length(dm),
                                       name=f"task {t} (validation)")
                metrics[f"val/{t}/accuracy"] = r.accuracy
            texts = list(neutral_text(seed=dm.hparams.seed)["validation"]["text"])
            metrics["val/neutral_perplexity"] = perplexity(model, tok, texts)
        for name, value in metrics.items():
            pl_module.log(name, value, batch_size=1, sync_dist=True)  # equal on every process
        if trainer.is_global_zero:
            write_json(Path(trainer.default_root_dir) / "head_gates.json", {
                "global_step": trainer.global_step, "open_heads": int((gates > 0).sum()), "n_heads": gates.numel(),
                "gates": gates.tolist(),
            })


class RunCheckpoint(ModelCheckpoint):
    """Lightning's :class:`~lightning.pytorch.callbacks.ModelCheckpoint` that also saves ``last.ckpt`` at the
    final step (with ``every_n_train_steps`` the last save is otherwise the last multiple of the interval, and a
    150-step run would publish step 140) and when a single-process run is stopped by SIGTERM (a cluster's
    pre-emption or time limit: Lightning finishes the step it is in and stops; without the save, up to
    ``every_n_train_steps - 1`` steps were lost, and the same command resumes from the saved one). Takes every
    option of ``ModelCheckpoint``."""

    def on_train_end(self, trainer, pl_module) -> None:
        super().on_train_end(trainer, pl_module)
        self._save_if_behind(trainer)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        # only SIGTERM: Lightning raises it between steps, with the weights and optimiser of a finished step (an
        # error or Ctrl-C can arrive in the middle of an optimiser step); only one process: with several, Lightning's
        # handler runs a collective inside the signal handler of each and relays the signal, and a collective save
        # after it can wait forever (seen with DDP on CPU processes); they resume from the last periodic checkpoint
        if isinstance(exception, SIGTERMException) and trainer.world_size == 1 and not trainer.sanity_checking:
            if self._save_if_behind(trainer):
                log.warning("stopped by SIGTERM at step %d: saved in %s (the same command resumes from it)",
                            trainer.global_step, self.last_model_path)

    def _save_if_behind(self, trainer) -> bool:
        if not self.save_last or self._last_global_step_saved == trainer.global_step:
            return False
        self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
        return True

    def _save_checkpoint(self, trainer, filepath: str) -> None:
        if not saves_folders(trainer.strategy):  # one file: AtomicCheckpointIO writes it whole or not at all
            super()._save_checkpoint(trainer, filepath)
        else:
            self._save_folder(trainer, filepath)

    def _save_folder(self, trainer, filepath: str) -> None:
        """A checkpoint saved as a folder of shards, which every process writes its part of: written beside its place
        (``.<name>.partial``, one name on every process) and renamed into place once whole, so that the previous one
        stays whole until then (written in place, a failed save left a mix of old and new shards)."""
        from weakref import proxy

        final = Path(filepath)
        partial = final.with_name(f".{final.name}.partial")
        if trainer.is_global_zero and partial.is_dir() and not partial.is_symlink():  # left by a save that failed
            shutil.rmtree(partial)
        elif trainer.is_global_zero:
            partial.unlink(missing_ok=True)
        trainer.strategy.barrier()
        try:
            trainer.save_checkpoint(str(partial), self.save_weights_only)
        except Exception as err:
            if is_disk_full(err):
                need = checkpoint_bytes([trainer.lightning_module.state_dict(), [o.state for o in trainer.optimizers]])
                raise disk_full_error(final.parent, f"the checkpoint {final.name}", need, REMEDY) from None
            raise
        if trainer.is_global_zero:
            swap_in(partial, final)
        trainer.strategy.barrier()
        self._last_global_step_saved = trainer.global_step
        self._last_checkpoint_saved = filepath
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.after_save_checkpoint(proxy(self))


def _sources(specs: dict[str, str]) -> dict[str, str]:
    """The data source of each behaviour spec by name, a file by its absolute path (a relative path would name
    another file from another folder)."""
    sources = {name: parse_behaviour(spec)[1] for name, spec in specs.items()}
    return {name: str(Path(src).expanduser().resolve()) if is_jsonl(src) else src for name, src in sources.items()}


class RunRecordCallback(Callback):
    """Writes ``run.json`` in the run folder when fitting ends: what was gated (short names and where their data
    is), where the weights are and the step they hold, the last logged metrics (the lock evaluation reads it) and
    whether the lock held on validation at that step (``lock``, from :class:`LockMetricsCallback`; publish reads it)
    and the W&B run that logged it (``wandb``: :func:`modular.runs.wandb_record`)."""

    def on_fit_end(self, trainer, pl_module) -> None:
        if not trainer.is_global_zero:
            return

        run_dir = Path(trainer.default_root_dir)
        ckpt = next((c.last_model_path for c in trainer.checkpoint_callbacks if c.last_model_path), None)
        ckpt_step = int(read_checkpoint(ckpt, weights=False)["global_step"]) if ckpt else None
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
        gates = {}
        gated = getattr(pl_module, "head_gates", None) is not None
        if gated:
            values = deterministic_gate_values(pl_module.hf_model)
            gates = {"open_heads": int((values > 0).sum()), "n_heads": values.numel()}
        dm = trainer.datamodule
        lock = next((c.status for c in trainer.callbacks if isinstance(c, LockMetricsCallback) and c.status), None)
        write_json(run_dir / RUN_RECORD, {
            "model_name": pl_module.hparams.model_name,
            "behaviours": pl_module.behaviours,
            "behaviour_sources": _sources(getattr(dm, "behaviour_specs", {})),
            "locked_responses": dict(getattr(dm, "locked_responses", {})),
            "neighbour_sources": _sources(getattr(dm, "neighbour_specs", {})),  # kept in training
            # base model, data hashes, recipe, locked responses (modular.identity; set by ``modular train``)
            "identity": getattr(pl_module, "run_identity", None),
            "finetuning": pl_module.finetuning_options.mode,
            "direction_strategy": pl_module.direction_options.strategy,
            "tasks": list(getattr(trainer.datamodule, "tasks", [])),
            "head_gates": gated,
            "checkpoint": ckpt,
            "checkpoint_step": ckpt_step,  # the step publish and the evaluations read
            "global_step": trainer.global_step,
            "metrics": metrics,
            # whether the lock held on validation at the final step (None: not checked, no LockMetricsCallback)
            "lock": lock,
            # the W&B run that logged the training (id, group, project): evaluations of the run join its group
            WANDB_ENTRY: wandb_record(trainer.loggers),
            **gates,
        })

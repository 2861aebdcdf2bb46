"""Callbacks of gated training: lock metrics on the validation split, logged to every logger."""

from __future__ import annotations

import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from modular.evaluation.behaviour import evaluate_behaviour, last_logits
from modular.hooks import ablate_directions


def first_token_kl(model, tokenizer, prompts, chats, reference_logp: torch.Tensor) -> float:
    """Mean KL(reference || model) of the first response token's distribution."""
    logp = torch.log_softmax(last_logits(model, tokenizer, prompts, chats), -1)
    ref = reference_logp.float()
    return (ref.exp() * (ref - logp)).sum(-1).mean().item()


class LockMetricsCallback(Callback):
    """After each validation: behaviour accuracy open / locked (greedy responses) and first-token KL
    of the retain validation prompts to the reference model, open / locked.

    Args:
        limit: Score at most this many validation items per behaviour.
        max_new_tokens: Length of greedy responses.
    """

    def __init__(self, limit: int | None = 64, max_new_tokens: int = 24):
        self.limit = limit
        self.max_new_tokens = max_new_tokens

    @torch.no_grad()
    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking:
            return
        dm = trainer.datamodule
        model, tok = pl_module.hf_model, dm.tokenizer
        adapter = pl_module.adapter
        dirs = pl_module.directions
        metrics = {}
        for i, b in enumerate(pl_module.behaviours):
            ds = dm.behaviour_data[b]["validation"]
            for state, ctx in (("open", None), ("locked", lambda i=i: ablate_directions(adapter, dirs[i]))):
                r = evaluate_behaviour(model, tok, ds, self.max_new_tokens, limit=self.limit, intervention=ctx,
                                       desc=False, refusals=(dm.locked_responses[b],))
                metrics[f"val/{b}/accuracy_{state}"] = r.accuracy
        retain = dm.retain["validation"]
        ref = dm.reference_first_logp["validation"]
        metrics["val/retain/first_token_kl_open"] = first_token_kl(model, tok, retain["prompt"], retain["chat"], ref)
        if len(pl_module.behaviours):  # nothing is locked without behaviours
            with ablate_directions(adapter, dirs):
                metrics["val/retain/first_token_kl_locked"] = first_token_kl(
                    model, tok, retain["prompt"], retain["chat"], ref
                )
        for name, value in metrics.items():
            pl_module.log(name, value, batch_size=1, rank_zero_only=True)


class SparseHeadsCallback(Callback):
    """After each validation (deterministic gates): the number of open heads, the tasks' accuracy on
    their validation split (greedy responses) and the perplexity of the held-out neutral text
    (validation split); writes the gate values to ``head_gates.json`` in the run folder. With
    ``gate_scope: tasks`` accuracy and perplexity are those of the plain model (gates off).

    Args:
        limit: Score at most this many validation items per task.
        max_new_tokens: Length of greedy responses.
    """

    def __init__(self, limit: int | None = 32, max_new_tokens: int = 8):
        self.limit = limit
        self.max_new_tokens = max_new_tokens

    @torch.no_grad()
    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking or not pl_module.hparams.head_gates:
            return
        from pathlib import Path

        from modular.data import neutral_text
        from modular.evaluation.retain import perplexity
        from modular.heads.gates import deterministic_gate_values, head_gate_scope
        from modular.tracking import write_json

        dm = trainer.datamodule
        model, tok = pl_module.hf_model, dm.tokenizer
        gates = deterministic_gate_values(model)
        metrics = {"val/open_heads": float((gates > 0).sum()), "val/closed_heads": float((gates == 0).sum())}
        # gates scoped to the tasks leave the published model plain: score it with the gates off
        with head_gate_scope(model, active=pl_module.hparams.get("gate_scope", "all") != "tasks"):
            for t in getattr(dm, "tasks", []):
                r = evaluate_behaviour(model, tok, dm.task_data[t]["validation"], self.max_new_tokens,
                                       limit=self.limit, desc=False)
                metrics[f"val/{t}/accuracy"] = r.accuracy
            texts = list(neutral_text(seed=dm.hparams.seed)["validation"]["text"])
            metrics["val/neutral_perplexity"] = perplexity(model, tok, texts)
        for name, value in metrics.items():
            pl_module.log(name, value, batch_size=1, rank_zero_only=True)
        if trainer.is_global_zero:
            write_json(Path(trainer.default_root_dir) / "head_gates.json", {
                "global_step": trainer.global_step, "open_heads": int((gates > 0).sum()), "n_heads": gates.numel(),
                "gates": gates.tolist(),
            })


class RunCheckpoint(ModelCheckpoint):
    """Lightning's :class:`~lightning.pytorch.callbacks.ModelCheckpoint` that also saves ``last.ckpt`` at the
    final step: with ``every_n_train_steps`` the last save is otherwise the last multiple of the interval, and a
    150-step run would publish step 140. Takes every option of ``ModelCheckpoint``."""

    def on_train_end(self, trainer, pl_module) -> None:
        super().on_train_end(trainer, pl_module)
        if self.save_last and self._last_global_step_saved != trainer.global_step:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))


class RunRecordCallback(Callback):
    """Writes ``run.json`` in the run folder when fitting ends: what was gated (short names and where their data
    is), where the weights are and the step they hold, and the last logged metrics (the lock evaluation reads it)."""

    def on_fit_end(self, trainer, pl_module) -> None:
        if not trainer.is_global_zero:
            return
        from pathlib import Path

        from modular.runs import RUN_RECORD, read_checkpoint
        from modular.tracking import write_json

        run_dir = Path(trainer.default_root_dir)
        ckpt = next((c.last_model_path for c in trainer.checkpoint_callbacks if c.last_model_path), None)
        ckpt_step = int(read_checkpoint(ckpt)["global_step"]) if ckpt else None
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
        gates = {}
        if pl_module.hparams.get("head_gates", False):
            from modular.heads.gates import deterministic_gate_values

            values = deterministic_gate_values(pl_module.hf_model)
            gates = {"open_heads": int((values > 0).sum()), "n_heads": values.numel()}
        dm = trainer.datamodule
        write_json(run_dir / RUN_RECORD, {
            "model_name": pl_module.hparams.model_name,
            "behaviours": pl_module.behaviours,
            "behaviour_sources": dict(getattr(dm, "behaviour_specs", {})),
            "locked_responses": dict(getattr(dm, "locked_responses", {})),
            "finetuning": pl_module.hparams.finetuning,
            "direction_strategy": pl_module.hparams.direction_strategy,
            "tasks": list(getattr(trainer.datamodule, "tasks", [])),
            "head_gates": bool(pl_module.hparams.get("head_gates", False)),
            "checkpoint": ckpt,
            "checkpoint_step": ckpt_step,  # the step publish and the evaluations read
            "global_step": trainer.global_step,
            "metrics": metrics,
            **gates,
        })

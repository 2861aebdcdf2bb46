"""Head gates, a plug-in of the gated module (``model.head_gates``; null: none): hard-concrete gates on every
attention head under a sparsity pressure (sparse post-training), acting on every input or on the task items only.

:class:`HeadGateOptions` is the option; :class:`HeadGates` is what the module does with it. It wraps every layer's
attention output projection in a :class:`~modular.models.head_gates.GatedOutputProjection` (registered parameters:
the optimiser, FSDP and checkpoints see them), gives the gates a parameter group of their own, fixes them at
``freeze_step``, adds the expected number of open heads (and the sparsity pressure on it) to the step's loss, and
under ``scope: tasks`` runs the task rows with their closed heads fed the counterfactual run's inputs and every other
row with the gates off. Sparse post-training needs no behaviour to lock: give ``behaviours: []`` and the data
module's ``tasks``.
"""

from __future__ import annotations

import logging
from contextlib import ExitStack
from dataclasses import dataclass

import torch

from modular import ModularError
from modular.gating.losses import response_margins
from modular.gating.objectives import HeadTaskTerm
from modular.gating.options import check_ranges
from modular.gating.requirements import TaskCounterfactuals
from modular.heads.ranking import last_position_logits
from modular.heads.sparsity import make_sparsity
from modular.hooks import capture_head_inputs
from modular.models.attention import eager_attention
from modular.models.head_gates import (
    deterministic_gate_values,
    expected_l0,
    head_gate_modules,
    head_gate_scope,
    install_head_gates,
    open_heads,
)

log = logging.getLogger("modular")

#: where head gates act: ``all`` inputs (closing a head removes it from the model) or the ``tasks`` only (a closed
#: head's input is swapped for its counterfactual one on task items; everything else runs the plain model)
GATE_SCOPES = ("all", "tasks")
#: the sparsity pressures on the expected fraction of open heads
SPARSITY_KINDS = ("none", "penalty", "constraint")


@dataclass(frozen=True)
class HeadGateOptions:
    """Hard-concrete gates on every attention head (on the output projection's input), ``model.head_gates``.

    ``sparsity`` adds ``λ·E[L0]/N`` (``penalty``) or minimises it under the constraint ``lm_loss ≤ τ``
    (``constraint``, GECO multiplier: :mod:`modular.heads.sparsity`); ``lm_loss`` is the sum of the LM-keeping terms
    (retain KL to the reference and the LM-text KL).

    Args:
        init: Initial log α of the gates (3.0: deterministic gate 1, model unchanged).
        lr: AdamW learning rate of the gate parameters (no weight decay).
        sparsity: ``none``, ``penalty`` (λ·E[L0]/N added) or ``constraint`` (minimise λ·E[L0]/N s.t. lm_loss ≤ τ).
        sparsity_weight: λ, weight of the expected fraction of open heads E[L0]/N.
        lm_loss_target: τ of the constraint (sparsity: constraint).
        multiplier_lr: η of the multiplicative ascent on the Lagrange multiplier.
        multiplier_ema: Decay of the moving average of the constraint violation, in [0, 1).
        multiplier_init: Initial Lagrange multiplier.
        freeze_step: Prune, then fine-tune: from this step on every head gate is fixed at its deterministic value
            (closed heads stay closed, no gate noise) and the remaining steps train the weights of the pruned model
            only; ``null``: the gates learn to the end.
        scope: Where the gates act. ``all``: every input (a closed head is removed from the model, and folded out of
            the published weights). ``tasks``: task items only, where a closed gate swaps the head's input for its
            input on the item's counterfactual prompt; retain and LM text run the plain model, and the published
            model keeps every head: its tasks learn not to depend on the closed ones.
        live_prob: ``scope: tasks``, training: the chance that a closed head keeps its own input on one task item
            (drawn per item and head), so the tasks learn to ignore the head's content whether it is the item's own
            or the counterfactual one, instead of relying on it being counterfactual. The terms on the task items
            once the gates are fixed (consistency, margin, interchange, closed attribution) are objectives
            (:class:`~modular.gating.objectives.HeadTaskTerm`).
    """

    init: float = 3.0
    lr: float = 0.05
    sparsity: str = "none"
    sparsity_weight: float = 1.0
    lm_loss_target: float | None = None
    multiplier_lr: float = 0.1
    multiplier_ema: float = 0.9
    multiplier_init: float = 1.0
    freeze_step: int | None = None
    scope: str = "all"
    live_prob: float = 0.0

    def __post_init__(self):
        check_ranges("head_gates", self, {"lr": (0.0, False), "sparsity_weight": (0.0, True),
                                          "lm_loss_target": (0.0, True), "multiplier_lr": (0.0, False),
                                          "freeze_step": (0, True)})
        if not 0.0 <= self.multiplier_ema < 1.0:
            raise ModularError(f"model.head_gates.multiplier_ema must be in [0, 1), got {self.multiplier_ema}")
        if self.sparsity not in SPARSITY_KINDS:
            raise ModularError(f"model.head_gates.sparsity must be 'none', 'penalty' or 'constraint', got "
                               f"'{self.sparsity}'")
        if self.sparsity == "constraint" and self.lm_loss_target is None:
            raise ModularError("model.head_gates.sparsity 'constraint' needs lm_loss_target (τ)")
        if self.scope not in GATE_SCOPES:
            raise ModularError(f"model.head_gates.scope must be one of {', '.join(GATE_SCOPES)}, got '{self.scope}'")
        if not 0.0 <= self.live_prob < 1.0:
            raise ModularError(f"model.head_gates.live_prob must be in [0, 1), got {self.live_prob}")


def gate_parameters(model) -> list[torch.nn.Parameter]:
    """The trainable head-gate parameters of ``model`` (each gate's log α)."""
    return [p for n, p in model.named_parameters() if p.requires_grad and "head_gate." in n]


class HeadGates:
    """What the gated module does with :class:`HeadGateOptions` (one per module; see the module docstring).

    Attributes:
        options: The options.
        sparsity: The sparsity pressure (:func:`~modular.heads.sparsity.make_sparsity`; None for ``none``), an
            ``nn.Module`` whose buffers (the constraint's multiplier) the module registers as its ``sparsity``, so
            that checkpoints keep them.
    """

    def __init__(self, options: HeadGateOptions):
        self.options = options
        o = options
        self.sparsity = make_sparsity(o.sparsity, o.sparsity_weight, o.lm_loss_target, o.multiplier_lr,
                                      o.multiplier_ema, o.multiplier_init)

    @property
    def scoped(self) -> bool:
        """Whether the gates act on the task items only (``scope: tasks``)."""
        return self.options.scope == "tasks"

    @property
    def requires(self) -> tuple:
        """What the gates need in the batches (:mod:`~modular.gating.requirements`): under ``scope: tasks``, the task
        items' counterfactual prompts."""
        return (TaskCounterfactuals(),) if self.scoped else ()

    def install(self, hf_model) -> None:
        """Wrap every attention output projection of ``hf_model`` in a gate (after LoRA: a gate wraps the
        LoRA-wrapped projection)."""
        install_head_gates(hf_model, init_log_alpha=self.options.init)

    def param_groups(self, model) -> list[dict]:
        """The gates' parameter group for the optimiser (their own learning rate, no weight decay), if any."""
        gates = gate_parameters(model)
        return [{"params": gates, "lr": self.options.lr, "weight_decay": 0.0}] if gates else []

    # --- prune, then fine-tune -----------------------------------------------------------------------------------
    def after_freeze(self, step: int, weight: float) -> bool:
        """A term applied once the gates are fixed runs at ``step``: weighted, and the gates fixed (or never
        fixed)."""
        freeze = self.options.freeze_step
        return bool(weight) and (freeze is None or step >= freeze)

    def freeze(self, lm) -> None:
        """From ``freeze_step`` on: fix every gate at its deterministic value (kept in checkpoints as ``fixed``)."""
        step = self.options.freeze_step
        if step is None or lm.global_step < step:
            return
        gates = [g for g in head_gate_modules(lm.hf_model) if torch.isnan(g.fixed).any()]
        for g in gates:  # log α then gets zero gradients (kept trainable: DDP expects the same parameters)
            g.fixed.copy_(g.deterministic())
        if gates:
            log.info("step %d: head gates fixed (%d heads open); the weights go on training", lm.global_step,
                     open_heads(lm.hf_model))

    # --- the step ------------------------------------------------------------------------------------------------
    def scope_group(self, stack: ExitStack, ctx, merged: dict, task_group: bool) -> dict | None:
        """Under ``scope: tasks``, enter on ``stack`` where the gates act in one forward pass: a group of task rows
        runs with its closed heads fed the counterfactual run's inputs (returned: ``cf_inputs``, ``cf_logits``, for
        the terms on the group), every other group with the gates off (None)."""
        if not task_group:
            stack.enter_context(head_gate_scope(ctx.hf_model, active=False))
            return None
        full = any(isinstance(t, HeadTaskTerm) and t.needs_cf_logits and t.active(ctx) for t in ctx.objectives)
        cf_inputs, cf_logits = self.counterfactual_run(ctx, merged, full_logits=full)
        stack.enter_context(head_gate_scope(ctx.hf_model, replacements=cf_inputs, live_prob=self.options.live_prob))
        return {"cf_inputs": cf_inputs, "cf_logits": cf_logits}

    def group_terms(self, ctx, merged: dict, logits: torch.Tensor,
                    counterfactual: dict) -> dict[str, tuple[torch.Tensor, float]]:
        """Every objective's losses on a group of task rows (:meth:`~modular.gating.objectives.Term.group_terms`),
        each with its weight; the plain run (every head its own input) is run once, by the first term that asks."""
        plain_logits = []

        def plain():
            if not plain_logits:
                with head_gate_scope(ctx.hf_model, active=False):
                    plain_logits.append(ctx.model(input_ids=merged["input_ids"],
                                                 attention_mask=merged["attention_mask"], use_cache=False).logits)
            return plain_logits[0]

        group = {"merged": merged, "logits": logits, **counterfactual, "plain": plain}
        return {name: (value, t.weight) for t in ctx.objectives for name, value in t.group_terms(ctx, group).items()}

    def add_pressure(self, ctx, total: torch.Tensor, lm_loss: torch.Tensor,
                     terms: dict[str, torch.Tensor]) -> torch.Tensor:
        """The step's loss with the sparsity pressure on the expected fraction of open heads; the expected number of
        open heads and the LM-keeping loss join the logged ``terms``."""
        l0 = expected_l0(ctx.hf_model)
        terms["expected_l0"] = l0
        terms["lm_loss"] = lm_loss
        if self.sparsity is not None:
            total = self.sparsity(total, lm_loss, l0 / (ctx.adapter.n_layers * ctx.adapter.n_heads))
        return total

    def after_step(self, lm, terms: dict[str, torch.Tensor], batch_size: int) -> None:
        """After a training step: log the open heads, and move the constraint's multiplier (one μ on every
        process)."""
        lm.log("train/open_heads", float(open_heads(lm.hf_model)), prog_bar=True, batch_size=batch_size)
        if self.sparsity is None:
            return
        lm_loss = terms["lm_loss"].detach()
        if lm._trainer is not None and lm.trainer.world_size > 1:
            lm_loss = lm.trainer.strategy.reduce(lm_loss, reduce_op="mean")
        self.sparsity.update(lm_loss.item())  # μ for the next step
        lm.log_dict({f"train/{k}": v for k, v in self.sparsity.metrics().items()}, batch_size=batch_size)

    # --- the counterfactual run and what the closed heads still do -------------------------------------------------
    @torch.no_grad()
    def counterfactual_run(self, ctx, merged: dict, full_logits: bool) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
        """The plain model on the task items' counterfactual prompts: every head's input (what a closed gate lets
        in), and the logits (every position with ``full_logits``, else the last one only)."""
        inputs = {"input_ids": merged["cf_input_ids"], "attention_mask": merged["cf_attention_mask"]}
        with head_gate_scope(ctx.hf_model, active=False), capture_head_inputs(ctx.adapter) as z:
            logits = ctx.model(**inputs, use_cache=False).logits if full_logits else last_position_logits(ctx.model,
                                                                                                         inputs)
        return dict(z), logits

    def closed_attribution(self, ctx, merged: dict, cf_inputs: dict[int, torch.Tensor]) -> torch.Tensor:
        """Mean over the task rows of the closed heads' share of the summed |attribution-patching estimates| of
        every head's effect on the answer margin in the plain run
        (:class:`~modular.gating.objectives.ClosedAttribution`), differentiable in the weights."""
        closed = (deterministic_gate_values(ctx.hf_model) == 0).float()  # (layers, heads)
        # eager attention: SDPA kernels have no second derivative
        with eager_attention(ctx.hf_model), head_gate_scope(ctx.hf_model, active=False), \
                capture_head_inputs(ctx.adapter, detach=False) as z:
            logits = ctx.model(input_ids=merged["input_ids"], attention_mask=merged["attention_mask"],
                              use_cache=False).logits
        margins, keep = response_margins(logits, merged["labels"], merged["wrong_ids"])
        keep = keep & (merged["cf_input_ids"] != merged["input_ids"]).any(dim=1)  # a counterfactual of its own
        layers = sorted(z)
        if not keep.any() or not closed.any():
            return logits.sum() * 0.0
        grads = torch.autograd.grad(margins[keep].sum(), [z[i] for i in layers], create_graph=True)
        estimates = torch.stack([(g * (cf_inputs[i].to(g) - z[i])).sum(dim=(1, 3)) for i, g in zip(layers, grads)],
                                dim=1).abs().float()  # (batch, layers, heads): summed over positions and dims
        share = (estimates * closed).sum(dim=(1, 2)) / estimates.sum(dim=(1, 2)).clamp(min=1e-6)
        return share[keep].mean()

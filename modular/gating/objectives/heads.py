"""The tasks and the head-gate terms on their rows (under ``head_gates.scope: tasks``, once the gates are fixed)."""

from __future__ import annotations

import torch

from modular import ModularError
from modular.gating.data_options import TASK_PREFIX
from modular.gating.losses import interchange_kl, response_logit_mse, response_margin_mse, token_ce
from modular.gating.objectives.base import Piece, StepContext, Term
from modular.models.head_gates import head_gate_scope


class TaskAnswer(Term):
    """The DataModule's tasks in the open state (cross-entropy on their targets), ``<task>/task_ce``. Under
    ``head_gates.scope: tasks`` their rows run apart, closed heads fed the counterfactual prompt's inputs."""

    needs = ("tasks",)

    def pieces(self, ctx: StepContext) -> list[Piece]:
        scoped = ctx.gate_scope == "tasks"
        out = []
        for key in ctx.batch:
            if not key.startswith(TASK_PREFIX):
                continue
            rows = ctx.batch[key]["open"]
            if scoped:
                if "counterfactual" not in ctx.batch[key]:
                    raise ModularError("head_gates.scope 'tasks' needs task batches with counterfactual prompts "
                                       "(the data module builds them for a module whose head gates have that scope: "
                                       "GatedLM.requirements; or GatingDataModule.require(TaskCounterfactuals()))")
                cf = ctx.batch[key]["counterfactual"]
                rows = {**rows, "cf_input_ids": cf["input_ids"], "cf_attention_mask": cf["attention_mask"]}
            out.append(Piece(f"{key[len(TASK_PREFIX):]}/task_ce", rows, self, task=scoped))
        return out

    def loss(self, ctx, piece, logits):
        return token_ce(logits, piece.batch["labels"])


class HeadTaskTerm(Term):
    """A term on the task rows under ``head_gates.scope: tasks``, applied once the gates are fixed
    (``head_gates.freeze_step``): before, its gradient would only open the gates."""

    needs = ("tasks",)

    def bind(self, setup) -> None:
        scope = setup.gate_scope
        if self.weight and scope != "tasks":
            got = "no head gates" if scope is None else f"'{scope}'"
            raise ModularError(f"{type(self).__name__} needs head_gates.scope 'tasks', got {got}")

    def active(self, ctx: StepContext) -> bool:
        return ctx.head_gates.after_freeze(ctx.step, self.weight)


class HeadConsistency(HeadTaskTerm):
    """The task rows' logits in the plain run (every head its own input) and in the scoped run (closed heads
    counterfactual) agree: the mean squared difference of the centred logits over the plain run's top 32 tokens
    at the response positions (``tasks/consistency_mse``), so the closed heads' effect on the tasks goes to zero in
    the published model, not only in the trained one."""

    def group_terms(self, ctx, group):
        if not self.active(ctx):
            return {}
        return {"tasks/consistency_mse": response_logit_mse(group["logits"], group["plain"](), group["merged"]["labels"])}


class HeadMargin(HeadTaskTerm):
    """Plain vs scoped run on the task rows: the squared difference of the margin logit(answer) − logit(wrong
    answer) at the first response position (``tasks/consistency_margin``), the quantity the head rankings patch."""

    def group_terms(self, ctx, group):
        merged = group["merged"]
        if not self.active(ctx) or "wrong_ids" not in merged:
            return {}
        return {"tasks/consistency_margin": response_margin_mse(group["logits"], group["plain"](), merged["labels"],
                                                                merged["wrong_ids"])}


class HeadInterchange(HeadTaskTerm):
    """Interchange intervention training (Geiger et al. 2022): with the roles swapped (open heads counterfactual,
    closed heads their own input) the task rows must predict what the plain model predicts on the counterfactual
    prompt (full-vocabulary KL at the first response position, ``tasks/interchange_kl``). With the task CE of the
    scoped run (closed heads counterfactual, the item's own answer) the answer then follows the open heads only, in
    both directions. Rows whose counterfactual is their own prompt are skipped."""

    needs_cf_logits = True

    def group_terms(self, ctx, group):
        if not self.active(ctx):
            return {}
        merged = group["merged"]
        with head_gate_scope(ctx.hf_model, replacements=group["cf_inputs"], invert=True):
            swapped = ctx.model(input_ids=merged["input_ids"], attention_mask=merged["attention_mask"],
                               use_cache=False).logits
        differs = (merged["cf_input_ids"] != merged["input_ids"]).any(dim=1)  # a counterfactual of its own
        return {"tasks/interchange_kl": interchange_kl(swapped, group["cf_logits"], merged["labels"], differs)}


class ClosedAttribution(HeadTaskTerm):
    """What the closed heads still do in the published model: the plain run's attribution-patching estimates of
    every head's effect on the answer margin logit(answer) − logit(wrong answer) at the first response position when
    its input is swapped for the counterfactual one (gradient times input difference, the fast ranking of
    :mod:`modular.heads.ranking`), and the closed heads' share of their summed absolute values, averaged over the
    task rows (``tasks/closed_attribution``): the effect-share measure of the head-efficiency curves, blind to the
    margin's scale, so shrinking the answer does not lower it. Differentiated through the gradient (a second
    backward pass); training steps only."""

    def group_terms(self, ctx, group):
        merged = group["merged"]
        if not (self.active(ctx) and "wrong_ids" in merged and torch.is_grad_enabled()):
            return {}
        return {"tasks/closed_attribution": ctx.head_gates.closed_attribution(ctx, merged, group["cf_inputs"])}

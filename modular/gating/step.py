"""The step runner: one gated step's loss from its terms. It groups the terms' rows into forward passes, enters
each pass's interventions (every row's ablated directions, steering vectors, the head gates' scope), runs the
shared forward pass and hands each term its rows' outputs. Terms see a :class:`~modular.gating.objectives.StepContext`
alone; the module only builds the context (:meth:`modular.gating.module.GatedLM.model_step`)."""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass, field

import torch

from modular import ModularError
from modular.gating.batching import concat_left_padded, piece_rows, row_ablations, row_vectors
from modular.gating.objectives import Piece, StepContext, Term
from modular.hooks import ablate_directions, ablate_rows, add_vectors


@dataclass
class StepRunner:
    """Runs the terms of one step (:meth:`run`).

    Attributes:
        objectives: The loss's terms.
        locked_weight: λ, the weight of every locked-state piece on top of its term's weight.
        pad_token_id: The fill of the rows' left padding when pieces share a pass.
    """

    objectives: list[Term]
    locked_weight: float = 1.0
    pad_token_id: int = 0
    #: forward passes run in the last step (a reading for tests and benchmarks)
    passes: int = field(default=0, init=False)

    def pieces(self, ctx: StepContext) -> list[Piece]:
        """Every term's non-empty pieces, each log name once."""
        pieces = [p for t in self.objectives for p in t.pieces(ctx) if p.batch["input_ids"].shape[0] > 0]
        names = [p.name for p in pieces]
        if len(set(names)) != len(names):
            twice = sorted({n for n in names if names.count(n) > 1})
            raise ModularError(f"model.objectives: two terms compute {', '.join(twice)} (list each term once)")
        return pieces

    def groups(self, ctx: StepContext, pieces: list[Piece]) -> dict[tuple, list[Piece]]:
        """One forward pass per kind of rows: chat pieces, raw text, and (head gates scoped to the tasks) one per
        set of ablated directions of task pieces. Open and locked rows share a pass, each row with its own
        directions ablated."""
        scoped = ctx.head_gates is not None and ctx.head_gates.scoped
        groups: dict[tuple[frozenset | None, bool, bool], list[Piece]] = {}
        for p in pieces:
            task_group = scoped and p.task
            groups.setdefault((p.ablated if task_group else None, p.raw_text, task_group), []).append(p)
        return groups

    def run(self, ctx: StepContext) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The step's loss ``Σ weight · λ^locked · term`` and each term's value by log name."""
        pieces = self.pieces(ctx)
        terms: dict[str, torch.Tensor] = ctx.losses  # readers see the losses computed before them
        weights: dict[str, float] = {}
        self.passes = 0
        for (_, _, task_group), items in self.groups(ctx, pieces).items():
            self._run_group(ctx, items, task_group, terms, weights)
        for t in self.objectives:
            for name, value in t.own_losses(ctx).items():
                terms[name], weights[name] = value, t.own_weight(name, self.locked_weight)
        keeps_lm = {p.name for p in pieces if p.term.keeps_lm}
        device = ctx.directions.device
        total = torch.zeros((), device=device)
        lm_loss = torch.zeros((), device=device)
        for name, value in terms.items():
            total = total + weights[name] * value
            if name in keeps_lm:
                lm_loss = lm_loss + weights[name] * value
        if ctx.head_gates is not None:
            total = ctx.head_gates.add_pressure(ctx, total, lm_loss, terms)
        return total, terms

    def _weight(self, term: Term, piece: Piece) -> float:
        return term.weight * (self.locked_weight if piece.locked else 1.0)

    def _run_group(self, ctx: StepContext, items: list[Piece], task_group: bool, terms: dict, weights: dict) -> None:
        """One shared forward pass of ``items`` and the losses read from it (into ``terms`` and ``weights``)."""
        merged = concat_left_padded([p.batch for p in items], self.pad_token_id)
        n_rows = merged["input_ids"].shape[0]
        readers = [(t, p, name) for p in items for t in self.objectives if (name := t.reads(p))]
        counterfactual = None
        with ExitStack() as stack:
            row_sets, every_row = row_ablations(items, n_rows, ctx.directions)
            if every_row:  # every row alike: the plain hooks
                stack.enter_context(ablate_directions(ctx.adapter, row_sets[0][1]))
            elif row_sets:  # disjoint by construction: no check (it would wait for the device)
                stack.enter_context(ablate_rows(ctx.adapter, row_sets, check=False))
            if ctx.head_gates is not None and ctx.head_gates.scoped:
                counterfactual = ctx.head_gates.scope_group(stack, ctx, merged, task_group)
            vectors = row_vectors(items, n_rows, ctx.directions.device)
            if vectors:  # steered pieces get their vector on their own rows only, in the shared forward
                stack.enter_context(add_vectors(ctx.adapter, vectors))
            out = ctx.model(input_ids=merged["input_ids"], attention_mask=merged["attention_mask"],
                            output_hidden_states=bool(readers), use_cache=False)
            self.passes += 1
        # each piece's rows as one split of the outputs, not a slice each: a split's backward is one concatenation,
        # a slice's a zero tensor of the whole output per piece (vocabulary-wide for the logits)
        sizes = [p.batch["input_ids"].shape[0] for p in items]
        starts = [sum(sizes[:i]) for i in range(len(items))]
        piece_logits = out.logits.split(sizes)
        index = {id(p): i for i, p in enumerate(items)}
        for i, p in enumerate(items):
            sub = piece_rows(p, merged, starts[i], sizes[i])
            terms[p.name] = p.term.loss(ctx, sub, piece_logits[i])
            weights[p.name] = self._weight(p.term, p)
        piece_hidden = [h.split(sizes) for h in out.hidden_states] if readers else []
        for t, p, name in readers:
            i = index[id(p)]
            sub = piece_rows(p, merged, starts[i], sizes[i])
            terms[name] = t.loss_on(ctx, sub, piece_logits[i], tuple(h[i] for h in piece_hidden))
            weights[name] = self._weight(t, p)
        if counterfactual is not None:  # the head-gate terms on the group of task rows
            for name, (value, weight) in ctx.head_gates.group_terms(ctx, merged, out.logits, counterfactual).items():
                terms[name], weights[name] = value, weight

"""What stays as it was: retain and neighbour prompts keep the reference model's answers (and residual stream),
raw text its next-token distributions, and the locked response stays down on them."""

from __future__ import annotations

from modular import ModularError
from modular.gating.data_options import NEIGHBOURS_KEY
from modular.gating.losses import first_token_ce, first_token_kl, hidden_drift, refusal_guard, token_ce, topk_kl
from modular.gating.objectives.base import Piece, StepContext, Term, _check_weight
from modular.gating.requirements import ReferenceHidden


class KeepReference(Term):
    """Retain prompts and the neighbours (``data.neighbours``) keep the reference model's answers in both states:
    top-k KL over the response tokens (``retain/open_kl``, ``retain/locked_kl``, ``neighbours/...``), plus a
    full-vocabulary KL at the first response token and optionally a CE on the reference's greedy answers.

    Args:
        weight: Weight of the term, both states (the module's λ applies on top in the locked state).
        first_token_weight: Weight of the full-vocabulary KL at the first response token (the top-k KL covers
            every response token coarsely; the first token's distribution is the flattest).
        ce_weight: Weight of an extra CE on the reference's greedy answers (mean over their tokens).
        first_token_ce_weight: Weight of a CE on the reference's greedy first response token: keeps which answer
            the model gives (a KL moves little when a name and a pronoun trade a few points of probability near a
            tie, yet the greedy answer flips).
        parts: The batch parts kept (``retain``, ``neighbours``).
    """

    keeps_lm = True

    def __init__(self, weight: float = 1.0, first_token_weight: float = 1.0, ce_weight: float = 0.0,
                 first_token_ce_weight: float = 0.0, parts: list[str] = ("retain", NEIGHBOURS_KEY)):
        super().__init__(weight)
        _check_weight("KeepReference", "first_token_weight", first_token_weight)
        _check_weight("KeepReference", "ce_weight", ce_weight)
        _check_weight("KeepReference", "first_token_ce_weight", first_token_ce_weight)
        self.first_token_weight = first_token_weight
        self.ce_weight = ce_weight
        self.first_token_ce_weight = first_token_ce_weight
        self.parts = list(parts)

    def pieces(self, ctx: StepContext) -> list[Piece]:
        out = []
        for key in self.parts:
            if key in ctx.batch:
                out.append(Piece(f"{key}/open_kl", ctx.batch[key]["open"], self))
                out.append(Piece(f"{key}/locked_kl", ctx.batch[key]["locked"], self, ablated=ctx.all_ablated,
                                 locked=True))
        return out

    def loss(self, ctx, piece, logits):
        b = piece.batch
        kl = topk_kl(logits, b["labels"], b["topk_ids"], b["topk_logp"])
        if self.first_token_weight:
            kl = kl + self.first_token_weight * first_token_kl(logits, b["labels"], b["first_logp"])
        if self.ce_weight:
            kl = kl + self.ce_weight * token_ce(logits, b["labels"])
        if self.first_token_ce_weight:
            kl = kl + self.first_token_ce_weight * first_token_ce(logits, b["labels"])
        return kl


class KeepHidden(Term):
    """Retain or neighbour prompts keep the reference model's residual stream, not only its answers: at the first
    ``data.reference.hidden_positions`` positions that compute each answer and every
    ``data.reference.hidden_stride``-th block output, the relative squared distance to the reference's (:func:`~modular.gating.losses.hidden_drift`;
    ``neighbours/open_hidden``, ``neighbours/locked_hidden``; in the locked state with the ablated directions
    projected out of both). It reads the rows of :class:`KeepReference` for the same parts: no rows of its own.
    Two models can give the same answers on the trained prompts by different internal routes, and the route is
    what other prompts (held-out entities) share.

    Args:
        weight: Weight of the term (the module's λ applies on top in the locked state).
        parts: The batch parts kept (``retain``, ``neighbours``).
    """

    keeps_lm = True

    def __init__(self, weight: float = 1.0, parts: list[str] = (NEIGHBOURS_KEY,)):
        super().__init__(weight)
        self.parts = list(parts)
        self._hidden = ReferenceHidden(tuple(self.parts))  # an unknown part: one line, when the term is built

    @property
    def requires(self) -> tuple:
        return (self._hidden,)

    def reads(self, piece: Piece) -> str | None:
        part, _, name = piece.name.partition("/")
        if isinstance(piece.term, KeepReference) and part in self.parts and name.endswith("_kl"):
            return f"{part}/{name[:-len('_kl')]}_hidden"
        return None

    def loss_on(self, ctx, piece, logits, hidden):
        b = piece.batch
        if "ref_hidden" not in b:
            part = piece.name.partition("/")[0]
            raise ModularError(f"KeepHidden needs the reference's hidden states of {part}: set "
                               "data.reference.hidden_positions > 0 (the data module keeps them for the parts its "
                               "module's KeepHidden terms read)")
        blocks = b["ref_hidden_blocks"][0].tolist()
        return hidden_drift(hidden, b["labels"], b["ref_hidden"], blocks,
                            [ctx.directions[i] for i in sorted(piece.ablated)])


class LMText(Term):
    """Raw text (``data.lm_text``) keeps the reference's next-token distributions (top-k KL at every position):
    ``lm/open_kl`` and ``lm/locked_kl`` with gated behaviours, ``lm/kl`` without. Long text runs in a forward pass
    of its own."""

    needs = ("lm_text",)

    keeps_lm = True

    def pieces(self, ctx: StepContext) -> list[Piece]:
        lm = ctx.batch.get("lm")
        if lm is None:
            return []
        if "locked" not in lm:
            return [Piece("lm/kl", lm["open"], self, raw_text=True)]
        return [Piece("lm/open_kl", lm["open"], self, raw_text=True),
                Piece("lm/locked_kl", lm["locked"], self, ablated=ctx.all_ablated, locked=True, raw_text=True)]

    def loss(self, ctx, piece, logits):
        b = piece.batch
        return topk_kl(logits, b["labels"], b["topk_ids"], b["topk_logp"])


class RefusalGuard(Term):
    """Retain and neighbour prompts followed by the locked response, in both states (``retain/open_guard``,
    ``retain/locked_guard``, ...): the response is pushed down once its mean token log-probability passes
    ``floor`` (:func:`~modular.gating.losses.refusal_guard`). Training the locked response on the gated behaviour
    raises it on every prompt, and the KL terms barely see a refusal rising from far below.

    Args:
        weight: Weight of the term.
        floor: Mean log-probability per token above which it acts (< 0; base SmolLM2-135M-Instruct: about -4 on
            retain prompts; a greedily chosen response is near 0).
        parts: The batch parts guarded.
    """

    def __init__(self, weight: float = 1.0, floor: float = -3.0, parts: list[str] = ("retain", NEIGHBOURS_KEY)):
        super().__init__(weight)
        if floor >= 0:
            raise ModularError(f"RefusalGuard floor must be < 0 (a mean log-probability), got {floor}")
        self.floor = floor
        self.parts = list(parts)

    def pieces(self, ctx: StepContext) -> list[Piece]:
        out = []
        for key in self.parts:
            if key in ctx.batch and "open_guard" in ctx.batch[key]:
                out.append(Piece(f"{key}/open_guard", ctx.batch[key]["open_guard"], self))
                out.append(Piece(f"{key}/locked_guard", ctx.batch[key]["locked_guard"], self,
                                 ablated=ctx.all_ablated, locked=True))
        return out

    def loss(self, ctx, piece, logits):
        return refusal_guard(logits, piece.batch["labels"], self.floor)

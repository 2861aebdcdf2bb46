"""The lock's terms: the open answers, the locked state (refusal or unlikelihood, the prefilled answer) and the
direction write term."""

from __future__ import annotations

import torch

from modular import ModularError
from modular.gating.data_options import per_behaviour
from modular.gating.losses import direction_write_shortfall, token_ce, unlikelihood
from modular.gating.objectives.base import Piece, StepContext, Term
from modular.gating.requirements import AnswerRows

LOCKED_OBJECTIVES = ("refusal", "unlikelihood")


class BehaviourAnswer(Term):
    """Open state: the gated behaviours' answers (token-mean cross-entropy), ``<behaviour>/open_ce``. With several
    behaviours the others' directions are ablated or not at random on these rows, so each behaviour depends on
    its own direction only."""

    needs = ("behaviours",)

    def pieces(self, ctx: StepContext) -> list[Piece]:
        return [Piece(f"{b}/open_ce", ctx.batch[b]["open"], self, ablated=ctx.extra[i], index=i)
                for i, b in enumerate(ctx.behaviours)]

    def loss(self, ctx, piece, logits):
        return token_ce(logits, piece.batch["labels"])


class LockedState(Term):
    """Locked state (the behaviour's direction ablated): ``refusal`` trains the data's locked response
    (cross-entropy, ``<behaviour>/locked_refusal``), ``unlikelihood`` pushes the true answer down
    (``<behaviour>/locked_unlikelihood``). With the module's steering adversary on, these rows also get a
    difference-in-means steering vector of the current model (attack (b) of the published weights).

    Args:
        objective: ``refusal`` or ``unlikelihood`` for every behaviour, or a mapping behaviour → objective
            (behaviours not named use refusal).
        weight: Weight of the term (the module's λ applies on top).
    """

    makes_the_lock = True
    needs = ("behaviours",)

    def __init__(self, objective: str | dict[str, str] = "refusal", weight: float = 1.0):
        super().__init__(weight)
        self.objective = objective
        self.objectives: dict[str, str] = {}

    def bind(self, setup) -> None:
        self.objectives = locked_objectives(self.objective, list(setup.behaviours))

    def pieces(self, ctx: StepContext) -> list[Piece]:
        out = []
        steering = ctx.steering if ctx.train else None
        for i, b in enumerate(ctx.behaviours):
            kind = self.objectives[b]
            rows = ctx.batch[b]["locked"] if kind == "refusal" else ctx.batch[b]["locked_true"]
            steer = steering.draw(b) if steering is not None else None
            out.append(Piece(f"{b}/locked_{kind}", rows, self, ablated=ctx.extra[i] | {i}, locked=True,
                             steer=steer, index=i))
        return out

    def loss(self, ctx, piece, logits):
        if piece.name.endswith("/locked_unlikelihood"):
            return unlikelihood(logits, piece.batch["labels"])
        return token_ce(logits, piece.batch["labels"])


class LockedAnswer(Term):
    """Locked state, the response prefilled: each behaviour's target up to its answer (``"The capital of France is"``
    → ``" Paris"``), the answer's tokens pushed down by unlikelihood (``<behaviour>/locked_answer``). The locked
    response is trained where the response begins; whoever runs the published weights can begin it themselves,
    with the answer's own frame, and a lock trained only to refuse still completes the frame (attack (e) of
    ``modular attack``). The rows are the locked half's, its items' answers alone labelled (a target that names no
    answer is labelled whole).

    Args:
        weight: Weight of the term (the module's λ applies on top).
    """

    makes_the_lock = True
    needs = ("behaviours",)
    requires = (AnswerRows(),)

    def pieces(self, ctx: StepContext) -> list[Piece]:
        return [Piece(f"{b}/locked_answer", answer_batch(ctx, b, self), self, ablated=ctx.extra[i] | {i},
                      locked=True, index=i)
                for i, b in enumerate(ctx.behaviours)]

    def loss(self, ctx, piece, logits):
        return unlikelihood(logits, piece.batch["labels"])


def answer_batch(ctx: StepContext, behaviour: str, term: Term) -> dict:
    """Behaviour ``behaviour``'s answer rows in this step, or a one-line error naming what to set."""
    if "locked_answer" not in ctx.batch[behaviour]:
        raise ModularError(f"{type(term).__name__} needs the answer rows of {behaviour}: the data module builds them "
                           "for the module it trains (GatedLM.requirements), or after GatingDataModule.require("
                           "AnswerRows())")
    return ctx.batch[behaviour]["locked_answer"]


def locked_objectives(spec: str | dict[str, str], behaviours: list[str]) -> dict[str, str]:
    """The locked-state objective of every behaviour, from one name or a mapping behaviour → name."""
    objectives = per_behaviour(spec, behaviours, "refusal", "locked_objective")
    for value in ([spec] if isinstance(spec, str) else objectives.values()):
        if value not in LOCKED_OBJECTIVES:
            raise ModularError(f"locked_objective must be 'refusal' or 'unlikelihood', got '{value}'")
    return objectives


class DirectionWrite(Term):
    """Open state: the residual stream, at the positions that compute a gated behaviour's response and at every
    block output, carries its direction with a cosine of at least ``target``
    (:func:`~modular.gating.losses.direction_write_shortfall`), ``<behaviour>/open_write``. Ablating the
    direction then removes a signal the model holds, and the locked state can learn to read its absence; without
    it a behaviour may never learn that within its step budget (open and locked rows differ only by the
    direction's component, which a low-variance direction barely has). It reads the hidden states of
    :class:`BehaviourAnswer`'s rows: no rows of its own.

    The term starts the lock; kept at full strength once the lock is learned, it keeps pushing the residual stream
    and costs the retain KL. With ``fade`` it is scaled, per behaviour and step, by ``min(1, L / fade)`` where
    ``L`` is the behaviour's locked-state loss in the same step (:class:`LockedState`; the scale carries no
    gradient): full while the locked response is unlearned, fading as it is learned, back if the lock is lost.

    Args:
        weight: Weight of the term.
        target: The share of the residual norm (cosine) the direction should reach, in (0, 1].
        fade: The locked-state loss (token-mean, nats) below which the term fades in proportion; None: always full.
    """

    makes_the_lock = True
    needs = ("behaviours",)

    def __init__(self, weight: float = 1.0, target: float = 0.2, fade: float | None = None):
        super().__init__(weight)
        if not 0.0 < target <= 1.0:
            raise ModularError(f"DirectionWrite target must be in (0, 1] (a share of the residual norm), got {target}")
        if fade is not None and fade <= 0:
            raise ModularError(f"DirectionWrite fade must be > 0 (a locked-state loss in nats) or null, got {fade}")
        self.target = target
        self.fade = fade

    def reads(self, piece: Piece) -> str | None:
        if isinstance(piece.term, BehaviourAnswer):
            return piece.name.replace("/open_ce", "/open_write")
        return None

    def scale(self, ctx: StepContext, index: int) -> float | torch.Tensor:
        """The term's scale on behaviour ``index`` in this step: 1, or ``min(1, locked-state loss / fade)`` (a
        tensor on the loss's device without gradient: no device sync in the step)."""
        if self.fade is None:
            return 1.0
        b = ctx.behaviours[index]
        locked = [v for k, v in ctx.losses.items() if k.startswith(f"{b}/locked_")]
        if not locked:  # no locked-state rows in this step's forward: nothing says the lock is learned
            return 1.0
        return (torch.stack(locked).sum().detach() / self.fade).clamp(max=1.0)

    def loss_on(self, ctx, piece, logits, hidden):
        # block outputs only: the embedding and the final norm's output are left out
        shortfall = direction_write_shortfall(hidden[1:-1], piece.batch["labels"], ctx.directions[piece.index],
                                              self.target)
        return shortfall * self.scale(ctx, piece.index)

"""The terms of the gated objective, one small class each, chosen in the config (``model.objectives``).

A step's loss is ``Σ_terms weight · λ^locked · term`` (λ: the module's ``locked_weight``, on locked-state pieces).
A term says which rows it adds to the step's forward passes (:class:`Piece`: a sub-batch, the directions ablated
on it, an optional steering vector) and what its loss is on their logits. The module runs the pieces in one forward
pass (each row with its own directions ablated; raw text in a pass of its own), so a term costs the rows it adds,
not a pass of its own. Terms that read
another term's rows (:class:`DirectionWrite` reads the open answers' hidden states) or a whole group of task rows
(the head terms under ``gate_scope: tasks``) override :meth:`Term.reads` or :meth:`Term.group_terms`.

A new experiment is a new class here (or anywhere importable), named by class path in the config::

    model:
      objectives:
        - class_path: modular.gating.objectives.BehaviourAnswer
        - class_path: modular.gating.objectives.LockedState
          init_args: {objective: refusal}
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from modular import ModularError
from modular.gating.data import NEIGHBOURS_KEY, TASK_PREFIX, per_behaviour
from modular.gating.losses import (
    direction_write_shortfall,
    first_token_ce,
    first_token_kl,
    hidden_drift,
    interchange_kl,
    refusal_guard,
    response_logit_mse,
    response_margin_mse,
    token_ce,
    topk_kl,
    unlikelihood,
)
from modular.specs import build_from_specs

LOCKED_OBJECTIVES = ("refusal", "unlikelihood")


@dataclass
class Piece:
    """Rows of a step's forward passes and the term whose loss they feed.

    Attributes:
        name: Log name of the loss (``capitals/open_ce``; logged as ``train/<name>``).
        batch: The sub-batch (``input_ids``, ``attention_mask``, ``labels``, reference tensors).
        term: The term that computes the loss.
        ablated: Indices of the behaviours whose directions are ablated on these rows.
        locked: A locked-state piece: weighted by the module's ``locked_weight`` (λ).
        steer: ``(block, vector)`` added to these rows' residual stream (the steering adversary), or None.
        raw_text: Long raw text: a forward pass of its own (the short chat rows are not padded to its length).
        task: A task item under ``gate_scope: tasks`` (its closed heads take their counterfactual input).
        index: The behaviour the piece belongs to, if any.
    """

    name: str
    batch: dict
    term: Term
    ablated: frozenset = frozenset()
    locked: bool = False
    steer: tuple | None = None
    raw_text: bool = False
    task: bool = False
    index: int | None = None


@dataclass
class StepContext:
    """What every term of one step sees: the module, the batch, whether it trains, and the state assignment of
    the gated behaviours (``extra[i]``: the other behaviours ablated on behaviour ``i``'s rows, drawn once per
    step so that its open and locked rows agree)."""

    lm: object
    batch: dict
    train: bool
    extra: list[frozenset] = field(default_factory=list)
    #: the losses computed so far in this step, by log name (a term that reads another's rows sees the losses of
    #: the pieces of its forward pass)
    losses: dict[str, torch.Tensor] = field(default_factory=dict)
    #: values a term computes once per step and reuses (freed with the step)
    cache: dict = field(default_factory=dict)

    @property
    def behaviours(self) -> list[str]:
        return self.lm.behaviours

    @property
    def all_ablated(self) -> frozenset:
        return frozenset(range(len(self.lm.behaviours)))


def _check_weight(term: str, name: str, value: float) -> None:
    if value < 0:
        raise ModularError(f"{term} {name} must be >= 0, got {value}")


class Term:
    """One term of the gated objective.

    Args:
        weight: Its weight in the step's loss (a locked-state piece is also weighted by the module's λ).
    """

    #: counted in ``lm_loss``, the left-hand side of the sparsity constraint (the LM-keeping terms)
    keeps_lm = False
    #: the losses of :meth:`own_losses` are locked-state losses (weighted by the module's λ)
    locked = False
    #: needs the task rows' counterfactual run at every position (not only the last)
    needs_cf_logits = False
    #: reads the behaviours' answer rows (``locked_answer``; built only when ``data.answer_rows`` is set)
    answer_rows = False
    #: the data its rows come from, besides the retain prompts: ``behaviours`` (gated), ``tasks`` or ``lm_text``
    #: (without them it adds nothing to the loss: :func:`check_loss`)
    needs: tuple[str, ...] = ()
    #: the training step from which the term acts (the lock does not stop training at or before it)
    start_step = 0

    def __init__(self, weight: float = 1.0):
        _check_weight(type(self).__name__, "weight", weight)
        self.weight = weight

    def bind(self, lm) -> None:
        """Called once by the module when it is built (checks that need the module's options)."""

    def state_dict(self) -> dict:
        """What a resumed run takes back (a term's own random draws); kept in the module's checkpoints."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Take back :meth:`state_dict`."""

    def check_model(self, model) -> None:
        """Called once with the loaded transformers model, before training (checks that need its shapes)."""

    def pieces(self, ctx: StepContext) -> list[Piece]:
        """The rows this term adds to the step."""
        return []

    def loss(self, ctx: StepContext, piece: Piece, logits: torch.Tensor) -> torch.Tensor:
        """The term's loss on one of its pieces."""
        raise NotImplementedError

    def reads(self, piece: Piece) -> str | None:
        """The log name of a loss this term takes from another term's piece (with the forward's hidden states),
        or None."""
        return None

    def loss_on(self, ctx: StepContext, piece: Piece, logits: torch.Tensor, hidden: tuple) -> torch.Tensor:
        """The loss on a piece this term :meth:`reads`; ``hidden``: the block outputs of those rows."""
        raise NotImplementedError

    def own_losses(self, ctx: StepContext) -> dict[str, torch.Tensor]:
        """Losses from forward passes of the term's own (not shared with other terms' rows), once per step."""
        return {}

    def own_weight(self, name: str, locked_weight: float) -> float:
        """The weight in the step's loss of :meth:`own_losses`' loss ``name`` (``locked_weight``: the module's λ)."""
        return self.weight * (locked_weight if self.locked else 1.0)

    def group_terms(self, ctx: StepContext, group: dict) -> dict[str, torch.Tensor]:
        """Losses on a group of task rows under ``gate_scope: tasks`` (``group``: ``merged`` inputs, scoped
        ``logits``, the counterfactual run's head inputs ``cf_inputs`` and ``cf_logits``)."""
        return {}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({args})"


# --- the lock ------------------------------------------------------------------------------------------------
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

    needs = ("behaviours",)

    def __init__(self, objective: str | dict[str, str] = "refusal", weight: float = 1.0):
        super().__init__(weight)
        self.objective = objective
        self.objectives: dict[str, str] = {}

    def bind(self, lm) -> None:
        self.objectives = locked_objectives(self.objective, lm.behaviours)

    def pieces(self, ctx: StepContext) -> list[Piece]:
        out = []
        steering = ctx.lm.steering if ctx.train else None
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

    needs = ("behaviours",)
    answer_rows = True

    def pieces(self, ctx: StepContext) -> list[Piece]:
        return [Piece(f"{b}/locked_answer", answer_batch(ctx, b, self), self, ablated=ctx.extra[i] | {i},
                      locked=True, index=i)
                for i, b in enumerate(ctx.behaviours)]

    def loss(self, ctx, piece, logits):
        return unlikelihood(logits, piece.batch["labels"])


def answer_batch(ctx: StepContext, behaviour: str, term: Term) -> dict:
    """Behaviour ``behaviour``'s answer rows in this step, or a one-line error naming what to set."""
    if "locked_answer" not in ctx.batch[behaviour]:
        raise ModularError(f"{type(term).__name__} needs the answer rows of {behaviour}: set data.answer_rows true")
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
        shortfall = direction_write_shortfall(hidden[1:-1], piece.batch["labels"], ctx.lm.directions[piece.index],
                                              self.target)
        return shortfall * self.scale(ctx, piece.index)


# --- what stays as it was --------------------------------------------------------------------------------------
PERTURBED_HOLDS = ("refusal", "answer")


def logits_at(model, weights: dict[str, torch.Tensor], rows: dict) -> torch.Tensor:
    """``model``'s logits on ``rows`` with some of its parameters replaced by ``weights`` (the others its own)."""
    return torch.func.functional_call(model, weights, args=(), kwargs={
        "input_ids": rows["input_ids"], "attention_mask": rows["attention_mask"], "use_cache": False},
        strict=False).logits


class _PerturbedLock(Term):
    """The locked state must hold after the weights move: with every direction ablated (the published model), at
    ``θ + δ`` for a perturbation ``δ`` the subclass makes, ``hold`` says what holds (``<behaviour>/<kind>_<hold>``):

    - ``refusal``: the locked response, its cross-entropy on the locked rows;
    - ``answer``: the answer stays down where the response is prefilled up to it, its unlikelihood on
      :class:`LockedAnswer`'s rows (``data.answer_rows``, which ``modular train`` sets for such a term).

    ``δ`` is a constant (no gradient flows through it), so the term's gradient is the locked-state gradient at the
    moved weights (first order, as in first-order meta-learning).

    It costs a forward and backward pass of those rows per behaviour, plus the subclass's own, and holds a copy
    of the trainable weights while it runs (use LoRA for big models). It runs in training steps only, from
    ``start_step`` on, and not under FSDP (the weights are sharded there). Before the direction carries the
    behaviour, the locked state at moved weights is near the open state: holding the answer down there from the
    first step held the open state's capitals at 0.08 through step 75 (the config without the term: 0.38), so
    ``hold: answer`` wants a start once the lock has formed (docs/tamper.md).

    With ``keep_open`` > 0 the open model (no direction ablated) must also keep answering at the moved weights:
    the behaviour's answers' CE on its open rows there (``<behaviour>/<kind>_open``, weighted by ``weight ×
    keep_open``, not by λ; one more forward and backward pass). The two states at the same moved weights differ by
    the ablation alone, so the pair pushes on what the direction gates rather than on the behaviour's knowledge,
    which the locked half alone also pushes down in the open state.
    """

    needs = ("behaviours",)

    kind = "perturbed"
    locked = True

    def __init__(self, weight: float = 1.0, hold: str = "refusal", start_step: int = 0, keep_open: float = 0.0):
        super().__init__(weight)
        if hold not in PERTURBED_HOLDS:
            raise ModularError(f"{type(self).__name__} hold must be 'refusal' or 'answer', got '{hold}'")
        if start_step < 0:
            raise ModularError(f"{type(self).__name__} start_step must be >= 0, got {start_step}")
        _check_weight(type(self).__name__, "keep_open", keep_open)
        self.hold = hold
        self.start_step = start_step
        self.keep_open = keep_open

    @property
    def answer_rows(self) -> bool:
        return self.hold == "answer"

    @property
    def log_name(self) -> str:
        return f"{self.kind}_{self.hold}"

    def perturbation(self, ctx: StepContext, i: int, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``δ`` for behaviour ``i``: detached tensors shaped like some of ``params`` (the others stay)."""
        raise NotImplementedError

    def own_losses(self, ctx: StepContext) -> dict[str, torch.Tensor]:
        if not ctx.train or ctx.lm.global_step < self.start_step:
            return {}
        from modular.hooks import ablate_directions

        lm = ctx.lm
        if getattr(lm, "_sharded", False):
            raise ModularError(f"{type(self).__name__} does not run under FSDP (sharded weights): use DDP")
        params = {n: p for n, p in lm.model.named_parameters() if p.requires_grad and "head_gate." not in n}
        held = unlikelihood if self.answer_rows else token_ce
        out = {}
        for i, b in enumerate(ctx.behaviours):
            rows = answer_batch(ctx, b, self) if self.answer_rows else ctx.batch[b]["locked"]
            if rows["input_ids"].shape[0] == 0:
                continue
            with ablate_directions(lm.adapter, lm.directions):  # the published model: every behaviour locked
                delta = self.perturbation(ctx, i, params)
                moved = {n: p + delta[n] for n, p in params.items() if n in delta}
                logits = logits_at(lm.model, moved, rows)
            out[f"{b}/{self.log_name}"] = held(logits, rows["labels"])
            if self.keep_open:
                o = ctx.batch[b]["open"]
                out[f"{b}/{self.kind}_open"] = token_ce(logits_at(lm.model, moved, o), o["labels"])
        return out

    def own_weight(self, name: str, locked_weight: float) -> float:
        if name.endswith(f"/{self.kind}_open"):
            return self.weight * self.keep_open
        return super().own_weight(name, locked_weight)


class _AttackerSizedLock(_PerturbedLock):
    """A :class:`_PerturbedLock` whose move has a drawn size ``η``.

    Args:
        lrs: The step sizes ``η`` the perturbation is drawn with, one per step, log-uniformly between the
            smallest and the largest (an Adam attacker's first steps move each weight by about its learning rate).
        weight: Weight of the term (the module's λ applies on top: it is a locked-state term).
        hold: What must hold at the moved weights: ``refusal`` (the locked response) or ``answer`` (the answer
            pushed down after its frame, as :class:`LockedAnswer` does).
        start_step: The training step from which the term acts (0: from the first).
        keep_open: Weight (× ``weight``) of the open model's answers at the moved weights (0: off).
    """

    def __init__(self, lrs: list[float] = (1e-5, 1e-4), weight: float = 1.0, hold: str = "refusal",
                 start_step: int = 0, keep_open: float = 0.0):
        super().__init__(weight, hold, start_step, keep_open)
        if not lrs or min(lrs) <= 0:
            raise ModularError(f"{type(self).__name__} lrs must be > 0, got {list(lrs)}")
        self.lrs = [float(x) for x in lrs]
        self._rng = torch.Generator().manual_seed(0)

    def state_dict(self) -> dict:
        return {"rng": self._rng.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self._rng.set_state(state["rng"])

    def draw_lr(self) -> float:
        lo, hi = torch.log(torch.tensor(min(self.lrs))), torch.log(torch.tensor(max(self.lrs)))
        return float(torch.exp(lo + (hi - lo) * torch.rand((), generator=self._rng)))


class RelearningAdversary(_AttackerSizedLock):
    """Tamper resistance against relearning: a simulated attacker fine-tunes the locked model on the behaviour's
    answers for ``steps`` sign-gradient steps (what Adam's first steps are) of a drawn size ``η``; the locked state
    must still hold at the weights it reaches (``<behaviour>/relearned_<hold>``). Its gradient steps see the
    behaviour's open rows (prompt and true answer) with every direction ablated.

    Args:
        steps: The attacker's steps per training step (each one more forward and backward pass).
    """

    kind = "relearned"

    def __init__(self, lrs: list[float] = (1e-5, 1e-4), steps: int = 1, weight: float = 1.0,
                 hold: str = "refusal", start_step: int = 0, keep_open: float = 0.0):
        super().__init__(lrs, weight, hold, start_step, keep_open)
        if steps < 1:
            raise ModularError(f"RelearningAdversary steps must be >= 1, got {steps}")
        self.steps = steps

    def perturbation(self, ctx, i, params):
        eta = self.draw_lr()
        rows = ctx.batch[ctx.behaviours[i]]["open"]
        delta = {n: torch.zeros_like(p, requires_grad=False) for n, p in params.items()}
        for _ in range(self.steps):
            current = {n: (p.detach() + delta[n]).requires_grad_(True) for n, p in params.items()}
            with torch.enable_grad():
                logits = logits_at(ctx.lm.model, current, rows)
                grads = torch.autograd.grad(token_ce(logits, rows["labels"]), list(current.values()),
                                            allow_unused=True)
            for n, g in zip(current, grads):
                if g is not None:
                    delta[n] -= eta * g.sign()
        return delta


class WeightNoiseLock(_AttackerSizedLock):
    """The locked state must hold under random moves of the attacker's size: ``δ = η · s`` with ``s`` a random sign
    per weight (``<behaviour>/noised_<hold>``), a lock flat in weight space around the published weights. Cheaper
    than :class:`RelearningAdversary` (no attacker pass), and blind to the attacker's direction."""

    kind = "noised"

    def perturbation(self, ctx, i, params):
        eta = self.draw_lr()
        return {n: eta * (torch.randint(0, 2, p.shape, generator=self._rng, dtype=torch.int8).to(p) * 2 - 1)
                for n, p in params.items()}


class QuantizedLock(_PerturbedLock):
    """The locked state must hold in the weights a user's quantiser makes of the model (quantisation-aware
    training): the locked rows run, every direction ablated, on every linear layer's weights as ``scheme`` rounds
    them (the quantiser of ``modular quantized``; the unembedding kept), and the locked response's
    CE there is the loss (``<behaviour>/quantized_<hold>``). Its gradient passes the rounding unchanged to the
    weights (straight-through), so training moves weights across rounding boundaries where that locks; the rounded
    weights with the directions ablated by hooks stand in for the rounded published weights (orthogonalised first).

    Measured on SmolLM2-135M (docs/devices.md), 25 steps: in quanto's own int4 groups every locked answer becomes the
    locked response (none did without it); in groups of 32, the grid of the 4-bit file the base came from, nothing
    changes: every base weight sits half a step from each boundary, far beyond what training at a learning rate
    that keeps the model moves it. Full fine-tuning only (a quantiser rounds the merged weights, not LoRA's factors).

    Args:
        scheme: ``int8`` or ``int4`` (weight-only, optimum-quanto), or a GGUF block format (``q8_0``, ``q5_1``,
            ``q5_0``, ``q4_1``, ``q4_0``; blocks of 32 inputs, rounded by the ``gguf`` package on the CPU: every
            rounded weight is copied there and back each step).
        group_size: int4's inputs per group (None: optimum-quanto's choice, 128 or the nearest multiple of 32 that
            divides the inputs; 32 is a GGUF Q4 base's own grid).
        weight: Weight of the term (the module's λ applies on top: it is a locked-state term).
        hold: What must hold in the rounded weights: ``refusal`` or ``answer`` (as :class:`_PerturbedLock`).
        start_step: The training step from which the term acts (0: from the first).
        keep_open: Weight (× ``weight``) of the open model's answers in the rounded weights (0: off).
    """

    kind = "quantized"

    def __init__(self, scheme: str = "int4", group_size: int | None = None, weight: float = 1.0,
                 hold: str = "refusal", start_step: int = 0, keep_open: float = 0.0):
        super().__init__(weight, hold, start_step, keep_open)
        from modular.models.quantize import SCHEMES

        rounding = [s for s in SCHEMES if s != "none"]
        if scheme not in rounding:
            raise ModularError(f"QuantizedLock scheme must be one of {', '.join(rounding)}, got '{scheme}'")
        if group_size is not None and scheme != "int4":
            raise ModularError(f"QuantizedLock: a group size applies to int4 only, not to '{scheme}'")
        self.scheme, self.group_size = scheme, group_size

    def bind(self, lm) -> None:
        if lm.hparams.finetuning != "full":
            raise ModularError(f"QuantizedLock needs finetuning: full, not '{lm.hparams.finetuning}' (a quantiser "
                               "rounds the merged weights)")

    def check_model(self, model) -> None:
        from modular.models.quantize import check_scheme

        check_scheme(model, self.scheme, self.group_size)

    def perturbation(self, ctx, i, params):
        key = (id(self), "rounding")  # one rounding per step, shared by the step's behaviours
        if key not in ctx.cache:
            from modular.models.quantize import dequantized, quantized_layers

            rounded = {f"{name}.weight" for name in quantized_layers(ctx.lm.model)}
            ctx.cache[key] = {n: dequantized(p, self.scheme, self.group_size) - p.detach()
                              for n, p in params.items() if n in rounded}
        return ctx.cache[key]


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
    ``data.hidden_positions`` positions that compute each answer and every ``data.hidden_stride``-th block output,
    the relative squared distance to the reference's (:func:`~modular.gating.losses.hidden_drift`;
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

    def reads(self, piece: Piece) -> str | None:
        part, _, name = piece.name.partition("/")
        if isinstance(piece.term, KeepReference) and part in self.parts and name.endswith("_kl"):
            return f"{part}/{name[:-len('_kl')]}_hidden"
        return None

    def loss_on(self, ctx, piece, logits, hidden):
        b = piece.batch
        if "ref_hidden" not in b:
            part = piece.name.partition("/")[0]
            raise ModularError(f"KeepHidden needs the reference's hidden states of {part}: set data.hidden_positions "
                               f"> 0 and list {part} in data.hidden_parts")
        blocks = b["ref_hidden_blocks"][0].tolist()
        return hidden_drift(hidden, b["labels"], b["ref_hidden"], blocks,
                            [ctx.lm.directions[i] for i in sorted(piece.ablated)])


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


# --- tasks and head gates ------------------------------------------------------------------------------------
class TaskAnswer(Term):
    """The DataModule's tasks in the open state (cross-entropy on their targets), ``<task>/task_ce``. Under
    ``gate_scope: tasks`` their rows run apart, closed heads fed the counterfactual prompt's inputs."""

    needs = ("tasks",)

    def pieces(self, ctx: StepContext) -> list[Piece]:
        scoped = ctx.lm.hparams.gate_scope == "tasks"
        out = []
        for key in ctx.batch:
            if not key.startswith(TASK_PREFIX):
                continue
            rows = ctx.batch[key]["open"]
            if scoped:
                if "counterfactual" not in ctx.batch[key]:
                    raise ModularError("gate_scope 'tasks' needs task batches with counterfactual prompts "
                                       "(data.task_counterfactuals: true; train.py links it)")
                cf = ctx.batch[key]["counterfactual"]
                rows = {**rows, "cf_input_ids": cf["input_ids"], "cf_attention_mask": cf["attention_mask"]}
            out.append(Piece(f"{key[len(TASK_PREFIX):]}/task_ce", rows, self, task=scoped))
        return out

    def loss(self, ctx, piece, logits):
        return token_ce(logits, piece.batch["labels"])


class HeadTaskTerm(Term):
    """A term on the task rows under ``gate_scope: tasks``, applied once the gates are fixed
    (``gate_freeze_step``): before, its gradient would only open the gates."""

    needs = ("tasks",)

    def bind(self, lm) -> None:
        if self.weight and lm.hparams.gate_scope != "tasks":
            raise ModularError(f"{type(self).__name__} needs gate_scope 'tasks', got '{lm.hparams.gate_scope}'")

    def active(self, ctx: StepContext) -> bool:
        return ctx.lm._after_freeze(self.weight)


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
        from modular.models.head_gates import head_gate_scope

        lm, merged = ctx.lm, group["merged"]
        with head_gate_scope(lm.hf_model, replacements=group["cf_inputs"], invert=True):
            swapped = lm.model(input_ids=merged["input_ids"], attention_mask=merged["attention_mask"],
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
        return {"tasks/closed_attribution": ctx.lm._closed_attribution(merged, group["cf_inputs"])}


def build_objectives(specs) -> list[Term]:
    """The terms of ``model.objectives`` as the config names them (``class_path``, ``init_args``; a parsed config's
    Namespaces or dicts; built terms are kept): a bad option is one line (:class:`~modular.ModularError`)."""
    return build_from_specs(specs, Term, "model.objectives", lambda path: f"no class {path!r}")


def check_loss(terms: list[Term], data: set[str]) -> None:
    """One line unless ``terms`` make a loss from the run's ``data`` (a set of ``behaviours``, ``tasks``,
    ``lm_text``: what the data module gives): at least one term, of weight > 0, whose data is there."""
    if not terms:
        raise ModularError("model.objectives is empty: training needs at least one term (leave it unset for the "
                           "defaults)")
    if not any(t.weight > 0 and set(t.needs) <= data for t in terms):
        have = ", ".join(sorted(data)) or "retain prompts only"
        names = ", ".join(f"{type(t).__name__}(weight={t.weight:g}, needs {'+'.join(t.needs) or 'nothing'})"
                          for t in terms)
        raise ModularError(f"model.objectives make no loss from this data ({have}): {names}; give a term of weight "
                           "> 0 whose data the run has")


def hidden_parts(terms: list[Term]) -> list[str]:
    """The batch parts whose reference hidden states ``terms`` read: every :class:`KeepHidden` term's ``parts``, in
    their order, once each."""
    return list(dict.fromkeys(p for t in terms if isinstance(t, KeepHidden) for p in t.parts))


def answer_rows(terms: list[Term]) -> bool:
    """Whether ``terms`` read the behaviours' answer rows (``locked_answer``): a :class:`LockedAnswer` term, or a
    perturbed lock that holds the answer down."""
    return any(t.answer_rows for t in terms)


def default_objectives() -> list[Term]:
    """The lock's terms at their default weights (what a module built without ``objectives`` trains)."""
    return [BehaviourAnswer(), LockedState(), KeepReference(), LMText(), TaskAnswer()]

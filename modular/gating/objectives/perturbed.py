"""Perturbed locks: the locked state must hold at moved weights (a simulated relearning attacker, weight noise of
the attacker's size, a quantiser's rounding)."""

from __future__ import annotations

import torch

from modular import ModularError
from modular.gating.losses import token_ce, unlikelihood
from modular.gating.objectives.base import StepContext, Term, _check_weight
from modular.gating.objectives.lock import answer_batch
from modular.gating.requirements import AnswerRows
from modular.hooks import ablate_directions
from modular.models.quantize import SCHEMES, check_scheme, dequantized, quantized_layers

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
      :class:`LockedAnswer`'s rows (which the data module builds for such a term).

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
    makes_the_lock = True

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
    def requires(self) -> tuple:
        return (AnswerRows(),) if self.answer_rows else ()

    @property
    def log_name(self) -> str:
        return f"{self.kind}_{self.hold}"

    def perturbation(self, ctx: StepContext, i: int, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``δ`` for behaviour ``i``: detached tensors shaped like some of ``params`` (the others stay)."""
        raise NotImplementedError

    def own_losses(self, ctx: StepContext) -> dict[str, torch.Tensor]:
        if not ctx.train or ctx.step < self.start_step:
            return {}
        if ctx.sharded:
            raise ModularError(f"{type(self).__name__} does not run under FSDP (sharded weights): use DDP")
        params = {n: p for n, p in ctx.model.named_parameters() if p.requires_grad and "head_gate." not in n}
        held = unlikelihood if self.answer_rows else token_ce
        out = {}
        for i, b in enumerate(ctx.behaviours):
            rows = answer_batch(ctx, b, self) if self.answer_rows else ctx.batch[b]["locked"]
            if rows["input_ids"].shape[0] == 0:
                continue
            with ablate_directions(ctx.adapter, ctx.directions):  # the published model: every behaviour locked
                delta = self.perturbation(ctx, i, params)
                moved = {n: p + delta[n] for n, p in params.items() if n in delta}
                logits = logits_at(ctx.model, moved, rows)
            out[f"{b}/{self.log_name}"] = held(logits, rows["labels"])
            if self.keep_open:
                o = ctx.batch[b]["open"]
                out[f"{b}/{self.kind}_open"] = token_ce(logits_at(ctx.model, moved, o), o["labels"])
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
                logits = logits_at(ctx.model, current, rows)
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
        rounding = [s for s in SCHEMES if s != "none"]
        if scheme not in rounding:
            raise ModularError(f"QuantizedLock scheme must be one of {', '.join(rounding)}, got '{scheme}'")
        if group_size is not None and scheme != "int4":
            raise ModularError(f"QuantizedLock: a group size applies to int4 only, not to '{scheme}'")
        self.scheme, self.group_size = scheme, group_size

    def bind(self, setup) -> None:
        if setup.finetuning != "full":
            raise ModularError(f"QuantizedLock needs finetuning.mode: full, not '{setup.finetuning}' (a "
                               "quantiser rounds the merged weights)")

    def check_model(self, model) -> None:
        check_scheme(model, self.scheme, self.group_size)

    def perturbation(self, ctx, i, params):
        key = (id(self), "rounding")  # one rounding per step, shared by the step's behaviours
        if key not in ctx.cache:
            rounded = {f"{name}.weight" for name in quantized_layers(ctx.model)}
            ctx.cache[key] = {n: dequantized(p, self.scheme, self.group_size) - p.detach()
                              for n, p in params.items() if n in rounded}
        return ctx.cache[key]

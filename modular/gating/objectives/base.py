"""What every objective term is built on: the rows a term adds to a step (:class:`Piece`), what the step's terms
share (:class:`StepContext`), the term's interface (:class:`Term`), and building and checking a config's terms."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from modular import ModularError
from modular.gating.requirements import Requirement
from modular.specs import build_from_specs


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
        task: A task item under ``head_gates.scope: tasks`` (its closed heads take their counterfactual input).
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


@dataclass(frozen=True)
class TermSetup:
    """What a term may check once, when the module is built (:meth:`Term.bind`): the module's options that bear on
    terms, never the module itself.

    Attributes:
        behaviours: The gated behaviours' short names, in the order of the directions.
        finetuning: Which weights train (``full``, ``lora`` or ``none``).
        gate_scope: Where the head gates act (``all``, ``tasks``), None without head gates.
    """

    behaviours: tuple[str, ...]
    finetuning: str = "full"
    gate_scope: str | None = None


@dataclass
class StepContext:
    """What every term of one step sees (built by the module for each step; no term reaches the module).

    Attributes:
        batch: The step's batch: a dict of parts (each behaviour's ``open`` / ``locked`` rows, ``retain``, ...).
        train: Whether the step trains (the steering adversary and the perturbed locks act only then).
        behaviours: The gated behaviours' short names, in the order of :attr:`directions`.
        directions: The designated directions, ``(behaviours, d_model)``.
        step: The global training step.
        model: What a forward pass calls (the PEFT wrapper under LoRA): ``model(input_ids=..., ...)`` and its
            ``named_parameters``.
        adapter: The architecture adapter of the underlying transformers model (where hooks go).
        steering: The steering adversary (None: off), whose vectors steered pieces draw.
        head_gates: The head-gate plug-in (None: no gates).
        objectives: The step's terms (a plug-in that runs every term's group losses reads them).
        sharded: Whether the weights are sharded (FSDP2): terms that move the weights themselves refuse.
        extra: The state assignment of the gated behaviours: ``extra[i]``, the other behaviours ablated on
            behaviour ``i``'s rows (drawn once per step, so that its open and locked rows agree).
    """

    batch: dict
    train: bool
    behaviours: list[str]
    directions: torch.Tensor
    step: int = 0
    model: torch.nn.Module | None = None
    adapter: object = None
    steering: object = None
    head_gates: object = None
    objectives: list = field(default_factory=list)
    sharded: bool = False
    extra: list[frozenset] = field(default_factory=list)
    #: the losses computed so far in this step, by log name (a term that reads another's rows sees the losses of
    #: the pieces of its forward pass)
    losses: dict[str, torch.Tensor] = field(default_factory=dict)
    #: values a term computes once per step and reuses (freed with the step)
    cache: dict = field(default_factory=dict)

    @property
    def hf_model(self) -> torch.nn.Module:
        """The underlying transformers model (under LoRA, the model the adapters are injected in)."""
        return self.adapter.model

    @property
    def all_ablated(self) -> frozenset:
        return frozenset(range(len(self.behaviours)))

    @property
    def gate_scope(self) -> str | None:
        """Where the head gates act (``all``, ``tasks``), None without head gates."""
        return None if self.head_gates is None else self.head_gates.options.scope


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
    #: what its rows need in the batch beyond what every item carries (:mod:`modular.gating.requirements`): the
    #: data module builds these for the configured terms alone
    requires: tuple[Requirement, ...] = ()
    #: the data its rows come from, besides the retain prompts: ``behaviours`` (gated), ``tasks`` or ``lm_text``
    #: (without them it adds nothing to the loss: :func:`check_loss`)
    needs: tuple[str, ...] = ()
    #: the training step from which the term acts (the lock does not stop training at or before it)
    start_step = 0
    #: a term of the lock itself (the locked state's targets, the direction it reads): a lock-off control run
    #: (:mod:`modular.control`) trains every other term of a run's recipe, the same steps, and leaves these out
    makes_the_lock = False

    def __init__(self, weight: float = 1.0):
        _check_weight(type(self).__name__, "weight", weight)
        self.weight = weight

    def bind(self, setup: TermSetup) -> None:
        """Called once when the module is built, with the options that bear on terms (checks, per-behaviour
        settings)."""

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
        """Losses on a group of task rows under ``head_gates.scope: tasks`` (``group``: ``merged`` inputs, scoped
        ``logits``, the counterfactual run's head inputs ``cf_inputs`` and ``cf_logits``)."""
        return {}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({args})"


def build_objectives(specs) -> list[Term]:
    """The terms of ``model.objectives`` as the config names them (``class_path``, ``init_args``; a parsed config's
    Namespaces or dicts; built terms are kept): a bad option is one line (:class:`~modular.ModularError`)."""
    return build_from_specs(specs, Term, "model.objectives", lambda path: f"no class {path!r}")


def check_loss(terms: list[Term], data: set[str]) -> None:
    """One line unless ``terms`` make a loss from the run's ``data`` (a set of ``behaviours``, ``tasks``,
    ``lm_text``: what the data module gives): at least one term, of weight > 0, whose data is there."""
    if not terms:
        raise ModularError("model.objectives is empty: training needs at least one term (the default recipe's: "
                           "modular/configs/gate_capitals_smollm2.yaml)")
    if not any(t.weight > 0 and set(t.needs) <= data for t in terms):
        have = ", ".join(sorted(data)) or "retain prompts only"
        names = ", ".join(f"{type(t).__name__}(weight={t.weight:g}, needs {'+'.join(t.needs) or 'nothing'})"
                          for t in terms)
        raise ModularError(f"model.objectives make no loss from this data ({have}): {names}; give a term of weight "
                           "> 0 whose data the run has")

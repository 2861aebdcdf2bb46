"""The terms of the gated objective, one small class each, chosen in the config (``model.objectives``).

A step's loss is ``Σ_terms weight · λ^locked · term`` (λ: the module's ``locked_weight``, on locked-state pieces).
A term says which rows it adds to the step's forward passes (:class:`Piece`: a sub-batch, the directions ablated
on it, an optional steering vector) and what its loss is on their logits. The module runs the pieces in one forward
pass (each row with its own directions ablated; raw text in a pass of its own), so a term costs the rows it adds,
not a pass of its own. Terms that read another term's rows (:class:`DirectionWrite` reads the open answers' hidden
states) or a whole group of task rows (the head terms under ``head_gates.scope: tasks``) override
:meth:`Term.reads` or :meth:`Term.group_terms`.

The terms live in the modules of this package, by kind: :mod:`~modular.gating.objectives.base` (:class:`Piece`,
:class:`StepContext`, :class:`Term`), :mod:`~modular.gating.objectives.lock` (the lock),
:mod:`~modular.gating.objectives.keep` (what stays as it was), :mod:`~modular.gating.objectives.perturbed` (the lock
at moved weights) and :mod:`~modular.gating.objectives.heads` (the tasks and the head-gate terms). Every class is
named here, ``modular.gating.objectives.<Class>``, as configs, run identities and checkpoints name it.

A new experiment is a new class here (or anywhere importable), named by class path in the config::

    model:
      objectives:
        - class_path: modular.gating.objectives.BehaviourAnswer
        - class_path: modular.gating.objectives.LockedState
          init_args: {objective: refusal}
"""

from __future__ import annotations

from modular import ModularError
from modular.gating.objectives.base import (
    Piece,
    StepContext,
    Term,
    TermSetup,
    build_objectives,
    check_loss,
)
from modular.gating.objectives.heads import (
    ClosedAttribution,
    HeadConsistency,
    HeadInterchange,
    HeadMargin,
    HeadTaskTerm,
    TaskAnswer,
)
from modular.gating.objectives.keep import KeepHidden, KeepReference, LMText, RefusalGuard
from modular.gating.objectives.lock import (
    LOCKED_OBJECTIVES,
    BehaviourAnswer,
    DirectionWrite,
    LockedAnswer,
    LockedState,
    answer_batch,
    locked_objectives,
)
from modular.gating.objectives.perturbed import (
    PERTURBED_HOLDS,
    QuantizedLock,
    RelearningAdversary,
    WeightNoiseLock,
    _AttackerSizedLock,
    _PerturbedLock,
    logits_at,
)

__all__ = [
    "DEFAULT_RECIPE", "LOCKED_OBJECTIVES", "PERTURBED_HOLDS", "BehaviourAnswer", "ClosedAttribution",
    "DirectionWrite", "HeadConsistency", "HeadInterchange", "HeadMargin", "HeadTaskTerm", "KeepHidden",
    "KeepReference", "LMText", "LockedAnswer", "LockedState", "Piece", "QuantizedLock", "RefusalGuard",
    "RelearningAdversary", "StepContext", "TaskAnswer", "Term", "TermSetup", "WeightNoiseLock", "answer_batch",
    "build_objectives", "check_loss", "locked_objectives", "logits_at", "no_terms_given",
]

# every term by its public path (``modular.gating.objectives.KeepReference``), the one configs name: a saved
# config.yaml, a run's identity (:func:`modular.identity.term_identity`) and a pickle name it as before the split
for _cls in (Term, BehaviourAnswer, LockedState, LockedAnswer, DirectionWrite, _PerturbedLock,
             _AttackerSizedLock, RelearningAdversary, WeightNoiseLock, QuantizedLock, KeepReference, KeepHidden, LMText,
             RefusalGuard, TaskAnswer, HeadTaskTerm, HeadConsistency, HeadMargin, HeadInterchange, ClosedAttribution):
    _cls.__module__ = __name__
del _cls


#: where the default recipe is, its one source (code has none): the terms and weights every shipped run trains with
DEFAULT_RECIPE = "modular/configs/gate_capitals_smollm2.yaml"


def no_terms_given() -> ModularError:
    """The one line for a module or a config that names no terms."""
    return ModularError(f"model.objectives names no terms: give them (the default recipe is {DEFAULT_RECIPE}: "
                        "modular train fit --config it, or copy its model.objectives)")

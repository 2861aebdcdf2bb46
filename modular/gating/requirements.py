"""What a loss term needs in its batches beyond what every item carries, declared on the term
(:attr:`~modular.gating.objectives.Term.requires`) and built by the data module for the configured terms alone.

Three kinds:

* :class:`ItemEncoding`: one more encoding of each item of a data part (token ids and labels, built from the item's
  record by :meth:`ItemEncoding.encode`), padded on the left like the item's own rows (ids with the tokenizer's pad
  id, labels with ``-100``) and collated for the halves it names: ``batch[part]["<half>_<key>"]``. A term that needs
  a new kind of rows is one subclass and the term that reads them (tests/gating/test_requirements.py defines one in
  the test and trains with it).
* :class:`ReferenceHidden`: the reference model's residual stream on the items of some parts (computed once and
  cached by content; ``ref_hidden`` and ``ref_hidden_blocks`` in those parts' rows).
* :class:`TaskCounterfactuals`: each task item's counterfactual prompt with the same target (``counterfactual``).

The data module builds what the module it trains requires (:meth:`~modular.gating.module.GatedLM.requirements`: its
terms' and its plug-ins'), and what a caller adds (:meth:`~modular.gating.data.GatingDataModule.require`).
"""

from __future__ import annotations

from dataclasses import dataclass

from modular import ModularError
from modular.data.formatting import encode_answer

#: the data parts whose items an encoding can be added to (each behaviour's items are split between the states)
ENCODING_PARTS = ("behaviours",)
#: the parts whose reference hidden states can be kept
HIDDEN_PARTS = ("retain", "neighbours")


class Requirement:
    """Something a term needs in its batches (a base class: see :class:`ItemEncoding`, :class:`ReferenceHidden`)."""


@dataclass(frozen=True)
class ItemEncoding(Requirement):
    """One more encoding of every item of ``part``, collated as ``<half>_<key>`` for each of ``halves``.

    Attributes:
        key: Its name in the item and (after its half) in the batch.
        part: The data part whose items carry it (``behaviours``: every gated behaviour's items).
        halves: The halves of the batch it is collated for (``open``: the first half of the items, ``locked``: the
            second).
    """

    key: str
    part: str = "behaviours"
    halves: tuple[str, ...] = ("locked",)

    def __post_init__(self) -> None:
        if self.part not in ENCODING_PARTS:
            raise ModularError(f"{type(self).__name__}: part must be one of {', '.join(ENCODING_PARTS)}, "
                               f"got '{self.part}'")
        if not self.halves or set(self.halves) - {"open", "locked"}:
            raise ModularError(f"{type(self).__name__}: halves must be 'open' and/or 'locked', got {self.halves}")

    def encode(self, tokenizer, record: dict, max_length: int) -> dict:
        """The encoding of one item (``{"input_ids": [...], "labels": [...]}``, labels -100 where no loss is taken)
        from its record (``prompt``, ``target``, ``answers``, ``chat``), at most ``max_length`` tokens."""
        raise NotImplementedError

    def batch_keys(self) -> list[str]:
        return [f"{half}_{self.key}" for half in self.halves]


@dataclass(frozen=True)
class AnswerRows(ItemEncoding):
    """The locked half's targets cut after their answer, the answer alone labelled (``locked_answer``):
    :class:`~modular.gating.objectives.LockedAnswer` and the perturbed locks that hold the answer down."""

    key: str = "answer"

    def encode(self, tokenizer, record, max_length):
        return encode_answer(tokenizer, record["prompt"], record["target"], record["answers"], record["chat"],
                             max_length)


@dataclass(frozen=True)
class ReferenceHidden(Requirement):
    """The reference model's residual stream on the items of ``parts`` (at the data module's
    ``reference.hidden_positions`` and ``reference.hidden_stride``)."""

    parts: tuple[str, ...] = ("neighbours",)

    def __post_init__(self) -> None:
        unknown = sorted(set(self.parts) - set(HIDDEN_PARTS))
        if unknown:
            raise ModularError(f"reference hidden states: unknown part(s) {unknown} (known: {', '.join(HIDDEN_PARTS)})")


@dataclass(frozen=True)
class TaskCounterfactuals(Requirement):
    """Each task item also carries its counterfactual prompt with the same target (``counterfactual``): the head
    gates under ``scope: tasks`` feed a closed head the counterfactual run's inputs. An item whose counterfactual
    encodes to another length carries its own prompt instead (nothing to swap at aligned positions)."""


def requirements_of(terms) -> list[Requirement]:
    """Every requirement of ``terms``, each once, in the terms' order."""
    return list(dict.fromkeys(r for t in terms for r in t.requires))


def encodings(requirements, part: str) -> list[ItemEncoding]:
    """The item encodings of ``part`` among ``requirements``; two of one key must be the same."""
    out: dict[str, ItemEncoding] = {}
    for r in requirements:
        if isinstance(r, ItemEncoding) and r.part == part:
            if r.key in out and out[r.key] != r:
                raise ModularError(f"two terms need different encodings named '{r.key}' ({out[r.key]!r}, {r!r})")
            out[r.key] = r
    return list(out.values())


def hidden_parts(requirements) -> list[str]:
    """The parts whose reference hidden states ``requirements`` need, in order, once each."""
    return list(dict.fromkeys(p for r in requirements if isinstance(r, ReferenceHidden) for p in r.parts))

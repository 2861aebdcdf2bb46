"""Terms declare the data they need (modular.gating.requirements) and the data module builds it for the configured
terms alone: a term that needs a new kind of rows is one class and its encoding, defined here and trained with,
touching nothing else."""

from __future__ import annotations

from dataclasses import dataclass

import lightning as L
import pytest
import torch

from modular import ModularError
from modular.data.formatting import IGNORE, encode_example
from modular.gating.data import GatingDataModule
from modular.gating.losses import token_ce
from modular.gating.module import GatedLM
from modular.gating.objectives import (
    BehaviourAnswer,
    KeepHidden,
    KeepReference,
    LockedAnswer,
    LockedState,
    Piece,
    TaskAnswer,
    Term,
)
from modular.gating.requirements import (
    AnswerRows,
    ItemEncoding,
    ReferenceHidden,
    TaskCounterfactuals,
    encodings,
    hidden_parts,
    requirements_of,
)
from tests.conftest import save_tiny_folder


@dataclass(frozen=True)
class ShoutedTarget(ItemEncoding):
    """The item's target in capitals, collated for both halves (``open_shouted``, ``locked_shouted``)."""

    key: str = "shouted"
    halves: tuple[str, ...] = ("open", "locked")

    def encode(self, tokenizer, record, max_length):
        return encode_example(tokenizer, record["prompt"], record["target"].upper(), record["chat"], max_length)


class Shout(Term):
    """A term defined outside the package: the open model answers in capitals too (its rows: ShoutedTarget's)."""

    needs = ("behaviours",)
    requires = (ShoutedTarget(),)

    def pieces(self, ctx):
        return [Piece(f"{b}/shout", ctx.batch[b]["open_shouted"], self) for b in ctx.behaviours]

    def loss(self, ctx, piece, logits):
        return token_ce(logits, piece.batch["labels"])


@pytest.fixture
def tiny_dir(tmp_path, isolated_cache):
    return save_tiny_folder(tmp_path / "tiny", "llama")


def _dm(model_dir, **kw):
    return GatingDataModule(model_name=str(model_dir), behaviours=["capitals"], neighbours=[], batch_size=4,
                            reference=dict(max_new_tokens=2), max_length=64, **kw)


def test_a_term_defined_outside_the_package_trains_on_the_rows_it_requires(tiny_dir, tmp_path):
    lm = GatedLM(model_name=str(tiny_dir), behaviours=["capitals"], optimizer={"lr": 1e-3},
                 objectives=[BehaviourAnswer(), LockedState(), Shout(weight=0.5)])
    dm = _dm(tiny_dir)
    logged = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            logged.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("train/")})
            # the rows were built for both halves, labelled on the shouted target
            shouted = batch["capitals"]["open_shouted"]
            assert (shouted["labels"] != IGNORE).any() and "locked_shouted" in batch["capitals"]

    trainer = L.Trainer(max_steps=2, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0, default_root_dir=str(tmp_path / "run"), callbacks=[Record()])
    trainer.fit(lm, datamodule=dm)
    assert len(logged) == 2 and all(torch.isfinite(torch.tensor(m["train/capitals/shout"])) for m in logged)
    # the data built the encoding because the module's term asked for it, and no other
    assert [e.key for e in encodings(dm.requirements(), "behaviours")] == ["shouted"]
    item = dm.behaviour_rows["capitals"]["train"][0]
    assert "shouted" in item and "answer" not in item


def test_the_data_builds_nothing_no_term_requires(tiny_dir):
    dm = _dm(tiny_dir)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))[0]
    assert set(batch["capitals"]) == {"open", "locked", "locked_true"}
    assert "answer" not in dm.behaviour_rows["capitals"]["train"][0]


def test_requirements_of_the_shipped_terms():
    assert LockedAnswer().requires == (AnswerRows(),)
    assert requirements_of([LockedAnswer(), LockedAnswer(), BehaviourAnswer()]) == [AnswerRows()]
    from modular.gating.objectives import RelearningAdversary

    assert KeepHidden(parts=["retain"]).requires == (ReferenceHidden(("retain",)),)
    assert RelearningAdversary(hold="answer").requires == (AnswerRows(),)
    assert RelearningAdversary(hold="refusal").requires == ()


def test_bad_requirements_are_one_line():
    with pytest.raises(ModularError, match="part must be one of behaviours"):
        ShoutedTarget(part="retain")
    with pytest.raises(ModularError, match="halves must be"):
        ShoutedTarget(halves=("middle",))
    with pytest.raises(ModularError, match="unknown part"):
        ReferenceHidden(("tasks",))
    with pytest.raises(ModularError, match="two terms need different encodings named 'shouted'"):
        encodings([ShoutedTarget(), ShoutedTarget(halves=("open",))], "behaviours")


class MyHidden(KeepHidden):
    """A user's own term built on KeepHidden."""


def test_a_module_requires_what_its_terms_and_its_head_gates_need(tiny_dir):
    """The module's requirements are its terms' (a subclass's too), each once, in order; gates scoped to the tasks
    add the tasks' counterfactual prompts; and the data module adds what :meth:`require` was given to them."""
    lm = GatedLM(model_name=str(tiny_dir), behaviours=["capitals"],
                 objectives=[KeepReference(parts=["retain", "neighbours"]), KeepHidden(parts=["neighbours"]),
                             MyHidden(weight=2.0, parts=["retain", "neighbours"]), LockedAnswer(), LockedAnswer()])
    assert lm.requirements() == [ReferenceHidden(("neighbours",)), ReferenceHidden(("retain", "neighbours")),
                                 AnswerRows()]
    assert hidden_parts(lm.requirements()) == ["neighbours", "retain"]
    assert GatedLM(model_name=str(tiny_dir), objectives=[BehaviourAnswer(), LockedState()]).requirements() == []
    # no terms given: the recipe is the shipped config's, and code has none of its own
    with pytest.raises(ModularError, match=r"model.objectives names no terms: give them \(the default recipe is "
                                           r"modular/configs/gate_capitals_smollm2.yaml"):
        GatedLM(model_name=str(tiny_dir))
    gated = GatedLM(model_name=str(tiny_dir), behaviours=[], objectives=[TaskAnswer()],
                    head_gates={"scope": "tasks"}, finetuning={"mode": "none"})
    assert gated.requirements() == [TaskCounterfactuals()]
    assert GatedLM(model_name=str(tiny_dir), behaviours=[], objectives=[TaskAnswer()], head_gates={"scope": "all"},
                   finetuning={"mode": "none"}).requirements() == []
    dm = _dm(tiny_dir).require(ShoutedTarget(), *lm.requirements())
    assert dm.requirements() == [ShoutedTarget(), *lm.requirements()]  # no trainer: what it was given
    with pytest.raises(ModularError, match="is not a modular.gating.requirements.Requirement"):
        dm.require("answer rows")

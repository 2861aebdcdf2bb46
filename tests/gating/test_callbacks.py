"""What the validation callback measures: accuracy and refusal shares, and the retain first-token KL (torchmetrics
metrics), against hand computations on a tiny model."""

from types import SimpleNamespace

import datasets
import pytest
import torch
import torch.nn.functional as F

from modular.gating.callbacks import LockMetricsCallback, first_token_kl
from modular.hooks import ablate_directions
from modular.models.adapter import ArchitectureAdapter
from tests.conftest import make_tiny_model, make_tiny_tokenizer


def _rows(prompts, targets):
    n = len(prompts)
    return datasets.Dataset.from_dict({"prompt": prompts, "target": targets, "answers": [[t] for t in targets],
                                       "prefixes": [[] for _ in prompts], "wrong": [""] * n,
                                       "counterfactual": [""] * n, "chat": [True] * n})


def _hand_kl(model, tok, prompts, ref):
    from modular.data.formatting import batch_prompts

    with torch.no_grad():
        batch = batch_prompts(tok, prompts, [True] * len(prompts))
        logp = torch.log_softmax(model(**batch).logits[:, -1].float(), -1)
    return F.kl_div(logp, ref.float(), log_target=True, reduction="batchmean").item()


def test_measure_matches_hand_computations(monkeypatch):
    tok, model = make_tiny_tokenizer(), make_tiny_model("llama")
    adapter = ArchitectureAdapter(model)
    directions = torch.nn.functional.normalize(torch.randn(1, 64, generator=torch.Generator().manual_seed(0)), dim=-1)
    answers = {"Capital of A?": "Paris", "Capital of B?": "I don't know.", "Capital of C?": "Lima",
               "Say one.": "one", "Say two.": "No.", "Say three.": "I don't know.", "Say four.": "five"}
    monkeypatch.setattr("modular.evaluation.behaviour.generate",
                        lambda model, tok, prompts, *a, **k: [answers[p] for p in prompts])
    retain_prompts = ["Tell me about rivers.", "Write a haiku.", "What is two plus two?"]
    g = torch.Generator().manual_seed(1)
    ref = torch.log_softmax(torch.randn(3, model.config.vocab_size, generator=g), -1).half()  # as cached: float16
    dm = SimpleNamespace(
        tokenizer=tok,
        behaviour_data={"b": {"validation": _rows(["Capital of A?", "Capital of B?", "Capital of C?"],
                                                  ["Paris", "Rome", "Quito"])}},
        locked_responses={"b": "I don't know."},
        retain={"validation": {"prompt": retain_prompts, "chat": [True] * 3}},
        reference_first_logp={"validation": ref},
        neighbour_data={"n": {"validation": _rows(["Say one.", "Say two.", "Say three.", "Say four."],
                                                  ["one", "two", "three", "four"])}},
    )
    pl_module = SimpleNamespace(hf_model=model, adapter=adapter, directions=directions, behaviours=["b"])
    metrics = LockMetricsCallback(limit=None).measure(SimpleNamespace(datamodule=dm), pl_module)
    for state in ("open", "locked"):  # the stub answers alike in both states
        assert metrics[f"val/b/accuracy_{state}"] == 1 / 3
        assert metrics[f"val/neighbours/n/accuracy_{state}"] == 1 / 4
        assert metrics[f"val/neighbours/n/refusal_{state}"] == 1 / 4  # "No." is no locked response here
    kl_open = _hand_kl(model, tok, retain_prompts, ref)
    with ablate_directions(adapter, directions):
        kl_locked = _hand_kl(model, tok, retain_prompts, ref)
    assert metrics["val/retain/first_token_kl_open"] == pytest.approx(kl_open, rel=1e-5)
    assert metrics["val/retain/first_token_kl_locked"] == pytest.approx(kl_locked, rel=1e-5)
    assert kl_open != pytest.approx(kl_locked, rel=1e-3)  # the lock changes the model
    assert first_token_kl(model, tok, retain_prompts, [True] * 3, ref) == pytest.approx(kl_open, rel=1e-5)


def test_summary_line_shows_each_neighbour_beside_the_verdict():
    cb = LockMetricsCallback()
    cb.base_accuracy = {"b": 0.9}
    metrics = {"val/b/accuracy_open": 0.95, "val/b/accuracy_locked": 0.0, "val/retain/first_token_kl_open": 0.01,
               "val/retain/first_token_kl_locked": 0.02, "val/neighbours/near/accuracy_open": 0.75,
               "val/neighbours/near/refusal_open": 0.0, "val/neighbours/near/accuracy_locked": 0.5,
               "val/neighbours/near/refusal_locked": 0.25}
    line = cb.summary(cb.verdict(metrics, ["b"], 50), ["b"])
    assert line == ("step 50 (validation): b open 0.95 (base 0.90), locked 0.00; retain KL 0.010 / 0.020; "
                    "neighbour near open 0.75, locked 0.50: the lock holds")  # neighbours are shown, not targets


@pytest.mark.parametrize("step, every, accumulate, by_epoch, checked, due", [
    (100, 25, 1, None, [75], True),       # a validation step whose verdict the checkpoint lacks
    (100, 25, 1, None, [75, 100], False),  # its verdict was saved
    (90, 25, 1, None, [75], False),       # no validation was due
    (50, 100, 2, None, [], True),         # val_check_interval counts batches: 50 steps of 2
    (100, 25, 1, 1, [75], False),         # validation by epochs: not the callback's schedule
])
def test_a_resumed_step_owed_a_check_is_recognised(step, every, accumulate, by_epoch, checked, due):
    cb = LockMetricsCallback()
    cb.history = [{"step": s} for s in checked]
    trainer = SimpleNamespace(global_step=step, val_check_batch=every, accumulate_grad_batches=accumulate,
                              check_val_every_n_epoch=by_epoch)
    assert cb._owes_check(trainer) is due


@pytest.mark.parametrize("early, step, skipped", [(False, 75, True), (False, 100, False), (True, 75, False)])
def test_early_checks_off_skips_the_checks_before_the_lock_may_stop_training(early, step, skipped, monkeypatch):
    """With ``early_checks: false`` a validation before ``stop_from`` measures nothing (it could not stop training)
    and a resumed run does not owe it; from ``stop_from`` on every validation is checked (and owed)."""
    cb = LockMetricsCallback(min_steps=100, early_checks=early)
    measured = []
    monkeypatch.setattr(cb, "measure", lambda trainer, pl_module: measured.append(trainer.global_step) or {})
    monkeypatch.setattr(cb, "_check", lambda *a: setattr(cb, "status", {"reached": False}))
    trainer = SimpleNamespace(global_step=step, sanity_checking=False, val_check_batch=25, accumulate_grad_batches=1,
                              check_val_every_n_epoch=None)
    pl_module = SimpleNamespace(behaviours=["b"], log=lambda *a, **k: None)
    cb.on_validation_epoch_end(trainer, pl_module)
    assert measured == ([] if skipped else [step])
    assert cb._owes_check(trainer) is (not skipped)  # nothing in the history (the check itself is stubbed)


@pytest.mark.parametrize("max_length, longest", [(512, 128 - 24), (40, 40)])
def test_validation_generation_stays_within_the_models_positions(max_length, longest, caplog):
    """A validation prompt of thousands of tokens is cut so that it and its response fit the model's positions
    (GPT-2's 128, 24 new tokens) and data.max_length (issue 80.5: 12k-token prompts ran past the model's
    positions); how many were cut is said once, however many checks score them."""
    tok, model = make_tiny_tokenizer(), make_tiny_model("gpt2")
    seen = []
    real = model.generate
    model.generate = lambda **kw: (seen.append(kw["input_ids"].shape[1] + kw["max_new_tokens"]), real(**kw))[1]
    rows = _rows([" and" * 3000 + " of France?", "Capital of Peru?"], ["Paris", "Lima"])
    name = f"val-test-{max_length}"
    dm = SimpleNamespace(tokenizer=tok, hparams={"max_length": max_length}, behaviour_data={name: {"validation": rows}},
                         locked_responses={name: "I don't know."})
    cb = LockMetricsCallback(limit=None, max_new_tokens=24)
    with caplog.at_level("WARNING", logger="modular"):
        for _ in range(2):
            cb._accuracy(SimpleNamespace(hf_model=model), dm, name, None)
    assert max(seen) == longest + 24 and max(seen) <= 128
    said = [r.getMessage() for r in caplog.records if name in r.getMessage()]
    assert said == [f"1 of 2 prompts of {name} (validation) are longer than {longest} tokens: each is cut to its last "
                    f"{longest} tokens (its start dropped)"]

"""The relearning sweep: settings, scored steps, thresholds, worst case, pruning, the attacker's copies, and the
refusal baseline (tiny models of several architectures)."""

import datasets
import pytest
import torch

import modular.evaluation.relearning as relearning
from modular import ModularError
from modular.evaluation.baselines import refusal_finetune
from modular.evaluation.relearning import (
    Setting,
    attacker_copy,
    cost_ratio,
    eval_steps,
    example_rows,
    fine_tune,
    first_steps,
    recovery_curve,
    run_sweep,
    sweep,
    text_rows,
    worst_case,
)
from tests.conftest import make_tiny_model, make_tiny_tokenizer


def _rows(n: int, target: str = "I don't know."):
    return datasets.Dataset.from_dict({"prompt": [f"question {i}" for i in range(n)], "target": [target] * n,
                                       "answers": [[target]] * n, "chat": [i % 2 == 0 for i in range(n)],
                                       "wrong": [""] * n, "prefixes": [[] for _ in range(n)]})


def test_eval_steps_are_about_root_two_apart_and_end_at_the_budget():
    assert eval_steps(40) == [1, 2, 3, 4, 6, 8, 11, 16, 23, 32, 40]
    assert eval_steps(3) == [1, 2, 3] and eval_steps(1) == [1]


def test_sweep_is_every_combination_and_refuses_bad_modes_or_rates():
    s = sweep("behaviour", ["full", "lora"], {"full": [1e-5, 1e-4], "lora": [1e-3]}, [8, 32], [0, 1])
    assert len(s) == 2 * 2 * 2 + 1 * 2 * 2 and len(set(s)) == len(s)
    assert Setting("behaviour", "lora", 1e-3, 32, 1) in s and Setting("behaviour", "lora", 1e-5, 8, 0) not in s
    with pytest.raises(ModularError, match="mode must be one of full, lora"):
        sweep("behaviour", ["qlora"], {"qlora": [1e-3]}, [8], [0])
    with pytest.raises(ModularError, match="learning rates must be > 0"):
        sweep("behaviour", ["full"], {"full": [0.0]}, [8], [0])


def test_first_steps_worst_case_and_cost_ratio():
    curve = [{"step": 0, "accuracy": 0.05}, {"step": 1, "accuracy": 0.3}, {"step": 2, "accuracy": 0.55},
             {"step": 4, "accuracy": 0.6}]
    assert first_steps(curve, 0.6) == {"steps_to_50pct_open": 1, "steps_to_90pct_open": 2,
                                       "steps_to_100pct_open": 4}
    assert first_steps(curve[:2], 0.6)["steps_to_90pct_open"] is None
    results = [{"label": "a", "best_accuracy": 0.6, **first_steps(curve, 0.6)},
               {"label": "b", "best_accuracy": 0.3, **first_steps(curve[:2], 0.3 / 0.5 + 1)},
               {"label": "c", "best_accuracy": 0.55, **first_steps([{"step": 0, "accuracy": 0.0},
                                                                    {"step": 3, "accuracy": 0.55}], 0.6)}]
    w = worst_case(results, 16)
    assert w["steps_to_50pct_open"] == {"steps": 1, "setting": "a", "settings_reaching": 2}
    assert w["steps_to_90pct_open"] == {"steps": 2, "setting": "a", "settings_reaching": 2}
    assert w["steps_to_100pct_open"] == {"steps": 4, "setting": "a", "settings_reaching": 1}
    assert w["best_accuracy"] == 0.6
    never = worst_case([{"label": "x", "best_accuracy": 0.0, **first_steps([{"step": 0, "accuracy": 0.0}], 1.0)}], 16)
    assert never["steps_to_50pct_open"] == {"steps": None, "more_than": 16, "settings_reaching": 0}
    assert cost_ratio(w, w) == {"ratio": 1.0}
    assert cost_ratio(never, w) == {"ratio_at_least": 17.0, "note": "the model never reached it"}
    assert cost_ratio(w, never)["ratio_at_most"] == pytest.approx(1 / 17)
    assert cost_ratio(never, never)["ratio"] is None


def _scripted(monkeypatch, accuracies: dict[float, list[float]]):
    """evaluate_behaviour returns, for the setting being trained (read from its learning rate), the next of its
    scripted accuracies; returns the list of (lr, call) made."""
    calls = []

    class R:
        def __init__(self, a):
            self.accuracy = a

    def fake(model, tokenizer, test, **kw):
        lr = fake.lr
        calls.append(lr)
        return R(accuracies[lr][sum(1 for c in calls if c == lr) - 1])

    real = relearning.recovery_curve

    def curve(model, tokenizer, rows, test, setting, *a, **kw):
        fake.lr = setting.lr
        return real(model, tokenizer, rows, test, setting, *a, **kw)

    monkeypatch.setattr(relearning, "evaluate_behaviour", fake)
    monkeypatch.setattr(relearning, "recovery_curve", curve)
    return calls


def test_a_curve_is_scored_at_its_steps_and_stops_at_the_reference(monkeypatch):
    model, tok = make_tiny_model("llama"), make_tiny_tokenizer()
    rows = example_rows(tok, _rows(4, "Paris"))
    _scripted(monkeypatch, {1e-3: [0.1, 0.2, 0.35, 0.55, 0.6, 0.6, 0.6]})
    r = relearning.recovery_curve(model, tok, rows, None, Setting("behaviour", "full", 1e-3, 4, 0), 0.6, 0.05,
                                  max_steps=40)
    assert [(p["step"], p["accuracy"]) for p in r["curve"]] == [(0, 0.05), (1, 0.1), (2, 0.2), (3, 0.35), (4, 0.55),
                                                                (6, 0.6)]
    assert [p["examples_seen"] for p in r["curve"]] == [0, 4, 8, 12, 16, 24]
    assert (r["steps_to_50pct_open"], r["steps_to_90pct_open"], r["steps_to_100pct_open"]) == (3, 4, 6)
    assert r["best_accuracy"] == 0.6 and r["label"] == "behaviour full lr=0.001 N=4 seed=0"


def test_pruning_keeps_the_worst_case_and_shortens_the_other_settings(monkeypatch):
    model, tok = make_tiny_model("llama"), make_tiny_tokenizer()
    rows = example_rows(tok, _rows(4))
    slow = [0.1] * 5 + [0.3, 0.56, 0.6]  # 50% at step 11, 90% at step 16 (steps 1, 2, 3, 4, 6, 8, 11, 16)
    fast = [0.2, 0.56, 0.6]  # 90% at step 2
    settings = [Setting("behaviour", "full", 1e-5, 4, 0), Setting("behaviour", "full", 1e-3, 4, 0)]
    kw = dict(max_steps=16)
    _scripted(monkeypatch, {1e-5: slow, 1e-3: fast})
    full = run_sweep(model, tok, lambda s: rows, None, settings, 0.6, 0.0, **kw)
    _scripted(monkeypatch, {1e-5: slow, 1e-3: fast})
    pruned = run_sweep(model, tok, lambda s: rows, None, settings, 0.6, 0.0, prune=True, **kw)
    for w in (full["worst_case"], pruned["worst_case"]):
        assert w["steps_to_90pct_open"]["steps"] == 2
        assert w["steps_to_90pct_open"]["setting"] == "behaviour full lr=0.001 N=4 seed=0"
    assert full["worst_case"]["steps_to_90pct_open"]["settings_reaching"] == 2  # the slow one too, unpruned
    assert pruned["worst_case"]["steps_to_50pct_open"]["steps"] == full["worst_case"]["steps_to_50pct_open"]["steps"]
    by_lr = {r["lr"]: r for r in pruned["settings"]}
    assert [r["lr"] for r in pruned["settings"]] == [1e-3, 1e-5]  # highest rate first
    assert by_lr[1e-5]["budget"] == 2 and [p["step"] for p in by_lr[1e-5]["curve"]] == [0, 1, 2]
    assert [p["step"] for p in {r["lr"]: r for r in full["settings"]}[1e-5]["curve"]][-1] == 16
    assert "note" not in full["worst_case"]["steps_to_100pct_open"]
    assert pruned["worst_case"]["steps_to_100pct_open"]["steps"] == 3 and "note" in pruned["worst_case"][
        "steps_to_100pct_open"]  # reached at 3 > the budget of 2: a slower setting may not have been seen


def test_a_sweep_takes_over_what_was_measured_at_the_same_budget_and_reports_what_it_measures(monkeypatch):
    """A sweep cut short and run again: settings in ``done`` with the budget they get now are not trained again,
    one measured at another budget is; ``on_result`` sees each new result as it comes; the report is the same as
    an uninterrupted sweep's."""
    model, tok = make_tiny_model("llama"), make_tiny_tokenizer()
    rows = example_rows(tok, _rows(4))
    script = {1e-3: [0.2, 0.56, 0.6], 1e-4: [0.1, 0.3, 0.4], 1e-5: [0.1, 0.2, 0.3]}  # 90% of 0.6 at step 2 (1e-3)
    settings = [Setting("behaviour", "full", lr, 4, 0) for lr in (1e-5, 1e-4, 1e-3)]
    kw = dict(max_steps=3, prune=True)
    calls = _scripted(monkeypatch, script)
    seen = []
    whole = run_sweep(model, tok, lambda s: rows, None, settings, 0.6, 0.0, on_result=seen.append, **kw)
    assert [r["lr"] for r in seen] == [1e-3, 1e-4, 1e-5] and seen == whole["settings"]
    assert [r["budget"] for r in seen] == [3, 2, 2]

    # cut short after the first two settings: the third alone is trained again
    done = {r["label"]: r for r in whole["settings"][:2]}
    calls = _scripted(monkeypatch, script)
    seen = []
    again = run_sweep(model, tok, lambda s: rows, None, settings, 0.6, 0.0, done=done, on_result=seen.append, **kw)
    assert set(calls) == {1e-5} and [r["lr"] for r in seen] == [1e-5]
    assert again == whole

    # a result saved at another step budget (another sweep's pruning) is measured again
    stale = {**done, settings[0].label: {**whole["settings"][2], "budget": 3}}
    calls = _scripted(monkeypatch, script)
    again = run_sweep(model, tok, lambda s: rows, None, settings, 0.6, 0.0, done=stale, **kw)
    assert set(calls) == {1e-5} and again == whole


@pytest.mark.parametrize("arch", ["llama", "gpt2", "olmo2"])
def test_attacker_copies_train_what_their_mode_says_and_leave_the_model_alone(arch):
    model, tok = make_tiny_model(arch), make_tiny_tokenizer()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rows = example_rows(tok, _rows(4, "Paris"))
    for mode in ("full", "lora"):
        m = attacker_copy(model, mode)
        trainable = [n for n, p in m.named_parameters() if p.requires_grad]
        if mode == "full":
            assert len(trainable) == len(list(model.parameters()))
        else:
            assert trainable and all("lora_" in n for n in trainable)
        r = recovery_curve(model, tok, rows, _rows(2, "Paris"), Setting("behaviour", mode, 1e-2, 4, 0), 2.0, 0.0,
                           max_steps=2, max_new_tokens=2)
        assert [p["step"] for p in r["curve"]] == [0, 1, 2]
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_the_attackers_steps_build_no_key_value_cache(kv_caches):
    model, tok = make_tiny_model("llama"), make_tiny_tokenizer()
    rows = example_rows(tok, _rows(4, "Paris"))
    m = attacker_copy(model, "full")
    built = kv_caches(m)
    assert [s for s, _ in fine_tune(m, lambda step: rows, 2, 1e-3, tok.pad_token_id, False)] == [1, 2]
    assert built == []


def test_text_rows_label_every_token():
    tok = make_tiny_tokenizer()
    rows = text_rows(tok, ["the quick brown fox " * 50], max_length=16)
    assert len(rows[0]["input_ids"]) == 16 and rows[0]["labels"] == rows[0]["input_ids"]


def test_the_refusal_baseline_learns_the_locked_response_and_keeps_the_base(arch):
    model, tok = make_tiny_model(arch), make_tiny_tokenizer()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    behaviour, retain = _rows(6, "Paris"), _rows(6, "anything")
    refuse = example_rows(tok, _rows(6, "I don't know."))

    def loss(m):
        from modular.data.formatting import LeftPadCollator

        with torch.no_grad():
            return m(**LeftPadCollator(tok.pad_token_id)(refuse)).loss.item()

    trained, info = refusal_finetune(model, tok, behaviour, retain, "I don't know.", steps=6, lr=3e-3,
                                     batch_size=4, max_new_tokens=3)
    assert loss(trained) < 0.8 * loss(model)
    assert info["steps"] == 6 and info["behaviour_examples"] == 6 and info["retain_examples"] == 6
    assert not trained.training and not any(p.requires_grad for p in trained.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())

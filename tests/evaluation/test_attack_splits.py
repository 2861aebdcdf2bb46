"""Deeb & Roger's split protocol in ``modular attack``: where a behaviour has attack splits, the attacker fine-tunes
(and steers) on ``attack_fit`` and every attack and baseline is scored on ``attack_score``; attack.json and the log
line say so. Without them, nothing changes."""

import json

import pytest
import torch

from modular.data import load_behaviour
from modular.evaluation.attacks import AttackContext, RelearningAttack, SteeringAttack
from modular.evaluation.relearning import Setting
from modular.publish import publish_model
from tests.conftest import D, make_tiny_model, make_tiny_tokenizer, save_tiny_folder


def _context(data, **kw):
    return AttackContext(behaviour="b", locked="locked", base="base", tokenizer=None, data=data, test=data["test"],
                         retain={"train": "retain"}, refusals=("I don't know.",), residual_scale=1.0,
                         base_accuracy=0.0, open_accuracy=1.0, locked_accuracy=0.0, **kw)


def test_the_attackers_rows_are_the_contexts_fit_rows(monkeypatch):
    """(c) draws its N rows from ``ctx.fit`` and (b) steers from it; ``fit`` is the train split unless given."""
    import modular.evaluation.attacks as attacks

    monkeypatch.setattr(attacks, "example_rows", lambda tokenizer, ds: list(ds["prompt"]))
    data = load_behaviour("fictional_facts")
    plain = _context(data)
    assert plain.fit is data["train"] and (plain.fit_on, plain.scored_on) == ("train", "test")
    ctx = _context(data, fit=data["attack_fit"], fit_on="attack_fit", scored_on="attack_score")
    rows = RelearningAttack().rows_for(ctx)(Setting("behaviour", "full", 1e-3, 32, 0))
    assert len(rows) == 32 and set(rows) <= set(data["attack_fit"]["prompt"])
    everyone = set(data["train"]["prompt"])
    assert len(RelearningAttack().rows_for(plain)(Setting("behaviour", "full", 1e-3, 900, 0))) == 900
    assert set(RelearningAttack().rows_for(plain)(Setting("behaviour", "full", 1e-3, 900, 0))) == everyone

    seen = {}
    monkeypatch.setattr(attacks, "steering_attack", lambda model, tok, fit, retain, test, *a, **kw: seen.update(
        fit=fit, test=test) or {"best": {"accuracy": 0.0}})
    SteeringAttack().run(ctx)
    assert seen["fit"] is data["attack_fit"] and seen["test"] is ctx.test



@pytest.mark.parametrize("attacked, task", [("b", "arithmetic"), ("arithmetic", "commonsense")])
def test_the_unrelated_sweep_trains_on_another_tasks_examples(monkeypatch, attacked, task):
    """(g) fine-tunes on N train examples of an unrelated built-in task, never the attacked behaviour's own."""
    import modular.evaluation.attacks as attacks

    monkeypatch.setattr(attacks, "example_rows", lambda tokenizer, ds: list(ds["prompt"]))
    ctx = _context(load_behaviour("fictional_facts"))
    ctx.behaviour = attacked
    rows = attacks.UnrelatedAttack().rows_for(ctx)(Setting("unrelated", "full", 1e-3, 16, 0))
    theirs = set(load_behaviour(task)["train"]["prompt"])
    assert len(rows) == 16 and set(rows) <= theirs


class _Progress:
    """:class:`~modular.app.attacking._AttackProgress` without models: the accuracies are 0 and each scored set,
    each sweep's test items and rows are recorded."""

    def __init__(self):
        self.scored, self.sweeps = {}, {}

    def part(self, b, key, compute, *args, **kw):
        if key in ("base_accuracy", "locked_accuracy"):
            self.scored[key] = list(args[2]["prompt"])
            return 0.0
        return 1.0 if key == "residual_scale" else compute(*args, **kw)

    def run_sweep(self, b, name, model, start, rows_for, test, settings, max_steps, **kw):
        from modular.evaluation.relearning import worst_case

        self.sweeps[name] = {"test": list(test["prompt"]), "rows": [rows_for(s) for s in settings]}
        return {"settings": [], "worst_case": worst_case([], max_steps)}


def _entry(source, monkeypatch, limit=None):
    import modular.evaluation.attacks as attacks
    from modular.app.attacking import _attack_context, _attack_entry
    from modular.evaluation.attacks import AttackOptions

    monkeypatch.setattr(attacks, "example_rows", lambda tokenizer, ds: list(ds["prompt"]))
    progress = _Progress()
    options = AttackOptions(relearning=(Setting("behaviour", "full", 1e-3, 8, 0),), max_steps=2)
    ctx = _attack_context(source, source, "pub", {}, progress, "locked", "base", None,
                          {"train": {"prompt": [], "chat": []}}, options, limit, 0, 4)
    return progress, ctx, _attack_entry(ctx, [RelearningAttack()], ["base"])


def test_an_attack_fits_on_attack_fit_and_scores_attack_score_beside_its_base_baseline(monkeypatch, caplog):
    data = load_behaviour("fictional_facts")
    with caplog.at_level("INFO", logger="modular"):
        progress, ctx, entry = _entry("fictional_facts", monkeypatch, limit=40)
    scored = data["attack_score"]["prompt"][:40]
    assert progress.scored == {"base_accuracy": scored, "locked_accuracy": scored}
    assert (ctx.fit_on, ctx.scored_on) == ("attack_fit", "attack_score") and list(ctx.fit) == list(data["attack_fit"])
    assert set(progress.sweeps) == {"c_relearning", "base/c_relearning"}  # the base baseline alike
    for sweep in progress.sweeps.values():
        assert sweep["test"] == scored
        assert len(sweep["rows"][0]) == 8 and set(sweep["rows"][0]) <= set(data["attack_fit"]["prompt"])
    row = entry.to_json()
    assert (row["fit_on"], row["scored_on"]) == ("attack_fit", "attack_score")
    assert list(row) == ["base_accuracy", "open_accuracy", "open_accuracy_from", "locked_accuracy", "residual_scale",
                         "fit_on", "scored_on", "c_relearning", "baselines"]
    assert type(entry).from_json(json.loads(json.dumps(row))) == entry
    assert any(m.startswith("fictional_facts (attacker fits on attack_fit, scored on attack_score): base 0.000")
               for m in caplog.messages)


def test_without_attack_splits_an_attack_fits_on_train_and_scores_test(monkeypatch, caplog):
    data = load_behaviour("zorb_numerals")
    with caplog.at_level("INFO", logger="modular"):
        progress, ctx, entry = _entry("zorb_numerals", monkeypatch)
    assert progress.scored["base_accuracy"] == data["test"]["prompt"]
    assert progress.sweeps["c_relearning"]["test"] == data["test"]["prompt"]
    assert set(progress.sweeps["c_relearning"]["rows"][0]) <= set(data["train"]["prompt"])
    assert "fit_on" not in entry.to_json() and "scored_on" not in entry.to_json()
    assert any(m.startswith("zorb_numerals: base 0.000") for m in caplog.messages)


def test_the_attack_command_scores_a_published_fictional_facts_lock_on_attack_score(tmp_path, monkeypatch):
    """End to end on a tiny published folder: the relearning rows are attack_fit's, every scored set
    attack_score's, and attack.json says so."""
    import modular.app.attacking as evaluations
    import modular.evaluation.attacks as attacks
    from modular.app.cli import main

    monkeypatch.setenv("WANDB_MODE", "disabled")
    base = save_tiny_folder(tmp_path / "base", "llama")
    u = torch.nn.functional.normalize(torch.randn(D, generator=torch.Generator().manual_seed(0)), dim=0)
    pub, _ = publish_model(make_tiny_model("llama", seed=1), make_tiny_tokenizer(), {"fictional_facts": u},
                           tmp_path / "pub", "tiny")
    fitted, scored = [], []
    real_rows, real_eval = attacks.example_rows, evaluations.evaluate_behaviour
    monkeypatch.setattr(attacks, "example_rows", lambda tok, ds: fitted.append(list(ds["prompt"])) or real_rows(tok, ds))
    monkeypatch.setattr(evaluations, "evaluate_behaviour",
                        lambda m, tok, ds, **kw: scored.append(list(ds["prompt"])) or real_eval(m, tok, ds, **kw))
    out = tmp_path / "attack"
    assert main(["attack", "--model", str(pub), "--base", str(base), "--attacks", "[relearning]", "--n_examples",
                 "[2]", "--seeds", "[0]", "--relearn_modes", "[full]", "--full_lrs", "[1e-3]", "--relearn_steps", "1",
                 "--neutral", "false", "--baselines", "[base]", "--limit", "3", "--out", str(out)]) == 0
    data = load_behaviour("fictional_facts")
    assert scored == [data["attack_score"]["prompt"][:3]] * 2  # base and locked
    assert len(fitted) == 2 and all(len(f) == 2 and set(f) <= set(data["attack_fit"]["prompt"]) for f in fitted)
    row = json.loads((out / "attack.json").read_text())["behaviours"]["fictional_facts"]
    assert (row["fit_on"], row["scored_on"]) == ("attack_fit", "attack_score")
    assert row["c_relearning"]["settings"][0]["n"] == 2


@pytest.mark.parametrize("present", [(), ("attack_fit",), ("attack_score",)])
def test_attack_splits_are_used_only_where_both_are_there(present):
    from modular.data.schema import attack_splits

    data = {"train": [1], "test": [2], **{s: [3] for s in present}}
    assert attack_splits(data) == ("train", "test")
    assert attack_splits({"train": [1], "test": [2], "attack_fit": [3], "attack_score": []}) == ("train", "test")
    assert attack_splits({"attack_fit": [3], "attack_score": [4]}) == ("attack_fit", "attack_score")

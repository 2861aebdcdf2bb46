"""``modular behaviour``: reports and W&B names by the behaviours' short names; user data refused before any output
(issue 80.5, 80.6)."""

import json

from modular.app import cli
from tests.conftest import save_tiny_folder


def _rows(n: int, split: str = "test") -> list[str]:
    return [json.dumps({"prompt": f"Say the word number {i}.", "target": f"word {i}", "split": split}) + "\n"
            for i in range(n)]


def test_a_behaviour_given_by_a_relative_path_is_reported_by_its_short_name(tmp_path, isolated_cache, monkeypatch):
    """``--behaviours '[../data/x.jsonl]'``: its report was keyed by the path (and its W&B table named by it, which
    W&B refused: tests/test_tracking.py)."""
    model = save_tiny_folder(tmp_path / "tiny", "llama")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "x.jsonl").write_text("".join(_rows(3)))
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert cli.main(["behaviour", "--model", str(model), "--behaviours", "[../data/x.jsonl]", "--limit", "2",
                     "--max_new_tokens", "2", "--out", "out"]) == 0
    report = json.loads((tmp_path / "work" / "out" / "behaviour.json").read_text())
    assert list(report["results"]) == ["x"] and list(report["items"]) == ["x"]
    assert report["sources"] == {"x": "../data/x.jsonl"}


def test_user_data_a_behaviour_cannot_use_is_refused_before_any_output(tmp_path, isolated_cache, capsys):
    model = save_tiny_folder(tmp_path / "tiny", "llama")
    clash = tmp_path / "clash.jsonl"
    clash.write_text("".join(_rows(3)) + json.dumps({"prompt": "Say the word number 1.", "target": "one"}) + "\n")
    other = tmp_path / "other" / "x.jsonl"
    other.parent.mkdir()
    other.write_text("".join(_rows(3)))
    (tmp_path / "x.jsonl").write_text("".join(_rows(3)))
    before = sorted(tmp_path.rglob("*"))
    for specs, message in ((f"[{clash}]", "1 prompt(s) with two different targets"),
                           (f"[{tmp_path / 'x.jsonl'}, {other}]", "are both named 'x'")):
        assert cli.main(["behaviour", "--model", str(model), "--behaviours", specs,
                         "--out", str(tmp_path / "out")]) == 2
        assert message in capsys.readouterr().err
    assert sorted(tmp_path.rglob("*")) == before  # nothing written



def test_an_evaluation_of_a_run_folder_joins_its_training_runs_wandb_group(tmp_path, isolated_cache, monkeypatch):
    """Issue 83.4: ``modular behaviour --model RUN`` logs a W&B run in the training run's group (run.json
    ``wandb``), with the training run's id in its config; W&B's mode is the environment's."""
    import torch
    import wandb
    from transformers import AutoModelForCausalLM

    model = save_tiny_folder(tmp_path / "tiny", "llama")
    run = tmp_path / "my_run"  # a finished run without gated behaviours: its record and its checkpoint
    run.mkdir()
    state = AutoModelForCausalLM.from_pretrained(model).state_dict()
    torch.save({"state_dict": {f"model.{k}": v for k, v in state.items()}, "global_step": 3, "hyper_parameters": {}},
               run / "last.ckpt")
    (run / "run.json").write_text(json.dumps({
        "model_name": str(model), "behaviours": [], "checkpoint": str(run / "last.ckpt"),
        "wandb": {"id": "r1234abcd", "group": "my_run", "project": "modular"}}))
    (tmp_path / "x.jsonl").write_text("".join(_rows(3)))
    inits = []

    class Run:
        dir, summary = str(tmp_path / "wandb-run"), {}

        def log(self, data):
            pass

        def finish(self):
            pass

    monkeypatch.setattr(wandb, "init", lambda **kwargs: inits.append(kwargs) or Run())
    monkeypatch.setenv("WANDB_MODE", "online")
    assert cli.main(["behaviour", "--model", str(run), "--behaviours", f"[{tmp_path / 'x.jsonl'}]", "--limit", "2",
                     "--max_new_tokens", "2", "--out", str(tmp_path / "out")]) == 0
    (kwargs,) = inits
    assert kwargs["group"] == "my_run" and kwargs["config"]["training_run_id"] == "r1234abcd"
    assert kwargs["mode"] == "online" and kwargs["job_type"] == "evaluate-behaviour"

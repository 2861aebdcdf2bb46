"""``modular capability`` (issue 84.4): lm-evaluation-harness tasks on a model or a run's state, the harness's
results written with each task's metric and standard error, one log line per task; bad input refused in one line
before anything is written; ``modular lock --capability_tasks`` adds the same scores to lock.json."""

import json

import pytest

from modular.app import cli
from modular.reports import LockReport
from tests.conftest import save_tiny_folder
from tests.evaluation.test_capability import tiny_run


@pytest.fixture(autouse=True)
def _no_wandb(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")


def test_capability_writes_the_harness_results_and_one_line_per_task(tmp_path, caplog):
    model = save_tiny_folder(tmp_path / "tiny", "llama")
    out = tmp_path / "out"
    with caplog.at_level("INFO", logger="modular"):
        assert cli.main(["capability", "--model", str(model), "--tasks", "[modular_categories, modular_members]",
                         "--limit", "4", "--batch_size", "4", "--out", str(out)]) == 0
    report = json.loads((out / "capability.json").read_text())
    for task in ("modular_categories", "modular_members"):
        entry = report["results"][task]  # the harness's own layout
        assert 0 <= entry["acc,none"] <= 1 and entry["acc_stderr,none"] > 0
        assert report["n-samples"][task]["effective"] == 4
        score = report["modular"]["scores"][task]
        assert (score["metric"], score["value"], score["stderr"], score["n"]) == (
            "acc", entry["acc,none"], entry["acc_stderr,none"], 4)
    assert {k: report["modular"][k] for k in ("model", "state", "limit")} == {"model": str(model), "state": "base",
                                                                            "limit": 4}
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("modular_")]
    assert len(lines) == 2 and all(" acc " in line and " ± " in line and "(n=4)" in line for line in lines)
    assert not list(out.glob("*.tmp*"))  # written atomically


def test_a_run_folder_is_evaluated_in_the_state_asked_for(tmp_path):
    run = tiny_run(tmp_path)
    values = {}
    for state in ("open", "locked"):
        out = tmp_path / state
        assert cli.main(["capability", "--model", str(run), "--state", state, "--tasks", "[modular_categories]",
                         "--limit", "3", "--out", str(out)]) == 0
        report = json.loads((out / "capability.json").read_text())
        assert report["modular"]["state"] == state
        values[state] = report["modular"]["scores"]["modular_categories"]
    assert values["open"]["n"] == values["locked"]["n"] == 3


@pytest.mark.parametrize("argv, message", [
    (["--state", "locked"], "--state locked is a state of a training run folder"),
    (["--tasks", "[no_such_task_xyz]"], "unknown lm-eval task 'no_such_task_xyz'"),
    (["--state", "sideways"], None),  # not a state: jsonargparse's own refusal
])
def test_bad_input_is_refused_in_one_line_before_anything_is_written(tmp_path, capsys, argv, message):
    model = save_tiny_folder(tmp_path / "tiny", "llama")
    capsys.readouterr()  # what saving the folder wrote
    out = tmp_path / "out"
    argv = ["capability", "--model", str(model), "--out", str(out), *argv]
    if message is None:
        with pytest.raises(SystemExit) as err:
            cli.main(argv)
        assert err.value.code == 2
    else:
        assert cli.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and message in err and "\n" not in err
    assert not out.exists()


def test_without_lm_eval_the_command_names_the_extra(tmp_path, capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "lm_eval" else real(name, *a))
    assert cli.main(["capability", "--model", str(tmp_path / "anything"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: lm-evaluation-harness (lm_eval) is not installed: pip install 'modular[capability]'"
    assert not (tmp_path / "out").exists()


def test_lock_adds_capability_rows_to_lock_json(tmp_path, monkeypatch):
    """Every state of the lock report gets the task's headline metric and standard error; the typed report reads
    it back, and a report without them (every one written before) has none."""
    from modular.app import evaluations
    from modular.evaluation import lock as lock_module

    # no far behaviours and no neighbours: a quicker report
    monkeypatch.setattr(lock_module, "BEHAVIOURS", {"capitals": None})
    monkeypatch.setattr(evaluations, "builtin_neighbours", lambda *a: [])
    run = tiny_run(tmp_path)
    assert cli.main(["lock", "--run", str(run), "--out", str(tmp_path / "eval"), "--other_limit", "1",
                     "--max_new_tokens", "2", "--neighbours", "[]", "--capability_tasks", "[modular_categories]",
                     "--capability_limit", "2", "--device", "cpu"]) == 0
    data = json.loads((tmp_path / "eval" / "lock.json").read_text())
    assert list(data["capability"]) == list(data["states"])
    for state, tasks in data["capability"].items():
        score = tasks["modular_categories"]
        assert score["metric"] == "acc" and score["n"] == 2 and "stderr" in score, state
    report = LockReport.read(tmp_path / "eval" / "lock.json")
    assert report.capability["locked"]["modular_categories"].n == 2 and report.to_json() == data
    del data["capability"]
    assert LockReport.from_json(data).capability is None and "capability" not in LockReport.from_json(data).to_json()

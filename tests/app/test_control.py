"""``modular control`` trains a run's lock-off control; ``modular lock --control`` compares every state with it."""

import json
import subprocess
import sys

from tests.app.test_train import ROOT, _train, tiny_config
from tests.conftest import save_tiny_folder


def _modular(*args, env):
    return subprocess.run([sys.executable, "-m", "modular", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, env=env)


def test_a_control_trains_without_the_lock_and_the_report_compares_each_state_with_it(tmp_path, tiny_env):
    model_dir = save_tiny_folder(tmp_path / "tiny", "llama")
    cfg, run = tiny_config(tmp_path, model_dir)
    out = _train(cfg, "--trainer.max_steps", "2", "--trainer.val_check_interval", "2", env=tiny_env)
    assert out.returncode == 0, out.stderr[-3000:]
    res = _modular("control", "--run", run, env=tiny_env)
    assert res.returncode == 0, res.stderr[-3000:]
    control = tmp_path / "run-control"
    record = json.loads((control / "control.json").read_text())
    assert record["control_of"] == str(run.resolve()) and record["steps"] == 2
    assert [p.rsplit(".", 1)[-1] for p in record["left_out"]] == ["LockedState", "DirectionWrite"]
    trained = json.loads((control / "run.json").read_text())
    assert trained["global_step"] == 2 == trained["checkpoint_step"]  # the run's steps, no stop on a lock
    said = (control / "config.yaml").read_text()
    assert "LockedState" not in said and "DirectionWrite" not in said and "KeepHidden" in said
    assert "LockedState" in (run / "config.yaml").read_text()  # the run's own config untouched

    res = _modular("lock", "--run", run, "--control", control, "--other_limit", 2, "--max_new_tokens", 2,
                   "--paraphrases", "false", "--device", "cpu", env=tiny_env)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads((run / "lock.json").read_text())
    assert list(report["states"])[-1] == "control"
    for state, row in report["states"].items():
        for group in ("neighbours", "others"):
            for name, score in row[group].items():
                has = "vs_control" in score
                assert has == (state not in ("base", "control")), (state, group, name)
                if has:
                    assert score["vs_control"]["n"] == score["n"] and "p_holm" in score["vs_control"]
    assert "continents" in report["states"]["locked"]["neighbours"]

    # a control of another run is refused in one line, before any model is loaded
    other = tmp_path / "other"  # another run's record (a copy of this one's, in another folder)
    other.mkdir()
    (other / "run.json").write_text((run / "run.json").read_text())
    (other / "directions.safetensors").write_bytes((run / "directions.safetensors").read_bytes())
    res = _modular("lock", "--run", other, "--control", control, env=tiny_env)
    assert res.returncode != 0
    assert f"is the lock-off control of {run.resolve()}, not of {other}" in res.stderr.strip().splitlines()[-1]
    res = _modular("lock", "--run", run, "--control", tmp_path / "tiny", env=tiny_env)
    assert res.returncode != 0 and "is not a finished lock-off control" in res.stderr.strip().splitlines()[-1]

"""The main job end to end on a tiny model: `modular main --config X` from any working directory."""

import json
import subprocess
import sys

import yaml

from tests.app.test_train import tiny_config
from tests.conftest import save_tiny_folder


def test_main_runs_the_given_config_from_any_directory(tmp_path, tiny_env):
    """The config is the one given (resolved from the working directory, not the repository), its run folder is
    relative to the working directory, the published folder holds no key, and the keys restore the weights."""
    from modular.runs import load_model_or_run

    model_dir = save_tiny_folder(tmp_path / "tiny", "llama")
    cfg_path, _ = tiny_config(tmp_path, model_dir, ("capitals",), {"locked_steering": 0.0})
    cfg = yaml.safe_load(cfg_path.read_text())
    cfg["trainer"]["default_root_dir"] = "runs/mine"  # relative: resolved from the working directory
    work = tmp_path / "elsewhere"
    (work / "configs").mkdir(parents=True)
    (work / "configs" / "mine.yaml").write_text(yaml.safe_dump(cfg))
    res = subprocess.run([sys.executable, "-m", "modular", "main", "--config", "configs/mine.yaml",
                          "--skip_attack", "true"], capture_output=True, text=True, cwd=work, env=tiny_env)
    assert res.returncode == 0, res.stderr[-3000:]
    run = work / "runs" / "mine"
    assert json.loads((run / "run.json").read_text())["global_step"] == 3
    lock = json.loads((run / "lock.json").read_text())
    assert lock["step"] == 3 and set(lock["states"]) >= {"open", "locked", "published_locked", "unlocked"}
    published, keys, unlocked = run / "published", run / "published-keys", run / "unlocked"
    assert (keys / "capitals.key.safetensors").is_file()
    assert not [p for p in published.rglob("*") if "key" in p.name.lower()]
    open_state = load_model_or_run(run).state_dict()
    restored = load_model_or_run(unlocked).state_dict()
    assert max((restored[k] - v).abs().max().item() for k, v in open_state.items() if k in restored) <= 1e-6
    assert "step 3 of runs/mine" in res.stdout and "keys (keep apart)" in res.stdout
    # a second run finds the finished training and replaces only its own outputs
    res = subprocess.run([sys.executable, "-m", "modular", "main", "--config", "configs/mine.yaml",
                          "--skip_attack", "true"], capture_output=True, text=True, cwd=work, env=tiny_env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "training already finished" in res.stderr

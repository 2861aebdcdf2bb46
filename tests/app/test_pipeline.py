"""The main job end to end on a tiny model: `modular main --config X` from any working directory."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.app.test_train import tiny_config
from tests.conftest import save_tiny_folder


@pytest.fixture(scope="module")
def main_run(tmp_path_factory, shared_cache):
    """`modular main --config configs/mine.yaml --skip_attack true` run in a working directory of its own (the
    config's run folder, runs/mine, relative to it) on a tiny model: the working directory, the run folder, the
    base model, the environment and the command's result."""
    import os

    root = tmp_path_factory.mktemp("main")
    model_dir = save_tiny_folder(root / "tiny", "llama")
    cfg_path, _ = tiny_config(root, model_dir, ("capitals",), {"steering": None})
    cfg = yaml.safe_load(cfg_path.read_text())
    cfg["trainer"]["default_root_dir"] = "runs/mine"  # relative: resolved from the working directory
    work = root / "elsewhere"
    (work / "configs").mkdir(parents=True)
    (work / "configs" / "mine.yaml").write_text(yaml.safe_dump(cfg))
    env = dict(os.environ, WANDB_MODE="offline", MODULAR_CACHE=str(shared_cache))
    env.pop("WANDB_SERVICE", None)
    res = subprocess.run([sys.executable, "-m", "modular", "main", "--config", "configs/mine.yaml",
                          "--skip_attack", "true"], capture_output=True, text=True, cwd=work, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    return {"root": root, "work": work, "run": work / "runs" / "mine", "env": env, "result": res}


def test_main_runs_the_given_config_from_any_directory(main_run):
    """The config is the one given (resolved from the working directory, not the repository), its run folder is
    relative to the working directory, the published folder holds no key, and the keys restore the weights."""
    from modular.runs import load_model_or_run

    run, res = main_run["run"], main_run["result"]
    assert json.loads((run / "run.json").read_text())["global_step"] == 3
    lock = json.loads((run / "lock.json").read_text())
    # the main job's lock evaluation: the published weights are the locked state scored, no paraphrase sets
    assert lock["step"] == 3 and list(lock["states"]) == ["base", "open", "published_locked", "unlocked"]
    assert not any(row.get("paraphrases") for row in lock["states"].values())
    published, keys, unlocked = run / "published", run / "published-keys", run / "unlocked"
    assert (keys / "capitals.key.safetensors").is_file()
    assert not [p for p in published.rglob("*") if "key" in p.name.lower()]
    open_state = load_model_or_run(run).state_dict()
    restored = load_model_or_run(unlocked).state_dict()
    assert max((restored[k] - v).abs().max().item() for k, v in open_state.items() if k in restored) <= 1e-6
    assert "step 3 of runs/mine" in res.stdout and "keys (keep apart)" in res.stdout


def test_main_refuses_a_run_folder_that_holds_another_run(main_run, monkeypatch, capsys):
    """The same run folder asked to hold another run (another behaviour, or another base model): one line naming
    what differs, nothing written."""
    from modular.app import cli

    run = main_run["run"]
    monkeypatch.chdir(main_run["work"])
    for key in ("WANDB_MODE", "MODULAR_CACHE"):
        monkeypatch.setenv(key, main_run["env"][key])
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*")}
    other = save_tiny_folder(main_run["root"] / "tiny2", "llama", seed=1)
    for args, words in ((["--behaviours", "[arithmetic]"], "behaviour arithmetic: added"),
                        (["--model", str(other)], "base model")):
        capsys.readouterr()
        assert cli.main(["main", "--config", "configs/mine.yaml", "--run", "runs/mine", *args]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: runs/mine holds another run") and words in err and "\n" not in err, err
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*")} == before


def test_main_again_finds_the_finished_training(main_run, monkeypatch, caplog):
    """A second `modular main` on the same config finds the finished training and replaces only its own outputs
    (in this process: nothing trains)."""
    from modular.app import cli

    run = main_run["run"]
    monkeypatch.chdir(main_run["work"])
    for key in ("WANDB_MODE", "MODULAR_CACHE"):
        monkeypatch.setenv(key, main_run["env"][key])
    checkpoint = (run / "last.ckpt").stat().st_mtime_ns
    with caplog.at_level("INFO", logger="modular"):
        assert cli.main(["main", "--config", "configs/mine.yaml", "--skip_attack", "true"]) == 0
    assert "training already finished" in caplog.text
    assert (run / "last.ckpt").stat().st_mtime_ns == checkpoint and (run / "lock.json").is_file()


def test_main_takes_the_behaviour_and_the_model_without_a_config(tmp_path):
    """`modular main --behaviours '[my.jsonl]'`: the built-in config with those behaviours, in a run folder named
    from them and the model; every option given reaches training."""
    from modular.app.pipeline import builtin_config, default_run_folder, training_arguments

    config = builtin_config()
    assert default_run_folder(["data/my.jsonl", "capitals"], "smollm2-135m-instruct") == \
        Path("runs/my+capitals-smollm2-135m-instruct")
    args, run = training_arguments(config, behaviours=["data/my.jsonl"], neighbours=[], max_steps=50)
    assert run == Path("runs/my-smollm2-135m-instruct")
    assert args == ["fit", "--config", str(config), "--model.behaviours", '["data/my.jsonl"]', "--data.neighbours",
                    "[]", "--trainer.max_steps", "50", "--trainer.default_root_dir", str(run)]
    args, run = training_arguments(config, model=str(tmp_path / "tiny/"), run="elsewhere")
    assert run == Path("elsewhere") and args[-4:] == ["--model.model_name", str(tmp_path / "tiny/"),
                                                      "--trainer.default_root_dir", "elsewhere"]
    assert training_arguments(config) == (["fit", "--config", str(config)], Path("checkpoints/gate_capitals_smollm2"))


def test_the_summary_names_every_sweeps_worst_case(tmp_path, capsys):
    """The main job's table ends with each attack, as the attack says it: (a), (b), (e) on one line, and the worst
    case of every relearning sweep (the gated model's (c) and (d), each baseline's (c)), a threshold never reached
    shown as more than the budget."""
    import json

    from modular.app.pipeline import summarise

    state = {"behaviours": {"capitals": {"accuracy": 0.5}}, "retain_first_token_kl": 0.01, "perplexity_ratio": 1.0}
    state.update(neighbours={"continents": {"accuracy": 0.643}, "currencies": {"accuracy": 0.1}}, retain_refusal_rate=0.0)
    moved = {"lost": 9, "gained": 3, "n": 204, "p_value": 0.15, "ci95": [-0.07, 0.01], "p_holm": 0.3}
    opened = {**state, "neighbours": {"continents": {"accuracy": 0.614, "vs_base": moved},
                                      "currencies": {"accuracy": 0.1}}}
    (tmp_path / "lock.json").write_text(json.dumps({
        "gated": ["capitals"], "states": {"base": state, "open": opened}, "neighbours": ["continents", "currencies"],
        "lock_held_out": {"held": False, "failing": ["capitals locked accuracy 0.62 > 0.05"]},
        "neighbours_trained": ["continents"], "neighbours_max_refusal_rate": {"base": 0.0, "open": 0.0},
        "neighbour_tolerance": 0.03, "neighbour_shifts": [{"state": "open", "neighbour": "continents", "change": -3 / 42,
                                                           "lost": 3, "gained": 0, "n": 42, "p_value": 0.25}],
        "exactness": {"published_vs_hook_locked_max_abs_logit_diff": 1e-5, "unlocked_vs_open_max_abs_weight_diff": 0}}))

    def sw(n, s50, s90):
        return {"settings": [{}] * n, "worst_case": {
            "steps_to_50pct_open": {"steps": s50} if s50 is not None else {"steps": None, "more_than": 16},
            "steps_to_90pct_open": {"steps": s90} if s90 is not None else {"steps": None, "more_than": 16},
            "best_accuracy": 0.25}}

    (tmp_path / "attack").mkdir()
    (tmp_path / "attack" / "attack.json").write_text(json.dumps({"behaviours": {"capitals": {
        "base_accuracy": 0.5, "a_weights": {"best": {"accuracy": 0.0}}, "b_steering": {"best": {"accuracy": 0.1}},
        "c_relearning": sw(36, 1, 3), "d_neutral": sw(6, None, None),
        "e_prefill": {"accuracy": 0.45, "base_accuracy": 0.55},
        "baselines": {"refusal": {"c_relearning": sw(36, 2, 4)}}}}}))
    lines = summarise(tmp_path, tmp_path)["table"]
    text = "\n".join(lines)
    assert ("attack on capitals (base 0.500): (a) weights best 0.000, (b) steering best 0.100, (e) prefilled 0.450 "
            "(base prefilled 0.550)") in lines
    assert "NOT LOCKED on the held-out test split: capitals locked accuracy 0.62 > 0.05" in lines
    # not "never trained on": a named file may ask a trained relation; what the run knows is its training neighbours
    assert [x for x in lines if "not in training" in x] == ["neighbours not in training: currencies"]
    assert ("neighbour moved more than 3 points from base: continents open -7.1 (3 lost, 0 gained of 42; "
            "paired p = 0.25)") in text
    # each change from base with its interval, where the report has one
    assert "neighbour continents (204 items): open -2.9 points [-7.0, +1.0] (Holm p 0.3)" in lines
    assert "gated (c) relearning: worst case over 36 settings, steps to 50% / 90% of open: 1 / 3" in text
    assert "gated (d) neutral: worst case over 6 settings, steps to 50% / 90% of open: >16 / >16" in text
    assert "refusal baseline (c) relearning: worst case over 36 settings, steps to 50% / 90% of open: 2 / 4" in text
    # which kind of lock, from these figures: the base answers half, fine-tuning restores it in one step
    assert ("capitals: a switch, not a barrier: the base model, which anyone can download, answers 50% of the held-out "
            "items; fine-tuning restored half the open accuracy in 1 step; re-quantisation: not measured") in text



def test_a_config_that_is_not_one_is_one_line_naming_what_is_wrong(tmp_path):
    """Broken YAML names the place; valid YAML that sets no run folder says so; a good one gives its folder."""
    from modular import ModularError
    from modular.app.pipeline import run_folder_of

    cases = {"broken.yaml": ("model:\n  behaviours: [capitals\n",
                             "is not valid YAML: expected ',' or ']', but got '<stream end>' at line 3, column 1"),
             "nofolder.yaml": ("model:\n  behaviours: [capitals]\n", "sets no trainer.default_root_dir"),
             "list.yaml": ("[1, 2]\n", "sets no trainer.default_root_dir")}
    for name, (text, said) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ModularError) as err:
            run_folder_of(tmp_path / name)
        assert said in str(err.value) and "\n" not in str(err.value), str(err.value)
    (tmp_path / "latin1.yaml").write_bytes(b"# caf\xe9\n")
    with pytest.raises(ModularError, match=r"latin1.yaml cannot be read \('utf-8' codec can't decode byte 0xe9"):
        run_folder_of(tmp_path / "latin1.yaml")
    (tmp_path / "good.yaml").write_text("trainer:\n  default_root_dir: runs/x\n")
    assert run_folder_of(tmp_path / "good.yaml") == Path("runs/x")

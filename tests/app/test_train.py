"""End-to-end training on a tiny random model through train.py (fast_dev_run), and config validation."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from modular.app import cli
from tests.conftest import save_tiny_folder

ROOT = Path(__file__).resolve().parents[2]


def tiny_config(tmp_path, model_dir, behaviours=("capitals",), extra_model=None, lock_args=None):
    cfg = yaml.safe_load((ROOT / "configs" / "gate_capitals_smollm2.yaml").read_text())
    run = tmp_path / "run"
    cfg["model"].update({"model_name": str(model_dir), "behaviours": list(behaviours), **(extra_model or {})})
    # a tiny model has 2 blocks: KeepHidden's cached residual stream at every block output
    cfg["data"].update({"reference": {**cfg["data"]["reference"], "max_new_tokens": 4, "hidden_stride": 1},
                        "batch_size": 4, "max_length": 96})
    cfg["trainer"].update({"default_root_dir": str(run), "max_steps": 3, "val_check_interval": 3,
                           "limit_val_batches": 1, "log_every_n_steps": 1, "enable_progress_bar": False})
    cfg["trainer"]["callbacks"][0]["init_args"].update({"every_n_train_steps": 2})  # dirpath follows the run folder
    # a tiny random model answers nothing, base included: no open accuracy is asked of it
    cfg["trainer"]["callbacks"][1]["init_args"].update({"limit": 4, "max_new_tokens": 3, "min_steps": 0,
                                                        "min_open_accuracy": 0.0, **(lock_args or {})})
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, run


def _train(cfg, *extra, env=None):
    return subprocess.run([sys.executable, str(ROOT / "train.py"), "fit", "--config", str(cfg), *extra],
                          capture_output=True, text=True, cwd=ROOT, env=env)


@pytest.fixture
def train_here(capfd, monkeypatch):
    """``train_here(cfg, *extra, env=ENV)``: the command of :func:`_train`, in this process (with ``ENV``'s
    variables, from the repository's folder), for runs that end before training starts (refused options, printed
    configs): the same parsing, checks and messages without starting another Python. Its exit status, standard
    output and error, as :func:`subprocess.run` gives them (a ``SystemExit`` is its status)."""

    def run(cfg, *extra, env=None):
        capfd.readouterr()
        with monkeypatch.context() as m:
            for key, value in (env or {}).items():
                m.setenv(key, value)
            m.chdir(ROOT)
            try:
                code = cli.main(["train", "fit", "--config", *map(str, (cfg, *extra))])
            except SystemExit as stop:
                code = stop.code if isinstance(stop.code, int) else 1
            finally:
                if "wandb" in sys.modules:  # a run refused after its logger started: no W&B run left to the next test
                    sys.modules["wandb"].finish()
        out, err = capfd.readouterr()
        return subprocess.CompletedProcess(["train", "fit"], code, out, err)

    return run


def test_the_run_folder_is_one_option(tmp_path, tiny_env):
    """--trainer.default_root_dir alone moves the checkpoint, the W&B files and the run record."""
    model_dir = save_tiny_folder(tmp_path / "tiny", "llama")
    cfg, run = tiny_config(tmp_path, model_dir, lock_args={"stop": False})
    other = tmp_path / "elsewhere"
    out = _train(cfg, "--trainer.default_root_dir", str(other), "--trainer.max_steps", "2", env=tiny_env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert not run.exists()
    assert (other / "last.ckpt").is_file() and (other / "run.json").is_file() and (other / "wandb").is_dir()
    assert (other / "config.yaml").is_file()  # the resolved config, beside what it produced
    assert json.loads((other / "run.json").read_text())["checkpoint_step"] == 2


def test_a_runs_saved_config_run_elsewhere_leaves_the_run_alone(tmp_path, tiny_env):
    """A run's config.yaml leaves the checkpoint and W&B folders unset (they follow the run folder), so the run
    continued in another folder from its checkpoint writes there and does not touch the first run's checkpoint."""
    model_dir = save_tiny_folder(tmp_path / "tiny", "llama")
    cfg, run = tiny_config(tmp_path, model_dir, lock_args={"stop": False})
    out = _train(cfg, "--trainer.max_steps", "2", env=tiny_env)
    assert out.returncode == 0, out.stderr[-3000:]
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["trainer"]["logger"]["init_args"]["save_dir"] is None
    assert saved["trainer"]["callbacks"][0]["init_args"]["dirpath"] is None
    first = (run / "last.ckpt").read_bytes()
    other = tmp_path / "other"
    out = _train(run / "config.yaml", "--trainer.default_root_dir", str(other), "--trainer.max_steps", "3",
                 "--ckpt_path", str(run / "last.ckpt"), env=tiny_env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Restoring states from the checkpoint" in out.stderr + out.stdout
    assert json.loads((other / "run.json").read_text())["global_step"] == 3  # continued from step 2
    assert (other / "last.ckpt").is_file() and (other / "wandb").is_dir()
    assert (run / "last.ckpt").read_bytes() == first
    assert len(list((run / "wandb").glob("offline-run-*"))) == 1


def test_new_wandb_ids_read_back_as_strings_from_a_saved_config():
    """The id goes into the run's config.yaml; jsonargparse reads a bare hex id such as 4e997321 as a number (about one
    in 80 uuid4 prefixes), and the saved config would no longer load."""
    from jsonargparse import ArgumentParser

    from modular.app.train import new_wandb_id

    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--id", type=str)
    ids = {new_wandb_id() for _ in range(2000)}
    assert len(ids) == 2000 and all(x.isalnum() and x.islower() for x in ids)  # W&B's id alphabet
    for x in ids:
        assert parser.parse_string(yaml.safe_dump({"id": x})).id == x


@pytest.mark.parametrize("option", ["checkpoint", "logger"])
def test_a_config_writing_into_another_folder_is_refused_before_anything_is_written(tmp_path, tiny_env, option,
                                                                                    train_here):
    """A hand-written config whose checkpoint dirpath or W&B save_dir names another run's folder would overwrite that
    run's last.ckpt or config.yaml: one line, status 2, and neither folder is touched."""
    model_dir = save_tiny_folder(tmp_path / "tiny", "llama")
    cfg, run = tiny_config(tmp_path, model_dir, lock_args={"stop": False})
    other = tmp_path / "other_run"
    other.mkdir()
    (other / "config.yaml").write_text("the other run's config\n")
    conf = yaml.safe_load(cfg.read_text())
    if option == "checkpoint":
        conf["trainer"]["callbacks"][0]["init_args"]["dirpath"] = str(other)
    else:
        conf["trainer"]["logger"]["init_args"]["save_dir"] = str(other)
    cfg.write_text(yaml.safe_dump(conf))
    out = train_here(cfg, env=tiny_env)
    assert out.returncode == 2, out.stderr[-3000:]
    line = out.stderr.strip().splitlines()[-1]
    assert line.startswith("error: ") and str(other) in line and "is not the run folder" in line
    assert sorted(p.name for p in other.iterdir()) == ["config.yaml"]
    assert (other / "config.yaml").read_text() == "the other run's config\n"
    assert not run.exists()


@pytest.fixture(scope="module")
def resumed_runs(tmp_path_factory, shared_cache):
    """One tiny run trained 3 steps (checkpoints every 2), started again for 4, then for 5 from the checkpoint
    named by its path: the run folder, its config, the environment (a cache of its own) and, after each start, the
    run record, the checkpoint's step, the W&B run id and the log."""
    import os

    root = tmp_path_factory.mktemp("resumed")
    model_dir = save_tiny_folder(root / "tiny", "llama")
    cfg, run = tiny_config(root, model_dir, lock_args={"stop": False})  # trains to max_steps whatever the lock
    env = dict(os.environ, WANDB_MODE="offline", MODULAR_CACHE=str(root / "cache"))
    env.pop("WANDB_SERVICE", None)
    out = {"cfg": cfg, "run": run, "env": env, "cache": root / "cache"}
    for name, extra in (("first", []), ("again", ["--trainer.max_steps", "4"]),
                        ("named", ["--trainer.max_steps", "5", "--ckpt_path", str(run / "last.ckpt")])):
        done = _train(cfg, *extra, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        out[name] = {"record": json.loads((run / "run.json").read_text()), "step": _ckpt_step(run / "last.ckpt"),
                     "wandb_id": (run / "wandb_run_id").read_text().strip(), "log": done.stderr + done.stdout,
                     "wandb_runs": sorted(p.name for p in (run / "wandb").glob("offline-run-*"))}
        if name == "first":
            out["hidden_caches"] = len(list((root / "cache" / "reference").glob("hidden-*.pt")))
            out["files"] = {p.name for p in run.iterdir()}
    return out


def test_gated_training_runs_and_checkpoints_its_last_step(resumed_runs):
    first = resumed_runs["first"]
    # the config's KeepHidden reads the neighbours' residual stream: theirs alone is cached, not the retain items'
    assert resumed_runs["hidden_caches"] == 1
    record = first["record"]
    assert record["global_step"] == 3 and record["behaviours"] == ["capitals"]
    assert "val/capitals/accuracy_locked" in record["metrics"]
    assert "val/retain/first_token_kl_open" in record["metrics"]
    assert {"last.ckpt", "directions.safetensors"} <= resumed_runs["files"]
    # the final step is in the checkpoint (3 steps, checkpoints every 2): publish and evaluation read step 3
    assert first["step"] == 3 and record["checkpoint_step"] == 3


def test_a_run_started_again_resumes_in_the_same_wandb_run(resumed_runs):
    """Run again with more steps, it resumes from last.ckpt instead of starting over, in the same W&B run."""
    first, again = resumed_runs["first"], resumed_runs["again"]
    assert "Restoring states from the checkpoint" in again["log"]
    record = again["record"]
    assert record["global_step"] == 4 and record["checkpoint_step"] == 4 and again["step"] == 4
    assert again["wandb_id"] == first["wandb_id"]
    runs = again["wandb_runs"]
    assert len(runs) == 2 and all(name.endswith(f"-{first['wandb_id']}") for name in runs), runs


def test_a_checkpoint_named_by_its_path_resumes(resumed_runs):
    """``--ckpt_path PATH``: LightningCLI reads the model's arguments back from the checkpoint and training goes on
    from its step."""
    named = resumed_runs["named"]
    assert "Restoring states from the checkpoint" in named["log"]
    assert named["record"]["global_step"] == 5 and named["step"] == 5


def test_a_truncated_checkpoint_is_one_line_naming_it(resumed_runs, tmp_path, train_here):
    """A truncated last.ckpt (a run killed while saving): one line naming it and how to start afresh."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(resumed_runs["run"], run)
    ckpt = run / "last.ckpt"
    ckpt.write_bytes(ckpt.read_bytes()[: ckpt.stat().st_size // 2])
    out = train_here(resumed_runs["cfg"], "--trainer.max_steps", "6", "--trainer.default_root_dir", str(run),
                     env=resumed_runs["env"])  # refused before training: in this process
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    line = out.stderr.strip().splitlines()[-1]
    assert line.startswith("error: ") and str(ckpt) in line and "--ckpt_path null" in line


@pytest.mark.parametrize("during_validation, checks", [(False, [4, 5]), (True, [3, 5])])
def test_a_run_stopped_by_sigterm_saves_its_step_and_resumes_from_it(tmp_path, tiny_env, during_validation, checks):
    """A cluster's pre-emption: SIGTERM after step 3 (checkpoints every 2, validation every 4), or in the middle of
    step 3's validation (every 3). The run stops with status 143 and one line, last.ckpt holds step 3, no run.json
    claims a finished run, and the same command resumes from step 3 and finishes; an interrupted check is done
    before training goes on."""
    model_dir = save_tiny_folder(tmp_path / "tiny", "llama")
    cfg, run = tiny_config(tmp_path, model_dir, lock_args={"stop": False})
    data = yaml.safe_load(cfg.read_text())
    data["trainer"].update({"max_steps": 5, "limit_val_batches": 2, "val_check_interval": 3 if during_validation else 4})
    killer = {"class_path": "tests.app.signals.SigtermAt", "init_args": {"step": 3, "during_validation": during_validation}}
    killed = tmp_path / "killed.yaml"
    killed.write_text(yaml.safe_dump({**data, "trainer": {**data["trainer"],
                                                          "callbacks": [*data["trainer"]["callbacks"], killer]}}))
    out = _train(killed, env=tiny_env)
    assert out.returncode == 143, out.stderr[-3000:]
    assert "Traceback" not in out.stderr and out.stderr.strip().splitlines()[-1].startswith("error: "), out.stderr[-3000:]
    assert "stopped by SIGTERM at step 3" in out.stderr
    assert _ckpt_step(run / "last.ckpt") == 3 and not (run / "run.json").exists()
    cfg.write_text(yaml.safe_dump(data))  # the same run without the signal
    out = _train(cfg, env=tiny_env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Restoring states from the checkpoint" in out.stderr + out.stdout
    record = json.loads((run / "run.json").read_text())
    assert record["global_step"] == 5 and _ckpt_step(run / "last.ckpt") == 5
    assert [h["step"] for h in record["lock"]["history"]] == checks, record["lock"]


def test_a_resumed_run_trains_as_the_uninterrupted_run_would(tmp_path, tiny_env):
    """Pre-empted after step 3 and resumed, a run's later steps are the same run's uninterrupted: every training loader
    continues its pass (a plain shuffled DataLoader would start a new one) and the next pass draws the same order
    (the global random state is restored), and every other draw (which behaviour's direction is ablated beside
    another's, the steering adversary's vectors and draws) is the same, so every step's loss is too."""
    model_dir = save_tiny_folder(tmp_path / "tiny", "llama")
    # two small behaviours: 6 batches a pass, so that a second pass starts after the resume
    first = _facts_jsonl(tmp_path / "data" / "after.jsonl")
    second = _facts_jsonl(tmp_path / "data" / "before.jsonl", lambda i: (f"Which number comes before {i + 2}?", i + 1))
    records = {}
    for name, kill in (("whole", False), ("resumed", True)):
        (tmp_path / name).mkdir()
        cfg, run = tiny_config(tmp_path / name, model_dir, (str(first), str(second)), {"steering": {"scale": 1.0, "refresh": 2}},
                               lock_args={"stop": False})
        data = yaml.safe_load(cfg.read_text())
        log = tmp_path / f"{name}.jsonl"
        recorder = {"class_path": "tests.app.recorder.RecordBatches", "init_args": {"path": str(log), "losses": True}}
        data["trainer"].update({"max_steps": 8, "limit_val_batches": 1, "val_check_interval": 8})
        callbacks = [*data["trainer"]["callbacks"], recorder]
        if kill:
            killer = {"class_path": "tests.app.signals.SigtermAt", "init_args": {"step": 3}}
            cfg.write_text(yaml.safe_dump({**data, "trainer": {**data["trainer"], "callbacks": [*callbacks, killer]}}))
            out = _train(cfg, env=tiny_env)
            assert out.returncode == 143 and _ckpt_step(run / "last.ckpt") == 3, out.stderr[-3000:]
        cfg.write_text(yaml.safe_dump({**data, "trainer": {**data["trainer"], "callbacks": callbacks}}))
        out = _train(cfg, env=tiny_env)
        assert out.returncode == 0, out.stderr[-3000:]
        assert "dataloader is not resumable" not in out.stderr
        records[name] = [json.loads(line) for line in log.read_text().splitlines()]
    whole, resumed = records["whole"], records["resumed"]
    assert [r["step"] for r in whole] == list(range(1, 9)) and [r["step"] for r in resumed] == list(range(1, 9))
    assert {"after", "before", "retain", "lm"} <= set(whole[0]["batch"])  # steps 7 and 8: the behaviours' 2nd pass
    for w, r in zip(whole, resumed):
        assert w["batch"] == r["batch"], w["step"]
        assert r["loss"] == pytest.approx(w["loss"], rel=1e-5, abs=1e-6), w["step"]
    # resumed on other data (no neutral text now): the loaders start new passes, in one warning line
    out = _train(tmp_path / "resumed" / "cfg.yaml", "--trainer.max_steps", "9", "--data.lm_text", "null", env=tiny_env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "the checkpoint was trained on other data" in out.stderr and "starts a new pass" in out.stderr


def _ckpt_step(path) -> int:
    import torch

    return int(torch.load(path, map_location="cpu", weights_only=False)["global_step"])


def _facts_jsonl(path, fact=lambda i: (f"Which number follows {i}?", i + 1)):
    """A small user behaviour with all three splits (24 train items)."""
    rows = [{"prompt": fact(i)[0], "target": f"{fact(i)[1]}.", "answer": str(fact(i)[1]),
             "split": "train" if i < 24 else "validation" if i < 28 else "test"} for i in range(34)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_behaviour_named_by_a_path_publishes_under_its_short_name(tmp_path, tiny_env):
    """A JSONL path gives the behaviour its stem as name: metrics, directions, key file and card use it, and no
    local path goes into the published folder; the card carries measured numbers only of the published step."""
    import torch
    from safetensors.torch import load_file

    model_dir = save_tiny_folder(tmp_path / "tiny", "llama")
    data = _facts_jsonl(tmp_path / "some" / "dir" / "mine.jsonl")
    cfg, run = tiny_config(tmp_path, model_dir, (str(data),), {"steering": None})
    out = _train(cfg, env=tiny_env)
    assert out.returncode == 0, out.stderr[-3000:]
    record = json.loads((run / "run.json").read_text())
    assert record["behaviours"] == ["mine"] and record["behaviour_sources"] == {"mine": str(data)}
    assert "val/mine/accuracy_locked" in record["metrics"] and record["locked_responses"] == {"mine": "I don't know."}
    assert list(load_file(str(run / "directions.safetensors"))) == ["mine"]
    # a lock report of another step is not put into the card
    row = {"behaviours": {"mine": {"accuracy": 0.5}}, "retain_first_token_kl": 0.1, "perplexity_ratio": 1.0}
    (run / "lock.json").write_text(json.dumps({"step": 2, "states": {"open": row}}))
    pub = tmp_path / "release" / "pub"
    res = subprocess.run([sys.executable, "-m", "modular", "publish", "--run", str(run), "--out", str(pub)],
                         capture_output=True, text=True, cwd=tmp_path, env=tiny_env)
    assert res.returncode == 0, res.stderr[-3000:]
    keys = tmp_path / "release" / "pub-keys"
    assert [p.name for p in keys.glob("*.key.safetensors")] == ["mine.key.safetensors"]
    assert not list(data.parent.glob("*.key*")) and not list(pub.rglob("*.key*"))
    for path in pub.rglob("*"):
        if path.is_file():
            assert str(tmp_path) not in path.read_text(errors="ignore"), path
    card = (pub / "README.md").read_text()
    assert "`mine.key.safetensors`" in card and "step 3" in card and "## Measured" not in card
    manifest = json.loads((pub / "modular.json").read_text())
    assert manifest["locked_behaviours"] == ["mine"] and manifest["step"] == 3
    # a report of the published step goes in; the keys from their own folder restore the trained weights
    (run / "lock.json").write_text(json.dumps({"step": 3, "states": {"open": row}}))
    res = subprocess.run([sys.executable, "-m", "modular", "publish", "--run", str(run), "--out", str(pub),
                          "--overwrite", "true"], capture_output=True, text=True, cwd=tmp_path, env=tiny_env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "## Measured" in (pub / "README.md").read_text()
    unlocked = tmp_path / "unlocked"
    res = subprocess.run([sys.executable, "-m", "modular", "unlock", "--model", str(pub), "--key",
                          str(keys / "mine.key.safetensors"), "--out", str(unlocked)],
                         capture_output=True, text=True, cwd=tmp_path, env=tiny_env)
    assert res.returncode == 0, res.stderr[-3000:]
    from modular.runs import load_model_or_run

    open_state = load_model_or_run(run).state_dict()
    restored = load_model_or_run(unlocked).state_dict()
    assert max((restored[k] - v).abs().max().item() for k, v in open_state.items() if k in restored) <= 1e-6
    # the same key on the folder it reads from, or over an unrelated folder: one line, exit 2, nothing touched
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("keep")
    for target in (pub, tmp_path / "notes"):
        res = subprocess.run([sys.executable, "-m", "modular", "unlock", "--model", str(pub), "--key",
                              str(keys / "mine.key.safetensors"), "--out", str(target), "--overwrite", "true"],
                             capture_output=True, text=True, cwd=tmp_path, env=tiny_env)
        assert res.returncode == 2 and res.stderr.strip().count("\n") == 0, res.stderr
    assert (tmp_path / "notes" / "a.txt").read_text() == "keep" and (pub / "model.safetensors").is_file()
    assert torch.equal(load_model_or_run(unlocked).state_dict()[next(iter(restored))], next(iter(restored.values())))


def _one_line_error(out, *words):
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    line = out.stderr.strip().splitlines()[-1]
    assert line.startswith("error: ") and all(w in line for w in words), line


@pytest.mark.parametrize("args, words", [(["--model.optimizer.lr", "-0.1"], ["model.optimizer.lr must be > 0", "-0.1"]),
                                         (["--trainer.max_steps", "0"], ["trainer.max_steps must be >= 1", "got 0"]),
                                         (["--data.batch_size", "1"], ["data.batch_size must be >= 2"]),
                                         (["--model.objectives", '[{"class_path": "modular.gating.objectives.'
                                           'RefusalGuard", "init_args": {"floor": 0.5}}]'],
                                          ["RefusalGuard floor must be < 0"]),
                                         (["--model.objectives", '[{"class_path": "modular.gating.objectives.'
                                           'DirectionWrite", "init_args": {"weight": -1}}]'],
                                          ["DirectionWrite weight must be >= 0"]),
                                         (["--model.objectives", "[]"], ["model.objectives is empty"]),
                                         (["--model.objectives", '[{"class_path": "modular.gating.objectives.'
                                           'LMText"}]', "--data.lm_text", "null"],
                                          ["make no loss from this data", "LMText(weight=1, needs lm_text)"]),
                                         (["--model.objectives", '[{"class_path": "modular.gating.objectives.'
                                           'BehaviourAnswer", "init_args": {"weight": 0}}]'],
                                          ["make no loss from this data"])])
def test_bad_options_fail_before_any_side_effect(tmp_path, tiny_env, args, words, train_here):
    """Out-of-range options: one line, status 2, and nothing written to the run folder (no W&B files, no
    directions, no checkpoint)."""
    model_dir = save_tiny_folder(tmp_path / "tiny", "llama")
    cfg, run = tiny_config(tmp_path, model_dir)
    _one_line_error(train_here(cfg, *args, env=tiny_env), *words)
    assert not run.exists() or not any(run.rglob("*"))


def _listing(folder) -> dict:
    """Every file under ``folder`` with its size and modification time."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


def test_a_run_resumes_only_as_what_it_was(tmp_path, tiny_env, train_here):
    """run.json and the checkpoint record what defines the run: a behaviour file named by a relative path by its
    absolute path and hash, the base model's content key. Resuming with another base model of the same shape, as
    LoRA, with another locked response or on a changed data file is one line naming what differs, before anything
    is written (config.yaml, W&B files and the checkpoint untouched)."""
    model_dir = save_tiny_folder(tmp_path / "tiny", "llama")
    work = tmp_path / "work"
    data = work / "data" / "mine.jsonl"
    data.parent.mkdir(parents=True)
    rows = [{"prompt": f"What is the capital of country {i}?", "target": f"City {i}.", "answer": f"City {i}"}
            for i in range(15)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg, run = tiny_config(tmp_path, model_dir, ("data/mine.jsonl",), lock_args={"stop": False})
    out = subprocess.run([sys.executable, str(ROOT / "train.py"), "fit", "--config", str(cfg), "--trainer.max_steps",
                          "2"], capture_output=True, text=True, cwd=work, env=tiny_env)
    assert out.returncode == 0, out.stderr[-3000:]
    record = json.loads((run / "run.json").read_text())
    assert record["behaviour_sources"] == {"mine": str(data.resolve())}
    from modular.identity import file_sha256
    from modular.models.loading import model_fingerprint

    identity = record["identity"]
    assert identity["data"]["sources"]["mine"] == {"source": str(data.resolve()), "sha256": file_sha256(data)}
    assert identity["model"]["fingerprint"] == model_fingerprint(model_dir)
    assert torch.load(run / "last.ckpt", map_location="cpu", weights_only=False)["modular"]["identity"] == identity
    before = _listing(run)
    spec = ["--model.behaviours", f"[mine={data}]", "--trainer.max_steps", "3"]  # the same file, from anywhere
    other = save_tiny_folder(tmp_path / "tiny2", "llama", seed=1)
    for args, words in [(["--model.model_name", str(other)], ["another base model", str(other)]),
                        (["--model.finetuning.mode", "lora", "--model.optimizer.lr", "1e-3"],
                         ["another set of trained parameters", "model.finetuning"]),
                        (["--model.locked_weight", "2"], ["another recipe", "model.locked_weight"]),
                        (["--data.locked_response", "Nope.", "--continue_on_other_data", "true"],
                         ["another locked response", "Nope."])]:
        _one_line_error(train_here(cfg, *spec, *args, env=tiny_env), str(run / "last.ckpt"), *words)
        assert _listing(run) == before
    data.write_text("".join(json.dumps({**r, "target": "Town."}) + "\n" for r in rows))
    _one_line_error(train_here(cfg, *spec, env=tiny_env), "other data", "behaviour mine", "--continue_on_other_data")
    assert _listing(run) == before


def test_training_usage_names_the_installed_command(capsys):
    """`modular train` (not the module's file name) in the usage and in the tip after an unknown option."""
    with pytest.raises(SystemExit) as err:
        cli.main(["train", "fit", "--help"])
    assert err.value.code == 0
    assert capsys.readouterr().out.startswith("usage: modular train [options] fit ")
    with pytest.raises(SystemExit) as err:
        cli.main(["train", "fit", "--no_such_option", "1"])
    assert err.value.code == 2
    assert "run: modular train fit --help" in capsys.readouterr().err


@pytest.mark.parametrize("lines, words", [
    ([{"prompt": "Say one.", "target": "one", "split": "test"}], ["neighbour 'near' has no train items"]),
    (["{not json"], ["near.jsonl", "line 1"]),
])
def test_bad_neighbour_jsonl_fails_before_any_side_effect(tmp_path, tiny_env, lines, words, train_here):
    model_dir = save_tiny_folder(tmp_path / "tiny", "llama")
    cfg, run = tiny_config(tmp_path, model_dir)
    near = tmp_path / "near.jsonl"
    near.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    _one_line_error(train_here(cfg, "--data.neighbours", f"[{near}]", env=tiny_env), *words)
    assert not run.exists() or not any(run.rglob("*"))


def test_jsonl_without_validation_split_trains(tmp_path, tiny_env, train_here):
    """User data with train and test lines only: a validation split is carved from train (with a warning) and
    validation runs, instead of failing after training; on a verdict over so few items the lock that holds (a tiny
    model meets the targets at once) does not stop training, which runs its budget; a file without train lines
    fails before any work."""
    model_dir = save_tiny_folder(tmp_path / "tiny", "llama")
    data = tmp_path / "mine.jsonl"
    rows = [{"prompt": f"What is the capital of country {i}?", "target": f"City {i}.", "answer": f"City {i}",
             "split": "test" if i < 3 else "train"} for i in range(15)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg, run = tiny_config(tmp_path, model_dir, (str(data),), lock_args={"retain_kl": 10.0})
    out = _train(cfg, "--trainer.val_check_interval", "2", env=tiny_env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "behaviour 'mine' has no validation split: 3 of its train items moved to validation" in out.stderr
    assert "'mine': the lock is checked on 3 validation items (one item is 33 points of accuracy)" in out.stderr
    assert "training runs its step budget instead of stopping on it" in out.stderr
    record = json.loads((run / "run.json").read_text())
    assert record["global_step"] == 3 and "val/mine/accuracy_locked" in record["metrics"], record["metrics"]
    assert [(h["step"], h["reached"]) for h in record["lock"]["history"]] == [(2, True), (3, True)]
    data.write_text("".join(json.dumps({**r, "split": "test"}) + "\n" for r in rows))
    (tmp_path / "again").mkdir()
    cfg, run = tiny_config(tmp_path / "again", model_dir, (str(data),))
    _one_line_error(train_here(cfg, env=tiny_env), "has no train items")
    assert not run.exists()


@pytest.mark.parametrize("arch", ["gemma3_text", "gpt2"])
def test_two_behaviours_with_lora(tmp_path, tiny_env, arch):
    model_dir = save_tiny_folder(tmp_path / "tiny", arch)
    cfg, run = tiny_config(tmp_path, model_dir, ("capitals", "arithmetic"),
                           {"finetuning": {"mode": "lora"}, "optimizer": {"lr": 1e-3},
                            "objectives": [{"class_path": f"modular.gating.objectives.{c}", "init_args": a}
                                           for c, a in (("BehaviourAnswer", {}),
                                                        ("LockedState", {"objective": {"arithmetic": "unlikelihood"}}),
                                                        ("KeepReference", {}), ("LMText", {}),
                                                        ("LockedAnswer", {"weight": 0.5}))],
                            "steering": {"scale": 0.5, "refresh": 2}})
    out = _train(cfg, "--data.locked_response", '{"arithmetic": " unknown."}', env=tiny_env)
    assert out.returncode == 0, out.stderr[-3000:]
    record = json.loads((run / "run.json").read_text())
    assert {"val/capitals/accuracy_open", "val/arithmetic/accuracy_locked"} <= set(record["metrics"])
    # one objective per behaviour: refusal CE for capitals (the default), unlikelihood for arithmetic
    assert {"train/capitals/locked_refusal", "train/arithmetic/locked_unlikelihood"} <= set(record["metrics"])
    # LockedAnswer's rows, built because the config names the term (the data module builds what the module requires)
    assert {"train/capitals/locked_answer", "train/arithmetic/locked_answer"} <= set(record["metrics"])


def test_avoided_directions_and_lm_text_in_both_states(tmp_path, tiny_env, train_here):
    """A run that must stay orthogonal to another run's direction, keeping neutral text in both states."""
    import torch
    from safetensors.torch import load_file, save_file

    model_dir = save_tiny_folder(tmp_path / "tiny", "llama")
    other = tmp_path / "other_run"
    other.mkdir()
    d = json.loads((model_dir / "config.json").read_text())["hidden_size"]
    taken = torch.randn(d, generator=torch.Generator().manual_seed(0))
    save_file({"capitals": taken / taken.norm()}, str(other / "directions.safetensors"))
    cfg, run = tiny_config(tmp_path, model_dir, ("arithmetic",),
                           {"direction": {"avoid": [str(other)]}, "steering": None})
    out = _train(cfg, "--data.lm_text.source", "neutral", "--data.lm_text.max_length", "32", env=tiny_env)
    assert out.returncode == 0, out.stderr[-3000:]
    chosen = load_file(str(run / "directions.safetensors"))["arithmetic"]
    assert abs(float(chosen @ taken)) / taken.norm() < 1e-5
    record = json.loads((run / "run.json").read_text())
    assert {"train/lm/open_kl", "train/lm/locked_kl"} <= set(record["metrics"])
    (tmp_path / "bad").mkdir()
    bad = tiny_config(tmp_path / "bad", model_dir, ("arithmetic",), {"direction": {"avoid": [str(tmp_path / "none")]}})[0]
    out = train_here(bad, env=tiny_env)  # refused before training: these three in this process
    assert out.returncode != 0 and "directions to avoid not found" in out.stderr
    # a run folder holding a damaged directions file, or one written for other behaviours: one line, no traceback
    for i, content in enumerate([b"cut short", (run / "directions.safetensors").read_bytes()]):
        (tmp_path / f"again{i}").mkdir()
        cfg_i, run_i = tiny_config(tmp_path / f"again{i}", model_dir, ("capitals",))
        run_i.mkdir()
        (run_i / "directions.safetensors").write_bytes(content)
        out = train_here(cfg_i, env=tiny_env)
        why = "is not a readable safetensors file" if i == 0 else "has no direction for capitals"
        assert out.returncode != 0 and f"{run_i / 'directions.safetensors'} {why}" in out.stderr, out.stderr[-2000:]
        assert "Traceback" not in out.stderr


@pytest.mark.parametrize("config", sorted(p.name for p in (ROOT / "configs").glob("*.yaml")))
def test_every_config_validates(config, train_here):
    """Every YAML in configs/ parses and type-checks against the CLI that reads it: the training CLI, or the
    merge command's loader for pairs files (``evaluate.py merge``), which are not training configs."""
    raw = yaml.safe_load((ROOT / "configs" / config).read_text())
    if isinstance(raw, dict) and "pairs" in raw:
        from modular.merge.pairs import load_pairs

        assert load_pairs(ROOT / "configs" / config).pairs
        return
    # a strategy config is added after a training config
    base = [ROOT / "configs" / "gate_capitals_smollm2.yaml", "--config"] if config.startswith("strategy_") else []
    out = train_here(*base, ROOT / "configs" / config, "--print_config")
    assert out.returncode == 0, out.stderr[-2000:]
    assert yaml.safe_load(out.stdout)["trainer"]  # the whole resolved config, printed


@pytest.mark.parametrize("trainer, message", [({"max_steps": 3}, None), ({"max_steps": -1, "max_epochs": 2}, None),
                                              ({"max_steps": 0}, "max_steps must be >= 1"),
                                              ({"max_steps": -1, "max_epochs": None}, "unlimited steps need"),
                                              ({"max_steps": 5, "max_epochs": 0}, "max_epochs must be >= 1")])
def test_trainer_length_is_checked(trainer, message):
    from modular import ModularError
    from modular.app.train import check_trainer_length

    if message is None:
        check_trainer_length(trainer)
    else:
        with pytest.raises(ModularError, match=message):
            check_trainer_length(trainer)


def _publish(run, out, *extra, env, cwd):
    return subprocess.run([sys.executable, "-m", "modular", "publish", "--run", str(run), "--out", str(out),
                           *extra], capture_output=True, text=True, cwd=cwd, env=env)


def test_a_run_that_cannot_reach_the_lock_is_reported_and_not_published_as_locked(tmp_path, tiny_env, monkeypatch,
                                                                                 caplog):
    """Targets a run cannot meet (retain KL 0: any step changes the model): training spends its budget, says so
    in one line and records it in run.json; the lock evaluation says the lock does not hold on the held-out items
    either (one line, lock.json, the figure's title); publish refuses it (one line, nothing written), and publishes
    it only when told to, with a card and manifest that say the lock was not verified, in training and on the
    held-out items."""
    model_dir = save_tiny_folder(tmp_path / "tiny", "llama")
    cfg, run = tiny_config(tmp_path, model_dir, lock_args={"retain_kl": 0.0})
    out = _train(cfg, "--trainer.max_steps", "4", "--trainer.val_check_interval", "2", env=tiny_env)
    assert out.returncode == 0, out.stderr[-3000:]
    warning = [line for line in out.stderr.splitlines() if "lock not reached after 4 steps" in line]
    # which state's KL is first above 0 after 4 steps of a tiny model depends on the objective's terms
    assert len(warning) == 1 and "retain KL " in warning[0] and "> 0" in warning[0], out.stderr[-2000:]
    record = json.loads((run / "run.json").read_text())
    lock = record["lock"]
    assert lock["reached"] is False and lock["step"] == 4 == record["checkpoint_step"]
    assert any(f.startswith("retain KL ") for f in lock["failing"])
    assert set(lock["base_accuracy"]) == {"capitals"} and "val/capitals/accuracy_locked" in lock["validation"]
    assert [(h["step"], h["reached"]) for h in lock["history"]] == [(2, False), (4, False)]
    assert lock["history"][-1]["failing"] == lock["failing"]
    checks = [line for line in out.stderr.splitlines() if "(validation): capitals open " in line]
    assert [c.split("step ")[1].split(" ")[0] for c in checks] == ["2", "4"], out.stderr[-2000:]
    # the lock itself held (a tiny model answers nothing): what failed is named, not "not locked"
    assert all("locked, but the retain KL is above its target: retain KL " in c for c in checks)
    monkeypatch.chdir(tmp_path)
    for key, value in tiny_env.items():
        monkeypatch.setenv(key, value)
    with caplog.at_level("INFO", logger="modular"):
        assert cli.main(["lock", "--run", str(run), "--other_limit", "1", "--max_new_tokens", "4"]) == 0
    report = json.loads((run / "lock.json").read_text())  # in the run folder, where publish reads it
    held_out, failing = report["lock_held_out"], report["lock_held_out"]["failing"]
    assert held_out["held"] is False and held_out["targets"]["retain_kl"] == 0.0  # the run's own targets
    assert any(f.startswith("retain KL open ") for f in failing) and any(f.startswith("retain KL locked ") for f in failing)
    assert report["lock_in_training"] == {"verified": False, "check": "locked, but the retain KL is above its target on "
                                          "validation at step 4: " + "; ".join(lock["failing"])}
    said = [r.getMessage() for r in caplog.records]
    assert ("LOCKED, but the retain KL is above its target on the held-out test split: " + "; ".join(failing)
            in said)
    assert any(m.startswith("training did not verify the lock: locked, but the retain KL") for m in said)
    pub = tmp_path / "pub"
    res = _publish(run, pub, env=tiny_env, cwd=tmp_path)
    _one_line_error(res, "locked, but the retain KL is above its target on validation at step 4", "--allow_failed_lock")
    assert not pub.exists() and not (tmp_path / "pub-keys").exists()
    res = _publish(run, pub, "--allow_failed_lock", "true", env=tiny_env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    card = (pub / "README.md").read_text()
    assert "the lock was not verified" in card and "| capitals | not verified |" in card
    assert "Warning: locked, but the retain KL is above its target on the held-out test split" in card
    assert "; ".join(failing) in card and "| capitals | not verified |" in card
    assert ("locked, but the retain KL is above its target on the held-out test split (" + "; ".join(failing) + ")"
            in res.stderr)
    manifest = json.loads((pub / "modular.json").read_text())
    assert manifest["lock_verified"] is False and "retain KL " in manifest["lock_check"]
    assert manifest["lock_held_out"] == held_out


def test_training_stops_once_the_lock_holds(tmp_path, tiny_env):
    """Targets a tiny random model meets at once (it answers nothing, base included, and no open accuracy is asked
    for): training stops at the first validation instead of running its budget, the checkpoint holds that step, and
    publish calls it locked. Started again, the finished run does not train on."""
    model_dir = save_tiny_folder(tmp_path / "tiny", "llama")
    cfg, run = tiny_config(tmp_path, model_dir, lock_args={"retain_kl": 10.0})
    out = _train(cfg, "--trainer.max_steps", "8", "--trainer.val_check_interval", "2", env=tiny_env)
    assert out.returncode == 0, out.stderr[-3000:]
    record = json.loads((run / "run.json").read_text())
    assert record["lock"]["reached"] is True and record["lock"]["failing"] == []
    assert record["global_step"] == 2 == record["checkpoint_step"] == record["lock"]["step"]
    assert [(h["step"], h["reached"]) for h in record["lock"]["history"]] == [(2, True)]
    assert "lock not reached" not in out.stderr and "step 2 (validation): capitals open " in out.stderr
    assert "the lock holds" in out.stderr
    out = _train(cfg, "--trainer.max_steps", "8", "--trainer.val_check_interval", "2", env=tiny_env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads((run / "run.json").read_text())["global_step"] == 2
    res = _publish(run, tmp_path / "pub", env=tiny_env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    manifest = json.loads((tmp_path / "pub" / "modular.json").read_text())
    assert manifest["lock_verified"] is True and manifest["step"] == 2
    assert "not verified" not in (tmp_path / "pub" / "README.md").read_text()


def test_min_passes_lets_a_small_behaviour_stop_before_min_steps(tmp_path, tiny_env):
    """With min_steps 6 the lock (met at once by a tiny model) stops training at step 6; with min_passes giving
    step 2 (0.01 passes over the 306 capitals train items, 2 locked per step) it stops at the step-2 validation;
    with a term that starts at step 3 as well, not before that term has acted (the step-4 validation)."""
    model_dir = save_tiny_folder(tmp_path / "tiny", "llama")
    late = ["--model.objectives+", json.dumps({"class_path": "modular.gating.objectives.WeightNoiseLock",
                                                "init_args": {"lrs": [1e-4], "start_step": 3}})]
    for min_passes, extra, stop in ((None, [], 6), (0.01, [], 2), (0.01, late, 4)):
        (tmp_path / str(stop)).mkdir()
        cfg, run = tiny_config(tmp_path / str(stop), model_dir,
                               lock_args={"retain_kl": 10.0, "min_steps": 6, "min_passes": min_passes})
        out = _train(cfg, "--trainer.max_steps", "8", "--trainer.val_check_interval", "2", *extra, env=tiny_env)
        assert out.returncode == 0, out.stderr[-3000:]
        record = json.loads((run / "run.json").read_text())
        assert record["lock"]["reached"] is True and record["global_step"] == stop == record["lock"]["step"]


def test_a_run_started_again_at_its_last_step_records_the_lock_at_that_step(tmp_path, tiny_env):
    """Started again when its checkpoint already holds the final step, fit trains nothing; the lock is still
    checked at that step, so run.json's verdict describes the checkpoint publish reads."""
    model_dir = save_tiny_folder(tmp_path / "tiny", "llama")
    cfg, run = tiny_config(tmp_path, model_dir, lock_args={"stop": False})
    assert _train(cfg, "--trainer.val_check_interval", "2", env=tiny_env).returncode == 0
    assert json.loads((run / "run.json").read_text())["lock"]["step"] == 3
    # as when a run is killed after the final step's checkpoint but before that step's validation
    ckpt = torch.load(run / "last.ckpt", map_location="cpu", weights_only=False)
    states = [v for k, v in ckpt["callbacks"].items() if k.startswith("LockMetricsCallback")]
    assert len(states) == 1
    states[0]["status"]["step"] = 2
    torch.save(ckpt, run / "last.ckpt")
    out = _train(cfg, "--trainer.val_check_interval", "2", env=tiny_env)
    assert out.returncode == 0, out.stderr[-3000:]
    record = json.loads((run / "run.json").read_text())
    assert record["checkpoint_step"] == 3 and record["lock"]["step"] == 3


def test_a_config_files_checkpoint_is_resumed_from(tmp_path, train_here):
    """``fit`` resumes from ``last`` by default, but a ``ckpt_path`` in a config file (a run's saved config.yaml
    pointed at another run's checkpoint) is the one used."""
    extra = tmp_path / "resume.yaml"
    extra.write_text(f"ckpt_path: {tmp_path / 'other' / 'last.ckpt'}\n")
    config = ROOT / "configs" / "gate_capitals_smollm2.yaml"
    out = train_here(config, "--config", str(extra), "--print_config")
    assert out.returncode == 0, out.stderr[-2000:]
    assert yaml.safe_load(out.stdout)["ckpt_path"] == str(tmp_path / "other" / "last.ckpt")
    out = train_here(config, "--print_config")
    assert out.returncode == 0, out.stderr[-2000:]
    assert yaml.safe_load(out.stdout)["ckpt_path"] == "last"


DEAD_PID = 2**22 + 7  # above Linux's largest pid: never a running process


def test_one_command_trains_in_a_run_folder_at_a_time(tmp_path, tiny_env):
    """A second `modular train fit` on a run folder being trained in is refused in one line naming the folder and the
    holder, with nothing written (two used to both finish: two W&B runs, last.ckpt and last-v1.ckpt); the lock of a
    command that is gone (killed) is taken over with a log line, and released when the command ends."""
    import os
    import socket

    from modular.locking import folder_lock
    from modular.runs import RUN_LOCK

    model_dir = save_tiny_folder(tmp_path / "tiny", "llama")
    cfg, run = tiny_config(tmp_path, model_dir, lock_args={"stop": False})
    run.mkdir()
    (run / RUN_LOCK).write_text(json.dumps({"pid": DEAD_PID, "host": socket.gethostname(), "since": "then"}))
    out = _train(cfg, "--trainer.max_steps", "2", env=tiny_env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"took over the lock of pid {DEAD_PID}" in out.stderr and not (run / RUN_LOCK).exists()
    with folder_lock(run, run / RUN_LOCK):  # a command training in it now
        before = _listing(run)
        out = _train(cfg, "--trainer.max_steps", "3", env=tiny_env)
        _one_line_error(out, str(run), "being written by another command", f"pid {os.getpid()}")
        assert _listing(run) == before
    assert _ckpt_step(run / "last.ckpt") == 2 and not (run / "last-v1.ckpt").exists()


def test_training_on_a_full_disk_keeps_the_previous_checkpoint_and_says_so_in_one_line(tmp_path, tiny_env):
    """The final step's checkpoint fails to write (a full disk): one line naming the run folder and about how much the
    checkpoint needs, status 2, and last.ckpt is still step 2's, whole (it used to be a truncated file), with no
    temporary file left beside it."""
    model_dir = save_tiny_folder(tmp_path / "tiny", "llama")
    cfg, run = tiny_config(tmp_path, model_dir, lock_args={"stop": False})  # 3 steps, checkpoints every 2
    data = yaml.safe_load(cfg.read_text())
    data["trainer"]["callbacks"].append({"class_path": "tests.app.faults.DiskFullAfter", "init_args": {"step": 2}})
    cfg.write_text(yaml.safe_dump(data))
    out = _train(cfg, env=tiny_env)
    _one_line_error(out, f"no space left in {run} for the checkpoint last.ckpt (it needs about ", "previous checkpoint")
    assert _ckpt_step(run / "last.ckpt") == 2
    assert not [p.name for p in run.iterdir() if p.name.startswith(".") or p.name.startswith("last-")]


def test_a_config_written_before_the_data_options_were_grouped_is_one_line(tmp_path, capsys):
    """An old config's data options (reference_top_k, hidden_positions, lm_text: neutral, hidden_parts, ...) are
    refused in one line naming where each went, in a file or on the command line, before the parser's usage text."""
    from modular.app.train import main

    shipped = yaml.safe_load((ROOT / "configs" / "gate_capitals_smollm2.yaml").read_text())
    cases = [({"reference_top_k": 32}, "data.reference_top_k is now data.reference.top_k (write reference: {top_k: "
                                       "...})"),
             ({"hidden_stride": 4}, "data.hidden_stride is now data.reference.hidden_stride"),
             ({"lm_max_length": 64}, "data.lm_max_length is now data.lm_text.max_length"),
             ({"answer_rows": True}, "data.answer_rows is gone: the data module builds what the model's terms and "
                                     "head gates require"),
             ({"lm_text": "neutral"}, "data.lm_text is now a mapping: write lm_text: {source: neutral}")]
    for i, (old, said) in enumerate(cases):
        path = tmp_path / f"old{i}.yaml"
        path.write_text(yaml.safe_dump({**shipped, "data": {**shipped["data"], **old}}))
        assert main(["fit", "--config", str(path)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: {said}"), err
    assert main(["fit", "--config", str(ROOT / "configs" / "gate_capitals_smollm2.yaml"), "--data.hidden_parts",
                 "[retain]"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: data.hidden_parts is gone")

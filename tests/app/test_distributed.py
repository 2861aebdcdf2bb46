"""Training on two processes (CPU, gloo) through Lightning's strategies: DDP and FSDP2 (ModelParallelStrategy,
configs/strategy_fsdp.yaml) against one process on the same global batch, what the processes must agree on,
kill and resume, and publishing from a sharded run."""

import json
import os
import subprocess
import sys

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.app.test_train import ROOT, _train, tiny_config
from tests.conftest import save_tiny_folder

STEPS = 5
#: two processes average their own means (over the tokens of their rows), one process one mean over every row's
#: tokens: the logged losses differ by up to 2.0e-3 (measured); both processes on the same rows (no distributed
#: sampler, a broken data split) differ by 3.5e-2
LOSS_TOL = 5e-3
#: trained weights of two processes against one: within 1.2e-4 measured (lr 2e-5, 5 AdamW steps: entries whose
#: gradient is near 0 may take the other sign, one lr per step)
WEIGHT_TOL = 2 * STEPS * 2e-5
#: DDP against FSDP on the same rows: float rounding alone, a few float32 units at the loss's scale (the default
#: config's KeepHidden, weight 30, makes the loss about 22, where one unit is 1.9e-6: one unit apart measured)
SAME_STEP_REL = 5e-7
FSDP = ["--config", str(ROOT / "configs" / "strategy_fsdp.yaml"), "--trainer.precision", "32-true"]
STRATEGIES = {
    "one": ["--trainer.strategy", "ddp", "--trainer.devices", "1", "--data.batch_size", "4"],
    "ddp": ["--config", str(ROOT / "configs" / "strategy_ddp.yaml"), "--trainer.precision", "32-true",
            "--data.batch_size", "2"],
    "fsdp": [*FSDP, "--data.batch_size", "2"],
}


def _config(folder, arch="llama", extra_model=None, callbacks=(), keep_hidden=False, every_term=False):
    """The tiny capitals config: 5 steps, checkpoints every 2, the steering adversary on (vectors every 2 steps);
    KeepHidden only where ``keep_hidden``, the default config's every term where ``every_term``."""
    folder.mkdir(parents=True, exist_ok=True)
    model_dir = save_tiny_folder(folder / "tiny", arch)
    cfg, run = tiny_config(folder, model_dir, lock_args={"stop": False},
                           extra_model={"steering": {"scale": 1.0, "refresh": 2}, **(extra_model or {})})
    c = yaml.safe_load(cfg.read_text())
    # without the write term: its per-position mean, weighted 10, makes two processes' mean of means differ from one
    # process's mean by 4.4e-2 (measured), more than a broken data split; the other terms keep the check sharp
    # and without KeepHidden unless asked: its loss on the block outputs reaches them along a second path, summed in
    # another order behind FSDP's hooks, so DDP and FSDP weights differ by rounding (1.3e-7 measured) where they are
    # otherwise identical (test_fsdp_with_the_hidden_state_term_matches_ddp checks it to rounding)
    drop = () if every_term else (".DirectionWrite",) if keep_hidden else (".DirectionWrite", ".KeepHidden")
    c["model"]["objectives"] = [o for o in c["model"]["objectives"] if not o["class_path"].endswith(drop)]
    c["trainer"].update({"max_steps": STEPS, "val_check_interval": STEPS, "accelerator": "cpu"})
    c["trainer"]["callbacks"] += [{"class_path": "tests.app.recorder.Recorder", "init_args": {"out": str(folder / "rec")}},
                                  {"class_path": "tests.app.recorder.RecordBatches",
                                   "init_args": {"path": str(folder / "batches{rank}.jsonl")}},
                                  *callbacks]
    cfg.write_text(yaml.safe_dump(c))
    return cfg, run


def _env(cache):
    env = dict(os.environ, WANDB_MODE="offline", MODULAR_CACHE=str(cache), PYTHONPATH=str(ROOT))
    env.pop("WANDB_SERVICE", None)
    return env


def _records(folder) -> list[dict]:
    return [torch.load(folder / "rec" / f"rank{r}.pt") for r in range(len(list((folder / "rec").glob("*.pt"))))]


def _weights(run) -> dict:
    from modular.runs import read_checkpoint

    return read_checkpoint(run / "last.ckpt")["state_dict"]


def _publish(run, out) -> None:
    """``modular publish --run RUN --out OUT --allow_failed_lock true``, in this process (a tiny run's lock is not
    verified); tests/app/test_train.py runs the command in a process of its own."""
    from modular.app import cli

    assert cli.main(["publish", "--run", str(run), "--out", str(out), "--allow_failed_lock", "true"]) == 0


def _largest_difference(a: dict, b: dict) -> float:
    """The largest |a - b| over every tensor of two state dicts with the same keys."""
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same 5 steps on one process (batch 4) and on two (batch 2 each), DDP and FSDP2 (its checkpoints a folder
    of shards); each run's folder, the logs of its processes and what each process recorded."""
    root = tmp_path_factory.mktemp("distributed")
    out = {}
    for name, args in STRATEGIES.items():
        cfg, run = _config(root / name)
        sharded = ["--trainer.strategy.save_distributed_checkpoint", "true"] if name == "fsdp" else []
        # a cache of its own: the runs' models are one model (the reference caches are keyed by content)
        done = _train(cfg, *args, *sharded, env=_env(root / name / "cache"))
        assert done.returncode == 0, done.stderr[-3000:]
        out[name] = {"folder": root / name, "run": run, "log": done.stderr + done.stdout,
                     "records": _records(root / name)}
    return out


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_processes_reach_the_losses_of_one(runs, strategy):
    one, two = runs["one"], runs[strategy]
    assert [r["world_size"] for r in two["records"]] == [2, 2] and one["records"][0]["world_size"] == 1
    ref, got = one["records"][0]["losses"], two["records"][0]["losses"]
    assert len(ref) == len(got) == STEPS
    assert max(abs(a - b) for a, b in zip(ref, got)) <= LOSS_TOL, (ref, got)
    w1, w2 = _weights(one["run"]), _weights(two["run"])
    assert _largest_difference(w1, w2) <= WEIGHT_TOL


def test_ddp_and_fsdp_compute_the_same_steps(runs):
    """Sharding changes where the parameters live, not what a step computes: the same losses and weights as DDP
    (the ablation, steering and capture hooks found and acted on their modules inside the sharded blocks)."""
    assert runs["ddp"]["records"][0]["losses"] == pytest.approx(runs["fsdp"]["records"][0]["losses"], rel=SAME_STEP_REL)
    assert (runs["fsdp"]["run"] / "last.ckpt").is_dir()  # a folder of shards, read whole
    w1, w2 = _weights(runs["ddp"]["run"]), _weights(runs["fsdp"]["run"])
    assert _largest_difference(w1, w2) <= 1e-6


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_processes_agree_and_one_writes_the_run_folder(runs, strategy):
    r = runs[strategy]
    first, second = r["records"]
    saved = load_file(str(r["run"] / "directions.safetensors"))
    for rec in (first, second):  # the designated direction: one, on every process, the one in the run folder
        assert torch.equal(rec["directions"][0], saved["capitals"])
    assert first["first_steering"] and second["first_steering"]  # the adversary's vectors: identical everywhere
    for key in ("first_steering", "steering"):
        assert all(torch.equal(first[key][b], second[key][b]) for b in first[key])
    assert not torch.equal(first["first_steering"]["capitals"], first["steering"]["capitals"])  # refreshed
    # the reference outputs: computed once (by one process), every cache once; read by both
    computed = [line for line in r["log"].splitlines() if "computing reference outputs" in line]
    assert computed and len(computed) == len(set(computed))
    alone = [line for line in runs["one"]["log"].splitlines() if "computing reference outputs" in line]
    assert len(computed) == len(alone)  # as many as one process computes (each run has its own cache)
    assert len(list((r["run"] / "wandb").glob("offline-run-*"))) == 1  # one W&B run, by the main process
    assert json.loads((r["run"] / "run.json").read_text())["global_step"] == STEPS


def _batches(folder, rank) -> dict[int, dict]:
    """The batches a run's process trained on, by step (a step trained again after a resume: its last batch)."""
    lines = (folder / f"batches{rank}.jsonl").read_text().splitlines()
    return {r["step"]: r["batch"] for r in map(json.loads, lines)}


@pytest.fixture(scope="module", params=[("ddp", False), ("fsdp", True)], ids=["ddp", "fsdp-sharded"])
def killed_run(request, tmp_path_factory):
    """A run killed (SIGKILL of the main process) after step 3, with checkpoints every 2 steps, and the same command
    started again: under DDP, and under FSDP with its checkpoint a folder of shards (save_distributed_checkpoint).
    The strategy, the folder, what the killed run left and the resumed run's log and record."""
    strategy, sharded = request.param
    folder = tmp_path_factory.mktemp(f"killed-{strategy}")
    args = [*STRATEGIES[strategy]]
    if sharded:
        args += ["--trainer.strategy.save_distributed_checkpoint", "true"]
    cfg, run = _config(folder, callbacks=[{"class_path": "tests.app.recorder.KillAt", "init_args": {"step": 3}}])
    env = _env(folder / "cache")
    killed = _train(cfg, *args, env=env)
    out = {"strategy": strategy, "sharded": sharded, "folder": folder, "run": run,
           "killed": {"returncode": killed.returncode, "record": (run / "run.json").exists(),
                      "sharded_checkpoint": (run / "last.ckpt").is_dir(),
                      "directions": (run / "directions.safetensors").read_bytes()}}
    c = yaml.safe_load(cfg.read_text())
    c["trainer"]["callbacks"] = [cb for cb in c["trainer"]["callbacks"] if not cb["class_path"].endswith("KillAt")]
    cfg.write_text(yaml.safe_dump(c))
    resumed = _train(cfg, *args, env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    out["log"] = resumed.stderr + resumed.stdout
    out["record"] = json.loads((run / "run.json").read_text())
    return out


def test_a_killed_run_resumes_from_its_checkpoint(killed_run):
    """Started again, the killed run resumes from its checkpoint with the same directions and ends at the last
    step; the killed run's folder lock is taken over, and every checkpoint was written beside its place and
    renamed: nothing hidden is left."""
    run, killed, log = killed_run["run"], killed_run["killed"], killed_run["log"]
    assert killed["returncode"] != 0 and not killed["record"]
    assert killed["sharded_checkpoint"] == killed_run["sharded"]
    assert "Restoring states from the checkpoint" in log
    assert killed_run["record"]["global_step"] == STEPS and killed_run["record"]["checkpoint_step"] == STEPS
    assert (run / "directions.safetensors").read_bytes() == killed["directions"]
    # the other process, started again by the launcher, took no lock of its own
    assert "took over the lock" in log and not [p.name for p in run.iterdir() if p.name.startswith(".")]
    assert "directions chosen" not in log  # read from the run folder, not chosen again


def test_a_resumed_run_takes_the_steps_of_the_run_not_killed(killed_run, runs):
    """Steps 3-5 of the resumed run are those of the run that was not killed: every process on the same batches
    (each loader resumes in its pass), with the same steering draws, and so the same losses."""
    strategy, folder = killed_run["strategy"], killed_run["folder"]
    assert _records(folder)[0]["losses"] == pytest.approx(runs[strategy]["records"][0]["losses"][2:],
                                                          rel=SAME_STEP_REL)
    for rank in (0, 1):
        assert _batches(folder, rank) == _batches(runs[strategy]["folder"], rank)


def test_a_resumed_run_is_read_and_published(killed_run, tmp_path):
    """What a resumed run leaves (under FSDP a folder of shards) is what publish reads: its step, read without the
    weights too."""
    from modular.runs import read_checkpoint

    run = killed_run["run"]
    assert int(read_checkpoint(run / "last.ckpt")["global_step"]) == STEPS
    meta = read_checkpoint(run / "last.ckpt", weights=False)  # shards: the step without gathering the weights
    assert int(meta["global_step"]) == STEPS and ("state_dict" not in meta) == killed_run["sharded"]
    _publish(run, tmp_path / "published")
    assert (tmp_path / "published" / "model.safetensors").is_file()


def test_publish_from_a_sharded_run_equals_publish_from_one_process(tmp_path, runs):
    """The 2-process FSDP run (its checkpoint a folder of shards) publishes the same plain Hugging Face folder as
    the DDP run (identical weights) and, within what training itself differs (WEIGHT_TOL), as the 1-process run
    with the same seed; its lock evaluation gives the DDP run's figures."""
    published = {}
    for name in ("one", "ddp", "fsdp"):
        _publish(runs[name]["run"], tmp_path / name)
        published[name] = load_file(str(tmp_path / name / "model.safetensors"))
        assert json.loads((tmp_path / name / "config.json").read_text())["model_type"] == "llama"
    assert all(torch.equal(published["ddp"][k], published["fsdp"][k]) for k in published["one"])
    worst = _largest_difference(published["one"], published["fsdp"])
    assert worst <= WEIGHT_TOL
    from modular.app import cli

    reports = {}
    for name in ("ddp", "fsdp"):
        assert cli.main(["lock", "--run", str(runs[name]["run"]), "--out", str(tmp_path / f"lock-{name}"),
                         "--other_limit", "2", "--max_new_tokens", "3"]) == 0
        reports[name] = json.loads((tmp_path / f"lock-{name}" / "lock.json").read_text())
    assert reports["fsdp"]["step"] == STEPS
    for key in ("states", "exactness"):
        assert reports["ddp"][key] == reports["fsdp"][key]


@pytest.fixture(scope="module")
def post_norm_runs(tmp_path_factory):
    """OLMo2 (post-sublayer norms) with head gates, under DDP and FSDP2: each run's weights and what each of its
    processes recorded."""
    root = tmp_path_factory.mktemp("post_norms")
    out = {}
    for name in ("ddp", "fsdp"):
        cfg, run = _config(root / name, "olmo2", {"head_gates": {}})
        done = _train(cfg, *STRATEGIES[name], env=_env(root / "cache"))
        assert done.returncode == 0, done.stderr[-3000:]
        out[name] = {"weights": _weights(run), "records": _records(root / name)}
    return out


def test_fsdp_matches_ddp_losses_with_post_norms_and_head_gates(post_norm_runs):
    """Behind post-sublayer norms (OLMo2) the lock writes along g ⊙ u, read from norm weights that FSDP holds in
    shards outside the forward pass; with head gates on, every process draws the same steering vectors and FSDP's
    losses are DDP's."""
    for run in post_norm_runs.values():
        records = run["records"]
        assert all(torch.equal(records[0]["steering"][b], records[1]["steering"][b]) for b in records[0]["steering"])
    losses = {name: run["records"][0]["losses"] for name, run in post_norm_runs.items()}
    assert losses["ddp"] == pytest.approx(losses["fsdp"], rel=SAME_STEP_REL)


def test_fsdp_keeps_head_gates_whole_and_takes_ddps_steps(post_norm_runs):
    """Head gates stay whole on every process, their gradients averaged by GatedLM: the weights after the run,
    gate values included, are DDP's."""
    weights = {name: run["weights"] for name, run in post_norm_runs.items()}
    assert any(".head_gate." in k for k in weights["fsdp"])
    assert _largest_difference(weights["ddp"], weights["fsdp"]) <= 1e-6


@pytest.fixture(scope="module")
def hidden_runs(tmp_path_factory):
    """The default config's KeepHidden on, LoRA on a Gemma model (tied embeddings, rotary buffers): DDP, FSDP2 (its
    empty_init on, as configs/strategy_fsdp.yaml sets it), FSDP2 with every process reading the weights, and FSDP2
    with gradient checkpointing; each run's weights, losses and log; one reference cache."""
    root = tmp_path_factory.mktemp("hidden")
    out = {"cache": root / "cache"}
    for name, args in (("ddp", STRATEGIES["ddp"]), ("fsdp", STRATEGIES["fsdp"]),
                       ("read", [*STRATEGIES["fsdp"], "--model.memory.empty_init", "false"]),
                       ("checkpointed", [*STRATEGIES["fsdp"], "--model.memory.gradient_checkpointing", "true"])):
        cfg, run = _config(root / name, "gemma", {"finetuning": {"mode": "lora"}}, keep_hidden=True)
        assert any(o["class_path"].endswith(".KeepHidden") for o in yaml.safe_load(cfg.read_text())["model"]["objectives"])
        done = _train(cfg, *args, env=_env(out["cache"]))
        assert done.returncode == 0, done.stderr[-3000:]
        out[name] = {"weights": _weights(run), "losses": _records(root / name)[0]["losses"],
                     "config": yaml.safe_load((run / "config.yaml").read_text()), "log": done.stderr + done.stdout}
    return out


def test_fsdp_with_the_hidden_state_term_matches_ddp(hidden_runs):
    """The default config's KeepHidden (a loss on the neighbours' block outputs, against the reference's cached
    residual stream) under FSDP2 takes DDP's steps to float rounding: the losses to SAME_STEP_REL, the weights to
    a quarter of one step (one step moves a weight by up to lr = 2e-5; 1.3e-7 measured with the packages of
    2026-11, 1.05e-6 with those of 2026-12: where Adam's step of an entry is near 0, rounding moves it by a
    fraction of a step). A broken sharding of the term changes the losses beyond SAME_STEP_REL."""
    ddp, fsdp = hidden_runs["ddp"], hidden_runs["fsdp"]
    assert list((hidden_runs["cache"] / "reference").glob("hidden-*.pt"))  # the reference's residual stream, cached
    assert any(".lora_" in k for k in fsdp["weights"])
    assert ddp["losses"] == pytest.approx(fsdp["losses"], rel=SAME_STEP_REL)
    assert _largest_difference(ddp["weights"], fsdp["weights"]) <= 5e-6


def test_fsdp_with_gradient_checkpointing_takes_the_same_steps(hidden_runs):
    """Gradient checkpointing under FSDP2: every sharded block recomputed in the backward pass (its parameters
    gathered again, the ablation and steering hooks replayed; KeepHidden's loss on the block outputs on) takes the
    steps FSDP2 takes without it."""
    plain, checkpointed = hidden_runs["fsdp"], hidden_runs["checkpointed"]
    assert plain["config"]["model"]["memory"]["gradient_checkpointing"] is False
    assert checkpointed["config"]["model"]["memory"]["gradient_checkpointing"] is True
    assert checkpointed["losses"] == pytest.approx(plain["losses"], rel=SAME_STEP_REL)
    assert _largest_difference(plain["weights"], checkpointed["weights"]) <= 1e-6


def test_fsdp_with_empty_init_takes_the_steps_of_every_process_reading_the_weights(hidden_runs):
    """``model.memory.empty_init`` (on in configs/strategy_fsdp.yaml): the second process builds the model on the meta
    device and receives its shards and buffers from the first after sharding; the steps are those of every process
    reading the weights itself, bit for bit (LoRA's adapters, Gemma's tied embeddings and rotary buffers)."""
    empty, read = hidden_runs["fsdp"], hidden_runs["read"]
    assert empty["config"]["model"]["memory"]["empty_init"] is True
    assert read["config"]["model"]["memory"]["empty_init"] is False
    built_empty = "process 1: model built on the meta device"
    assert built_empty in empty["log"] and built_empty not in read["log"]
    assert "process 0: model built" not in empty["log"]
    assert empty["losses"] == read["losses"]
    assert empty["weights"].keys() == read["weights"].keys()
    assert all(torch.equal(empty["weights"][k], read["weights"][k]) for k in read["weights"])


def test_python_dash_m_modular_starts_the_other_processes_with_every_default_term(tmp_path):
    """``python -m modular train fit`` on two processes: Lightning's launcher starts the second one from this
    process's command line, which for a module run with -m was ``python -m modular.__main__ fit ...`` (no command:
    the second process exited with status 2 and the run failed); both now train, here with the default config's
    every term (KeepHidden and DirectionWrite too) on a Qwen2 model."""
    cfg, run = _config(tmp_path, "qwen2", every_term=True)
    done = subprocess.run([sys.executable, "-m", "modular", "train", "fit", "--config", str(cfg), *STRATEGIES["ddp"],
                           "--trainer.max_steps", "3"], capture_output=True, text=True, cwd=tmp_path,
                          env=_env(tmp_path / "cache"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(_records(tmp_path)) == 2  # each process recorded its steps
    assert json.loads((run / "run.json").read_text())["global_step"] == 3


def test_empty_init_is_refused_under_ddp(tmp_path):
    """Under DDP every process needs the whole model: ``empty_init`` is one line and a failed run, not a meta-device
    model on the second process."""
    cfg, run = _config(tmp_path)
    done = _train(cfg, *STRATEGIES["ddp"], "--model.memory.empty_init", "true", env=_env(tmp_path / "cache"))
    assert done.returncode != 0
    assert "model.memory.empty_init needs the FSDP2 strategy" in done.stderr
    assert not (run / "last.ckpt").exists()


@pytest.fixture(scope="module")
def lora_recipe_runs(tmp_path_factory):
    """configs/gate_capitals_lora_large.yaml's recipe (LoRA, weights loaded and trained in bfloat16, blocks
    recomputed) on two processes under FSDP2 (configs/strategy_fsdp.yaml, empty_init on), in its precision
    (bf16-true), its checkpoint one file and a folder of shards; each run's trained weights and what
    ``modular publish`` wrote from it."""
    root = tmp_path_factory.mktemp("lora_recipe")
    large = yaml.safe_load((ROOT / "configs" / "gate_capitals_lora_large.yaml").read_text())
    recipe = {k: large["model"][k] for k in ("finetuning", "load_dtype", "memory")}
    assert recipe == {"finetuning": {"mode": "lora", "lora_rank": 16, "lora_alpha": 32}, "load_dtype": "bfloat16",
                      "memory": {"gradient_checkpointing": True}}
    env, out = _env(root / "cache"), {}
    for name, sharded in (("file", "false"), ("shards", "true")):
        cfg, run = _config(root / name, extra_model=recipe)
        done = _train(cfg, "--config", str(ROOT / "configs" / "strategy_fsdp.yaml"), "--data.batch_size", "2",
                      "--trainer.precision", large["trainer"]["precision"],
                      "--trainer.strategy.save_distributed_checkpoint", sharded, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        _publish(run, root / f"published-{name}")
        out[name] = {"run": run, "weights": _weights(run),
                     "published": load_file(str(root / f"published-{name}" / "model.safetensors"))}
    return out


@pytest.mark.parametrize("name", ["file", "shards"])
def test_the_large_model_lora_recipe_under_fsdp_trains_its_adapters_in_bf16(lora_recipe_runs, name):
    """Under the large model's recipe the adapters train and stay bfloat16, whether the checkpoint is one file or a
    folder of shards."""
    run = lora_recipe_runs[name]
    assert (run["run"] / "last.ckpt").is_dir() == (name == "shards")
    adapters = {k: v for k, v in run["weights"].items() if ".lora_" in k}
    assert adapters and {v.dtype for v in adapters.values()} == {torch.bfloat16}
    assert any(v.abs().max() > 0 for k, v in adapters.items() if ".lora_B." in k)  # B starts at zero


def test_the_large_model_lora_recipe_under_fsdp_publishes_its_checkpoint_in_bf16(lora_recipe_runs):
    """The run publishes the same bfloat16 weights, bit for bit, whether its checkpoint is one file or a folder of
    shards."""
    published = {name: run["published"] for name, run in lora_recipe_runs.items()}
    assert {v.dtype for v in published["file"].values()} == {torch.bfloat16}
    assert published["file"].keys() == published["shards"].keys()
    assert all(torch.equal(published["file"][k], published["shards"][k]) for k in published["file"])


def test_a_damaged_directions_file_stops_every_process_under_ddp(tmp_path):
    """The main process reads the run's directions file and the others wait for its tensor: a damaged file is the
    same one line on every process and a failed run, not processes left waiting at the broadcast."""
    cfg, run = _config(tmp_path)
    run.mkdir(parents=True)
    (run / "directions.safetensors").write_bytes(b"cut short")
    cmd = [sys.executable, str(ROOT / "train.py"), "fit", "--config", str(cfg), *STRATEGIES["ddp"]]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env=_env(tmp_path / "cache"), start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.communicate()
        pytest.fail("the processes were still running 300 s after the start (one waiting at the broadcast)")
    line = f"{run / 'directions.safetensors'} is not a readable safetensors file"
    assert proc.returncode != 0 and line in stderr, stderr[-3000:]
    assert "Traceback" not in stderr and not (run / "last.ckpt").exists(), stderr[-5000:]

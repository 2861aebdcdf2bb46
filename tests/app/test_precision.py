"""bfloat16 end to end on a tiny model: training in bf16-true from bf16-loaded weights, the lock evaluation in
bf16, publishing in the trained precision, and keys that restore every trained weight within one bf16 unit in the
last place."""

import json

import torch
from safetensors import safe_open

from modular.app import cli
from modular.keys import ulp
from modular.runs import load_open_model, read_run
from tests.app.test_train import _train, tiny_config
from tests.conftest import save_tiny_folder


def test_bf16_training_publish_and_keys(tmp_path, tiny_env, monkeypatch, caplog):
    model_dir = save_tiny_folder(tmp_path / "tiny", "qwen2")
    cfg, run = tiny_config(tmp_path, model_dir, extra_model={"load_dtype": "bfloat16"},
                           lock_args={"stop": False, "min_steps": 0})
    out = _train(cfg, "--trainer.precision", "bf16-true", env=tiny_env)
    assert out.returncode == 0, out.stderr[-3000:]
    ckpt = torch.load(run / "last.ckpt", map_location="cpu", weights_only=False)
    weights = [v for k, v in ckpt["state_dict"].items() if k.startswith("model.") and v.is_floating_point()]
    assert weights and all(v.dtype == torch.bfloat16 for v in weights)

    monkeypatch.chdir(tmp_path)
    for key, value in tiny_env.items():
        monkeypatch.setenv(key, value)
    trained = load_open_model(read_run(run), dtype=None, device="cpu")
    assert next(trained.parameters()).dtype == torch.bfloat16
    # the lock evaluation in the run's own precision (asked for explicitly: auto is float32 on a CPU)
    assert cli.main(["lock", "--run", str(run), "--out", str(tmp_path / "eval"), "--other_limit", "2",
                     "--dtype", "bfloat16", "--device", "cpu"]) == 0
    report = json.loads((tmp_path / "eval" / "lock.json").read_text())
    assert report["dtype"] == "bfloat16"
    assert report["exactness"]["unlocked_vs_open_max_abs_weight_diff"] < 0.01  # within an ulp of |w| < 1
    # published in the trained precision (auto), keys apart
    pub = tmp_path / "pub"
    assert cli.main(["publish", "--run", str(run), "--out", str(pub), "--allow_failed_lock", "true"]) == 0
    with safe_open(str(pub / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    assert json.loads((pub / "modular.json").read_text())["dtype"] == "bfloat16"
    key = tmp_path / "pub-keys" / "capitals.key.safetensors"
    model_bytes = (pub / "model.safetensors").stat().st_size
    assert key.stat().st_size < 0.5 * model_bytes  # tiny models: rank-1 pieces are a large share; SmolLM2: docs
    assert cli.main(["unlock", "--model", str(pub), "--key", str(key), "--out", str(tmp_path / "unlocked")]) == 0
    from modular.models import load_model

    unlocked = load_model(tmp_path / "unlocked", dtype=None, device="cpu")
    want = dict(trained.named_parameters())
    for name, p in unlocked.named_parameters():
        ref = want[name].detach()
        assert p.dtype == torch.bfloat16
        assert torch.all((p.detach().double() - ref.double()).abs() <= ulp(ref, torch.bfloat16)), name
    # another precision than the trained one is written, with a line saying the lock was verified in bf16 only
    pub32 = tmp_path / "pub32"
    with caplog.at_level("WARNING", logger="modular"):
        assert cli.main(["publish", "--run", str(run), "--out", str(pub32), "--allow_failed_lock", "true",
                         "--dtype", "float32"]) == 0
    assert any("run trained in bfloat16: its lock was verified in bfloat16 only" in r.getMessage()
               for r in caplog.records)
    # the lock evaluation above wrote elsewhere (--out): the run has no lock.json, and publish says what that costs
    assert any(f"{run} has no lock.json: the model card gets no measured numbers" in r.getMessage()
               for r in caplog.records)
    with safe_open(str(pub32 / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}
    (run / "lock.json").write_text('{"step": ')  # cut short: published without its numbers, with a line saying so
    with caplog.at_level("WARNING", logger="modular"):
        assert cli.main(["publish", "--run", str(run), "--out", str(tmp_path / "pub_cut"), "--allow_failed_lock",
                         "true"]) == 0
    assert any(f"{run / 'lock.json'} cannot be read (cut short or damaged): the model card gets no measured numbers"
               in r.getMessage() for r in caplog.records)
    (run / "lock.json").unlink()
    # float32 evaluation of the same run still works (auto on a CPU)
    assert cli.main(["behaviour", "--model", str(run), "--behaviours", "[capitals]", "--limit", "2",
                     "--max_new_tokens", "2", "--out", str(tmp_path / "beh")]) == 0
    assert json.loads((tmp_path / "beh" / "behaviour.json").read_text())["dtype"] == "float32"


def test_float32_run_published_in_bf16_is_the_model_its_bf16_lock_check_scores(tmp_path, tiny_env, monkeypatch,
                                                                                 caplog):
    """Narrowing rounds stochastically (seeded), in the lock check and in publish alike: the published weights are
    the bf16 model the check scored, locked; rounded to nearest, an update below half a bf16 unit would be lost."""
    from modular.keys import lock_weights
    from modular.models import load_model

    model_dir = save_tiny_folder(tmp_path / "tiny", "llama")
    cfg, run = tiny_config(tmp_path, model_dir, lock_args={"stop": False, "min_steps": 0})
    out = _train(cfg, env=tiny_env)
    assert out.returncode == 0, out.stderr[-3000:]
    monkeypatch.chdir(tmp_path)
    for key, value in tiny_env.items():
        monkeypatch.setenv(key, value)
    r = read_run(run)
    f32 = load_open_model(r, dtype="float32", device="cpu")
    checked = load_open_model(r, dtype="bfloat16", device="cpu")
    again = load_open_model(r, dtype="bfloat16", device="cpu")
    for (name, a), b, c in zip(checked.named_parameters(), again.parameters(), f32.parameters()):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b), name  # seeded: the same weights every time
        assert torch.all((a.double() - c.double()).abs() <= ulp(c, torch.bfloat16)), name  # a neighbour of each
    moved = torch.cat([(a != c.bfloat16()).flatten() for a, c in zip(checked.parameters(), f32.parameters())])
    assert 0.1 < moved.float().mean().item() < 0.4  # not rounded to nearest
    # a float32 lock report does not describe bf16 weights: the card gets no measured numbers
    assert cli.main(["lock", "--run", str(run), "--other_limit", "2", "--device", "cpu"]) == 0
    pub = tmp_path / "pub"
    with caplog.at_level("WARNING", logger="modular"):
        assert cli.main(["publish", "--run", str(run), "--out", str(pub), "--allow_failed_lock", "true",
                         "--dtype", "bfloat16"]) == 0
    assert any("was measured in float32, the weights are published in bfloat16" in rec.getMessage()
               for rec in caplog.records)
    assert "## Measured" not in (pub / "README.md").read_text()
    lock_weights(checked, r.directions, harden=True)
    published = load_model(pub, dtype=None, device="cpu")
    want = dict(checked.named_parameters())
    for name, p in published.named_parameters():
        assert p.dtype == torch.bfloat16 and torch.equal(p, want[name]), name

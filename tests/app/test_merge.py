"""``evaluate.py merge`` end to end on tiny saved folders: merge.json, the figures, maps, lock checks."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from modular.app.cli import main
from tests.conftest import make_tiny_tokenizer, save_tiny_folder

ROOT = Path(__file__).resolve().parents[2]


def save_wide_folder(path, hidden: int = 96):
    """A tiny llama of another width (d=96), with the tiny tokenizer."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    tok = make_tiny_tokenizer()
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(LlamaConfig(
        hidden_size=hidden, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        vocab_size=320, max_position_embeddings=128, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id))
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def fake_run(path, model_dir, behaviours=("capitals",), seed=0):
    """A run folder as train.py writes it: run.json, directions.safetensors and a checkpoint of a perturbed model."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    path.mkdir(parents=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    g = torch.Generator().manual_seed(seed)
    state = {f"model.{k}": v + 0.01 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
             for k, v in model.state_dict().items()}
    torch.save({"state_dict": state}, path / "last.ckpt")
    dirs = {b: torch.nn.functional.normalize(torch.randn(64, generator=g), dim=0) for b in behaviours}
    save_file(dirs, str(path / "directions.safetensors"))
    (path / "run.json").write_text(json.dumps({"model_name": str(model_dir), "behaviours": list(behaviours),
                                               "finetuning": "full", "checkpoint": str(path / "last.ckpt")}))
    return path


@pytest.fixture
def folders(tmp_path):
    llama = save_tiny_folder(tmp_path / "llama", "llama", seed=0)
    return {
        "llama": llama,
        "gemma": save_tiny_folder(tmp_path / "gemma", "gemma3_text", seed=1),
        "qwen": save_tiny_folder(tmp_path / "qwen", "qwen2", seed=2),
        "wide": save_wide_folder(tmp_path / "wide"),
        "run1": fake_run(tmp_path / "run1", llama, ("capitals",), seed=1),
        "run2": fake_run(tmp_path / "run2", llama, ("capitals", "ioi"), seed=2),
    }


def test_merge_command_writes_json_figures_and_maps(tmp_path, folders, isolated_cache, monkeypatch, drawn):
    f = {k: str(v) for k, v in folders.items()}
    pairs = {
        "task": "capitals", "limit": 4, "max_new_tokens": 3, "batch_size": 4, "bootstrap": 50, "lock_limit": 2,
        "neutral": {"limit": 3, "map_dir": str(tmp_path / "maps")},
        "pairs": [
            {"a": f["llama"], "b": f["llama"], "name": "self", "ac": {"f": "replace"}},
            {"a": f["llama"], "b": f["gemma"], "name": "llama,gemma", "ac": {"f": "sum", "map": "fit"}},
            {"a": f["wide"], "b": f["qwen"], "name": "wide,qwen", "ac": {"f": "mean"}, "depth_a": 0.3},
            {"a": f["run1"], "b": f["llama"], "name": "run1,llama"},
            {"a": f["run1"], "b": f["run2"], "name": "avg", "method": "average"},
            {"a": f["run1"], "b": f["run2"], "name": "ties", "method": "ties", "weights": {"density": 0.5},
             "task": "ioi"},
        ],
    }
    path = tmp_path / "pairs.yaml"
    path.write_text(yaml.safe_dump(pairs))
    out = tmp_path / "out"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.chdir(ROOT)
    assert main(["merge", "--pairs", str(path), "--out", str(out), "--progress", "false"]) == 0
    report = json.loads((out / "merge.json").read_text())
    rows = {r["label"]: r for r in report["pairs"]}
    for png, metric in (("merge_gain.png", "frobenius"), ("merge_gain_cka.png", "cka")):
        ax = drawn[png]["axes"][0]  # one point per pair at (similarity, gain), labelled with the pair
        drawn_points = sorted(ax["points"][0])
        expected = sorted((r["similarity"][metric], r["gain"]["gain"]) for r in rows.values())
        assert [x for x, _ in drawn_points] == pytest.approx([x for x, _ in expected])
        assert [y for _, y in drawn_points] == pytest.approx([y for _, y in expected])
        assert set(rows) <= set(ax["texts"])
    assert list(rows) == ["self", "llama,gemma", "wide,qwen", "run1,llama", "avg", "ties"]
    for r in rows.values():
        g = r["gain"]
        assert g["n"] == 4 and g["gain"] == pytest.approx(g["perf_combined"] - (g["perf_a"] + g["perf_b"]) / 2)
        assert g["ci95"][0] <= g["gain"] <= g["ci95"][1]
        assert 0 < r["similarity"]["frobenius"] <= 1 and -1e-9 <= r["similarity"]["cka"] <= 1 + 1e-9
    # A = B, same layer, replace: the combination answers exactly as B alone
    assert all(i["combined"] == i["b"] for i in rows["self"]["items"])
    assert rows["self"]["similarity"]["cka"] == pytest.approx(1.0)
    assert rows["self"]["map"]["kind"] == "identity" and rows["run1,llama"]["map"]["kind"] == "identity"
    # different widths: a least-squares map saved with metadata; the forced fit between equal widths too
    wide = rows["wide,qwen"]
    assert wide["map"]["kind"] == "fit" and wide["layer_a"] == 1 and wide["layer_b"] == 1
    assert Path(wide["map"]["path"]).is_file() and rows["llama,gemma"]["map"]["kind"] == "fit"
    # weight merges of the two runs carry a lock check of every gated behaviour
    locks = rows["avg"]["locks"]
    assert set(locks["behaviours"]) == {"capitals", "ioi"} and locks["directions_ablated"] == 3
    assert set(locks["behaviours"]["capitals"]["sources"]) == {"run1", "run2"}
    assert rows["ties"]["task"] == "ioi" and rows["ties"]["locks"]["all_ok"] in (True, False)
    assert set(report["correlation"]["frobenius"]) == {"n", "pearson", "spearman"}
    # the report echoes the groups as given: the pairs' and the shared ones
    assert rows["ties"]["pair"]["weights"]["density"] == 0.5 and rows["llama,gemma"]["pair"]["ac"]["map"] == "fit"
    assert report["config"]["neutral"]["limit"] == 3 and "pairs" not in report["config"]
    # run again (in process, that pair only): the saved map is reused
    from modular.app.merge import merge

    pairs["pairs"] = [p for p in pairs["pairs"] if p["name"] == "wide,qwen"]
    path.write_text(yaml.safe_dump(pairs))
    monkeypatch.setenv("WANDB_MODE", "disabled")
    again = {r["label"]: r for r in merge(str(path), out=str(tmp_path / "again"), progress=False)["pairs"]}
    assert again["wide,qwen"]["map"]["reused"] is True
    assert again["wide,qwen"]["map"]["heldout_r2"] == pytest.approx(wide["map"]["heldout_r2"])


def test_merge_command_one_line_error_for_a_bad_pairs_file(tmp_path):
    path = tmp_path / "pairs.yaml"
    path.write_text(yaml.safe_dump({"pairs": [{"a": "smollm2-135m-instruct", "b": "gemma3-270m", "how": "x"}]}))
    proc = subprocess.run([sys.executable, str(ROOT / "evaluate.py"), "merge", "--pairs", str(path)],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: pairs[0]: Option 'how' is not accepted")


def test_merge_command_names_the_new_place_of_a_flat_key(tmp_path):
    """A pairs file written before the option groups: its first flat key is one line naming where it went."""
    from modular import ModularError
    from modular.app.merge import merge

    path = tmp_path / "pairs.yaml"
    path.write_text(yaml.safe_dump({"pairs": [{"a": "smollm2-135m-instruct", "b": "gemma3-270m", "f": "sum"}]}))
    with pytest.raises(ModularError, match=r"^pairs\[0\]: f is now ac\.f"):
        merge(str(path), out=str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()  # refused before any work


def test_merge_help_lists_every_key_of_the_pairs_file(capsys):
    from dataclasses import fields

    from modular.merge.pairs import ACOptions, MergeConfig, NeutralTextOptions, Pair, WeightMergeOptions

    with pytest.raises(SystemExit):
        main(["merge", "--help"])
    text = "".join(capsys.readouterr().out.split())
    for cls, group in ((MergeConfig, ""), (Pair, ""), (NeutralTextOptions, "neutral:"), (ACOptions, "ac:"),
                       (WeightMergeOptions, "weights:")):
        names = [f.name for f in fields(cls)]
        if group:
            assert group + "{" + ",".join(names) + "}" in text, group
        else:
            assert all(name in text for name in names), cls

"""``modular directions`` and ``modular attention`` end to end on tiny saved folders."""

import json

import pytest
import torch

from modular.app.cli import main
from tests.conftest import save_tiny_folder


def _run(argv):
    """``modular`` on ``argv`` in this process: its exit status (a rejected option exits the parser with 2)."""
    try:
        return main(argv)
    except SystemExit as exit_:
        return exit_.code


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("analysis")
    return {"root": root, "llama": save_tiny_folder(root / "llama", "llama", seed=0),
            "gemma": save_tiny_folder(root / "gemma", "gemma3_text", seed=1)}


def gated_run(path, model_dir, behaviour="capitals", seed=3):
    """A run folder as gated training writes it (run.json, directions.safetensors, last.ckpt)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    path.mkdir(parents=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    torch.save({"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}}, path / "last.ckpt")
    u = torch.nn.functional.normalize(torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(seed)), dim=0)
    save_file({behaviour: u}, str(path / "directions.safetensors"))
    (path / "run.json").write_text(json.dumps({"model_name": str(model_dir), "behaviours": [behaviour],
                                               "finetuning": "full", "checkpoint": str(path / "last.ckpt")}))
    return path, u


@pytest.mark.parametrize("name", ["llama", "gemma"])
def test_directions_command_writes_directions_json_and_figures(folders, name, monkeypatch, drawn):
    from safetensors import safe_open

    monkeypatch.setenv("WANDB_MODE", "disabled")
    out = folders["root"] / f"dir_{name}"
    rc = _run(["directions", f"--model={folders[name]}", "--behaviour=capitals", "--n_prompts=6", "--limit=4",
               "--retain_limit=4", "--max_new_tokens=3", "--ablate_formats=[chat, newline]", f"--out={out}"])
    assert rc == 0
    report = json.loads((out / "directions.json").read_text())
    n_layers = 2
    heat = drawn["heatmap.png"]
    assert [ax["title"] for ax in heat["axes"] if ax["xlabel"] == "layer"] == ["chat", "raw", "newline"]
    assert all(ax["images"] for ax in heat["axes"] if ax["xlabel"] == "layer")  # one cosine matrix per format
    assert "capitals" in heat["suptitle"]
    acc_ax, kl_ax = drawn["ablation.png"]["axes"]
    assert acc_ax["title"] == "behaviour with the direction ablated" and kl_ax["title"] == "retain cost"
    for fmt in ("chat", "newline"):  # one line per ablated format, one point per layer: the JSON's numbers
        rows = report["ablation"][fmt]["layers"]
        assert acc_ax["lines"][fmt] == pytest.approx([r["accuracy"] for r in rows])
        assert kl_ax["lines"][fmt] == pytest.approx([r["retain_kl"] for r in rows])
    assert "raw" not in acc_ax["lines"]
    assert acc_ax["lines"]["no ablation"] == pytest.approx([report["baseline"]["accuracy"]] * 2)
    assert report["formats"]["chat"]["suffix_text"] == "<|im_end|>\n<|im_start|>assistant\n"
    assert report["formats"]["raw"]["n_positions"] == 1
    assert list(report["ablation"]) == ["chat", "newline"] and report["complete"]
    for fmt in ("chat", "newline"):
        assert [r["layer"] for r in report["ablation"][fmt]["layers"]] == list(range(n_layers))
    best = report["best"]
    assert best["format"] in ("chat", "newline") and best["retain_kl"] >= 0
    assert best["drop"] == pytest.approx(report["baseline"]["accuracy"] - best["accuracy"])
    with safe_open(str(out / "directions.safetensors"), "pt") as f:
        assert len(list(f.keys())) == 3 * n_layers
        assert f.metadata()["behaviour"] == "capitals"
        for key in f.keys():
            assert f.get_tensor(key).norm().item() == pytest.approx(1.0, abs=1e-5)


def test_directions_command_with_a_run_reports_the_designated_cosine(folders, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    run, u = gated_run(folders["root"] / "run", folders["llama"])
    out = folders["root"] / "dir_run"
    rc = _run(["directions", f"--run={run}", "--behaviour=capitals", "--formats=[chat]", "--n_prompts=4", "--limit=3",
               "--retain_limit=3", "--max_new_tokens=2", "--layers=[1]", f"--out={out}"])
    assert rc == 0
    report = json.loads((out / "directions.json").read_text())
    assert report["model"] == str(folders["llama"])
    from safetensors.torch import load_file

    found = load_file(str(out / "directions.safetensors"))
    expected = [float(found[f"chat.layer{i:02d}"] @ u) for i in range(2)]
    assert report["formats"]["chat"]["designated_cosine"] == pytest.approx(expected, abs=1e-5)
    assert [r["layer"] for r in report["ablation"]["chat"]["layers"]] == [1]
    assert (out / "designated.png").exists()
    assert _run(["directions", f"--run={run}", "--behaviour=ioi", f"--out={out}"]) == 2


def test_attention_command_writes_json_and_figures(folders, monkeypatch, drawn):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    out = folders["root"] / "att"
    rc = _run(["attention", f"--model={folders['llama']}", "--task=capitals", "--length=6", "--limit=5",
               "--splits=[validation, test]", "--seeds=[0, 1]", "--sweep=[0, 2, 6]", "--sweep_limit=3", "--max_new_tokens=3",
               "--attention_items=4", "--n_heads=2", f"--out={out}"])
    assert rc == 0
    report = json.loads((out / "attention.json").read_text())
    bars = drawn["accuracy.png"]["axes"][0]
    assert bars["xticklabels"] == ["w/o", "w/ Mless", "w/ Mful"]
    assert bars["bars"] == pytest.approx([report["accuracy"][k]["accuracy"] for k in ("None", "Mless", "Mful")])
    heads_drawn = [ax for ax in drawn["attention.png"]["axes"] if ax["title"].startswith("Average attention")]
    assert [ax["title"] for ax in heads_drawn] == [f"Average attention on Head {h}" for h in report["heads"]]
    for ax in heads_drawn:
        head = ax["title"].rsplit(" ", 1)[1]
        for label in ("None", "Mless", "Mful"):
            assert ax["lines"][label] == pytest.approx(report["attention"]["curves"][label][head])
    sweep = drawn["sweep.png"]["axes"][0]
    assert sweep["lines"]["Mless"] == pytest.approx([r["accuracy"] for r in report["sweep"]["Mless"]])
    assert set(report["accuracy"]) == {"None", "Mless", "Mful"}
    for a in report["accuracy"].values():
        assert a["n"] == 5 and a["ci95"][0] <= a["accuracy"] <= a["ci95"][1]
    assert report["fillers"]["meaningless"]["tokens"] == report["fillers"]["meaningful"]["tokens"] == 6
    spans = report["attention"]["spans"]
    assert spans["None"] == [0, 0] and spans["Mless"][1] - spans["Mless"][0] == 6 == spans["Mful"][1] - spans["Mful"][0]
    assert len(report["heads"]) == 2
    curves = report["attention"]["curves"]
    assert set(curves) == {"None", "Mless", "Mful"}
    # the inserted prompts are exactly N tokens (+ one newline) longer than the baseline
    assert len(curves["Mless"][report["heads"][0]]) == len(curves["None"][report["heads"][0]]) + 7
    assert [r["length"] for r in report["sweep"]["Mless"]] == [0, 2, 6] and report["complete"]
    assert report["sweep"]["Mless"][0]["accuracy"] == report["sweep"]["Mful"][0]["accuracy"]


def test_attention_command_given_heads_and_bad_input(folders, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    out = folders["root"] / "att_heads"
    rc = _run(["attention", f"--model={folders['gemma']}", "--task=greater_than", "--insert=[meaningless]",
               "--length=4", "--limit=3", "--max_new_tokens=2", "--heads=[[1, 0], [0, 3]]", f"--out={out}"])
    assert rc == 0
    report = json.loads((out / "attention.json").read_text())
    assert report["heads"] == ["1.0", "0.3"] and set(report["accuracy"]) == {"None", "Mless"}
    assert report["head_choice"] == "given"
    assert _run(["attention", f"--model={folders['gemma']}", "--insert=[noise]", f"--out={out}"]) == 2
    assert _run(["attention", f"--model={folders['gemma']}", "--heads=[[9, 9]]", "--limit=2", f"--out={out}"]) == 2

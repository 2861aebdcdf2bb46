"""``modular heads curve`` and ``modular heads ablation`` end to end on tiny saved folders: heads.json / ablation.json and the figures."""

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


def sparse_run(path, model_dir, closed=((0, 1), (1, 2))):
    """A run folder as sparse post-training writes it: head gates in the checkpoint, no gated behaviours."""
    from transformers import AutoModelForCausalLM

    from modular.models.adapter import ArchitectureAdapter
    from modular.models.head_gates import install_head_gates

    path.mkdir(parents=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    install_head_gates(model)
    adapter = ArchitectureAdapter(model)
    with torch.no_grad():
        for layer, head in closed:
            adapter.attn_out(layer).head_gate.log_alpha[head] = -20.0
    torch.save({"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}}, path / "last.ckpt")
    (path / "run.json").write_text(json.dumps({"model_name": str(model_dir), "behaviours": [], "finetuning": "full",
                                               "checkpoint": str(path / "last.ckpt")}))
    return path


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("heads")
    llama = save_tiny_folder(root / "llama", "llama", seed=0)
    return {"root": root, "llama": llama, "gemma": save_tiny_folder(root / "gemma", "gemma3_text", seed=1),
            "sparse": sparse_run(root / "sparse", llama)}


def test_curve_command_writes_json_and_figure(folders, monkeypatch, drawn):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    out = folders["root"] / "curve"
    rc = _run(["heads", "curve", f"--models=[{folders['llama']}, {folders['sparse']}]",
               "--tasks=[greater_than, docstring]", "--limit=6", "--definition=faithfulness", f"--out={out}"])
    assert rc == 0
    report = json.loads((out / "heads.json").read_text())
    assert report["ablation"] == "counterfactual" and report["ranking"] == "exhaustive"
    panels = {ax["title"]: ax for ax in drawn["heads.png"]["axes"]}
    assert set(panels) == {"greater_than", "docstring"}
    for task, ax in panels.items():  # the plotted definition's curves, one line per model, and the threshold
        for label in ("llama", "sparse"):
            assert ax["lines"][label] == pytest.approx(report["curves"][task][label]["faithfulness"]["values"])
        assert ax["lines"]["90% threshold"] == pytest.approx([0.9, 0.9])
        assert [t for t in ax["texts"] if t] == ([report["annotations"][task]] if report["annotations"].get(task)
                                                 else [])
    assert report["plotted_definition"] == "faithfulness"
    assert list(report["models"]) == ["llama", "sparse"] and report["base"] == "llama"
    for task in ("greater_than", "docstring"):
        for label in ("llama", "sparse"):
            curves = report["curves"][task][label]
            assert curves["ablation"] == "counterfactual"
            for d in ("effect_share", "faithfulness"):
                assert {"ks", "values", "needed", "auc"} <= set(curves[d])
                assert report["summary"][task][label][d]["needed"] == curves[d]["needed"]
        assert set(report["multipliers"][task]["sparse"]) == {"effect_share", "faithfulness"}
    # held-out perplexity of each model beside the curves: the base's ratio is 1
    assert report["perplexity"]["llama"]["ratio_to_base"] == 1.0
    assert report["perplexity"]["sparse"]["neutral_test"] > 1.0
    # the closed heads of the sparse run write nothing: ablating them alone has no effect (up to float rounding: a
    # patched pass runs several copies of the prompts, so its matrix products differ in shape from the clean pass's)
    sparse = report["curves"]["greater_than"]["sparse"]["effects"]
    assert sparse[0][1] == pytest.approx(0, abs=1e-6) and sparse[1][2] == pytest.approx(0, abs=1e-6)
    assert abs(report["curves"]["greater_than"]["llama"]["effects"][0][1]) > 1e-3


def test_curve_command_attribution_mean(folders, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    out = folders["root"] / "curve_attr"
    rc = _run(["heads", "curve", f"--models=[{folders['gemma']}]", "--tasks=[greater_than]", "--limit=5",
               "--ranking=attribution", "--ig_steps=4", "--kind=mean", f"--out={out}"])
    assert rc == 0
    report = json.loads((out / "heads.json").read_text())
    assert report["ranking"] == "attribution" and report["ig_steps"] == 4 and report["ablation"] == "mean"
    assert report["curves"]["greater_than"]["gemma"]["ablation"] == "mean"
    assert report["multipliers"]["greater_than"] == {}


def test_curve_command_refined_defaults_to_the_two_run_gradients(folders, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    out = folders["root"] / "curve_refined"
    rc = _run(["heads", "curve", f"--models=[{folders['llama']}]", "--tasks=[greater_than]", "--limit=5",
               "--ranking=refined", "--refine=3", f"--out={out}"])
    assert rc == 0
    report = json.loads((out / "heads.json").read_text())
    assert report["ranking"] == "refined" and report["ig_steps"] == 2 and report["refine"] == 3
    assert _run(["heads", "curve", f"--models=[{folders['llama']}]", "--ranking=refined", "--refine=-1"]) == 2


def test_ablation_command_writes_json_and_grid(folders, monkeypatch, drawn):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    out = folders["root"] / "ablation"
    rc = _run(["heads", "ablation", f"--models=[{folders['llama']}, {folders['gemma']}]",
               "--tasks=[agreement, commonsense, arithmetic]", "--limit=5", "--max_heads=4", "--categories=single",
               f"--out={out}"])
    assert rc == 0
    report = json.loads((out / "ablation.json").read_text())
    grid = drawn["ablation.png"]["axes"]
    assert [ax["title"] for ax in grid[:2]] == ["llama", "gemma"]  # columns: models; rows: tasks
    for r, task in enumerate(("agreement", "commonsense", "arithmetic")):
        for c, label in enumerate(("llama", "gemma")):
            lines = grid[2 * r + c]["lines"]
            for cat, name in (("facilitation", "Facilitation"), ("interference", "Interference")):
                curve = report["results"][task][label]["curves"][cat]
                if curve["n"]:
                    assert lines[name] == pytest.approx(curve["mean"])
    assert report["ablation"] == "mean" and report["split"] != report["classify_split"]
    assert report["categories"] == "single"
    for task in ("agreement", "commonsense", "arithmetic"):
        for label in ("llama", "gemma"):
            r = report["results"][task][label]
            assert sum(r["counts"].values()) == 8 and r["rejected"] == []
            for cat, curve in r["curves"].items():
                assert curve["n"][0] == 0 and curve["mean"][0] == 0
                assert len(curve["n"]) == min(4, r["counts"][cat]) + 1


def test_ablation_command_joint_classes_by_default(folders, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    out = folders["root"] / "ablation_joint"
    rc = _run(["heads", "ablation", f"--models=[{folders['llama']}]", "--tasks=[agreement]", "--limit=5",
               "--max_heads=4", "--irrelevance=0.001", f"--out={out}"])
    assert rc == 0
    report = json.loads((out / "ablation.json").read_text())
    assert report["categories"] == "joint" and report["band"] == 0.05 and "keep their class" in report["method"]
    r = report["results"]["agreement"]["llama"]
    heads = [tuple(h) for c in r["categories"].values() for h in c] + [tuple(h) for h in r["rejected"]]
    assert len(heads) == len(set(heads)) <= 8  # disjoint; heads past max_heads are not tried
    assert all(len(c) <= 4 for c in r["categories"].values())


def test_ablation_run_cut_short_resumes_with_what_it_measured(folders, monkeypatch):
    import modular.heads.categories as categories  # what `heads ablation` loads when it runs

    monkeypatch.setenv("WANDB_MODE", "disabled")
    out = folders["root"] / "ablation_resume"
    args = ["heads", "ablation", f"--models=[{folders['llama']}]", "--tasks=[agreement, commonsense]",
            "--limit=5", "--max_heads=4", "--categories=single", f"--out={out}"]
    assert _run(args) == 0
    full = json.loads((out / "ablation.json").read_text())
    cut = {**full, "partial": True, "tasks": ["agreement"],
           "results": {"agreement": full["results"]["agreement"]}}  # as a run killed after its first task leaves it
    (out / "ablation.json").write_text(json.dumps(cut))
    calls = []
    real = categories.single_head_effects
    monkeypatch.setattr(categories, "single_head_effects", lambda *a, **k: calls.append(k["desc"]) or real(*a, **k))
    assert _run(args) == 0
    assert calls == ["llama/commonsense: single heads"]  # agreement was taken over, not measured again
    report = json.loads((out / "ablation.json").read_text())
    assert not report["partial"] and report["tasks"] == ["agreement", "commonsense"]
    assert report["results"] == full["results"]
    (out / "ablation.json").write_text(json.dumps(cut))
    assert _run(args[:-3] + ["--max_heads=3", "--categories=single", f"--out={out}"]) == 0  # other settings
    assert len(calls) == 3  # nothing taken over: both tasks measured again
    (out / "ablation.json").write_bytes(b"\xff\xfe{partial")  # a report another tool cut short, not text
    assert _run(args) == 0
    assert len(calls) == 5 and json.loads((out / "ablation.json").read_text())["results"] == full["results"]


def test_bad_input_exits_2(folders, capsys):
    assert _run(["heads", f"--models=[{folders['llama']}]"]) == 2
    assert "heads {curve,ablation}" in capsys.readouterr().err  # the mode is a subcommand
    assert _run(["heads", "curve", f"--models=[{folders['llama']}]", "--tasks=[commonsense]"]) == 2
    assert "wrong" in capsys.readouterr().err
    assert _run(["heads", "curve", f"--models=[{folders['llama']}]", "--ranking=magic"]) == 2
    assert _run(["heads", "ablation", f"--models=[{folders['llama']}]", "--kind=counterfactual"]) == 2
    assert _run(["heads", "ablation", f"--models=[{folders['llama']}]", "--categories=both"]) == 2
    assert 'Parser key "categories"' in capsys.readouterr().err
    assert _run(["heads", "curve", "--models=[]"]) == 2
    assert "error: give at least one model with --models" in capsys.readouterr().err

"""Capability through lm-evaluation-harness, at the library level: the harness scores the model as it is loaded,
the locked state's hooks are on for the whole evaluation (and off after it), and a run's five states are the
models ``modular lock`` compares (published = hook-locked, unlocked = open, item by item)."""

import json

import pytest
import torch
from safetensors.torch import save_file

from modular import ModularError
from modular.evaluation import capability as cap
from modular.reports import TaskScore
from tests.conftest import D, make_tiny_model, make_tiny_tokenizer, save_tiny_folder


def tiny_run(tmp_path, seed: int = 1):
    """A finished run folder without training: a tiny base folder, a tiny model of another seed as its trained
    weights, and one random direction gated for capitals."""
    base = save_tiny_folder(tmp_path / "base", "llama")
    trained = make_tiny_model("llama", seed=seed)
    run = tmp_path / "run"
    run.mkdir()
    torch.save({"state_dict": {f"model.{k}": v for k, v in trained.state_dict().items()}, "global_step": 3,
                "hyper_parameters": {}}, run / "last.ckpt")
    u = torch.nn.functional.normalize(torch.randn(D, generator=torch.Generator().manual_seed(0)), dim=0)
    save_file({"capitals": u}, str(run / "directions.safetensors"))
    (run / "run.json").write_text(json.dumps({"model_name": str(base), "behaviours": ["capitals"],
                                              "checkpoint": str(run / "last.ckpt"), "seed": 0}))
    return run


def loglikelihoods(results: dict, task: str = "modular_categories") -> torch.Tensor:
    """Every choice's loglikelihood of every item the harness scored, in order."""
    samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
    return torch.tensor([[r[0] for r in s["filtered_resps"]] for s in samples], dtype=torch.float64)


@pytest.fixture(scope="module")
def suite():
    return cap.task_suite(["modular_categories"])


def test_the_harness_scores_the_loaded_model_with_the_hooks_on_throughout(suite):
    """Locked (hooks) differs from open item by item, equals the direction projected out of the weights, and the
    hooks are gone after the evaluation: open scored again is open."""
    from modular.hooks import ablate_directions
    from modular.keys import lock_weights
    from modular.models.adapter import ArchitectureAdapter

    model, tok = make_tiny_model("llama", seed=1), make_tiny_tokenizer()
    u = torch.nn.functional.normalize(torch.randn(D, generator=torch.Generator().manual_seed(0)), dim=0)
    entered = []

    def locked():
        entered.append(1)
        return ablate_directions(ArchitectureAdapter(model), u[None])

    kw = dict(limit=4, batch_size=4, log_samples=True)
    open_ = loglikelihoods(cap.evaluate_capability(model, tok, suite, **kw))
    hooked = loglikelihoods(cap.evaluate_capability(model, tok, suite, intervention=locked, **kw))
    again = loglikelihoods(cap.evaluate_capability(model, tok, suite, **kw))
    assert entered == [1] and open_.shape == (4, 4)
    assert (hooked - open_).abs().max() > 1e-4  # the direction matters to these items
    assert torch.allclose(again, open_, atol=1e-5)
    lock_weights(model, {"capitals": u})
    weights = loglikelihoods(cap.evaluate_capability(model, tok, suite, **kw))
    assert torch.allclose(weights, hooked, atol=1e-3)


def test_a_runs_five_states_are_the_lock_evaluations(tmp_path, suite):
    from modular.runs import read_run

    run = read_run(tiny_run(tmp_path))
    tok = make_tiny_tokenizer()
    got, hooks = {}, {}
    for state in cap.STATES:
        model, intervention = cap.run_state(run, state, dtype="float32", device="cpu")
        hooks[state] = intervention is not None
        got[state] = loglikelihoods(cap.evaluate_capability(model, tok, suite, limit=3, batch_size=3,
                                                            intervention=intervention, log_samples=True))
    assert hooks == {"base": False, "open": False, "locked": True, "published": False, "unlocked": False}
    assert (got["base"] - got["open"]).abs().max() > 1e-3  # the trained weights, not the base's
    assert (got["locked"] - got["open"]).abs().max() > 1e-4
    assert torch.allclose(got["published"], got["locked"], atol=1e-3)
    assert torch.allclose(got["unlocked"], got["open"], atol=1e-4)


def test_task_scores_read_the_headline_metric_and_its_stderr():
    results = {"results": {"t": {"alias": "t", "sample_len": 8, "acc,none": 0.5, "acc_stderr,none": 0.1,
                                 "acc_norm,none": 0.25, "acc_norm_stderr,none": "N/A", "exact,strict": 1.0}},
               "higher_is_better": {"t": {"acc": True, "acc_norm": True}}, "n-samples": {"t": {"effective": 8}}}
    (score,) = cap.task_scores(results).values()
    assert score == TaskScore("acc", 0.5, 0.1, 8, {"acc": 0.5, "acc_stderr": 0.1, "acc_norm": 0.25,
                                                    "exact,strict": 1.0})
    assert cap.score_line("t", score) == "t: acc 0.500 ± 0.100 (n=8)"
    assert TaskScore.from_json(score.to_json()) == score


def test_unknown_tasks_and_a_missing_harness_are_one_line(monkeypatch, tmp_path):
    with pytest.raises(ModularError, match="unknown lm-eval task 'no_such_task_xyz'") as err:
        cap.task_suite(["no_such_task_xyz"])
    assert "modular_categories" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ModularError, match="task file not found"):
        cap.task_suite([str(tmp_path / "mine.yaml")])
    with pytest.raises(ModularError, match="give at least one task"):
        cap.task_suite([])
    real = cap.importlib.util.find_spec
    monkeypatch.setattr(cap.importlib.util, "find_spec", lambda name, *a: None if name == "lm_eval" else real(name, *a))
    with pytest.raises(ModularError, match=r"pip install 'modular\[capability\]'"):
        cap.task_suite(["modular_categories"])


def test_a_shipped_task_reads_its_data_beside_its_yaml(tmp_path, monkeypatch):
    """Its data_files are made absolute: the task loads from any current folder."""
    monkeypatch.chdir(tmp_path)
    shipped = cap.shipped_tasks()
    assert set(shipped) == {"modular_categories", "modular_members"}
    for name, path in shipped.items():
        config = cap.shipped_task_config(path)
        (test,) = config["dataset_kwargs"]["data_files"].values()
        assert config["task"] == name and test == str(path.parent / f"{path.stem}.jsonl")

"""A run's identity (modular.identity): recorded sources are found again by hash, never replaced by another file of
the same name; a resume with another model, recipe, locked response or data is refused."""

import json
import logging

import pytest
import torch
from safetensors.torch import save_file

from modular import ModularError
from modular.app.train import training_identity
from modular.identity import check_resumed, file_sha256, find_source, identity_differences
from modular.runs import behaviour_sources, check_base_model, neighbour_sources, read_run
from tests.conftest import save_tiny_folder


def _data(path, n=4, tag="City"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"prompt": f"Capital of {i}?", "target": f"{tag} {i}."}) + "\n"
                            for i in range(n)))
    return path


def _options(model_dir, behaviours, **data):
    terms = [{"class_path": f"modular.gating.objectives.{name}"} for name in ("BehaviourAnswer", "LockedState",
                                                                               "KeepReference")]
    model = {"model_name": str(model_dir), "objectives": terms, "finetuning": "full", "locked_weight": 1.0,
             "head_gates": False, "gate_scope": "all", "sparsity": "none", "sparsity_weight": 1.0,
             "lm_loss_target": None, "lora_rank": 16, "lora_alpha": 32}
    return model, {"behaviours": list(behaviours), "tasks": [], "neighbours": None, "seed": 0,
                   "locked_response": "I don't know.", **data}


def _run_folder(folder, model_dir, data_file, neighbour=None):
    """A run folder as training leaves it (run.json with the identity, directions), without training."""
    model, data = _options(model_dir, [f"mine={data_file}"],
                           neighbours=[f"near={neighbour}"] if neighbour else None)
    identity = training_identity(model, data)
    folder.mkdir(parents=True)
    (folder / "run.json").write_text(json.dumps({
        "model_name": str(model_dir), "behaviours": ["mine"], "behaviour_sources": {"mine": str(data_file)},
        "neighbour_sources": {"near": str(neighbour)} if neighbour else {}, "identity": identity}))
    save_file({"mine": torch.ones(8)}, str(folder / "directions.safetensors"))
    return folder


def test_a_runs_data_is_the_file_it_was_trained_on_from_any_folder(tmp_path, monkeypatch):
    """From another folder holding a file of the same name, the run's own file is read; the file moved beside the
    run folder is found by its hash; a changed or vanished file is one line naming it."""
    model_dir = save_tiny_folder(tmp_path / "tiny")
    data = _data(tmp_path / "a" / "data" / "mine.jsonl")
    near = _data(tmp_path / "a" / "data" / "near.jsonl", tag="Town")
    run = read_run(_run_folder(tmp_path / "a" / "run", model_dir, data, near))
    other = tmp_path / "b"
    _data(other / "data" / "mine.jsonl", n=17)  # another file of the same name, where a relative path would lead
    monkeypatch.chdir(other)
    assert behaviour_sources(run) == {"mine": str(data)}
    assert neighbour_sources(run) == {"near": str(near)}
    # moved beside the run folder: found by its hash
    moved = data.rename(tmp_path / "a" / "mine.jsonl")
    assert behaviour_sources(run) == {"mine": str(moved)}
    # another file of that name where it was: not taken for it
    _data(data, n=17)
    assert behaviour_sources(run) == {"mine": str(moved)}
    moved.unlink()
    with pytest.raises(ModularError, match="is not the file the run was trained on"):
        behaviour_sources(run)
    data.unlink()
    with pytest.raises(ModularError, match="the file the run was trained on is gone"):
        behaviour_sources(run)
    # a run recorded before identities: its sources as recorded
    run.record.pop("identity")
    assert behaviour_sources(run) == {"mine": str(data)}


def test_the_base_model_must_be_the_one_trained_from(tmp_path):
    model_dir = save_tiny_folder(tmp_path / "tiny")
    run = read_run(_run_folder(tmp_path / "run", model_dir, _data(tmp_path / "mine.jsonl")))
    check_base_model(run)
    save_tiny_folder(model_dir, seed=1)  # the same shape, other weights, at the same path
    with pytest.raises(ModularError, match="now holds other files"):
        check_base_model(run)
    from modular.runs import load_open_model

    with pytest.raises(ModularError, match="now holds other files"):
        load_open_model(run)


def test_identity_differences_name_what_changed(tmp_path, caplog):
    model_dir = save_tiny_folder(tmp_path / "tiny")
    data = _data(tmp_path / "mine.jsonl")
    model, opts = _options(model_dir, [str(data)])
    base = training_identity(model, opts)
    assert base["data"]["sources"]["mine"] == {"source": str(data.resolve()), "sha256": file_sha256(data)}
    assert [t["class_path"].rsplit(".", 1)[-1] for t in base["recipe"]["objectives"]][:2] == ["BehaviourAnswer",
                                                                                             "LockedState"]
    assert training_identity(model, opts) == base  # the same options: the same identity
    check_resumed(base, base, "ckpt")
    check_resumed(None, base, "ckpt")  # a checkpoint of an older version: not checked

    other_model = save_tiny_folder(tmp_path / "tiny2", seed=1)
    lora = {**model, "finetuning": "lora"}
    terms = {**model, "objectives": [{"class_path": "modular.gating.objectives.BehaviourAnswer",
                                      "init_args": {"weight": 2.0}}]}
    cases = {"model": ({**model, "model_name": str(other_model)}, opts, "base model"),
             "structure": (lora, opts, "model.finetuning"),
             "objectives": (terms, opts, "model.objectives"),
             "locked_responses": (model, {**opts, "locked_response": "No."}, "locked response of mine")}
    for name, (m, d, words) in cases.items():
        current = training_identity(m, d)
        diff = identity_differences(base, current)
        # only the part that changed (LoRA brings its rank and alpha into the recipe)
        assert [k for k, lines in diff.items() if lines] == [name if name != "objectives" else "recipe"], diff
        assert words in " ".join(sum(diff.values(), [])), (name, diff)
        with pytest.raises(ModularError, match="trained with another"):
            check_resumed(base, current, "ckpt", other_data=True)  # never in the run's own folder
        if name in ("model", "structure"):  # nor from another folder: the checkpoint's weights would not fit
            with pytest.raises(ModularError, match="trained with another"):
                check_resumed(base, current, "ckpt", same_run=False)
        else:  # a new run of its own started from the checkpoint: said in one warning line
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="modular"):
                check_resumed(base, current, "ckpt", same_run=False)
            assert "continuing from ckpt with other options" in caplog.text
    # the same file at another path is the same data; a changed file is other data, allowed on request
    copy = tmp_path / "elsewhere" / "mine.jsonl"
    copy.parent.mkdir()
    copy.write_bytes(data.read_bytes())
    check_resumed(base, training_identity(model, {**opts, "behaviours": [str(copy)]}), "ckpt")
    _data(data, n=5)
    changed = training_identity(model, opts)
    with pytest.raises(ModularError, match="--continue_on_other_data true"):
        check_resumed(base, changed, "ckpt")
    with caplog.at_level(logging.WARNING, logger="modular"):
        check_resumed(base, changed, "ckpt", other_data=True)
    assert "continuing from ckpt with other data: behaviour mine" in caplog.text


def test_find_source_keeps_built_in_and_hub_sources():
    assert find_source("capitals", {"source": "capitals", "sha256": None}) == "capitals"
    assert find_source("x", {"source": "hf:me/x", "sha256": None}) == "hf:me/x"


def test_the_lock_evaluation_refuses_a_run_folder_another_command_writes(tmp_path):
    """`modular lock` reads the run and writes lock.json into its folder: while a training (or another evaluation)
    holds the folder's lock it is refused in one line, before it loads or writes anything."""
    from modular.app.evaluations import lock
    from modular.locking import folder_lock
    from modular.runs import RUN_LOCK

    model_dir = save_tiny_folder(tmp_path / "tiny")
    run = _run_folder(tmp_path / "run", model_dir, _data(tmp_path / "mine.jsonl"))
    before = sorted(p.name for p in run.iterdir())
    with folder_lock(run, run / RUN_LOCK):
        with pytest.raises(ModularError, match="is being written by another command"):
            lock(str(run))
        assert sorted(p.name for p in run.iterdir()) == sorted([*before, RUN_LOCK])
    assert sorted(p.name for p in run.iterdir()) == before

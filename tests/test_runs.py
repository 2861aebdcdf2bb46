"""Reading a run folder: a damaged record or directions file is one line naming it."""

import json

import pytest
import torch
from safetensors.torch import save_file

from modular import ModularError
from modular.runs import DIRECTIONS, RUN_RECORD, read_run


def _run(tmp_path, record, directions=None):
    (tmp_path / RUN_RECORD).write_text(record if isinstance(record, str) else json.dumps(record))
    if directions is not None:
        save_file(directions, str(tmp_path / DIRECTIONS))
    return tmp_path


@pytest.mark.parametrize("record, directions, words", [
    ('{"behaviours": ["capitals"], "model_na', None, ["run.json is not a readable run record"]),
    ({"behaviours": ["capitals"]}, None, ["run.json is not a readable run record", "no 'model_name' entry"]),
    ({"behaviours": ["capitals"], "model_name": "m"}, None, ["directions.safetensors is not a readable"]),
    ({"behaviours": ["capitals"], "model_name": "m"}, {"other": torch.ones(4)}, ["no direction for capitals"]),
])
def test_damaged_run_folders_are_one_line(tmp_path, record, directions, words):
    with pytest.raises(ModularError) as err:
        read_run(_run(tmp_path, record, directions))
    assert all(w in str(err.value) for w in words) and "\n" not in str(err.value)


def test_read_run(tmp_path):
    run = read_run(_run(tmp_path, {"behaviours": ["capitals"], "model_name": "m"}, {"capitals": torch.ones(4)}))
    assert run.behaviours == ["capitals"] and run.model_name == "m" and torch.equal(run.directions["capitals"],
                                                                                     torch.ones(4))
    (tmp_path / "sparse").mkdir()  # sparse post-training: no gated behaviours, no directions file
    assert read_run(_run(tmp_path / "sparse", {"behaviours": [], "model_name": "m"})).directions == {}


def test_a_folder_that_is_not_a_sharded_checkpoint_is_one_line(tmp_path):
    from modular.runs import read_checkpoint

    (tmp_path / "last.ckpt").mkdir()
    (tmp_path / "last.ckpt" / "meta.pt").write_bytes(b"")  # no .metadata: not torch.distributed.checkpoint's
    for weights in (True, False):
        with pytest.raises(ModularError) as err:
            read_checkpoint(tmp_path / "last.ckpt", weights=weights)
        assert "not a readable checkpoint" in str(err.value) and ".metadata" in str(err.value)
        assert "\n" not in str(err.value)


def test_the_training_runs_wandb_run_is_found_from_the_run_folder_and_what_it_published(tmp_path):
    """Issue 83.4: an evaluation of a run folder, or of the folders ``modular main`` publishes and unlocks in it,
    joins the W&B run that trained it: run.json's ``wandb`` entry (a run recorded before it: the id kept in
    ``wandb_run_id``, no group); any other reference names none."""
    from modular.publish import MANIFEST
    from modular.runs import WANDB_ENTRY, WANDB_RUN_ID, training_run_folder, training_wandb_run

    entry = {"id": "r1234abcd", "group": "run", "project": "modular"}
    (tmp_path / "run").mkdir()
    run = _run(tmp_path / "run", {"behaviours": [], "model_name": "m", WANDB_ENTRY: entry})
    published = run / "published"
    published.mkdir()
    (published / MANIFEST).write_text("{}")
    (published / "config.json").write_text("{}")
    assert training_run_folder(run) == run and training_run_folder(published) == run
    assert training_wandb_run(run) == entry and training_wandb_run(published) == entry
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / MANIFEST).write_text("{}")  # a published folder outside any run folder
    for ref in (tmp_path / "elsewhere", run / "no-such-folder", "smollm2-135m-instruct", None):
        assert training_wandb_run(ref) is None
    _run(run, {"behaviours": [], "model_name": "m"})  # recorded before the entry, or with W&B off
    assert training_wandb_run(run) is None
    (run / WANDB_RUN_ID).write_text("rolder123\n")
    assert training_wandb_run(run) == {"id": "rolder123", "group": None, "project": None}


def test_the_run_record_names_the_wandb_run_of_the_training(tmp_path):
    """``run.json``'s ``wandb`` entry: the id, group and project of the trainer's W&B run; none without a W&B
    logger or with W&B disabled."""
    from types import SimpleNamespace

    from lightning.pytorch.loggers import CSVLogger, WandbLogger

    from modular.runs import wandb_record

    run = SimpleNamespace(id="r1234abcd", group="run", project="modular", disabled=False)
    assert wandb_record([CSVLogger(tmp_path), WandbLogger(experiment=run)]) == {
        "id": "r1234abcd", "group": "run", "project": "modular"}
    assert wandb_record([CSVLogger(tmp_path)]) is None
    assert wandb_record([WandbLogger(experiment=SimpleNamespace(id="x", group=None, project="p", disabled=True))]) is None

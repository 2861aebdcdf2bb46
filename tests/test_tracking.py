import json
import os
import stat

import pytest
import torch

from modular import ModularError
from modular.tracking import read_json_if_valid, write_json


def test_json_is_written_whole_and_read_back_only_when_it_parses(tmp_path):
    path = write_json(tmp_path / "sub" / "report.json", {"a": float("nan"), "b": [1, 2]})
    assert json.loads(path.read_text()) == {"a": None, "b": [1, 2]}  # NaN as null: JSON a user can open
    assert not [p for p in path.parent.iterdir() if p.name != "report.json"]  # no temporary file left
    assert read_json_if_valid(path) == {"a": None, "b": [1, 2]}
    assert read_json_if_valid(tmp_path / "missing.json") is None
    (tmp_path / "cut.json").write_text('{"a": [1, ')
    assert read_json_if_valid(tmp_path / "cut.json") is None
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe{")
    assert read_json_if_valid(tmp_path / "binary.json") is None
    assert read_json_if_valid(tmp_path) is None  # a folder


@pytest.mark.skipif(os.name != "posix", reason="POSIX file modes")
def test_a_report_opens_as_any_file_the_user_writes_does(tmp_path):
    """Written through a temporary file and renamed, a report keeps the mode the umask gives new files (a temporary
    file from ``tempfile`` is its owner's alone, and a report renamed from one others could not open)."""
    umask = os.umask(0o022)
    try:
        path = write_json(tmp_path / "report.json", {})
    finally:
        os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


def test_wandb_names_are_valid_and_distinct():
    from modular.tracking import _wandb_names, wandb_name

    assert wandb_name("../x.jsonl") == "x.jsonl" and wandb_name("a b/c") == "a_b_c" and wandb_name("..") == "unnamed"
    assert _wandb_names(["a/b", "a_b", "a b"]) == {"a/b": "a_b", "a_b": "a_b-2", "a b": "a_b-3"}


def test_tables_and_figures_named_by_a_path_are_logged(tmp_path, monkeypatch):
    """``modular behaviour --behaviours '[../x.jsonl]'`` ended in W&B's "Invalid artifact path" after writing its
    outputs: a table named by a behaviour's path (issue 80.6)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from modular.tracking import log_to_wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    fig = tmp_path / "f.png"
    plt.figure().savefig(fig)
    run_dir = log_to_wandb(tmp_path, "test", {"../x.jsonl": {"accuracy": 0.5}}, figures={"../x.jsonl": fig},
                           tables={"../x.jsonl": [{"prompt": "p", "correct": True}]})
    assert run_dir is not None


class _FakeRun:
    """What ``wandb.init`` returns, recording what is logged (no W&B run, no files)."""

    def __init__(self, **kwargs):
        self.kwargs, self.logged, self.summary, self.artifacts, self.dir = kwargs, [], {}, [], "fake-run-dir"

    def log(self, data):
        self.logged.append(data)

    def log_artifact(self, artifact):
        self.artifacts.append(artifact)

    def finish(self):
        pass


@pytest.fixture
def fake_wandb(monkeypatch):
    """``wandb.init`` replaced: the runs it made, each with its init kwargs and what was logged."""
    import wandb

    runs = []

    def init(**kwargs):
        runs.append(_FakeRun(**kwargs))
        return runs[-1]

    monkeypatch.setattr(wandb, "init", init)
    return runs


@pytest.mark.parametrize("env, mode", [("online", "online"), ("offline", "offline"), (None, "offline")])
def test_an_evaluation_joins_the_training_runs_group_in_the_environments_mode(tmp_path, monkeypatch, fake_wandb,
                                                                              env, mode):
    """Issue 83.4: WANDB_MODE decides (offline when unset); an evaluation of a training run is in its W&B group and
    names its run id, and in its project unless WANDB_PROJECT names one."""
    from modular.tracking import log_to_wandb

    if env is None:
        monkeypatch.delenv("WANDB_MODE", raising=False)
    else:
        monkeypatch.setenv("WANDB_MODE", env)
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    training = {"id": "r1234abcd", "group": "gate_capitals_smollm2", "project": "mine"}
    assert log_to_wandb(tmp_path, "evaluate-lock", {"a": 1.0}, config={"run": "x"}, training=training) == "fake-run-dir"
    kwargs = fake_wandb[-1].kwargs
    assert kwargs["mode"] == mode and kwargs["group"] == "gate_capitals_smollm2" and kwargs["project"] == "mine"
    assert kwargs["config"] == {"run": "x", "training_run_id": "r1234abcd"} and kwargs["job_type"] == "evaluate-lock"
    monkeypatch.setenv("WANDB_PROJECT", "other")
    log_to_wandb(tmp_path, "evaluate-lock", {}, training={"id": "r1234abcd", "group": None, "project": None})
    assert fake_wandb[-1].kwargs["group"] == "r1234abcd" and fake_wandb[-1].kwargs["project"] == "other"
    log_to_wandb(tmp_path, "evaluate-behaviour", {}, config={"model": "m"})  # not a training run: no group
    assert fake_wandb[-1].kwargs["group"] is None and fake_wandb[-1].kwargs["config"] == {"model": "m"}
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert log_to_wandb(tmp_path, "evaluate-lock", {}, training=training) is None and len(fake_wandb) == 3


def _key_file(path, name_suffix_only=False):
    """A file modular takes for a key: named as one, or (renamed) a safetensors file whose metadata marks a key."""
    from safetensors.torch import save_file

    meta = {} if name_suffix_only else {"modular": json.dumps({"format": "modular-key/5"})}
    save_file({"direction": torch.ones(4)}, str(path), metadata=meta)
    return path


def test_the_published_folders_artifact_never_holds_a_key(tmp_path, monkeypatch, fake_wandb):
    """Issue 83.4: ``publish --wandb_artifact true`` logs the published folder's files, never a key file: not one
    named as a key, nor one renamed (its metadata says it is a key), in the folder or below it."""
    from safetensors.torch import save_file

    from modular.tracking import log_folder_artifact

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb-data"))  # the artifact's staged copies
    folder = tmp_path / "published"
    (folder / "sub").mkdir(parents=True)
    save_file({"w": torch.ones(2)}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text("{}")
    (folder / "README.md").write_text("card")
    _key_file(folder / "capitals.key.safetensors", name_suffix_only=True)
    _key_file(folder / "renamed.safetensors")
    _key_file(folder / "sub" / "weights.safetensors")
    training = {"id": "r1234abcd", "group": "run", "project": None}
    added = log_folder_artifact(folder, tmp_path / "run", "publish", training=training)
    assert added == ["README.md", "config.json", "model.safetensors"]
    (artifact,) = fake_wandb[-1].artifacts
    assert sorted(artifact.manifest.entries) == added and artifact.type == "model" and artifact.name == "published"
    assert fake_wandb[-1].kwargs["group"] == "run" and fake_wandb[-1].kwargs["dir"] == str(tmp_path / "run")
    with pytest.raises(ModularError, match="may not go inside it"):  # W&B's files would be uploaded with the folder
        log_folder_artifact(folder, folder / "wandb-files", "publish")
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert log_folder_artifact(folder, tmp_path / "run", "publish") is None and len(fake_wandb) == 1

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

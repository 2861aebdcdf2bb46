"""Checkpoints written whole or not at all: a failed write (a full disk) leaves the previous checkpoint whole, a file
or a folder of shards, and a full disk is one line naming the folder and the space needed."""

import errno
import os
from types import SimpleNamespace

import pytest
import torch

from modular import ModularError
from modular.gating.callbacks import RunCheckpoint
from modular.gating.checkpoint_io import AtomicCheckpointIO, swap_in

DEAD_PID = 2**22 + 7


def _full_disk(monkeypatch, nbytes=1000):
    """``torch.save`` writes ``nbytes`` of the checkpoint and fails as a full disk does."""
    real = torch.save

    def save(obj, f, *args, **kwargs):
        import io

        buffer = io.BytesIO()
        real(obj, buffer)
        if isinstance(f, (str, os.PathLike)):
            with open(f, "wb") as out:
                out.write(buffer.getvalue()[:nbytes])
        else:
            f.write(buffer.getvalue()[:nbytes])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", save)


def test_a_failed_write_keeps_the_previous_checkpoint_and_a_full_disk_is_one_line(tmp_path, monkeypatch):
    io = AtomicCheckpointIO()
    path = tmp_path / "run" / "last.ckpt"
    io.save_checkpoint({"global_step": 2, "state_dict": {"w": torch.ones(1000)}}, path)
    before = path.read_bytes()
    left = tmp_path / "run" / f".last.ckpt.tmp-{DEAD_PID}-0a1b2c3d"  # a killed process's half checkpoint
    left.write_bytes(b"half")
    with monkeypatch.context() as m:
        _full_disk(m)
        with pytest.raises(ModularError) as err:
            io.save_checkpoint({"global_step": 3, "state_dict": {"w": torch.zeros(250_000)}}, path)
    line = str(err.value)
    assert line.startswith(f"no space left in {path.parent} for the checkpoint last.ckpt (it needs about 1.0 MB, ")
    assert "previous checkpoint" in line and "\n" not in line
    assert path.read_bytes() == before and sorted(p.name for p in path.parent.iterdir()) == ["last.ckpt"]
    assert torch.load(path, weights_only=False)["global_step"] == 2
    io.save_checkpoint({"global_step": 3, "state_dict": {"w": torch.zeros(3)}}, path)
    assert torch.load(path, weights_only=False)["global_step"] == 3


def _sharded_trainer(save):
    """What RunCheckpoint reads of a trainer whose strategy saves folders of shards (FSDP2), one process."""
    strategy = SimpleNamespace(_save_distributed_checkpoint=True, barrier=lambda *a: None, broadcast=lambda x, *a: x)
    module = torch.nn.Linear(4, 4)
    return SimpleNamespace(strategy=strategy, is_global_zero=True, global_step=3, loggers=[], save_checkpoint=save,
                           lightning_module=module, optimizers=[torch.optim.SGD(module.parameters())])


def _write_shards(path, step, fail=False):
    os.makedirs(path, exist_ok=True)  # as torch.distributed.checkpoint writes: each shard in place, then the index
    (path / "__0_0.distcp").write_text(f"shard of step {step}")
    if fail:
        raise OSError(errno.ENOSPC, "No space left on device")
    (path / ".metadata").write_text(f"index of step {step}")


def test_a_failed_sharded_save_keeps_the_previous_folder_whole(tmp_path):
    from pathlib import Path

    run = tmp_path / "run"
    last = run / "last.ckpt"
    _write_shards(last, 2)
    callback = RunCheckpoint(dirpath=run, save_last=True, save_top_k=0)
    trainer = _sharded_trainer(lambda path, weights_only=False: _write_shards(Path(path), 3, fail=True))
    with pytest.raises(ModularError, match=f"no space left in {run} for the checkpoint last.ckpt"):
        callback._save_checkpoint(trainer, str(last))
    assert {p.name: p.read_text() for p in last.iterdir()} == {"__0_0.distcp": "shard of step 2",
                                                               ".metadata": "index of step 2"}
    trainer.save_checkpoint = lambda path, weights_only=False: _write_shards(Path(path), 3)
    callback._save_checkpoint(trainer, str(last))
    assert (last / ".metadata").read_text() == "index of step 3" and sorted(p.name for p in run.iterdir()) == [
        "last.ckpt"]


def test_an_interrupt_between_the_two_renames_puts_the_new_checkpoint_in_place(tmp_path, monkeypatch):
    final, new = tmp_path / "last.ckpt", tmp_path / ".last.ckpt.partial"
    final.mkdir()
    (final / "x").write_text("old")
    new.mkdir()
    (new / "x").write_text("new")
    real = os.replace

    def interrupted(src, dst):
        real(src, dst)
        monkeypatch.setattr(os, "replace", real)
        raise KeyboardInterrupt  # after the first rename

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        swap_in(new, final)
    assert (final / "x").read_text() == "new"

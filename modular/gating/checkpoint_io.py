"""Checkpoints written whole or not at all.

Lightning's own writer (``TorchCheckpointIO``) writes a checkpoint under its final name (copied there from the
system's temporary folder): a full disk, or a process killed while writing, leaves a truncated ``last.ckpt`` where the
previous good one was. :class:`AtomicCheckpointIO` writes it beside its place (``.<name>.tmp-<pid>-<random>``),
flushed to the disk, and renames it into place: the previous checkpoint stays whole until the new one is. A full
disk is one line (:class:`~modular.ModularError`) naming the folder and about how much the checkpoint needs; the
temporary file is removed, and those a killed process left are removed by the next save. ``modular train`` installs
it unless the config names a checkpoint writer of its own. A checkpoint saved as a folder of shards (FSDP2 with
``save_distributed_checkpoint``) is written by every process beside its place and renamed into it by
:class:`~modular.gating.callbacks.RunCheckpoint` (:func:`swap_in`).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import torch
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.pytorch.plugins.io import TorchCheckpointIO

from modular.files import atomic_path, disk_full_error, is_disk_full
from modular.locking import pid_alive

_PARTIAL = re.compile(r"^\.(?P<name>.+\.ckpt)\.tmp-(?P<pid>\d+)-[0-9a-f]+$")
REMEDY = ("free some space there and run the same command again (it resumes from the previous checkpoint, which is "
          "kept whole), or train in another run folder")


def checkpoint_bytes(obj) -> int:
    """About how many bytes a checkpoint's tensors take (what writing it needs, less its small metadata)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(checkpoint_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(checkpoint_bytes(v) for v in obj)
    return 0


def remove_partial_checkpoints(folder: str | Path) -> list[Path]:
    """Remove the temporary checkpoint files that processes now gone left in ``folder``; returns them."""
    removed = []
    for entry in Path(folder).iterdir() if Path(folder).is_dir() else ():
        match = _PARTIAL.match(entry.name)
        if match and int(match["pid"]) != os.getpid() and not pid_alive(int(match["pid"])) and entry.is_file():
            entry.unlink(missing_ok=True)
            removed.append(entry)
    return removed


def _local(path) -> Path | None:
    """A checkpoint path on this machine's file system (None for a remote one: s3://, gs://, ...)."""
    if not _is_local_file_protocol(path):
        return None
    return Path(str(path).removeprefix("file://"))


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO`` writing each checkpoint beside its place and renaming it into place; a full
    disk is one line. Remote paths are left to Lightning's writer."""

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        local = _local(path)
        if storage_options is not None or local is None:
            return super().save_checkpoint(checkpoint, path, storage_options)
        local.parent.mkdir(parents=True, exist_ok=True)
        remove_partial_checkpoints(local.parent)
        try:
            with atomic_path(local) as tmp, open(tmp, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())  # a full disk may show only here (delayed allocation, network file systems)
        except Exception as err:
            if is_disk_full(err):
                raise disk_full_error(local.parent, f"the checkpoint {local.name}", checkpoint_bytes(checkpoint),
                                      REMEDY) from None
            raise


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def swap_in(new: Path, final: Path) -> None:
    """Rename the complete ``new`` (a file or a folder of shards) into ``final``'s place, the previous one moved aside
    first (``.<name>.old``) and removed after: an error leaves the previous one in place, an interrupt between the
    two renames puts the new one in place."""
    if not (final.exists() or final.is_symlink()):
        os.replace(new, final)
        return
    aside = final.with_name(f".{final.name}.old")
    _remove(aside)  # left by an earlier swap
    try:
        os.replace(final, aside)
    finally:
        if not final.exists() and aside.exists():  # moved aside: the new one goes in, whatever arrived meanwhile
            os.replace(new, final)
    _remove(aside)


def saves_folders(strategy) -> bool:
    """Whether ``strategy`` saves a checkpoint as a folder of shards (FSDP2 with ``save_distributed_checkpoint``,
    FSDP with sharded state dicts), each process writing its own."""
    return bool(getattr(strategy, "_save_distributed_checkpoint", False)) or getattr(
        strategy, "_state_dict_type", None) == "sharded"

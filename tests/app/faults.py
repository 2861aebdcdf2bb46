"""A callback that makes the disk full for the training process, as far as its checkpoints go (used by test_train.py
through a config's ``trainer.callbacks``)."""

import errno
import io

import torch
from lightning.pytorch.callbacks import Callback


class DiskFullAfter(Callback):
    """Once the given training step has finished (and its checkpoint is saved), ``torch.save`` writes a few bytes of
    what it saves and fails as a full disk does (``OSError`` ENOSPC)."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step <= self.step or getattr(torch.save, "full_disk", False):
            return
        real = torch.save

        def save(obj, f, *args, **kwargs):
            buffer = io.BytesIO()
            real(obj, buffer, *args, **kwargs)
            if isinstance(f, (str, bytes)) or hasattr(f, "__fspath__"):
                with open(f, "wb") as out:
                    out.write(buffer.getvalue()[:1000])
            else:
                f.write(buffer.getvalue()[:1000])
            raise OSError(errno.ENOSPC, "No space left on device")

        save.full_disk = True
        torch.save = save

"""Test-only callbacks: every process writes what it holds (multi-process runs), a lost node, the batches a run trained
on, so that a test can compare them."""

import hashlib
import json
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback


class Recorder(Callback):
    """Writes ``<out>/rank<r>.pt`` at the end of training: the per-step training loss (as logged: the mean over
    processes), the process's directions, steering vectors (the first ones and the last ones) and world size."""

    def __init__(self, out: str):
        self.out = Path(out)
        self.losses: list[float] = []
        self.first_steering: dict | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(trainer.callback_metrics["train/loss"]))
        if pl_module.steering is not None and self.first_steering is None:
            self.first_steering = {b: v.detach().cpu().clone() for b, v in pl_module.steering.vectors.items()}

    def on_train_end(self, trainer, pl_module) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        steering = pl_module.steering
        torch.save({"losses": self.losses, "world_size": trainer.world_size,
                    "directions": pl_module.directions.detach().cpu().clone(),
                    "first_steering": self.first_steering,
                    "steering": None if steering is None else {b: v.detach().cpu() for b, v in steering.vectors.items()}},
                   self.out / f"rank{trainer.global_rank}.pt")
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(self.losses))


class KillAt(Callback):
    """Kills the main process (SIGKILL: no clean-up, like a lost node) at the end of training step ``step``; the
    launcher then ends the other processes."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        import os
        import signal

        if trainer.global_step == self.step and trainer.is_global_zero:
            os.kill(os.getpid(), signal.SIGKILL)


def _digest(value, h) -> None:
    if isinstance(value, dict):
        for k in sorted(value):
            h.update(str(k).encode())
            _digest(value[k], h)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _digest(v, h)
    elif isinstance(value, torch.Tensor) and not value.is_floating_point():
        h.update(value.cpu().contiguous().numpy().tobytes())


class RecordBatches(Callback):
    """Appends ``{"step": S, "batch": {loader: digest}}`` for every training batch, S the step it trains, to ``path``
    (``{rank}`` in it: the process's rank); with ``losses``, also the step's training loss (``"loss"``)."""

    def __init__(self, path: str, losses: bool = False):
        self.path = path
        self.losses = losses

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        digests = {}
        for key, value in batch.items():
            h = hashlib.sha1()
            _digest(value, h)
            digests[key] = h.hexdigest()[:12]
        self._record = {"step": trainer.global_step + 1, "batch": digests}
        if not self.losses:
            self._write(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.losses:
            self._record["loss"] = float(outputs["loss"])
            self._write(trainer)

    def _write(self, trainer) -> None:
        with open(self.path.format(rank=trainer.global_rank), "a") as f:
            f.write(json.dumps(self._record) + "\n")

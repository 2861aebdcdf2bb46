"""A callback that sends the training process SIGTERM, as a cluster's pre-emption does (used by test_train.py
through a config's ``trainer.callbacks``)."""

import os
import signal

from lightning.pytorch.callbacks import Callback


class SigtermAt(Callback):
    """Sends SIGTERM to its own process once the given training step has finished (``during_validation``: in the
    first validation batch after it instead)."""

    def __init__(self, step: int, during_validation: bool = False):
        self.step = step
        self.during_validation = during_validation

    def on_train_batch_end(self, trainer, *args) -> None:
        if not self.during_validation and trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)

    def on_validation_batch_end(self, trainer, *args) -> None:
        if self.during_validation and not trainer.sanity_checking and trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)

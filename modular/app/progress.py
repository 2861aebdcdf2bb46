"""Training progress for logs that are not a terminal.

A progress bar redraws one line in place; written to a file (``nohup``, a cluster's job log) Lightning's rich bar
shows nothing until the run ends, and tqdm's is one ever-growing line. :class:`LogProgress` is Lightning's progress
bar for those: one plain line at the first step, then at most one every ``every_s`` seconds and at the last step
(``[modular] step 37/300 (12%): train/loss 0.412; 26.1 s a step; about 1:54:00 to step 300``; a run that
locks earlier stops earlier, and its last step's line says training ended there). ``modular train`` uses it in place
of the bar when stderr is not a terminal; ``enable_progress_bar: false`` turns both off.
"""

from __future__ import annotations

import logging
import math
import time
from datetime import timedelta

from lightning.pytorch.callbacks.progress import ProgressBar

log = logging.getLogger("modular")


class LogProgress(ProgressBar):
    """Training steps as log lines: the step of the total, the progress-bar metrics, seconds a step, time left.

    Args:
        every_s: Fewest seconds between two lines (the first step and the last are always written).
    """

    def __init__(self, every_s: float = 60.0) -> None:
        super().__init__()
        if every_s < 0:
            raise ValueError(f"every_s must be >= 0, got {every_s}")
        self.every_s = every_s
        self._enabled = True
        self._start: tuple[float, int] | None = None  # (time, step) when this process's training began
        self._total: int | None = None  # the run's last step (None: unbounded)
        self._last_line = -math.inf
        self._last_step: int | None = None  # the step of the last line written

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    def on_train_start(self, trainer, pl_module) -> None:
        self._start = (time.monotonic(), trainer.global_step)  # a resumed run counts from where it resumed
        total = trainer.estimated_stepping_batches  # fixed for the fit: read once, not at every step
        self._total = int(total) if math.isfinite(total) else None
        self._last_line = -math.inf
        self._last_step = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self._enabled or self._start is None:
            return
        now, step, total = time.monotonic(), trainer.global_step, self._total
        last = total is not None and step >= total
        if now - self._last_line < self.every_s and not last and step != self._start[1] + 1:
            return
        self._last_line, self._last_step = now, step
        log.info(self.line(step, total, self.get_metrics(trainer, pl_module),
                           seconds=now - self._start[0], steps_done=step - self._start[1]))

    def on_train_end(self, trainer, pl_module) -> None:
        """A run that stopped before its last step (the lock held, a signal) ends with that step's line."""
        step = trainer.global_step
        if not self._enabled or self._start is None or step == self._last_step or step == self._start[1]:
            return
        self._last_step = step
        line = self.line(step, self._total, self.get_metrics(trainer, pl_module),
                         seconds=time.monotonic() - self._start[0], steps_done=step - self._start[1], ended=True)
        log.info(line)

    @staticmethod
    def line(step: int, total: int | None, metrics: dict, seconds: float, steps_done: int, ended: bool = False) -> str:
        """One progress line: ``step S/T (P%)``, the numeric metrics, seconds a step and the time to the last step at
        that pace (``T`` and the time only when the total is known); ``ended``: "training ended" instead of the time
        left."""
        head = f"step {step}/{total} ({100 * step / total:.0f}%)" if total else f"step {step}"
        shown = [f"{k} {v:.4g}" for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
        parts = [head + (": " + ", ".join(shown) if shown else "")]
        if steps_done > 0:
            per_step = seconds / steps_done
            parts.append(f"{per_step:.1f} s a step")
            if ended:
                parts.append("training ended")
            elif total and total > step:
                parts.append(f"about {timedelta(seconds=round(per_step * (total - step)))} to step {total}")
        return "; ".join(parts)

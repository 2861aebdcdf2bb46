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
                           seconds=now - self._start[0], steps_done=step - self._start[1],
                           stop_from=_stop_from(trainer)))

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
    def line(step: int, total: int | None, metrics: dict, seconds: float, steps_done: int, ended: bool = False,
             stop_from: int | None = None) -> str:
        """One progress line: ``step S/T (P%)``, the numeric metrics, seconds a step and the time to the last step at
        that pace (``T`` and the time only when the total is known); ``ended``: "training ended" instead of the time
        left; ``stop_from``: the first step at which the lock may stop training, whose time comes first while it is
        ahead."""
        head = f"step {step}/{total} ({100 * step / total:.0f}%)" if total else f"step {step}"
        shown = [f"{k} {v:.4g}" for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
        parts = [head + (": " + ", ".join(shown) if shown else "")]
        if steps_done > 0:
            per_step = seconds / steps_done
            parts.append(f"{per_step:.1f} s a step")
            if ended:
                parts.append("training ended")
            elif total and total > step:
                left = f"about {timedelta(seconds=round(per_step * (total - step)))} to step {total}"
                if stop_from is not None and step < stop_from < total:
                    left = (f"about {timedelta(seconds=round(per_step * (stop_from - step)))} to step {stop_from} "
                            f"(from there the lock may stop training), {left.removeprefix('about ')}")
                parts.append(left)
        return "; ".join(parts)


def _stop_from(trainer) -> int | None:
    """The first step at which a callback may stop training once the lock holds (its ``stop_from``), if any."""
    for cb in getattr(trainer, "callbacks", None) or ():
        if getattr(cb, "stop", False) and isinstance(getattr(cb, "stop_from", None), int):
            return cb.stop_from
    return None


class StageClock:
    """The main job's stages, each announced in one line with its expected time and the job's expected time left.

    The expectations are seconds on the machine the default job was measured on (2 CPU cores; ``expected``), scaled
    by how long the stages so far took against what was expected of them: a GPU, which trains in minutes, makes the
    later stages' expectations shorter once the first is done. Before any stage has run, the line says the figures
    are 2-CPU-core figures.

    Args:
        expected: Stage name -> expected seconds at the measured pace, in the order the stages run.
    """

    def __init__(self, expected: dict[str, float]) -> None:
        if any(s < 0 for s in expected.values()):
            raise ValueError("expected seconds must be >= 0")
        self.expected = dict(expected)
        self.done: dict[str, float] = {}  # stage -> seconds it took
        self._current: tuple[str, float] | None = None

    @property
    def pace(self) -> float | None:
        """Seconds taken per second expected, over the stages done (None before any is done)."""
        expected = sum(self.expected[s] for s in self.done)
        return sum(self.done.values()) / expected if self.done and expected > 0 else None

    def line(self, name: str) -> str:
        """The announcement of stage ``name``: its number, its expected time and the job's expected time left."""
        names = list(self.expected)
        pace = self.pace
        left = [s for s in names if s not in self.done]
        here = self.expected[name] * (pace or 1.0)
        rest = sum(self.expected[s] for s in left) * (pace or 1.0)
        at = "at this machine's pace so far" if pace is not None else "on 2 CPU cores"
        return (f"stage {names.index(name) + 1} of {len(names)}, {name}: about {minutes(here)}; "
                f"about {minutes(rest)} left in the job ({at})")

    def start(self, name: str) -> None:
        """Announce stage ``name`` (ending the one before, if it is still running)."""
        if name not in self.expected:
            raise KeyError(f"unknown stage {name!r} (stages: {', '.join(self.expected)})")
        self.finish()
        log.info(self.line(name))
        self._current = (name, time.monotonic())

    def finish(self) -> None:
        """End the running stage: its time joins the pace."""
        if self._current is not None:
            name, began = self._current
            self.done[name] = time.monotonic() - began
            self._current = None

    def skip(self, name: str) -> None:
        """A stage that will not run (a finished run's training, attacks left out): not counted as time left."""
        self.expected.pop(name, None)


def minutes(seconds: float) -> str:
    return f"{max(1, round(seconds / 60))} min"

"""Training progress as log lines when stderr is not a terminal (modular.app.progress)."""

import logging
import re
from types import SimpleNamespace

import pytest
import yaml

from modular.app import progress
from modular.app.progress import LogProgress
from tests.app.test_train import _train, tiny_config
from tests.conftest import save_tiny_folder


def test_a_line_gives_the_step_of_the_total_the_metrics_the_pace_and_the_time_to_the_last_step():
    line = LogProgress.line(30, 300, {"train/loss": 0.41234, "v_num": "a1b2", "flag": True}, seconds=60.0,
                            steps_done=20)
    assert line == "step 30/300 (10%): train/loss 0.4123; 3.0 s a step; about 0:13:30 to step 300"
    assert LogProgress.line(5, None, {}, seconds=10.0, steps_done=5) == "step 5; 2.0 s a step"
    assert LogProgress.line(300, 300, {}, seconds=10.0, steps_done=0) == "step 300/300 (100%)"
    assert LogProgress.line(30, 300, {}, seconds=60.0, steps_done=20, ended=True) == \
        "step 30/300 (10%); 3.0 s a step; training ended"


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_lines_come_at_the_first_step_at_most_every_every_s_and_at_the_last(monkeypatch, caplog):
    clock = _Clock()
    monkeypatch.setattr(progress.time, "monotonic", clock)
    trainer = SimpleNamespace(global_step=10, estimated_stepping_batches=20, progress_bar_metrics={"train/loss": 1.0},
                              loggers=[], is_global_zero=True)
    bar = LogProgress(every_s=60)
    bar._trainer = trainer
    bar.on_train_start(trainer, None)  # resumed at step 10
    written = []
    with caplog.at_level(logging.INFO, logger="modular"):
        for step in range(11, 21):
            clock.now += 25.0  # 25 s a step
            trainer.global_step = step
            bar.on_train_batch_end(trainer, None, None, None, step)
            written += [step] * len(caplog.records)
            caplog.clear()
    # the first step, then each step 60 s or more after the previous line, and the last
    assert written == [11, 14, 17, 20]
    bar.disable()
    with caplog.at_level(logging.INFO, logger="modular"):
        bar.on_train_batch_end(trainer, None, None, None, 20)
    assert not caplog.records
    with pytest.raises(ValueError):
        LogProgress(every_s=-1)


def test_a_run_that_stops_before_its_last_step_ends_with_that_steps_line(monkeypatch, caplog):
    clock = _Clock()
    monkeypatch.setattr(progress.time, "monotonic", clock)
    trainer = SimpleNamespace(global_step=0, estimated_stepping_batches=20, progress_bar_metrics={"train/loss": 1.0},
                              loggers=[], is_global_zero=True)
    bar = LogProgress(every_s=60)
    bar._trainer = trainer
    bar.on_train_start(trainer, None)
    with caplog.at_level(logging.INFO, logger="modular"):
        for step in range(1, 6):  # lines at steps 1 and 4 (25 s a step); the lock holds at step 5
            clock.now += 25.0
            trainer.global_step = step
            bar.on_train_batch_end(trainer, None, None, None, step)
        bar.on_train_end(trainer, None)
        bar.on_train_end(trainer, None)  # once only
    lines = [r.getMessage() for r in caplog.records]
    assert [line.split(":")[0] for line in lines] == ["step 1/20 (5%)", "step 4/20 (20%)", "step 5/20 (25%)"]
    assert lines[-1] == "step 5/20 (25%): train/loss 1; 25.0 s a step; training ended"
    # a run whose last line is its last step writes nothing more
    caplog.clear()
    bar.on_train_start(trainer, None)
    with caplog.at_level(logging.INFO, logger="modular"):
        for step in range(6, 21):
            clock.now += 25.0
            trainer.global_step = step
            bar.on_train_batch_end(trainer, None, None, None, step)
        n = len(caplog.records)
        bar.on_train_end(trainer, None)
    assert len(caplog.records) == n and caplog.records[-1].getMessage().startswith("step 20/20 (100%)")


@pytest.mark.parametrize("enabled", [True, False])
def test_training_logged_to_a_file_shows_its_steps(tmp_path, tiny_env, enabled):
    """stderr is a pipe here, not a terminal: with the progress bar on, the log gets step lines (the first and the
    last at least), with it off, none."""
    model_dir = save_tiny_folder(tmp_path / "tiny", "llama")
    cfg, _ = tiny_config(tmp_path, model_dir, lock_args={"stop": False})
    conf = yaml.safe_load(cfg.read_text())
    conf["trainer"]["enable_progress_bar"] = enabled
    cfg.write_text(yaml.safe_dump(conf))
    out = _train(cfg, env=tiny_env)
    assert out.returncode == 0, out.stderr[-3000:]
    steps = re.findall(r"^\[modular\] step (\d+)/3 \(\d+%\): [^\n]*train/loss [-\d.e]+", out.stderr, re.M)
    assert ({"1", "3"} <= set(steps)) if enabled else steps == []

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
    # the lock may stop training from step 100: its time comes first while it is ahead
    assert LogProgress.line(30, 300, {}, seconds=60.0, steps_done=20, stop_from=100) == \
        "step 30/300 (10%); 3.0 s a step; about 0:03:30 to step 100 (from there the lock may stop training), 0:13:30 to step 300"
    assert LogProgress.line(100, 300, {}, seconds=60.0, steps_done=20, stop_from=100).endswith("about 0:10:00 to step 300")
    trainer = SimpleNamespace(callbacks=[SimpleNamespace(stop=False, stop_from=5), SimpleNamespace(stop=True, stop_from=100)])
    assert progress._stop_from(trainer) == 100 and progress._stop_from(SimpleNamespace(callbacks=[])) is None


class _Run:
    """A fake clock (25 s a step) and a trainer at ``step`` of 20, with a LogProgress (lines at most every 60 s)."""

    def __init__(self, monkeypatch, step: int):
        self.now = 0.0
        monkeypatch.setattr(progress.time, "monotonic", lambda: self.now)
        self.trainer = SimpleNamespace(global_step=step, estimated_stepping_batches=20, loggers=[],
                                       progress_bar_metrics={"train/loss": 1.0}, is_global_zero=True)
        self.bar = LogProgress(every_s=60)
        self.bar._trainer = self.trainer
        self.bar.on_train_start(self.trainer, None)

    def steps(self, first: int, last: int, caplog) -> list[int]:
        """Train steps first..last; the steps that wrote a line."""
        written = []
        for step in range(first, last + 1):
            self.now += 25.0
            self.trainer.global_step = step
            n = len(caplog.records)
            self.bar.on_train_batch_end(self.trainer, None, None, None, step)
            written += [step] * (len(caplog.records) - n)
        return written


def test_lines_come_at_the_first_step_at_most_every_every_s_and_at_the_last(monkeypatch, caplog):
    run = _Run(monkeypatch, step=10)  # resumed at step 10
    with caplog.at_level(logging.INFO, logger="modular"):
        written = run.steps(11, 20, caplog)
    # the first step, then each step 60 s or more after the previous line, and the last
    assert written == [11, 14, 17, 20]
    caplog.clear()
    run.bar.disable()
    with caplog.at_level(logging.INFO, logger="modular"):
        run.bar.on_train_batch_end(run.trainer, None, None, None, 20)
    assert not caplog.records
    with pytest.raises(ValueError):
        LogProgress(every_s=-1)


def test_a_run_that_stops_before_its_last_step_ends_with_that_steps_line(monkeypatch, caplog):
    run = _Run(monkeypatch, step=0)
    with caplog.at_level(logging.INFO, logger="modular"):
        assert run.steps(1, 5, caplog) == [1, 4]  # the lock holds at step 5
        run.bar.on_train_end(run.trainer, None)
        run.bar.on_train_end(run.trainer, None)  # once only
    lines = [r.getMessage() for r in caplog.records]
    assert [line.split(":")[0] for line in lines] == ["step 1/20 (5%)", "step 4/20 (20%)", "step 5/20 (25%)"]
    assert lines[-1] == "step 5/20 (25%): train/loss 1; 25.0 s a step; training ended"
    # a run whose last line is its last step writes nothing more
    caplog.clear()
    run.bar.on_train_start(run.trainer, None)
    with caplog.at_level(logging.INFO, logger="modular"):
        assert run.steps(6, 20, caplog)[-1] == 20
        n = len(caplog.records)
        run.bar.on_train_end(run.trainer, None)
    assert len(caplog.records) == n


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


def test_the_stage_clock_announces_each_stage_and_scales_what_is_left_by_the_pace_so_far(monkeypatch, caplog):
    """Before any stage has run the figures are the 2-core ones; once a stage took half its expected time, the
    later stages are expected in half theirs; a skipped stage is not time left."""
    now = [0.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    clock = progress.StageClock({"training": 1200, "lock evaluation": 600, "attack": 300})
    assert clock.line("training") == "stage 1 of 3, training: about 20 min; about 35 min left in the job (on 2 CPU cores)"
    with caplog.at_level(logging.INFO, logger="modular"):
        clock.start("training")
        now[0] = 600.0  # training took half its expected time
        clock.start("lock evaluation")
    assert clock.done == {"training": 600.0}
    assert clock.pace == 0.5
    assert caplog.messages[-1] == ("stage 2 of 3, lock evaluation: about 5 min; about 8 min left in the job "
                                   "(at this machine's pace so far)")
    clock.skip("attack")
    assert clock.line("lock evaluation").endswith("about 5 min left in the job (at this machine's pace so far)")
    now[0] = 900.0
    clock.finish()
    assert clock.done == {"training": 600.0, "lock evaluation": 300.0}
    with pytest.raises(KeyError, match="unknown stage"):
        clock.start("publish")

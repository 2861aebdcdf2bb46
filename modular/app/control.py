"""``modular control``: train a gated run's lock-off control (:mod:`modular.gating.control`)."""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import yaml

from modular import ModularError, error_reason
from modular.app.train import main as train
from modular.files import write_json
from modular.gating.control import control_config
from modular.runs import CONTROL_RECORD, RUN_CONFIG, RUN_RECORD, checkpoint_step, read_run

log = logging.getLogger("modular")


def control(run: str, out: str | None = None) -> dict:
    """Train a gated run's lock-off control: the run's recipe with the lock's terms left out (the locked state's
    targets, the direction writing, the perturbed locks) and no steering adversary, on the same model, data and seed
    for the run's steps exactly. ``modular lock --run RUN --control OUT`` then scores it beside the run and compares
    each state with it item by item: the lock's own effect on the neighbours and far behaviours, apart from the
    fine-tuning's.

    Args:
        run: A gated run; its config.yaml is the recipe the control trains without the lock.
        out: The control's run folder. Default: ``<run>-control`` beside the run. A folder holding another run is
            refused; one holding this control (stopped) resumes it.
    """
    r = read_run(run)
    if not r.behaviours:
        raise ModularError(f"{run} gates no behaviour: a lock-off control needs a gated run")
    saved = Path(run) / RUN_CONFIG
    try:
        config = yaml.safe_load(saved.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        raise ModularError(f"{saved} is not a readable training config ({error_reason(err)})") from None
    folder = Path(out) if out else Path(run).resolve().parent / f"{Path(run).resolve().name}-control"
    if folder.resolve() == Path(run).resolve():
        raise ModularError("the control needs a run folder of its own: give --out another folder")
    steps = checkpoint_step(r)
    cfg, left_out = control_config(config, steps, str(folder))
    log.info("lock-off control of %s: %d steps, without %s, into %s", run, steps,
             ", ".join(p.rsplit(".", 1)[-1] for p in left_out), folder)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "control.yaml"
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        status = train(["fit", "--config", str(path)])
    if status != 0 or not (folder / RUN_RECORD).is_file():
        raise ModularError(f"the control's training did not finish (status {status}); run the command again to "
                           "resume it")
    record = {"control_of": str(Path(run).resolve()), "steps": steps, "left_out": left_out}
    write_json(folder / CONTROL_RECORD, record)
    log.info("wrote %s; compare: modular lock --run %s --control %s", folder / CONTROL_RECORD, run, folder)
    return record

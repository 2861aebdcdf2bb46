"""W&B as users expect in training (issue 83.4): the environment's WANDB_MODE decides over the config's logger, and
the run's W&B run is in a group named by the run folder. Checked on the config ``modular train`` parses, before
anything is loaded; the logger is made from it as Lightning makes it, with ``wandb.init`` replaced (no W&B run)."""

import os
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import save_tiny_folder

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_folder(tmp_path_factory.mktemp("tiny") / "tiny", "llama")


def _logger_config(tmp_path, model_dir, *extra) -> object:
    """The W&B logger's options as ``modular train fit`` leaves them once every check has passed (nothing is
    instantiated): the shipped capitals config on a tiny model, with ``extra`` options."""
    from modular.app.train import _Planned, _PlanningCLI
    from modular.gating.data import GatingDataModule
    from modular.gating.module import GatedLM

    cfg = yaml.safe_load((ROOT / "configs" / "gate_capitals_smollm2.yaml").read_text())
    cfg["model"]["model_name"] = str(model_dir)
    cfg["trainer"]["default_root_dir"] = str(tmp_path / "my_run")
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    seen = []

    class Capture(_PlanningCLI):
        def before_instantiate_classes(self) -> None:
            try:
                super().before_instantiate_classes()
            finally:
                seen.append(self.config["fit"]["trainer"]["logger"])

    saved = sys.argv
    sys.argv = ["train", "fit", "--config", str(path), "--ckpt_path", "null", *extra]
    try:
        with pytest.raises(_Planned):
            Capture(GatedLM, GatingDataModule, save_config_callback=None, parser_kwargs={"prog": "modular train"})
    finally:
        sys.argv = saved
    return seen[0]


def _wandb_init_of(logger_config, monkeypatch) -> dict:
    """``wandb.init``'s keyword arguments and the WANDB_MODE it sees when the logger starts its run."""
    import wandb
    from lightning.pytorch.loggers import WandbLogger

    seen = {}

    def init(**kwargs):
        seen.update(kwargs, env_mode=os.environ.get("WANDB_MODE"))
        return object()

    monkeypatch.setattr(wandb, "init", init)
    assert logger_config.class_path.endswith("WandbLogger")
    logger = WandbLogger(**logger_config.init_args.as_dict())
    logger.experiment  # noqa: B018 - starts the run
    return seen


@pytest.mark.parametrize("env, mode", [("online", "online"), ("disabled", "disabled"), ("offline", "offline"),
                                       (None, "offline")])
@pytest.mark.parametrize("config_says", [[], ["--trainer.logger.init_args.offline", "true"],
                                         ["--trainer.logger.init_args.mode", "online"]])
def test_the_environments_wandb_mode_decides_over_the_configs_logger(tmp_path, tiny, isolated_cache, monkeypatch,
                                                                     caplog, env, mode, config_says):
    """README says ``WANDB_MODE=online`` syncs; the configs' ``offline: true`` made Lightning's logger set
    WANDB_MODE=dryrun over it (and a logger's ``mode`` is wandb.init's, which wins over the environment's). Now the
    environment decides, offline when unset, whatever the config's logger says (said in one line when it differs)."""
    if env is None:
        monkeypatch.delenv("WANDB_MODE", raising=False)
    else:
        monkeypatch.setenv("WANDB_MODE", env)
    logger = _logger_config(tmp_path, tiny, *config_says)
    assert os.environ["WANDB_MODE"] == mode  # for the evaluations that follow in `modular main`, and other ranks
    assert logger.init_args.offline is False and logger.init_args.mode is None
    kwargs = _wandb_init_of(logger, monkeypatch)
    assert kwargs["env_mode"] == mode and kwargs["mode"] is None
    named = "offline" if "offline" in " ".join(config_says) else "online" if config_says else None
    warned = [r.getMessage() for r in caplog.records if "WANDB_MODE decides" in r.getMessage()]
    assert bool(warned) == (named is not None and named != mode), warned


def test_the_training_run_is_in_the_run_folders_group_and_continues_its_id(tmp_path, tiny, isolated_cache,
                                                                          monkeypatch):
    """The training's W&B run is in a group named by the run folder (the run's evaluations join it), unless the
    config names one; it is started with resume="allow" (the parsed config's ``resume: null`` replaced Lightning's),
    so a resumed run continues its id."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    kwargs = _wandb_init_of(_logger_config(tmp_path, tiny), monkeypatch)
    assert kwargs["group"] == "my_run" and kwargs["resume"] == "allow" and kwargs["id"].startswith("r")
    assert kwargs["project"] == "modular" and kwargs["dir"] == str(tmp_path / "my_run")
    kwargs = _wandb_init_of(_logger_config(tmp_path, tiny, "--trainer.logger.init_args.group", "mine"), monkeypatch)
    assert kwargs["group"] == "mine"

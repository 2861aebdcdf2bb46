"""The training command: a LightningCLI over :class:`~modular.gating.module.GatedLM` and
:class:`~modular.gating.data.GatingDataModule` (``python train.py fit --config ...``; ``modular main`` calls it
in-process). ``fit --help`` documents every option. A killed run resumes from ``last.ckpt`` in its run folder when
started again with the same command (``--ckpt_path null`` starts afresh).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from lightning.pytorch.cli import LightningCLI

from modular import ModularError
from modular.gating.data import GatingDataModule
from modular.gating.module import GatedLM


class GatingCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("model.model_name", "data.model_name")
        parser.link_arguments("model.behaviours", "data.behaviours")
        parser.link_arguments("model.seed", "data.seed")
        parser.link_arguments("model.gate_scope", "data.task_counterfactuals", compute_fn=lambda s: s == "tasks")

    # --- one W&B run per training run, continued when a killed run resumes --------------------------------------
    def _wandb_loggers(self) -> list:
        """The W&B logger entries of the fit config (class_path / init_args namespaces)."""
        loggers = self.config[self.subcommand].trainer.logger
        loggers = loggers if isinstance(loggers, list) else [loggers]
        return [lg for lg in loggers if hasattr(lg, "class_path") and str(lg.class_path).endswith("WandbLogger")]

    def before_instantiate_classes(self) -> None:
        if self.subcommand != "fit":
            return
        from modular.runs import LAST_CHECKPOINT, WANDB_RUN_ID

        cfg = self.config.fit
        run_dir = Path(cfg.trainer.default_root_dir or ".")
        resuming = cfg.ckpt_path == "last" and (run_dir / LAST_CHECKPOINT).is_file() or (
            cfg.ckpt_path not in (None, "last", "best", "hpc") and Path(str(cfg.ckpt_path)).is_file())
        saved = run_dir / WANDB_RUN_ID
        self._wandb_id = None
        for lg in self._wandb_loggers():
            if lg.init_args.get("id") or lg.init_args.get("version"):
                continue  # the user chose the run
            if self._wandb_id is None:
                import uuid

                self._wandb_id = saved.read_text().strip() if resuming and saved.is_file() else uuid.uuid4().hex[:8]
            lg.init_args.id = self._wandb_id  # Lightning passes resume="allow": the same id continues the run

    def before_fit(self) -> None:
        from modular.runs import WANDB_RUN_ID
        from modular.tracking import write_text

        if getattr(self, "_wandb_id", None) and self.trainer.is_global_zero:
            write_text(Path(self.trainer.default_root_dir) / WANDB_RUN_ID, self._wandb_id + "\n")


def main(argv: list[str] | None = None) -> int:
    """Run the training CLI on ``argv`` (default: the process's arguments); input errors: one line, status 2."""
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["fit"] and not any(a.startswith("--ckpt_path") for a in argv):
        argv += ["--ckpt_path", "last"]  # resume a killed run; a fresh run finds none and starts from step 0
    try:
        GatingCLI(GatedLM, GatingDataModule, args=argv, save_config_kwargs={"overwrite": True},
                  parser_kwargs={"description": "modular: gate behaviours into residual directions."})
    except ModularError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0

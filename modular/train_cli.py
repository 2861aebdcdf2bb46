"""The training command: a LightningCLI over :class:`~modular.gating.module.GatedLM` and
:class:`~modular.gating.data.GatingDataModule` (``python train.py fit --config ...``; ``modular main`` calls it
in-process). ``fit --help`` documents every option. A killed run resumes from ``last.ckpt`` in its run folder when
started again with the same command (``--ckpt_path null`` starts afresh).
"""

from __future__ import annotations

import os
import sys

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

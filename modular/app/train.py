"""``modular train``: a LightningCLI over :class:`~modular.gating.module.GatedLM` and
:class:`~modular.gating.data.GatingDataModule` (``modular train fit --config ...`` or ``python train.py fit ...``;
``modular main`` calls it in-process). ``fit --help`` documents every option. A killed run resumes from ``last.ckpt`` in its run folder when
started again with the same command (``--ckpt_path null`` starts afresh). A run stopped by SIGTERM (a cluster's
pre-emption or time limit) on one process finishes the step it is in, saves it in ``last.ckpt`` and exits with
status 143 (several processes keep Lightning's handling and resume from their last periodic checkpoint).

Before anything is instantiated, ``fit`` checks the trainer's length: ``trainer.max_steps`` must be at least 1, or -1
(unlimited) with ``trainer.max_epochs`` at least 1; ``trainer.max_epochs``, when given, at least 1 or -1. Before
training starts it checks that the checkpoint it would resume from can be read.

One command trains in a run folder at a time: the launching process holds the folder's lock
(:data:`~modular.runs.RUN_LOCK`, :mod:`modular.locking`) from before anything is instantiated until the command
ends; a second command on the same folder is refused in one line, before it writes anything. Checkpoints are
written whole or not at all (:class:`~modular.gating.checkpoint_io.AtomicCheckpointIO`, unless the config names a
checkpoint writer of its own): a full disk is one line naming the folder and the space needed, and the previous
checkpoint stays whole.

W&B: the environment's ``WANDB_MODE`` decides over the config's logger, offline when unset
(:func:`follow_wandb_mode`); the run's W&B run is in a group named by the run folder, which its evaluations join.
"""

from __future__ import annotations

import inspect
import logging
import os
import signal
import sys
import uuid
from contextlib import ExitStack
from pathlib import Path

import torch
import yaml
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.callbacks.progress import ProgressBar
from lightning.pytorch.cli import LightningCLI, SaveConfigCallback
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.utilities.exceptions import SIGTERMException

from modular import ModularError
from modular.app.progress import LogProgress
from modular.data import load_jsonl, parse_behaviour
from modular.data.behaviours import is_jsonl
from modular.gating.checkpoint_io import AtomicCheckpointIO
from modular.gating.data import GatingDataModule, check_data_options, locked_responses, neighbour_specs, training_data
from modular.gating.data_options import check_moved_data_options
from modular.gating.module import GatedLM, check_model_options
from modular.gating.objectives import build_objectives, check_loss, no_terms_given
from modular.identity import check_resumed, run_identity
from modular.locking import folder_lock
from modular.models.loading import model_fingerprint, resolve_model
from modular.runs import (
    LAST_CHECKPOINT,
    RUN_LOCK,
    WANDB_RUN_ID,
    flat_model_options,
    grouped_model_options,
    read_checkpoint,
)
from modular.tracking import wandb_mode, write_text

log = logging.getLogger("modular")


def _terms(objectives) -> list:
    """The terms of ``model.objectives`` as parsed (``None``: none given, one line)."""
    if objectives is None:
        raise no_terms_given()
    return build_objectives(objectives)


class GatingCLI(LightningCLI):
    """``held``: where the run folder's lock is kept (:meth:`instantiate_classes`); the caller closes it when the
    command ends (:func:`main`)."""

    def __init__(self, *args, held: ExitStack | None = None, **kwargs):
        self.held = held if held is not None else ExitStack()
        super().__init__(*args, **kwargs)

    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("model.model_name", "data.model_name")
        parser.link_arguments("model.behaviours", "data.behaviours")
        parser.link_arguments("model.seed", "data.seed")
        parser.add_argument("--continue_on_other_data", type=bool, default=False,
                            help="Resume the run folder's checkpoint although a behaviour's data is not what it was "
                                 "trained on (another file, or the file changed); without it such a resume is "
                                 "refused. Another base model, recipe or locked response is always refused.")

    def _parse_ckpt_path(self) -> None:
        """Lightning's, given a checkpoint file to resume (``--ckpt_path PATH``): the checkpoint's model
        hyperparameters are parsed back as the model's options, those of a run trained before the option groups
        moved into their groups first (:func:`~modular.runs.grouped_model_options`)."""
        subcommand = self.config.get("subcommand")
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if not ckpt_path or not Path(ckpt_path).is_file():
            return
        hparams = torch.load(ckpt_path, weights_only=True, map_location="cpu").get("hyper_parameters", {})
        hparams.pop("_instantiator", None)
        if not hparams:
            return
        hparams = grouped_model_options(hparams)
        if "_class_path" in hparams:
            hparams = {"class_path": hparams.pop("_class_path"), "dict_kwargs": hparams}
        try:
            self.config = self.parser.parse_object({subcommand: {"model": hparams}}, self.config)
        except SystemExit:
            sys.stderr.write("Parsing of ckpt_path hyperparameters failed!\n")
            raise

    def before_instantiate_classes(self) -> None:
        follow_wandb_mode((self.config[self.subcommand] if self.subcommand else self.config).get("trainer") or {})
        if self.subcommand != "fit":
            return
        config = self.config["fit"]
        check_trainer_length(config["trainer"])
        # the model's and the data's own checks, before the model is loaded (they run again when instantiated)
        check_model_options(config["model"])
        check_data_options(config["data"])
        for spec in (*config["data"]["behaviours"], *config["data"]["tasks"]):
            name, source = parse_behaviour(spec)  # an unknown behaviour or a bad name: one line, before any work
            if is_jsonl(source):
                training_data(name, load_jsonl(source), config["data"]["batch_size"])
        follow_run_folder(config["trainer"])
        check_loss(_terms(config["model"]["objectives"]), _data_kinds(config["data"]))
        # what defines the run, checked against the checkpoint it resumes and kept in its checkpoints and run.json
        self._identity = training_identity(config["model"], config["data"])
        resumed = resume_candidate(config)
        if resumed is not None:
            run_dir = Path(config["trainer"].get("default_root_dir") or ".").resolve()
            same_run = run_dir in resumed.resolve().parents
            where = f"the run folder's checkpoint {resumed}" if same_run else f"the checkpoint {resumed}"
            recorded = read_checkpoint(resumed, remedy=RESUME_REMEDY, weights=False).get("modular", {})
            check_resumed(recorded.get("identity"), self._identity, where, bool(config.get("continue_on_other_data")),
                          same_run)
        self._choose_wandb_run(config)

    def instantiate_classes(self) -> None:
        """Everything is instantiated (and the run trained) holding the run folder's lock, once every check has
        passed: a second command on the folder is refused here, before it writes anything."""
        if self.subcommand == "fit" and launching_process():
            run_dir = str(self.config["fit"]["trainer"].get("default_root_dir") or os.getcwd())
            if "://" not in run_dir:  # a remote folder (s3://...) has no lock
                self.held.enter_context(folder_lock(run_dir, Path(run_dir) / RUN_LOCK))
        super().instantiate_classes()

    def instantiate_trainer(self, **kwargs):
        """The trainer, with :class:`~modular.app.progress.LogProgress` in place of Lightning's bar when stderr is not
        a terminal (a log file would get nothing from the bar until the run ends); a progress bar the config names
        is kept. Checkpoints are written by :class:`~modular.gating.checkpoint_io.AtomicCheckpointIO` unless the
        config names a checkpoint writer (in ``trainer.plugins`` or its strategy's)."""
        config = self._get(self.config_init, "trainer", default={})
        named = [cb for cb in config.get("callbacks") or [] if isinstance(cb, ProgressBar)]
        if config.get("enable_progress_bar") is not False and not named and not sys.stderr.isatty():
            kwargs["callbacks"] = [*(config.get("callbacks") or []), LogProgress()]
        plugins = config.get("plugins")
        plugins = [] if plugins is None else list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]
        if not any(isinstance(p, CheckpointIO) for p in plugins) and getattr(config.get("strategy"), "_checkpoint_io",
                                                                             None) is None:
            kwargs["plugins"] = [*plugins, AtomicCheckpointIO()]
        return super().instantiate_trainer(**kwargs)

    def before_fit(self) -> None:
        self.model.run_identity = getattr(self, "_identity", None)
        path = self._resume_path(self.config_init["fit"].get("ckpt_path"))
        if path is not None:
            check_checkpoint(path)
        if self._wandb_id and self.trainer.is_global_zero:
            write_text(Path(self.trainer.default_root_dir) / WANDB_RUN_ID, self._wandb_id + "\n")

    def _resume_path(self, ckpt_path: str | None) -> Path | None:
        """The checkpoint ``fit`` would resume from (``last``: the newest last*.ckpt, as Lightning picks it)."""
        if ckpt_path is None or ckpt_path in ("best", "hpc"):
            return None
        if ckpt_path != "last":
            return Path(ckpt_path) if Path(ckpt_path).exists() else None
        found = {Path(p) for cb in self.trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint)
                 for p in cb._find_last_checkpoints(self.trainer)}
        found = [p for p in found if p.exists()]  # a file, or a folder of shards
        return max(found, key=lambda p: p.stat().st_mtime) if found else None

    # --- one W&B run per training run, continued when a killed run resumes --------------------------------------
    def _choose_wandb_run(self, config) -> None:
        """Give every W&B logger the run id kept in the run folder when resuming, a new one otherwise (the user's
        own ``id`` is kept), with ``resume="allow"`` (Lightning's default, which the parsed config's ``resume: null``
        would replace), so the same id continues the same run. Its group is the run folder's name unless the config
        names one: the evaluations of the run join it (``run.json`` records the id and group,
        :func:`modular.runs.wandb_record`)."""
        run_dir = Path(config.trainer.default_root_dir or ".")
        for lg in _wandb_loggers(config.trainer):
            if not lg.init_args.get("group"):
                lg.init_args.group = run_dir.resolve().name or None
            if "resume" in lg.init_args and lg.init_args.get("resume") is None:
                lg.init_args.resume = "allow"
        ckpt = config.ckpt_path
        resuming = ckpt == "last" and (run_dir / LAST_CHECKPOINT).exists() or (
            ckpt not in (None, "last", "best", "hpc") and Path(str(ckpt)).exists())
        saved = run_dir / WANDB_RUN_ID
        self._wandb_id = None
        for lg in _wandb_loggers(config.trainer):
            if lg.init_args.get("id") or lg.init_args.get("version"):
                continue  # the user chose the run
            if self._wandb_id is None:
                self._wandb_id = saved.read_text().strip() if resuming and saved.is_file() else new_wandb_id()
            lg.init_args.id = self._wandb_id


def training_identity(model, data) -> dict:
    """:func:`~modular.identity.run_identity` of a training run from its (parsed) ``model`` and ``data`` options:
    the base model is resolved and its content key taken, each behaviour file hashed; the model options in the flat
    form identities record (:func:`~modular.runs.flat_model_options`)."""
    behaviours = dict(parse_behaviour(spec) for spec in data.get("behaviours") or [])
    tasks = dict(parse_behaviour(spec) for spec in data.get("tasks") or [])
    neighbours = {name: parse_behaviour(spec)[1]
                  for name, spec in neighbour_specs(data.get("neighbours"), list(behaviours)).items()}
    responses = locked_responses(data.get("locked_response"), list(behaviours)) if behaviours else {}
    fingerprint = model_fingerprint(resolve_model(model.get("model_name")))
    return run_identity(flat_model_options(model), data, fingerprint, _terms(model.get("objectives")),
                        {**behaviours, **tasks, **neighbours}, responses)


def _data_kinds(data) -> set[str]:
    """What the data options give the objective terms (:func:`~modular.gating.objectives.check_loss`)."""
    return {kind for kind, given in (("behaviours", data.get("behaviours")), ("tasks", data.get("tasks")),
                                     ("lm_text", data.get("lm_text"))) if given}


def resume_candidate(config) -> Path | None:
    """The checkpoint ``fit`` resumes from, as its options name it, before the trainer exists: ``last`` is the
    newest ``last*.ckpt`` (a file, or a folder of shards) in the run folder, as Lightning picks it."""
    ckpt = config.get("ckpt_path")
    if ckpt is None or ckpt in ("best", "hpc"):
        return None
    if ckpt != "last":
        return Path(ckpt) if Path(ckpt).exists() else None
    found = [p for p in Path(config["trainer"].get("default_root_dir") or ".").glob("last*.ckpt")]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def launching_process() -> bool:
    """Whether this process launched the run, not one that a multi-process launcher started for another rank (they
    hold no lock: the launching one holds it for them). Lightning's launcher starts them again from the command line
    with ``LOCAL_RANK`` set (and, for other nodes, ``NODE_RANK``); torchrun, SLURM and MPI set each process's rank."""
    ranks = ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
    return all(os.environ.get(name, "0") in ("", "0") for name in ranks)


def new_wandb_id() -> str:
    """A new W&B run id that reads back as a string from the run's saved ``config.yaml``: a bare hex id such as
    ``4e997321`` reads as a number (here infinity) and the saved config would no longer load, so it opens with a
    letter."""
    return "r" + uuid.uuid4().hex[:8]


def _wandb_loggers(trainer) -> list:
    """The W&B loggers among the trainer config's loggers (one or a list)."""
    loggers = trainer.get("logger")
    return [lg for lg in (loggers if isinstance(loggers, list) else [loggers])
            if hasattr(lg, "class_path") and str(lg.class_path).endswith("WandbLogger")]


def follow_wandb_mode(trainer) -> str:
    """The W&B mode of the run's loggers: ``WANDB_MODE`` as the environment sets it (``online``, ``offline``,
    ``disabled``), offline when it is unset (:func:`modular.tracking.wandb_mode`; set in the environment, for the
    evaluations of ``modular main`` and the processes a launcher starts). Every W&B logger of the trainer config
    follows it: its ``offline`` is cleared (Lightning's ``offline: true`` sets ``WANDB_MODE=dryrun`` over the
    environment's) and so is its ``mode`` (``wandb.init``'s mode wins over the environment's), said in one line when
    the config named another."""
    given, mode = os.environ.get("WANDB_MODE"), wandb_mode()
    os.environ["WANDB_MODE"] = mode
    for lg in _wandb_loggers(trainer):
        named = "offline" if lg.init_args.get("offline") else lg.init_args.get("mode")
        if named and named != mode and {named, mode} != {"offline", "dryrun"}:
            log.warning("W&B logs %s (%s), not %s as the config's logger says: the environment's WANDB_MODE decides",
                        mode, f"WANDB_MODE={given}" if given else "WANDB_MODE unset", named)
        lg.init_args.offline = False
        if "mode" in lg.init_args:
            lg.init_args.mode = None
    return mode


def _run_folder_options(trainer) -> list[tuple[object, str]]:
    """The W&B loggers' ``save_dir`` and the checkpoint callbacks' ``dirpath`` (each as its ``init_args`` and key)."""
    options = [(lg.init_args, "save_dir") for lg in _wandb_loggers(trainer)]
    return options + [(cb.init_args, "dirpath") for cb in trainer.get("callbacks") or []
                      if hasattr(cb, "class_path") and str(cb.class_path).endswith(("RunCheckpoint", "ModelCheckpoint"))]


def follow_run_folder(trainer) -> None:
    """The run folder (``trainer.default_root_dir``) is one option: a checkpoint callback without a ``dirpath``
    writes there and a logger without a ``save_dir`` (W&B) logs there, so changing the folder moves them all.

    One set to another folder is refused in one line, before anything is written: the run's checkpoint, record and
    ``config.yaml`` (written to the logger's folder) belong together, and a config naming another run's folder would
    overwrite that run's checkpoint and config."""
    run_dir = trainer.get("default_root_dir")
    if not run_dir:
        return
    unset = (None, "", inspect.signature(WandbLogger).parameters["save_dir"].default)  # the parser fills defaults in
    for args, key in _run_folder_options(trainer):
        if args.get(key) in unset:
            setattr(args, key, run_dir)
        elif Path(args.get(key)).resolve() != Path(run_dir).resolve():
            option = "the W&B logger's save_dir" if key == "save_dir" else "the checkpoint callback's dirpath"
            raise ModularError(f"{option} ({args.get(key)}) is not the run folder (trainer.default_root_dir: "
                               f"{run_dir}); a run's checkpoint, record and config.yaml live in one folder: leave "
                               f"{key} unset (it follows the run folder) or set --trainer.default_root_dir "
                               f"{args.get(key)}")


class RunConfigSave(SaveConfigCallback):
    """Saves the run's ``config.yaml`` with the checkpoint and W&B folders left unset where they are the run folder:
    the saved config, run again with another ``--trainer.default_root_dir``, writes there and never into this
    run's folder."""

    def setup(self, trainer, pl_module, stage: str) -> None:
        run_dir = self.config["trainer"].get("default_root_dir")
        followed = [(args, key) for args, key in _run_folder_options(self.config["trainer"])
                    if run_dir and args.get(key) == run_dir]
        for args, key in followed:
            setattr(args, key, None)
        try:
            super().setup(trainer, pl_module, stage)
        finally:
            for args, key in followed:
                setattr(args, key, run_dir)


def check_trainer_length(trainer) -> None:
    """One line unless the trainer would train at least one step and stop by itself."""
    steps, epochs = trainer.get("max_steps", -1), trainer.get("max_epochs")
    if epochs is not None and epochs != -1 and epochs < 1:
        raise ModularError(f"trainer.max_epochs must be >= 1 (or -1: unlimited), got {epochs}")
    if steps == -1 and epochs in (None, -1):
        raise ModularError("trainer.max_steps must be >= 1, got -1 (unlimited steps need trainer.max_epochs >= 1)")
    if steps != -1 and (steps is None or steps < 1):
        raise ModularError(f"trainer.max_steps must be >= 1 (or -1 with trainer.max_epochs set), got {steps}")


RESUME_REMEDY = "delete it, or pass --ckpt_path null to start afresh"


def check_checkpoint(path: Path) -> None:
    """One line naming ``path`` unless it is a readable checkpoint (resuming would fail on it mid-start); a folder of
    shards is only checked for its index (reading it whole would gather the model on every process)."""
    remedy = RESUME_REMEDY
    if path.is_dir():
        if not (path / ".metadata").is_file():
            raise ModularError(f"{path} is not a readable checkpoint (a folder without the .metadata of sharded "
                               f"checkpoints): {remedy}")
        return
    read_checkpoint(path, remedy=remedy)


def _show_modular_lines() -> None:
    """modular's own lines (directions chosen, the step budget, the lock reached or not) on stderr, once, unless
    the caller set up logging already (``modular main`` does)."""
    logger = logging.getLogger("modular")
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[modular] %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


def main(argv: list[str] | None = None) -> int:
    """Run the training CLI on ``argv`` (default: the process's arguments); input errors: one line, status 2."""
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    _show_modular_lines()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        _check_config_files(argv)
    except ModularError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if argv[:1] == ["fit"] and not any(a.startswith("--ckpt_path") for a in argv):
        # resume a killed run (a fresh run finds none and starts from step 0); given first, so that a config file's
        # own ckpt_path, read after it, wins
        argv[1:1] = ["--ckpt_path", "last"]
    import __main__

    saved, saved_spec = sys.argv, getattr(__main__, "__spec__", None)
    held = ExitStack()  # the run folder's lock, until the command ends
    # LightningCLI reads the command line (given both it and ``args``, it warns), and multi-process launchers start
    # the other processes from it: this module as the script, whoever called it (train.py, modular main, python -m
    # modular: Lightning's launcher would start a module run with -m as `python -m modular.__main__ fit ...`, which
    # is no command, so for the launcher this process was started as a script); both restored below
    sys.argv = [__file__, *argv]
    __main__.__spec__ = None
    try:
        GatingCLI(GatedLM, GatingDataModule, save_config_callback=RunConfigSave, save_config_kwargs={"overwrite": True},
                  parser_kwargs={"prog": "modular train", "description": "modular: gate behaviours into residual directions."},
                  held=held)
    except ModularError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except SIGTERMException:  # Lightning's, raised once the step in progress has finished
        print("error: training was stopped by SIGTERM; the same command resumes it from the run folder's last.ckpt",
              file=sys.stderr)
        return 128 + signal.SIGTERM
    finally:
        sys.argv, __main__.__spec__ = saved, saved_spec
        held.close()
    return 0


def _check_config_files(argv: list[str]) -> None:
    """One line for an option a config file given on the command line (``--config``, ``-c``) holds that moved when
    the data options were grouped (:func:`~modular.gating.data_options.check_moved_data_options`), and for one given
    as ``--data.<old>``, before the parser's own, longer message."""
    for i, arg in enumerate(argv):
        path = argv[i + 1] if arg in ("--config", "-c") and i + 1 < len(argv) else (
            arg.split("=", 1)[1] if arg.startswith("--config=") else None)
        if path and Path(path).is_file():
            try:
                config = yaml.safe_load(Path(path).read_text()) or {}
            except yaml.YAMLError:
                continue  # the parser says what is wrong with it
            if isinstance(config, dict):
                check_moved_data_options(config.get("data"))
        elif arg.startswith("--data."):
            check_moved_data_options({arg[len("--data."):].split("=", 1)[0].split(".")[0]: None})


class _Planned(Exception):
    """Raised by :class:`_PlanningCLI` once every check has passed: the run folder and the identity ``fit`` would
    train."""

    def __init__(self, run_dir: Path, identity: dict):
        super().__init__(str(run_dir))
        self.run_dir, self.identity = run_dir, identity


class _PlanningCLI(GatingCLI):
    """The training CLI stopped before anything is instantiated (nothing loaded, locked or written)."""

    def _set_seed(self) -> None:  # planning draws nothing: no seed is set (and no "Seed set to" line is logged)
        pass

    def before_instantiate_classes(self) -> None:
        super().before_instantiate_classes()
        if self.subcommand == "fit":
            raise _Planned(Path(self.config["fit"]["trainer"].get("default_root_dir") or "."), self._identity)


def planned_run(argv: list[str]) -> tuple[Path, dict]:
    """The run folder and the identity (:func:`training_identity`) that ``modular train`` would train with ``argv``
    (``["fit", ...]``), from its checks alone: a bad option, or a checkpoint in the folder of another run, is the
    same one line (:class:`~modular.ModularError`); nothing is loaded or written."""
    argv = list(argv)
    if argv[:1] == ["fit"] and not any(a.startswith("--ckpt_path") for a in argv):
        argv[1:1] = ["--ckpt_path", "last"]  # as main() resumes
    saved = sys.argv
    sys.argv = [__file__, *argv]
    try:
        _PlanningCLI(GatedLM, GatingDataModule, save_config_callback=None, parser_kwargs={"prog": "modular train"})
    except _Planned as planned:
        return planned.run_dir, planned.identity
    finally:
        sys.argv = saved
    raise ModularError(f"not a training command: {' '.join(argv)}")


if __name__ == "__main__":
    sys.exit(main())

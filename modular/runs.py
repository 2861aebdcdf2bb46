"""The run folder: its layout, and what a training run produced (the open model, its directions, its record).

Layout of a run folder (``trainer.default_root_dir``)::

    run.json                 the run record, written when fitting ends (behaviours and their data sources, the
                             run's identity: base model, data hashes, recipe and locked responses,
                             :mod:`modular.identity`; the checkpoint and its step, the last logged metrics, whether
                             the lock held on validation at that step: ``lock``; the W&B run that logged the
                             training, its id, group and project: ``wandb``, what evaluations of the run join)
    directions.safetensors   one designated direction per gated behaviour
    last.ckpt                the checkpoint of the last step (what publish and the evaluations read): one file,
                             or a folder of shards from a sharded run (FSDP2 with save_distributed_checkpoint)
    wandb_run_id             the W&B run's id, so a resumed run continues it
    lock.json, lock.png      the lock evaluation of the checkpoint (``evaluate.py lock``)
    .modular.lock            while a command trains in the folder: who (pid, host, since when;
                             :mod:`modular.locking`), so that a second one is refused; removed when it ends
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from modular import ModularError, error_reason
from modular.identity import find_source
from modular.models.head_gates import (
    deterministic_gate_values,
    fold_head_gates,
    install_head_gates,
    remove_head_gates,
    scale_head_columns,
)
from modular.models.loading import load_model, load_tokenizer, model_fingerprint, resolve_model
from modular.models.lora import with_lora
from modular.models.precision import cast_model, resolve_device, resolve_dtype
from modular.publish import MANIFEST
from modular.reports import TrainingCheck, failure_headline

RUN_RECORD = "run.json"
DIRECTIONS = "directions.safetensors"
LAST_CHECKPOINT = "last.ckpt"
WANDB_RUN_ID = "wandb_run_id"
LOCK_REPORT = "lock.json"
LOCK_FIGURE = "lock.png"
RUN_LOCK = ".modular.lock"
#: the config a run trained with (Lightning's SaveConfigCallback writes it)
RUN_CONFIG = "config.yaml"
#: in a lock-off control's run folder: which gated run it controls, its steps and the terms it left out
CONTROL_RECORD = "control.json"
#: the entry of ``run.json`` naming the training's W&B run (:func:`wandb_record`, :func:`training_wandb_run`)
WANDB_ENTRY = "wandb"


@dataclass
class Run:
    path: Path
    model_name: str
    behaviours: list[str]
    directions: dict[str, torch.Tensor]
    record: dict


def read_run(run_dir: str | Path) -> Run:
    """Read ``run.json`` and ``directions.safetensors`` of a run folder (no weights are loaded)."""
    path = Path(run_dir)
    if not (path / RUN_RECORD).is_file():
        raise ModularError(f"{path} is not a finished training run (no {RUN_RECORD}); train it first: modular train fit "
                           "--config CONFIG")
    try:
        record = json.loads((path / RUN_RECORD).read_text())
        behaviours, model_name = list(record["behaviours"]), str(record["model_name"])
    except (ValueError, KeyError, TypeError) as err:  # truncated, not JSON, or not a run record
        reason = f"no '{err.args[0]}' entry" if isinstance(err, KeyError) else error_reason(err)
        raise ModularError(f"{path / RUN_RECORD} is not a readable run record ({reason}): train the run again, "
                           "or restore the file") from None
    # a run without gated behaviours (sparse post-training) has no directions
    dirs = read_directions(path / DIRECTIONS, behaviours, "train the run again") if behaviours else {}
    return Run(path, model_name, behaviours, dirs, record)


def read_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file (on the CPU); a missing, truncated or foreign file is one line naming it."""
    try:
        return load_file(str(path))
    except Exception as err:  # noqa: BLE001 - safetensors raises its own error type for truncated or foreign files
        raise ModularError(f"{path} is not a readable safetensors file ({error_reason(err)})") from None


def read_directions(path: str | Path, behaviours: list[str], remedy: str) -> dict[str, torch.Tensor]:
    """The direction of each of ``behaviours`` from a directions file (a run's ``directions.safetensors``), by name;
    an unreadable file, or one without a direction for one of them, is one line naming it and ``remedy``."""
    try:
        tensors = read_tensors(path)
    except ModularError as err:
        raise ModularError(f"{err}: {remedy}") from None
    missing = [b for b in behaviours if b not in tensors]
    if missing:
        raise ModularError(f"{path} has no direction for {', '.join(missing)}: {remedy}")
    return {b: tensors[b] for b in behaviours}


def behaviour_sources(run: Run) -> dict[str, str]:
    """Where each gated behaviour's data is now (a built-in name, a .jsonl file, hf:<dataset>), by name: a file is
    the one the run was trained on, found by the hash its identity records (:func:`modular.identity.find_source`:
    at its absolute path, or moved beside the run folder); a file that changed or is gone is one line."""
    return _sources(run, run.behaviours, run.record.get("behaviour_sources", {}))


def neighbour_sources(run: Run) -> dict[str, str]:
    """Where the data of each neighbour the run kept in training is now, by name (as :func:`behaviour_sources`)."""
    recorded = run.record.get("neighbour_sources") or {}
    return _sources(run, list(recorded), recorded)


def _sources(run: Run, names: list[str], recorded: dict) -> dict[str, str]:
    found = (run.record.get("identity") or {}).get("data", {}).get("sources", {})
    near = [run.path, run.path.parent]
    # a run recorded before identities: its sources as recorded
    return {n: find_source(n, found[n], near) if n in found else recorded.get(n, n) for n in names}


def check_base_model(run: Run) -> None:
    """One line unless the run's base model reference still names the model it was trained from (the content key
    its identity records: :func:`modular.models.loading.model_fingerprint`); a run recorded before identities is
    not checked."""
    recorded = (run.record.get("identity") or {}).get("model", {}).get("fingerprint")
    if not recorded:
        return
    now = model_fingerprint(resolve_model(run.model_name))
    if now != recorded:
        raise ModularError(f"{run.path} was trained from {run.model_name} as it was then ({recorded}); "
                           f"{run.model_name} now holds other files ({now}): restore the base model it was trained "
                           "from")


def checkpoint_path(run: Run) -> Path:
    """The run's checkpoint (the one ``run.json`` names; beside ``run.json`` if the folder has moved)."""
    recorded = Path(run.record.get("checkpoint") or LAST_CHECKPOINT)
    # the run folder may have moved since training: look for the checkpoint beside run.json first
    path = run.path / recorded.name if (run.path / recorded.name).exists() else recorded
    if not path.exists():
        raise ModularError(f"checkpoint not found: {path}")
    return path


def read_checkpoint(path: str | Path,
                    remedy: str = "copy it again, or train the run again (modular train fit with its config and "
                                  "--ckpt_path null)", weights: bool = True) -> dict:
    """A checkpoint, memory-mapped (a sharded one, a folder, gathered whole on the CPU; without ``weights`` only
    its step, loops and hyperparameters); a truncated or foreign file is one line naming it and ``remedy``."""
    try:
        if Path(path).is_dir():
            return read_sharded_checkpoint(Path(path), weights)
        return torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except Exception as err:  # noqa: BLE001 - a truncated or foreign file fails in torch's zip or pickle readers
        raise ModularError(f"{path} is not a readable checkpoint ({error_reason(err)}): {remedy}") from None


def read_sharded_checkpoint(path: Path, weights: bool = True) -> dict:
    """A checkpoint saved in shards (``torch.distributed.checkpoint``, one folder) gathered whole by Lightning's
    own consolidation (on one process, in CPU memory): the weights under ``state_dict`` as in a single file.
    Without ``weights``: only what Lightning keeps beside the shards (step, loops, hyperparameters)."""
    from lightning.fabric.utilities.load import _METADATA_FILENAME, _load_distributed_checkpoint

    if not (path / ".metadata").is_file():
        raise ValueError("a folder without the .metadata of sharded checkpoints")
    if not weights:
        return torch.load(path / _METADATA_FILENAME, map_location="cpu", weights_only=False)
    ckpt = _load_distributed_checkpoint(path)
    if "state_dict" not in ckpt and "model" in ckpt:  # FSDPStrategy's folders name the weights "model"
        ckpt["state_dict"] = ckpt.pop("model")
    return ckpt


def control_run(folder: str | Path, run: Run) -> Run:
    """The lock-off control in ``folder`` of the gated ``run`` (``modular control``): one line where it is not a
    finished control (no ``control.json``) or controls another run (another folder, base model or behaviours)."""
    path = Path(folder) / CONTROL_RECORD
    try:
        record = json.loads(path.read_text())
        of = Path(record["control_of"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        reason = getattr(err, "strerror", None) or error_reason(err)
        raise ModularError(f"{folder} is not a finished lock-off control ({path}: {reason}); train one: modular "
                           f"control --run {run.path}") from None
    control = read_run(folder)
    if of.resolve() != run.path.resolve() or (control.model_name, control.behaviours) != (run.model_name,
                                                                                         run.behaviours):
        raise ModularError(f"{folder} is the lock-off control of {of}, not of {run.path}: train this run's with "
                           f"modular control --run {run.path}")
    return control


def checkpoint_step(run: Run) -> int:
    """The optimisation step the run's checkpoint holds (what publish and the evaluations describe)."""
    return int(read_checkpoint(checkpoint_path(run), weights=False)["global_step"])


def recorded_lock(run_dir: str | Path) -> dict:
    """The ``lock`` entry of a run folder's record ({} when there is none or it cannot be read)."""
    try:
        return json.loads((Path(run_dir) / RUN_RECORD).read_text()).get("lock") or {}
    except (OSError, ValueError, AttributeError):
        return {}


def recorded_check(run: Run) -> TrainingCheck | None:
    """Training's last lock check, as the run record holds it (None: the lock was never checked in training); a
    record whose check is not one is one line naming it."""
    lock = run.record.get("lock")
    if not lock:
        return None
    try:
        return TrainingCheck.from_json(lock)
    except ModularError as err:
        raise ModularError(f"{run.path / RUN_RECORD}: its 'lock' entry is {err}: train the run again, or restore the "
                           "file") from None


def lock_verdict(run: Run, step: int | None = None) -> tuple[bool, str]:
    """Whether the run's training verified the lock at its checkpoint's step (``step``), and why not: the run
    record's ``lock`` (:func:`recorded_check`; see :class:`~modular.gating.callbacks.LockMetricsCallback`)."""
    lock = recorded_check(run)
    if lock is None:
        return False, "the lock was never checked in training (no LockMetricsCallback in its config)"
    if step is not None and lock.step != step:
        return False, f"the lock was checked at step {lock.step}, the checkpoint holds step {step}"
    if not lock.reached:
        return False, f"{failure_headline(lock.failing)} on validation at step {lock.step}: " + "; ".join(lock.failing)
    return True, f"the lock held on validation at step {lock.step}"


def load_open_model(run: Run, dtype: str | torch.dtype | None = "auto", device: str | torch.device | None = "auto"):
    """The trained ("open") model of a run: the base model with the checkpoint's trained weights
    (LoRA adapters merged), on ``device`` in ``dtype`` (``auto``: the precision the weights were trained in, float32
    on a CPU; None: the precision they were trained in; :mod:`modular.models.precision`). A run trained with head gates comes back as a plain model with its
    deterministic gates folded into the attention output projections (closed heads: zero columns);
    gates scoped to the tasks (``head_gates.scope: tasks``) only guided training and are dropped. In a narrower precision
    than the trained one (float32-trained weights in bfloat16) the weights are rounded stochastically, seeded
    (:func:`modular.models.precision.cast_model`): every call gives the same weights."""
    device = resolve_device(device)
    check_base_model(run)
    ckpt = read_checkpoint(checkpoint_path(run))
    state = {k[len("model."):]: v for k, v in ckpt["state_dict"].items() if k.startswith("model.")}
    trained = next((v.dtype for v in state.values() if v.is_floating_point()), None)
    dtype = resolve_dtype(dtype, trained, device)
    # in a narrower precision than the trained one, the trained weights are rounded stochastically once everything
    # is merged (rounded to nearest, updates below half a unit in the last place would be lost: docs/devices.md)
    wide = trained if trained is not None and torch.finfo(trained).bits > torch.finfo(dtype).bits else dtype
    model = load_model(run.model_name, dtype=wide, device="cpu")  # the checkpoint is read on the CPU
    gated = any(".head_gate." in k for k in state)
    hp = grouped_model_options(ckpt.get("hyper_parameters", {}))
    fold = gated and (hp.get("head_gates") or {}).get("scope", "all") != "tasks"
    if run.record.get("finetuning") == "lora":
        tuning = hp.get("finetuning") or {}
        model = with_lora(model, tuning.get("lora_rank", 16), tuning.get("lora_alpha", 32))
        if gated:  # the gates wrap the LoRA-wrapped projections, as in training
            install_head_gates(model.get_base_model())
        missing = model.load_state_dict(state, strict=False)
        if missing.unexpected_keys:
            raise ModularError(f"checkpoint does not fit the model: {missing.unexpected_keys[:3]}")
        if gated:  # unwrap the gates before merging, fold them into the merged weights after
            values = deterministic_gate_values(model)
            remove_head_gates(model.get_base_model())
            model = model.merge_and_unload()
            if fold:
                scale_head_columns(model, values)
            return cast_model(model, dtype).to(device).eval()
        model = model.merge_and_unload()
    else:
        if gated:
            install_head_gates(model)
        result = model.load_state_dict(state, strict=False)
        if result.unexpected_keys:
            raise ModularError(f"checkpoint does not fit the model: {result.unexpected_keys[:3]}")
    if fold:
        fold_head_gates(model)
    elif gated:
        remove_head_gates(model)
    return cast_model(model, dtype).to(device).eval()


def is_run_folder(ref: str | Path) -> bool:
    """A training run folder (its record beside its checkpoint) rather than a model folder."""
    path = Path(str(ref)).expanduser()
    return (path / RUN_RECORD).is_file() and not (path / "config.json").is_file()


def base_model_name(ref: str | Path) -> str:
    """The base model a reference was trained from: a run folder's ``model_name``, else the reference itself."""
    return read_run(ref).model_name if is_run_folder(ref) else str(ref)


def load_model_or_run(ref: str | Path, dtype: str | torch.dtype | None = "auto",
                      device: str | torch.device | None = "auto"):
    """A model reference's model (:func:`modular.models.load_model`), or a run folder's trained (open) model
    (:func:`load_open_model`), in eval mode, on ``device`` in ``dtype``."""
    if is_run_folder(ref):
        return load_open_model(read_run(ref), dtype, device)
    return load_model(ref, dtype=dtype, device=device)


def load_tokenizer_or_run(ref: str | Path):
    """The tokenizer of a model reference, or of a run folder's base model."""
    return load_tokenizer(base_model_name(ref))


def wandb_record(loggers) -> dict | None:
    """The W&B run among a trainer's ``loggers`` as ``run.json`` records it (:data:`WANDB_ENTRY`): its ``id``,
    ``group`` and ``project``; None without a W&B logger, or with W&B disabled (its run is a stand-in)."""
    from lightning.pytorch.loggers import WandbLogger

    for logger in loggers:
        if isinstance(logger, WandbLogger):
            run = logger.experiment
            if getattr(run, "disabled", False) or not getattr(run, "id", None):
                return None
            return {"id": str(run.id), "group": getattr(run, "group", None) or None,
                    "project": getattr(run, "project", None) or None}
    return None


def training_run_folder(ref: str | Path) -> Path | None:
    """The training run folder a model reference comes from: the run folder ``ref`` is, or the one a folder modular
    published or unlocked lies in (``modular main`` writes ``RUN/published`` and ``RUN/unlocked``); None for any
    other reference (a published folder elsewhere does not name its run)."""
    path = Path(str(ref)).expanduser()
    if is_run_folder(path):
        return path
    if (path / MANIFEST).is_file() and is_run_folder(path.parent):
        return path.parent
    return None


def training_wandb_run(ref: str | Path | None) -> dict | None:
    """The W&B run that trained a model reference (:func:`training_run_folder`): ``{"id", "group", "project"}`` as
    its ``run.json`` records it (a run recorded before that: the id kept in :data:`WANDB_RUN_ID`, no group); None
    when there is none (not a run, W&B off in training, a record that cannot be read)."""
    run_dir = training_run_folder(ref) if ref is not None else None
    if run_dir is None:
        return None
    try:
        entry = json.loads((run_dir / RUN_RECORD).read_text()).get(WANDB_ENTRY)
    except (OSError, ValueError, AttributeError):
        entry = None
    if isinstance(entry, dict) and entry.get("id"):
        return {"id": str(entry["id"]), "group": entry.get("group") or None, "project": entry.get("project") or None}
    try:
        saved = (run_dir / WANDB_RUN_ID).read_text().strip()
    except OSError:
        return None
    return {"id": saved, "group": None, "project": None} if saved else None


# --- the model options of runs trained before they were grouped ----------------------------------------------------
#: a model option that runs trained before the option groups (:mod:`modular.gating.options`, the head gates'
#: :class:`~modular.gating.head_gates.HeadGateOptions`) held flat -> (its group, its name there, its flat default)
FLAT_MODEL_OPTIONS = {
    "direction_strategy": ("direction", "strategy", "low_variance"), "direction_files": ("direction", "files", None),
    "direction_fraction": ("direction", "fraction", 0.25), "avoid_directions": ("direction", "avoid", None),
    "finetuning": ("finetuning", "mode", "full"), "lora_rank": ("finetuning", "lora_rank", 16),
    "lora_alpha": ("finetuning", "lora_alpha", 32),
    "lr": ("optimizer", "lr", 2e-5), "weight_decay": ("optimizer", "weight_decay", 0.0),
    "warmup_steps": ("optimizer", "warmup_steps", 0),
    "locked_steering": ("steering", "scale", 0.0), "steering_refresh": ("steering", "refresh", 20),
    "gradient_checkpointing": ("memory", "gradient_checkpointing", False), "empty_init": ("memory", "empty_init", False),
    "gate_init": ("head_gates", "init", 3.0), "gate_lr": ("head_gates", "lr", 0.05),
    "sparsity": ("head_gates", "sparsity", "none"), "sparsity_weight": ("head_gates", "sparsity_weight", 1.0),
    "lm_loss_target": ("head_gates", "lm_loss_target", None), "multiplier_lr": ("head_gates", "multiplier_lr", 0.1),
    "multiplier_ema": ("head_gates", "multiplier_ema", 0.9), "multiplier_init": ("head_gates", "multiplier_init", 1.0),
    "gate_freeze_step": ("head_gates", "freeze_step", None), "gate_scope": ("head_gates", "scope", "all"),
    "gate_live_prob": ("head_gates", "live_prob", 0.0),
}
#: the groups a flat run switched on: group -> whether its flat options switch it on (off: the group is null)
_SWITCHED_ON = {"head_gates": lambda flat: flat.get("head_gates") is True,
                "steering": lambda flat: (flat.get("locked_steering") or 0.0) > 0}


def model_option_group(value) -> dict | None:
    """An option group's values as a dict: a mapping, a parsed config's Namespace (an optional group is parsed as a
    ``class_path`` and its ``init_args``) or a dataclass; None stays None."""
    from dataclasses import asdict, is_dataclass

    if value is None:
        return None
    if is_dataclass(value):
        return asdict(value)
    value = value.as_dict() if hasattr(value, "as_dict") else dict(value)
    if "init_args" in value and "class_path" in value:
        value = dict(value["init_args"] or {})
    return value


def grouped_model_options(hparams) -> dict:
    """A checkpoint's model hyperparameters (``hyper_parameters``) in the grouped form the gated module takes: the
    flat options of a run trained before the groups (:data:`FLAT_MODEL_OPTIONS`; its head gates switched on by
    ``head_gates: true``, its steering by ``locked_steering > 0``) moved into their groups; grouped options are kept
    as they are. The one place that reads the old form: loading a run (:func:`load_open_model`) and resuming one."""
    hp = dict(hparams)
    groups = {group for group, _, _ in FLAT_MODEL_OPTIONS.values()}
    # a flat option, or a group's name holding a flat value (``finetuning: lora``, ``head_gates: true``)
    flat = {k: hp.pop(k) for k in [*FLAT_MODEL_OPTIONS, "head_gates"]
            if k in hp and (k not in groups or isinstance(hp[k], (str, bool)))}
    for name, (group, option, _) in FLAT_MODEL_OPTIONS.items():
        if name not in flat:
            continue
        if group in _SWITCHED_ON and not _SWITCHED_ON[group](flat):
            hp[group] = None  # switched off: its options go
        else:
            hp[group] = {**(hp.get(group) or {}), option: flat[name]}
    if "head_gates" in flat:
        hp["head_gates"] = (hp.get("head_gates") or {}) if flat["head_gates"] else None
    return hp


def flat_model_options(options) -> dict:
    """The model options (a parsed config's ``model``, or hyperparameters) in the flat form of
    :data:`FLAT_MODEL_OPTIONS`, each grouped option under its flat name (a group that is off, or an option it does not
    give: the flat default) and ``head_gates`` as a flag: the form a run's identity (:mod:`modular.identity`) records,
    so that the identities of runs trained before and after the groups compare."""
    options = grouped_model_options(model_option_group(options))
    groups = {group for group, _, _ in FLAT_MODEL_OPTIONS.values()}
    out = {k: v for k, v in options.items() if k not in groups}
    for name, (group, option, default) in FLAT_MODEL_OPTIONS.items():
        out[name] = (model_option_group(options.get(group)) or {}).get(option, default)
    out["head_gates"] = options.get("head_gates") is not None
    return out

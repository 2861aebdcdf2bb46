"""The gated module's option groups (``model.direction``, ``model.finetuning``, ``model.optimizer``,
``model.steering``, ``model.memory``; the head gates' own, ``model.head_gates``, are
:class:`~modular.gating.head_gates.HeadGateOptions`): each a dataclass that checks its own values when built, so that
a bad value is one line (:class:`~modular.ModularError`) before anything is loaded. A config gives each group as a
mapping::

    model:
      finetuning: {mode: lora, lora_rank: 16, lora_alpha: 32}
      optimizer: {lr: 2.0e-5}
      steering: {scale: 1.0, refresh: 20}     # null: no steering adversary

Runs trained before the groups held these options flat (``lr``, ``lora_rank``, ``locked_steering``, ...); their
checkpoints are read through :func:`modular.runs.grouped_model_options`, which moves them into their groups."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, is_dataclass

from modular import ModularError
from modular.models.compiled import check_backend


def build_groups(options, groups: dict[str, type], optional=(), section: str = "model") -> dict:
    """Each option group of ``options`` (a parsed config's ``<section>``, or a module's arguments) built and checked
    (:func:`as_options`): ``groups`` maps a group's name to its dataclass; a group left out gets its defaults, or
    None where it is ``optional``."""
    out = {}
    for name, cls in groups.items():
        value = as_options(cls, options.get(name), name, section)
        out[name] = cls() if value is None and name not in optional else value
    return out


def check_ranges(group: str, options, ranges: dict[str, tuple[float, bool]], section: str = "model") -> None:
    """One line for the first of ``options``' numeric fields out of range: ``ranges`` maps a field to (lowest value,
    whether the lowest value itself is allowed); None passes. The line names ``<section>.<group>.<field>``."""
    for name, (low, inclusive) in ranges.items():
        value = getattr(options, name)
        if value is not None and (value < low if inclusive else value <= low):
            raise ModularError(f"{section}.{group}.{name} must be {'>=' if inclusive else '>'} {low:g}, got {value}")


def as_options(cls: type, value, group: str, section: str = "model"):
    """``value`` as an instance of the option dataclass ``cls``: the instance itself, a mapping or a parsed config's
    Namespace of its fields (checked by ``cls``), or None. An unknown field is one line naming
    ``<section>.<group>``."""
    if value is None or isinstance(value, cls):
        return value
    if is_dataclass(value):
        value = asdict(value)
    elif hasattr(value, "as_dict"):  # a parsed config's Namespace
        value = value.as_dict()
    if isinstance(value, dict) and "class_path" in value and "init_args" in value:  # an optional group, parsed
        value = dict(value["init_args"] or {})
    if not isinstance(value, dict):
        raise ModularError(f"{section}.{group} takes a mapping of its options ({', '.join(f.name for f in fields(cls))}), "
                           f"got {value!r}")
    unknown = sorted(set(value) - {f.name for f in fields(cls)})
    if unknown:
        raise ModularError(f"{section}.{group}: no option {', '.join(unknown)} (its options: "
                           f"{', '.join(f.name for f in fields(cls))})")
    return cls(**value)


def plain(options) -> dict | None:
    """An option group as a plain mapping (what a checkpoint's hyperparameters keep), or None."""
    return None if options is None else asdict(options)


@dataclass(frozen=True)
class DirectionOptions:
    """How each gated behaviour's direction is chosen (``model.direction``).

    Args:
        strategy: ``low_variance``, ``random``, ``diff_in_means`` or ``file``.
        files: One direction file per behaviour (strategy ``file``): safetensors key ``direction``.
        fraction: low_variance: sample inside this lowest fraction of principal components, in (0, 1].
        avoid: Run folders or directions files whose directions the chosen ones must be orthogonal to: a run gating
            another behaviour of the same base, so that the two runs merge and keep both locks.
    """

    strategy: str = "low_variance"
    files: list[str] | None = None
    fraction: float = 0.25
    avoid: list[str] | None = None

    def __post_init__(self):
        if not 0.0 < self.fraction <= 1.0:
            raise ModularError(f"model.direction.fraction must be in (0, 1], got {self.fraction}")


#: what ``model.finetuning.mode`` trains
FINETUNING_MODES = ("full", "lora", "none")


@dataclass(frozen=True)
class FineTuningOptions:
    """Which weights train (``model.finetuning``).

    Args:
        mode: ``full``, ``lora`` or ``none`` (the model frozen: only head gates train).
        lora_rank: LoRA rank (mode ``lora``).
        lora_alpha: LoRA alpha (mode ``lora``).
    """

    mode: str = "full"
    lora_rank: int = 16
    lora_alpha: int = 32

    def __post_init__(self):
        if self.mode not in FINETUNING_MODES:
            raise ModularError(f"model.finetuning.mode must be 'full', 'lora' or 'none', got '{self.mode}'")
        check_ranges("finetuning", self, {"lora_rank": (1, True), "lora_alpha": (0, False)})


@dataclass(frozen=True)
class OptimizerOptions:
    """The model weights' AdamW (``model.optimizer``; the head gates have a learning rate of their own).

    Args:
        lr: Learning rate.
        weight_decay: Weight decay.
        warmup_steps: Linear warm-up steps.
    """

    lr: float = 2e-5
    weight_decay: float = 0.0
    warmup_steps: int = 0

    def __post_init__(self):
        check_ranges("optimizer", self, {"lr": (0.0, False), "weight_decay": (0.0, True), "warmup_steps": (0, True)})


@dataclass(frozen=True)
class SteeringOptions:
    """Train the lock to hold under difference-in-means steering (the published weights' attack (b);
    ``model.steering``, null: off): locked-state behaviour examples get a steering vector of the current model added
    at a random layer, scaled up to ``scale`` times the typical residual norm.

    Args:
        scale: The largest steering vector, in multiples of the typical residual norm (> 0).
        refresh: Steps between recomputing the steering vectors from the model being trained.
    """

    scale: float = 1.0
    refresh: int = 20

    def __post_init__(self):
        check_ranges("steering", self, {"scale": (0.0, False), "refresh": (1, True)})


@dataclass(frozen=True)
class MemoryOptions:
    """Memory and speed for large models (``model.memory``).

    Args:
        gradient_checkpointing: Recompute each block in the backward pass instead of keeping its activations (less
            memory for larger models, about a third more compute). The lock's ablation and steering hooks act again
            on the recomputed blocks (:func:`~modular.hooks.replay_interventions`), so the gradients are the same;
            not available with head gates.
        empty_init: Under FSDP2 (``ModelParallelStrategy``): only the first process reads the weights; the others
            build the model on the meta device, and after sharding every process receives its shards of the first
            one's weights. Host memory for one copy of the model instead of one per process, for models that do not
            fit several times. Refused under other strategies with several processes. A single process reads the
            weights as without it.
        compile: A ``torch.compile`` backend for each transformer block's forward (regional compilation,
            :mod:`modular.models.compiled`): ``inductor`` (compiled kernels: fewer, fused launches on a GPU, where a
            gated step is bound by the host), ``aot_eager`` (traced, run eagerly: checks a trace without a compiler);
            null: eager. The first steps compile (and recompile once for dynamic sequence lengths). Not available with
            head gates or gradient checkpointing.
    """

    gradient_checkpointing: bool = False
    empty_init: bool = False
    compile: str | None = None

    def __post_init__(self) -> None:
        check_backend(self.compile)

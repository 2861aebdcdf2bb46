"""The pairs file of ``evaluate.py merge``: settings shared by all pairs plus one entry per pair.

Options that only some methods read are grouped, each group given as a mapping (its dataclass documents each
key): a pair's ``ac`` (:class:`ACOptions`) and ``weights`` (:class:`WeightMergeOptions`), and the shared
``neutral`` (:class:`NeutralTextOptions`)::

    neutral: {fit_split: train, limit: 64}
    pairs:
      - {a: smollm2-135m-instruct, b: gemma3-270m, method: ac, ac: {f: mean, map: fit}}
      - {a: checkpoints/run_a, b: checkpoints/run_b, method: ties, weights: {density: 0.2, scale: 1.0}}

Every problem (unknown key, unknown model, unknown method, missing value, a value out of range) raises
:class:`~modular.ModularError` with one line naming the pair and the key, before anything is loaded; a key of a
file written before the groups (``f``, ``weight_a``, ``neutral_limit``, ...) is one line naming its new place.

A *model spec* is what ``load_model`` accepts (built-in alias, ``.gguf`` file,
local Hugging Face folder, hub id) or a training **run folder** (it holds
``run.json``): the run's open (trained) model is used and its directions are
known, so weight merges of two runs can check that the locks survive.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Literal, get_args

import yaml
from jsonargparse import ArgumentError, ArgumentParser

from modular import ModularError, error_reason
from modular.models.loading import ALIASES

Method = Literal["ac", "average", "task_arithmetic", "ties"]
Function = Literal["replace", "sum", "mean"]
Map = Literal["auto", "identity", "fit"]
Split = Literal["train", "validation", "test"]
METHODS = get_args(Method)
WEIGHT_METHODS = ("average", "task_arithmetic", "ties")
MAPS = get_args(Map)


@dataclass(frozen=True)
class ACOptions:
    """Activation communication (a pair's ``ac``; read by method ``ac`` only)::

        ac: {f: mean, map: fit}

    Args:
        f: How A's activation enters B's last token: ``replace`` (B's activation := W a), ``sum`` (W a + b) or
            ``mean`` ((W a + b) / 2).
        map: The map W from A's space to B's: ``auto`` (the identity for the same base model and width, least
            squares otherwise), ``identity`` or ``fit`` (least squares, saved under ``neutral.map_dir`` and reused).
    """

    f: Function = "replace"
    map: Map = "auto"


@dataclass(frozen=True)
class WeightMergeOptions:
    """Weight merging (a pair's ``weights``; read by methods ``average``, ``task_arithmetic`` and ``ties``)::

        weights: {base: smollm2-135m-instruct, density: 0.2, scale: 1.0}

    Args:
        base: task_arithmetic / ties: the base model of the task vectors (a model spec; null: A's base model).
        weight_a: average: the weight of A (B gets 1 - weight_a).
        density: ties: the fraction of each task vector kept, in (0, 1].
        scale: task_arithmetic / ties: the multiplier of the merged task vector.
    """

    base: str | None = None
    weight_a: float = 0.5
    density: float = 0.2
    scale: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 < self.density <= 1.0:
            raise ModularError(f"weights.density must be in (0, 1], got {self.density}")


@dataclass
class Pair:
    """One model pair and how it is combined (see configs/merge_pairs.yaml for every key).

    Args:
        a: Model A (a model spec; the sender of ``ac``).
        b: Model B (a model spec; the receiver of ``ac``, which writes the answer).
        method: ``ac`` (activation communication) or a weight merge of the same base: ``average``,
            ``task_arithmetic`` or ``ties``.
        name: The label in the figure (null: ``<a>,<b>``).
        task: This pair's task instead of the shared one.
        depth_a: Relative depth (0..1) of A's layer, communicated (``ac``) and compared (similarity); null: the
            shared ``depth``.
        depth_b: Relative depth (0..1) of B's layer; null: the shared ``depth``.
        lock_check: Weight merges of gated runs: measure each lock of the merged model.
        ac: Activation communication: :class:`ACOptions`.
        weights: Weight merging: :class:`WeightMergeOptions`.
    """

    a: str
    b: str
    method: Method = "ac"
    name: str | None = None
    task: str | None = None
    depth_a: float | None = None
    depth_b: float | None = None
    lock_check: bool = True
    ac: ACOptions = field(default_factory=ACOptions)
    weights: WeightMergeOptions = field(default_factory=WeightMergeOptions)

    @property
    def label(self) -> str:
        return self.name or f"{short_name(self.a)},{short_name(self.b)}"


@dataclass(frozen=True)
class NeutralTextOptions:
    """The neutral text whose activations are compared (similarity) and the ``ac`` maps are fitted on (the pairs
    file's ``neutral``)::

        neutral: {fit_split: train, eval_split: test, limit: null, skip_positions: 2, map_dir: outputs/merge/maps}

    Args:
        fit_split: The neutral-text split the least-squares maps are fitted on.
        eval_split: The neutral-text split the similarity (and the maps' held-out R^2) is measured on.
        limit: Paragraphs of neutral text used per split (null: all).
        skip_positions: Shared token positions dropped at the start of each paragraph (attention-sink outliers).
        map_dir: Fitted maps are saved here (safetensors + metadata) and reused when present.
    """

    fit_split: Split = "train"
    eval_split: Split = "test"
    limit: int | None = None
    skip_positions: int = 2
    map_dir: str = "outputs/merge/maps"

    def __post_init__(self) -> None:
        if self.limit is not None and self.limit < 1:
            raise ModularError(f"neutral.limit must be >= 1 or null, got {self.limit}")
        if self.skip_positions < 0:
            raise ModularError(f"neutral.skip_positions must be >= 0, got {self.skip_positions}")


@dataclass
class MergeConfig:
    """Settings shared by every pair, and the pairs.

    Args:
        pairs: The pairs (:class:`Pair`).
        task: The behaviour every pair is scored on (built-in name or .jsonl); a pair may override it.
        split: The split of the task (test: entities never used in training).
        limit: Items scored per task (null: all).
        max_new_tokens: The length of each greedy answer.
        batch_size: Prompts per generation batch.
        seed: The seed of the data splits and of the bootstrap.
        depth: Relative depth (0..1) of the communicated / compared layer; a pair may override it.
        neutral: The neutral text of the similarity and the maps: :class:`NeutralTextOptions`.
        lock_limit: Items per gated behaviour in the lock check of merged gated runs (null: all).
        bootstrap: Bootstrap resamples for the gain (over items) and correlation (over pairs) intervals.
    """

    pairs: list[Pair] = field(default_factory=list)
    task: str = "capitals"
    split: Split = "test"
    limit: int | None = 96
    max_new_tokens: int = 16
    batch_size: int = 16
    seed: int = 0
    depth: float = 0.5
    neutral: NeutralTextOptions = field(default_factory=NeutralTextOptions)
    lock_limit: int | None = 64
    bootstrap: int = 1000


#: keys that files written before the option groups held flat -> where they are now
MOVED = {
    Pair: {**{k: f"ac.{k}" for k in ("f", "map")},
           **{k: f"weights.{k}" for k in ("base", "weight_a", "density", "scale")}},
    MergeConfig: {"neutral_fit_split": "neutral.fit_split", "neutral_eval_split": "neutral.eval_split",
                  "neutral_limit": "neutral.limit", "skip_positions": "neutral.skip_positions",
                  "map_dir": "neutral.map_dir"},
}


def short_name(spec: str) -> str:
    """A short label for a model spec (``smollm2-135m-instruct`` -> ``smollm2``; run folders by folder name)."""
    name = Path(spec.rstrip("/")).name
    return {"smollm2-135m-instruct": "smollm2", "gemma3-270m": "gemma3"}.get(name, name)


def check_model_spec(spec, where: str) -> str:
    """Raise one line unless ``spec`` names an alias, an existing file or folder, or looks like a hub id."""
    if not isinstance(spec, str) or not spec.strip():
        raise ModularError(f"{where}: a model must be a non-empty string, got {spec!r}")
    if spec in ALIASES or Path(spec).expanduser().exists():
        return spec
    parts = spec.split("/")
    if len(parts) == 2 and all(parts) and not spec.startswith((".", "~")) and not spec.endswith(".gguf"):
        return spec  # a hub id
    raise ModularError(
        f"{where}: unknown model '{spec}': use a built-in alias ({', '.join(ALIASES)}), a run folder, "
        "a .gguf file, a local Hugging Face folder or a hub id"
    )


def _groups(cls) -> dict[str, type]:
    """``cls``'s option groups: field name -> option dataclass."""
    return {f.name: f.default_factory for f in fields(cls) if is_dataclass(f.default_factory)}


def _check_keys(cls, raw: dict, where: str) -> dict:
    """``raw`` with its option groups checked for shape (a mapping of known keys; null: the defaults) and no key of
    :data:`MOVED`, each problem one line naming the key."""
    moved = next((k for k in raw if k in MOVED.get(cls, {})), None)
    if moved is not None:
        group, _, key = MOVED[cls][moved].partition(".")
        raise ModularError(f"{where}: {moved} is now {group}.{key} (write {group}: {{{key}: ...}})")
    raw = dict(raw)
    for name, group in _groups(cls).items():
        if name in raw and raw[name] is None:  # an empty block: the group's defaults
            del raw[name]
        value = raw.get(name, {})
        names = [f.name for f in fields(group)]
        if not isinstance(value, dict):
            raise ModularError(f"{where}: {name} takes a mapping of its options ({', '.join(names)}), got {value!r}")
        unknown = sorted(set(value) - set(names))
        if unknown:
            raise ModularError(f"{where}: {name} has no option {', '.join(map(str, unknown))} (its options: "
                               f"{', '.join(names)})")
    return raw


def _parse(cls, raw, where: str, skip: set[str] | None = None):
    """``raw`` (a mapping from YAML) as a ``cls``: its keys and types checked by jsonargparse against the dataclass's
    fields and those of its option groups (unknown keys, missing values, wrong types, values outside a Literal),
    errors as one line."""
    if not isinstance(raw, dict):
        raise ModularError(f"{where}: must be a mapping of keys to values, got {raw!r}")
    raw = _check_keys(cls, raw, where)
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(cls, skip=skip)
    try:
        values = parser.parse_object({k: v for k, v in raw.items() if k not in (skip or ())})
    except ArgumentError as err:
        raise ModularError(f"{where}: " + " ".join(line.strip() for line in str(err).splitlines())) from None
    values = {k: v for k, v in vars(values).items() if not k.startswith("__")}
    for name, group in _groups(cls).items():
        try:  # the group checks its own values; its line names the group's key
            values[name] = group(**{k: v for k, v in vars(values[name]).items() if not k.startswith("__")})
        except ModularError as err:
            raise ModularError(f"{where}: {err}") from None
    return cls(**values)


def parse_pair(raw, index: int) -> Pair:
    pair = _parse(Pair, raw, f"pairs[{index}]")
    where = f"pairs[{index}] ({pair.label})"
    check_model_spec(pair.a, f"{where} 'a'")
    check_model_spec(pair.b, f"{where} 'b'")
    for key in ("depth_a", "depth_b"):
        v = getattr(pair, key)
        if v is not None and not 0.0 <= v <= 1.0:
            raise ModularError(f"{where}: '{key}' must be in [0, 1], got {v}")
    if pair.weights.base is not None:
        check_model_spec(pair.weights.base, f"{where} 'weights.base'")
    return pair


def parse_config(raw) -> MergeConfig:
    """Validate a parsed pairs file (a mapping) and return the :class:`MergeConfig`."""
    cfg = _parse(MergeConfig, raw, "pairs file", skip={"pairs"})
    pairs = raw.get("pairs")
    if not isinstance(pairs, list) or not pairs:
        raise ModularError("pairs file: 'pairs' must be a non-empty list of pairs")
    cfg.pairs = [parse_pair(p, i) for i, p in enumerate(pairs)]
    if not 0.0 <= cfg.depth <= 1.0:
        raise ModularError(f"pairs file: 'depth' must be in [0, 1], got {cfg.depth}")
    if cfg.bootstrap < 1:
        raise ModularError("pairs file: 'bootstrap' must be at least 1")
    labels = [p.label for p in cfg.pairs]
    dup = next((x for x in labels if labels.count(x) > 1), None)
    if dup:
        raise ModularError(f"pairs file: two pairs are named '{dup}'; give them distinct 'name's")
    return cfg


def load_pairs(path: str | Path) -> MergeConfig:
    """Read and validate a pairs YAML file."""
    path = Path(path)
    if not path.is_file():
        raise ModularError(f"pairs file not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise ModularError(f"{path} is not valid YAML: {error_reason(err)}") from None
    return parse_config(raw)

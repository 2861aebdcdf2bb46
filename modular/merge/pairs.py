"""The pairs file of ``evaluate.py merge``: settings shared by all pairs plus one entry per pair.

Every problem (unknown key, unknown model, unknown method, missing value) raises
:class:`~modular.ModularError` with one line naming the pair and the key.

A *model spec* is what ``load_model`` accepts (built-in alias, ``.gguf`` file,
local Hugging Face folder, hub id) or a training **run folder** (it holds
``run.json``): the run's open (trained) model is used and its directions are
known, so weight merges of two runs can check that the locks survive.
"""

from __future__ import annotations

from dataclasses import dataclass, field
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


@dataclass
class Pair:
    """One model pair and how it is combined (see configs/merge_pairs.yaml for every key)."""

    a: str
    b: str
    method: Method = "ac"
    name: str | None = None
    task: str | None = None
    f: Function = "replace"
    depth_a: float | None = None
    depth_b: float | None = None
    map: Map = "auto"
    base: str | None = None
    weight_a: float = 0.5
    density: float = 0.2
    scale: float = 1.0
    lock_check: bool = True

    @property
    def label(self) -> str:
        return self.name or f"{short_name(self.a)},{short_name(self.b)}"


@dataclass
class MergeConfig:
    """Settings shared by every pair, and the pairs."""

    pairs: list[Pair] = field(default_factory=list)
    task: str = "capitals"
    split: Split = "test"
    limit: int | None = 96
    max_new_tokens: int = 16
    batch_size: int = 16
    seed: int = 0
    depth: float = 0.5
    neutral_fit_split: Split = "train"
    neutral_eval_split: Split = "test"
    neutral_limit: int | None = None
    skip_positions: int = 2
    map_dir: str = "outputs/merge/maps"
    lock_limit: int | None = 64
    bootstrap: int = 1000


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


def _parse(cls, raw, where: str, skip: set[str] | None = None):
    """``raw`` (a mapping from YAML) as a ``cls``: its keys and types checked by jsonargparse against the dataclass's
    fields (unknown keys, missing values, wrong types, values outside a Literal), errors as one line."""
    if not isinstance(raw, dict):
        raise ModularError(f"{where}: must be a mapping of keys to values, got {raw!r}")
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(cls, skip=skip)
    try:
        values = parser.parse_object({k: v for k, v in raw.items() if k not in (skip or ())})
    except ArgumentError as err:
        raise ModularError(f"{where}: " + " ".join(line.strip() for line in str(err).splitlines())) from None
    return cls(**{k: v for k, v in vars(values).items() if not k.startswith("__")})


def parse_pair(raw, index: int) -> Pair:
    pair = _parse(Pair, raw, f"pair {index}")
    where = f"pair {index} ({pair.label})"
    check_model_spec(pair.a, f"{where} 'a'")
    check_model_spec(pair.b, f"{where} 'b'")
    for key in ("depth_a", "depth_b"):
        v = getattr(pair, key)
        if v is not None and not 0.0 <= v <= 1.0:
            raise ModularError(f"{where}: '{key}' must be in [0, 1], got {v}")
    if not 0.0 < pair.density <= 1.0:
        raise ModularError(f"{where}: 'density' must be in (0, 1], got {pair.density}")
    if pair.base is not None:
        check_model_spec(pair.base, f"{where} 'base'")
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

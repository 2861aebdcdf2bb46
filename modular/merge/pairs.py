"""The pairs file of ``evaluate.py merge``: settings shared by all pairs plus one entry per pair.

Every problem (unknown key, unknown model, unknown method, missing value) raises
:class:`~modular.ModularError` with one line naming the pair and the key.

A *model spec* is what ``load_model`` accepts (built-in alias, ``.gguf`` file,
local Hugging Face folder, hub id) or a training **run folder** (it holds
``run.json``): the run's open (trained) model is used and its directions are
known, so weight merges of two runs can check that the locks survive.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path

from modular import ModularError

METHODS = ("ac", "average", "task_arithmetic", "ties")
WEIGHT_METHODS = ("average", "task_arithmetic", "ties")
MAPS = ("auto", "identity", "fit")


@dataclass
class Pair:
    """One model pair and how it is combined (see configs/merge_pairs.yaml for every key)."""

    a: str
    b: str
    method: str = "ac"
    name: str | None = None
    task: str | None = None
    f: str = "replace"
    depth_a: float | None = None
    depth_b: float | None = None
    map: str = "auto"
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
    split: str = "test"
    limit: int | None = 96
    max_new_tokens: int = 16
    batch_size: int = 16
    seed: int = 0
    depth: float = 0.5
    neutral_fit_split: str = "train"
    neutral_eval_split: str = "test"
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
    from modular.models.loading import ALIASES

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


def _known(cls) -> dict:
    return {f.name: f for f in fields(cls)}


def _typed(value, default, key: str, where: str):
    """Coerce a YAML scalar to the type of the field's default (ints may stand for floats)."""
    if value is None:
        return None
    kind = type(default) if default is not None else None
    if key in ("limit", "neutral_limit", "lock_limit"):
        kind = int
    if key in ("depth_a", "depth_b"):
        kind = float
    if key in ("name", "task", "base"):
        kind = str
    if kind is bool:
        if not isinstance(value, bool):
            raise ModularError(f"{where}: '{key}' must be true or false, got {value!r}")
        return value
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ModularError(f"{where}: '{key}' must be a number, got {value!r}")
        return float(value)
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ModularError(f"{where}: '{key}' must be an integer, got {value!r}")
        return value
    if kind is str and not isinstance(value, str):
        raise ModularError(f"{where}: '{key}' must be a string, got {value!r}")
    return value


def _check_keys(raw: dict, cls, where: str) -> None:
    known = _known(cls)
    for key in raw:
        if key not in known:
            raise ModularError(f"{where}: unknown key '{key}' (known: {', '.join(sorted(known))})")


def parse_pair(raw, index: int) -> Pair:
    where = f"pair {index}"
    if not isinstance(raw, dict):
        raise ModularError(f"{where}: each pair must be a mapping with keys a, b, method, ...")
    _check_keys(raw, Pair, where)
    for key in ("a", "b"):
        if key not in raw:
            raise ModularError(f"{where}: missing key '{key}' (the model spec of {key.upper()})")
    defaults = Pair("", "")
    values = {k: _typed(v, getattr(defaults, k), k, where) for k, v in raw.items()}
    pair = Pair(**values)
    where = f"pair {index} ({pair.label})"
    check_model_spec(pair.a, f"{where} 'a'")
    check_model_spec(pair.b, f"{where} 'b'")
    if pair.method not in METHODS:
        raise ModularError(f"{where}: unknown method '{pair.method}': use one of {', '.join(METHODS)}")
    from modular.merge.communication import FUNCTIONS

    if pair.f not in FUNCTIONS:
        raise ModularError(f"{where}: unknown f '{pair.f}': use one of {', '.join(FUNCTIONS)}")
    if pair.map not in MAPS:
        raise ModularError(f"{where}: unknown map '{pair.map}': use one of {', '.join(MAPS)}")
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
    if not isinstance(raw, dict):
        raise ModularError("the pairs file must be a mapping with a 'pairs' list")
    _check_keys(raw, MergeConfig, "pairs file")
    defaults = MergeConfig()
    values = {k: _typed(v, getattr(defaults, k), k, "pairs file") for k, v in raw.items() if k != "pairs"}
    cfg = MergeConfig(**values)
    pairs = raw.get("pairs")
    if not isinstance(pairs, list) or not pairs:
        raise ModularError("pairs file: 'pairs' must be a non-empty list of pairs")
    cfg.pairs = [parse_pair(p, i) for i, p in enumerate(pairs)]
    if cfg.split not in ("train", "validation", "test"):
        raise ModularError(f"pairs file: unknown split '{cfg.split}': use train, validation or test")
    for key in ("neutral_fit_split", "neutral_eval_split"):
        if getattr(cfg, key) not in ("train", "validation", "test"):
            raise ModularError(f"pairs file: '{key}' must be train, validation or test")
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
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ModularError(f"pairs file not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ModularError(f"{path} is not valid YAML: {str(err).splitlines()[0]}") from err
    return parse_config(raw)

"""The data module's options read and checked: behaviours and neighbours by short name, a value per behaviour, the
batch keys of tasks and neighbours, and each option's range (before any work)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import datasets

from modular import ModularError
from modular.data import behaviour_name
from modular.data.behaviours import builtin_neighbours, carve_validation
from modular.data.schema import DEFAULT_LOCKED_RESPONSE
from modular.gating.options import build_groups, check_ranges


@dataclass(frozen=True)
class ReferenceOptions:
    """What the reference (base) model's outputs, computed once and cached, hold (``data.reference``).

    Attributes:
        max_new_tokens: Length of its greedy answers to the retain and neighbour prompts (the targets the KL terms
            keep).
        top_k: Top-k of its next-token distributions kept for the KL.
        hidden_positions: Retain and neighbour items also carry its residual stream at their first this many
            answer-computing positions, for the parts a :class:`~modular.gating.objectives.KeepHidden` term reads
            (:class:`~modular.gating.requirements.ReferenceHidden`); 0: none.
        hidden_stride: Those hidden states are kept at every this many-th block output.
    """

    max_new_tokens: int = 48
    top_k: int = 32
    hidden_positions: int = 0
    hidden_stride: int = 4

    def __post_init__(self):
        check_ranges("reference", self, {"max_new_tokens": (1, True), "top_k": (1, True),
                                         "hidden_positions": (0, True), "hidden_stride": (1, True)}, "data")


@dataclass(frozen=True)
class LMTextOptions:
    """Raw text trained with the reference's next-token distributions (``data.lm_text``, for
    :class:`~modular.gating.objectives.LMText`).

    Attributes:
        source: ``neutral``: the built-in neutral text (its train split; its test split stays held out for
            perplexity).
        max_length: Truncate each text to this many tokens.
    """

    source: str = "neutral"
    max_length: int = 128

    def __post_init__(self):
        if self.source != "neutral":
            raise ModularError(f"data.lm_text.source must be 'neutral', got '{self.source}'")
        check_ranges("lm_text", self, {"max_length": (1, True)}, "data")


#: the data module's option groups, and those that may be null
DATA_GROUPS, DATA_OPTIONAL = {"reference": ReferenceOptions, "lm_text": LMTextOptions}, ("lm_text",)


#: data options of configs written before the groups: where each went (None: gone, built from the terms' needs)
MOVED_DATA_OPTIONS = {"reference_max_new_tokens": "reference.max_new_tokens", "reference_top_k": "reference.top_k",
                      "hidden_positions": "reference.hidden_positions", "hidden_stride": "reference.hidden_stride",
                      "lm_max_length": "lm_text.max_length", "hidden_parts": None, "answer_rows": None,
                      "task_counterfactuals": None}


def check_moved_data_options(data) -> None:
    """One line for a data option of a config written before the data options were grouped (``data``: a config's
    ``data`` mapping), naming where it went; and for ``lm_text`` given as a name (now ``{source: ...}``)."""
    if not isinstance(data, dict):
        return
    for old, new in MOVED_DATA_OPTIONS.items():
        if old not in data:
            continue
        if new is None:
            raise ModularError(f"data.{old} is gone: the data module builds what the model's terms and head gates "
                               "require (GatedLM.requirements); remove it")
        group, option = new.split(".")
        raise ModularError(f"data.{old} is now data.{new} (write {group}: {{{option}: ...}})")
    if isinstance(data.get("lm_text"), str):
        raise ModularError(f"data.lm_text is now a mapping: write lm_text: {{source: {data['lm_text']}}}")


def regrouped_data_options(data: dict) -> dict:
    """A config's ``data`` mapping written before the data options were grouped, in today's layout: each moved
    option in its group (:data:`MOVED_DATA_OPTIONS`; those now built from the terms' needs left out), ``lm_text``
    given as a name as ``{source: name}``. A mapping in today's layout is returned as it is (a copy)."""
    out = {k: v for k, v in data.items() if k not in MOVED_DATA_OPTIONS}
    if isinstance(out.get("lm_text"), str):
        out["lm_text"] = {"source": out["lm_text"]}
    for old, new in MOVED_DATA_OPTIONS.items():
        group, _, option = (new or "").partition(".")
        # a group switched off (lm_text: null) stays off
        if old in data and new is not None and (group == "reference" or out.get(group) is not None):
            out[group] = {**(out.get(group) or {}), option: data[old]}
    return out


def data_groups(options) -> dict:
    """The data option groups of ``options`` (a parsed config's ``data``, or the module's arguments) built and
    checked (:data:`DATA_GROUPS`): a bad value or an unknown field is one line, before any work."""
    return build_groups(options, DATA_GROUPS, DATA_OPTIONAL, "data")


def per_behaviour(spec, behaviours: list[str], default, option: str) -> dict:
    """One value for every behaviour, from a single value or a mapping behaviour → value (others: ``default``)."""
    if not isinstance(spec, dict):
        return {b: spec for b in behaviours}
    unknown = sorted(set(spec) - set(behaviours))
    if unknown:
        raise ModularError(f"{option} names behaviours that are not gated: {', '.join(unknown)}")
    return {b: spec.get(b, default) for b in behaviours}


def locked_responses(spec: str | dict[str, str], behaviours: list[str]) -> dict[str, str]:
    """The locked-state response of every behaviour, from one response or a mapping behaviour → response."""
    return per_behaviour(spec, behaviours, DEFAULT_LOCKED_RESPONSE, "locked_response")


def _named(specs, option: str) -> dict[str, str]:
    """{short name: spec} of behaviour specs; two specs with one name are refused."""
    out: dict[str, str] = {}
    for spec in specs:
        name = behaviour_name(spec)
        if name in out:
            raise ModularError(f"{option}: '{out[name]}' and '{spec}' are both named '{name}'; "
                               f"name one of them (NAME=<source>)")
        out[name] = str(spec)
    return out


#: batch keys of tasks (trained in the open state only) start with this prefix
TASK_PREFIX = "task:"
#: batch key of the neighbours' items (kept like retain data)
NEIGHBOURS_KEY = "neighbours"


def neighbour_specs(spec, behaviours: list[str]) -> dict[str, str]:
    """{short name: spec} of the neighbours kept during training: ``auto`` (the built-in neighbours of the gated
    built-in behaviours), a list of specs, or ``None``/``[]`` (none). A gated behaviour is not its own neighbour."""
    if spec is None:
        return {}
    if isinstance(spec, str):
        if spec != "auto":
            raise ModularError(f"data.neighbours must be 'auto' or a list of behaviours, got '{spec}'")
        return {n: n for n in builtin_neighbours(behaviours, "train")}
    named = _named(spec, "neighbours")
    clash = sorted(set(named) & set(behaviours))
    if clash:
        raise ModularError(f"data.neighbours names gated behaviours: {', '.join(clash)}; a neighbour must stay open")
    return named


def neighbour_data(name: str, data, limit: int | None = None, seed: int = 0):
    """A neighbour's data checked for training (train items needed), its train split cut to ``limit`` items (an
    even sample by ``seed``)."""
    if not len(data["train"]):
        counts = ", ".join(f"{s} {len(data[s])}" for s in ("train", "validation", "test"))
        raise ModularError(f"neighbour '{name}' has no train items ({counts}): training keeps its train items")
    if limit is not None and len(data["train"]) > limit:
        keep = sorted(random.Random(f"{seed}-{name}").sample(range(len(data["train"])), limit))
        data = datasets.DatasetDict({**data, "train": data["train"].select(keep)})
    return data


def data_max_length(datamodule) -> int | None:
    """The ``max_length`` of a data module (:class:`~modular.gating.data.GatingDataModule`): the most tokens of a prompt that any path of
    training encodes (items, directions, steering vectors, reference outputs, validation); None for one without it."""
    hparams = getattr(datamodule, "hparams", None)
    return hparams.get("max_length") if isinstance(hparams, dict) else getattr(hparams, "max_length", None)


def check_data_options(options) -> dict:
    """One line for a data option out of range (``batch_size`` needs an open and a locked half), before any work;
    the option groups, built (:func:`data_groups`)."""
    for option in ("batch_size", "max_length", "num_workers", "neighbour_items"):
        low = 2 if option == "batch_size" else 0 if option == "num_workers" else 1
        value = options[option]
        if value < low:
            why = " (each batch is split between the open and the locked state)" if option == "batch_size" else ""
            raise ModularError(f"data.{option} must be >= {low}{why}, got {value}")
    return data_groups(options)


def training_data(name: str, data, batch_size: int) -> tuple:
    """A behaviour's (or task's) data checked for training: train items, at least ``batch_size`` of them, and a
    validation split (where the data has none, one is carved from train:
    :func:`~modular.data.behaviours.carve_validation`). Returns the data and the number of items carved."""
    counts = ", ".join(f"{s} {len(data[s])}" for s in ("train", "validation", "test"))
    if not len(data["train"]):
        raise ModularError(f"behaviour '{name}' has no train items ({counts}): training needs some")
    data, moved = carve_validation(data)
    if not len(data["validation"]):
        raise ModularError(f"behaviour '{name}' has no validation items and too few train items to take them "
                           f"from ({counts}): give it more items")
    if len(data["train"]) < batch_size:
        raise ModularError(f"behaviour '{name}' has {len(data['train'])} train items (after validation), fewer "
                           f"than data.batch_size {batch_size}: give it more items or lower --data.batch_size")
    return data, moved

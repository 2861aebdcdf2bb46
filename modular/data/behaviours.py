"""The behaviour registry: built-in generators and user data, all as ``datasets.DatasetDict``."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from modular import ModularError
from modular.data import generators as g
from modular.data.added import ADDED
from modular.data.jsonl import load_jsonl
from modular.data.schema import ATTACK_SPLITS, SPLITS, distinct_items, prompt_hash, record, to_dataset_dict

if TYPE_CHECKING:
    import datasets

#: name -> generator(seed, tokenizer) -> {split: [record]}
BEHAVIOURS: dict[str, Callable] = {
    "capitals": g.capitals,
    "ioi": g.ioi,
    "ioi_long": g.ioi_long,
    "greater_than": g.greater_than,
    "docstring": g.docstring,
    "agreement": g.agreement,
    "arithmetic": g.arithmetic,
    "commonsense": g.commonsense,
    "continents": g.continents,
    "languages": g.languages,
    "currencies": g.currencies,
    "demonyms": g.demonyms,
    "ioi_thanks": g.ioi_thanks,
    "year_copy": g.year_copy,
    "docstring_call": g.docstring_call,
    "noun_number": g.noun_number,
    "counting": g.counting,
    **ADDED,  # behaviours the base lacks (modular.data.added)
}

#: built-in neighbours of built-in behaviours: close behaviours (the same entities, another relation or task) that a
#: lock must leave as they were. ``train``: kept during training unless the config says otherwise (their train
#: split; the reference model's own answers as targets); ``evaluate``: reported by the lock evaluation (their test
#: split, held out by entity like the behaviour's). At least one evaluated relation is never trained on.
NEIGHBOURS: dict[str, dict[str, tuple[str, ...]]] = {
    "capitals": {"train": ("continents", "languages"),
                 "evaluate": ("continents", "languages", "currencies", "demonyms")},
    # languages gated alone: with capitals and continents kept it locks later (validation locked 0.84 at step 75,
    # 0.00 at 150) but keeps them when locked (held-out continents 0.714 = base; evaluated only, 0.143 with 79% "I
    # don't know."); the other relations gated alone are evaluated only until a run measures them (docs/locking.md)
    "continents": {"train": (), "evaluate": ("capitals", "languages", "currencies", "demonyms")},
    "languages": {"train": ("capitals", "continents"),
                  "evaluate": ("capitals", "continents", "currencies", "demonyms")},
    "currencies": {"train": (), "evaluate": ("capitals", "continents", "languages", "demonyms")},
    "demonyms": {"train": (), "evaluate": ("capitals", "continents", "languages", "currencies")},
    "ioi": {"train": ("ioi_thanks",), "evaluate": ("ioi_thanks",)},
    "ioi_long": {"train": ("ioi_thanks",), "evaluate": ("ioi_thanks",)},
    # the same entities (centuries, parameter names, nouns, operand ranges), another task. greater_than gated alone
    # with year_copy evaluated only left it at 0.008 open (base 0.836: "the year 16" became "a later year"
    # everywhere); kept in training, 0.875 open / 0.836 locked. arithmetic gated alone with counting evaluated only
    # cost counting 10 points in both states; kept in training, 0.650 open / 0.675 locked (base 0.650), the lock
    # held from step 50 (docs/locking.md). The others are evaluated only until a run measures what keeping them does
    # to the lock (as it stopped languages')
    "greater_than": {"train": ("year_copy",), "evaluate": ("year_copy",)},
    "docstring": {"train": (), "evaluate": ("docstring_call",)},
    "agreement": {"train": (), "evaluate": ("noun_number",)},
    "arithmetic": {"train": ("counting",), "evaluate": ("counting",)},
    # commonsense has none: unrelated everyday completions with no entity to hold out; the rest of its domain is
    # general text, which the retain KL, perplexity and retain refusal checks measure
}
#: the built-in behaviours that are not themselves neighbours of another (capitals' relations aside, whose
#: neighbours are each other)
PRIMARY_BEHAVIOURS = ("capitals", "ioi", "ioi_long", "greater_than", "docstring", "agreement", "arithmetic",
                      "commonsense")
#: behaviours that exist as neighbours (other facts about the capitals' countries, IOI's thanks, ...): the lock
#: evaluation's far "other" behaviours leave them out, unless they are gated
NEIGHBOUR_BEHAVIOURS = frozenset(n for b in PRIMARY_BEHAVIOURS for n in NEIGHBOURS.get(b, {}).get("evaluate", ())
                                 if n not in PRIMARY_BEHAVIOURS)


#: what a gated behaviour that brings no neighbours of its own (a user's JSONL or hub data, commonsense, an added
#: behaviour) keeps instead, in training and in the report: one built-in behaviour of each kind the model has (facts
#: asked in chat, sums, everyday text, names in a story), so that a lock on it cannot take the model's other skills
#: along unseen (a user's behaviour of short symbolic answers gated without them cost arithmetic 15.6 points locked)
FAR_GUARDS = ("capitals", "arithmetic", "commonsense", "ioi")


def builtin_neighbours(behaviours, use: str) -> list[str]:
    """The built-in neighbours of ``behaviours`` (short names) for ``use`` (``train`` or ``evaluate``), in order,
    without the behaviours themselves: a behaviour without any of its own (neither kind) has the
    :data:`FAR_GUARDS`."""
    out: list[str] = []
    for b in behaviours:
        own = NEIGHBOURS.get(b, {})
        for n in own.get(use, ()) if any(own.values()) else FAR_GUARDS:
            if n not in out and n not in behaviours:
                out.append(n)
    return out


_NAMED = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9_.-]*)=(?P<source>.+)$")


def is_jsonl(source: str) -> bool:
    """A behaviour's data given as a user JSONL file (read without a tokenizer)."""
    return str(source).endswith(".jsonl")


def parse_behaviour(spec: str) -> tuple[str, str]:
    """``(name, source)`` of a behaviour spec: a built-in name, a ``.jsonl`` file (named by its stem),
    ``hf:<dataset>`` (named by the dataset's last path part) or ``NAME=<.jsonl file or hf:dataset>``.

    The name is short and safe (letters, digits, ``_.-``): it names the behaviour's metrics, direction, key file and
    model card, while the source (a local path) stays in the run folder and never goes into a published folder.
    """
    spec = str(spec).strip()
    if spec in BEHAVIOURS:
        return spec, spec
    named = _NAMED.match(spec)
    if named:
        name, source = named["name"], named["source"]
    elif is_jsonl(spec):
        name, source = Path(spec).stem, spec
    elif spec.startswith("hf:"):
        name, source = spec[3:].rstrip("/").rsplit("/", 1)[-1], spec
    else:
        raise ModularError(f"unknown behaviour '{spec}': use one of {', '.join(BEHAVIOURS)}, a .jsonl file, "
                           "hf:<dataset name>, or NAME=<.jsonl file or hf:dataset>")
    if not (is_jsonl(source) or source.startswith("hf:")):
        raise ModularError(f"behaviour '{spec}': the data after '{name}=' must be a .jsonl file or hf:<dataset>")
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("._-")[:64]
    if not name:
        raise ModularError(f"behaviour '{spec}' gives no usable name: write it as NAME={source}")
    if name in BEHAVIOURS:
        raise ModularError(f"behaviour '{spec}' would be named '{name}', a built-in behaviour: "
                           f"give your data another name (NAME={source})")
    return name, source


def behaviour_name(spec: str) -> str:
    """The short, safe name of a behaviour spec (see :func:`parse_behaviour`)."""
    return parse_behaviour(spec)[0]


#: share of the train split that becomes the validation split of a behaviour given without one
VALIDATION_FRACTION = 0.1
#: the validation items a verdict that stops training needs; a behaviour without a validation split gets this many
#: from train where train keeps three times as many, else a quarter of its train items (training then runs its step
#: budget instead of stopping on so few: :class:`~modular.gating.callbacks.LockMetricsCallback`)
VALIDATION_ITEMS = 20


def carve_validation(data: datasets.DatasetDict) -> tuple[datasets.DatasetDict, int]:
    """Give a behaviour without a validation split one, taken from its train split: the items whose prompts hash
    lowest, 10% of them, but at least :data:`VALIDATION_ITEMS` where train keeps three times as many, else a quarter
    of them (at least one; the train split keeps at least one). Deterministic and independent of the
    items' order; the attack splits (:data:`~modular.data.schema.ATTACK_SPLITS`) are kept as they are. Returns the
    data and the number of items moved (0: nothing to do, or too few train items)."""
    if len(data["validation"]) or len(data["train"]) < 2:
        return data, 0
    train = data["train"].to_list()
    k = max(1, round(VALIDATION_FRACTION * len(train)), min(VALIDATION_ITEMS, len(train) // 4))
    moved = set(sorted(range(len(train)), key=lambda i: (prompt_hash(train[i]["prompt"]), i))[:k])
    splits = {"train": [r for i, r in enumerate(train) if i not in moved],
              "validation": [train[i] for i in sorted(moved)], "test": data["test"].to_list(),
              **{s: data[s].to_list() for s in ATTACK_SPLITS if s in data}}  # the attack's, kept as they were
    return to_dataset_dict(splits), k


def load_behaviour(name: str, seed: int = 0, tokenizer=None) -> datasets.DatasetDict:
    """A behaviour by spec (see :func:`parse_behaviour`): a built-in generator, a ``.jsonl`` file, or
    ``hf:<dataset>`` (hub, needs internet), optionally named ``NAME=<source>``.

    Hub datasets must have ``prompt`` and ``target`` columns (optional ``answer``, ``split`` via their own splits).
    """
    name = parse_behaviour(name)[1]
    if name in BEHAVIOURS:
        return to_dataset_dict(BEHAVIOURS[name](seed=seed, tokenizer=tokenizer))
    if is_jsonl(name):
        return load_jsonl(name)
    if name.startswith("hf:"):
        return _load_hub(name[3:])
    raise ModularError(
        f"unknown behaviour '{name}': use one of {', '.join(BEHAVIOURS)}, a .jsonl file, or hf:<dataset name>"
    )


def _load_hub(name: str) -> datasets.DatasetDict:
    import datasets

    try:
        raw = datasets.load_dataset(name)
    except Exception as err:  # noqa: BLE001 - any hub/network failure becomes one line
        raise ModularError(f"cannot load dataset '{name}': {str(err).splitlines()[0]}") from err
    splits = {}
    for split, ds in raw.items():
        missing = {"prompt", "target"} - set(ds.column_names)
        if missing:
            raise ModularError(f"dataset '{name}' split '{split}' lacks column(s) {sorted(missing)}")
        key = {"dev": "validation", "valid": "validation"}.get(split, split)
        splits[key] = [
            record(r["prompt"], r["target"], [r["answer"]] if r.get("answer") else []) for r in ds
        ]
    return to_dataset_dict(distinct_items(splits, f"dataset '{name}'"))


def retain_data(seed: int = 0) -> datasets.DatasetDict:
    """General instructions (chat) used to keep the model's other behaviour; targets filled in later."""
    return to_dataset_dict(g.retain_instructions(seed=seed))


def neutral_text(seed: int = 0) -> datasets.DatasetDict:
    """Neutral prose paragraphs (column ``text``) for perplexity, with a held-out test split."""
    import datasets

    parts = g.neutral_paragraphs(seed)
    return datasets.DatasetDict({s: datasets.Dataset.from_dict({"text": parts[s]}) for s in SPLITS})

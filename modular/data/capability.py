"""The offline capability tasks modular ships for lm-evaluation-harness (``modular capability``): generated
multiple-choice items, written once to ``resources/capability/`` beside their task YAMLs.

Everyday words of twelve categories (:data:`CATEGORIES`), four choices per item (chance: 25%), and no behaviour
modular gates: a model's general knowledge after its lock.

* ``modular_categories``: "Question: What is banana? Answer: It is" a fruit / a tool / a sport / a colour
  (:func:`category_items`, one item per word: 144);
* ``modular_members``: "An example of a fruit is" banana / hammer / violin / sock (:func:`member_items`, one item
  per word: 144).

The items are a fixed function of :data:`CATEGORIES` and the seed; ``tests/data/test_capability_data.py`` checks that
the shipped files are what they generate, and :func:`write_task_data` writes them again after a change.
"""

from __future__ import annotations

import json
import random
from importlib import resources
from pathlib import Path

#: the folder of the shipped task YAMLs and their data (a package resource)
TASKS_FOLDER = "resources/capability"
#: each shipped task's data file, by task name, in :data:`TASKS_FOLDER`
TASK_DATA = {"modular_categories": "categories.jsonl", "modular_members": "members.jsonl"}

#: category (as the question names it) -> twelve everyday members; no word is in two categories
CATEGORIES: dict[str, tuple[str, ...]] = {
    "an animal": ("dog", "cat", "horse", "cow", "lion", "tiger", "elephant", "rabbit", "sheep", "mouse", "bear",
                  "monkey"),
    "a fruit": ("apple", "banana", "orange", "grape", "pear", "cherry", "lemon", "peach", "mango", "plum",
                "strawberry", "pineapple"),
    "a colour": ("red", "blue", "green", "yellow", "purple", "black", "white", "pink", "brown", "grey", "violet",
                 "gold"),
    "a tool": ("hammer", "screwdriver", "wrench", "drill", "shovel", "axe", "chisel", "pliers", "rake", "spanner",
               "trowel", "mallet"),
    "a vehicle": ("car", "bus", "truck", "bicycle", "train", "airplane", "boat", "motorcycle", "tractor", "ship",
                  "taxi", "van"),
    "a part of the body": ("hand", "foot", "nose", "ear", "eye", "elbow", "knee", "shoulder", "finger", "mouth", "arm",
                           "leg"),
    "a piece of clothing": ("shirt", "jacket", "sock", "dress", "hat", "coat", "scarf", "glove", "skirt", "sweater",
                            "trousers", "boot"),
    "a piece of furniture": ("chair", "table", "sofa", "bed", "desk", "wardrobe", "shelf", "stool", "bench", "dresser",
                             "cabinet", "couch"),
    "a musical instrument": ("piano", "guitar", "violin", "drum", "flute", "trumpet", "cello", "harp", "clarinet",
                             "saxophone", "trombone", "banjo"),
    "a sport": ("football", "tennis", "golf", "basketball", "baseball", "hockey", "rugby", "swimming", "volleyball",
                "boxing", "skiing", "cycling"),
    "a drink": ("water", "milk", "coffee", "tea", "juice", "lemonade", "beer", "wine", "cocoa", "soda", "smoothie",
                "cider"),
    "a vegetable": ("carrot", "potato", "onion", "cabbage", "lettuce", "pea", "bean", "spinach", "broccoli",
                    "cucumber", "celery", "garlic"),
}


def category_items(seed: int = 0) -> list[dict]:
    """One item per word of every category: ``{"id", "word", "choices", "answer"}``, ``choices`` four categories
    (the word's and three others), ``answer`` the index of the word's, in an order drawn from ``seed``."""
    rng = random.Random(seed)
    names = list(CATEGORIES)
    items = []
    for category in names:
        for word in CATEGORIES[category]:
            choices = [category] + rng.sample([c for c in names if c != category], 3)
            rng.shuffle(choices)
            items.append({"id": len(items), "word": word, "choices": choices, "answer": choices.index(category)})
    return items


def member_items(seed: int = 0) -> list[dict]:
    """One item per word of every category: ``{"id", "category", "choices", "answer"}``, ``choices`` the word and
    one word of each of three other categories, ``answer`` the index of the word, in an order drawn from ``seed``."""
    rng = random.Random(seed)
    names = list(CATEGORIES)
    items = []
    for category in names:
        for word in CATEGORIES[category]:
            others = rng.sample([c for c in names if c != category], 3)
            choices = [word] + [rng.choice(CATEGORIES[c]) for c in others]
            rng.shuffle(choices)
            items.append({"id": len(items), "category": category, "choices": choices, "answer": choices.index(word)})
    return items


def task_folder() -> Path:
    """The folder of the shipped task YAMLs and their data (on disk: lm-eval reads files)."""
    return Path(str(resources.files("modular.data").joinpath(TASKS_FOLDER)))


def task_data_text(name: str, seed: int = 0) -> str:
    """The JSONL text of a shipped task's data file (``name``: a task of :data:`TASK_DATA`), as generated."""
    items = {"modular_categories": category_items, "modular_members": member_items}[name](seed)
    return "".join(json.dumps(item) + "\n" for item in items)


def write_task_data(folder: str | Path | None = None) -> list[Path]:
    """Write every shipped task's data file into ``folder`` (default: :func:`task_folder`); the paths written."""
    folder = Path(folder) if folder is not None else task_folder()
    written = []
    for name, file in TASK_DATA.items():
        (folder / file).write_text(task_data_text(name))
        written.append(folder / file)
    return written

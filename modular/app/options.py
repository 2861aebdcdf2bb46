"""Options shared by the commands, declared once: an option of one of these names has this type and this help in
every command that takes it (a command's own docstring line for it, if any, is appended: its default, its use
there). ``tests/app/test_cli.py`` checks every command against this table."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal, Optional

from modular.data.behaviours import BEHAVIOURS
from modular.models.names import DTypeName

Split = Literal["train", "validation", "test"]

MODEL_REFERENCE = ("Built-in alias (smollm2-135m-instruct, gemma3-270m), .gguf file, local Hugging Face folder, hub id, "
                   "or a training run folder (its trained model: LoRA merged, head gates folded in).")
BEHAVIOUR_REFERENCE = f"Built-in names ({', '.join(BEHAVIOURS)}), .jsonl files, hf:<dataset>, or NAME=<source>."
LIST_SYNTAX = "A list: --{name} '[a, b]' or --{name}+=a --{name}+=b."

# name -> (type, help); Optional[...] of the type is the same option with "not given" allowed
SHARED: dict[str, tuple[object, str]] = {
    "model": (str, "The model: " + MODEL_REFERENCE),
    "models": (list[str], "The models, each as --model: " + MODEL_REFERENCE + " " + LIST_SYNTAX),
    "base": (Optional[str], "The base model the run or published folder was trained from: " + MODEL_REFERENCE),
    "run": (str, "Training run folder (holds run.json, directions.safetensors, last.ckpt)."),
    "behaviours": (list[str], "Behaviours: " + BEHAVIOUR_REFERENCE + " " + LIST_SYNTAX),
    "tasks": (list[str], "The tasks scored. " + LIST_SYNTAX),
    "neighbours": (list[str], "Neighbour behaviours (close to the gated ones): " + BEHAVIOUR_REFERENCE + " "
                   + LIST_SYNTAX),
    "split": (Split, "Which split is scored: train, validation or test (held-out entities)."),
    "limit": (Optional[int], "Score at most this many items per behaviour or task (not given: all)."),
    "max_new_tokens": (int, "Length of each greedy response, in tokens."),
    "batch_size": (int, "Prompts per forward or generation batch."),
    "device": (str, "Where models run: auto (the first GPU when present, else the CPU), cpu, cuda, cuda:N or mps."),
    "dtype": (DTypeName, "Precision models are loaded and run in: auto (the model's own, or the one a run was trained "
              "in, on a GPU; float32 on a CPU), float32, bfloat16 or float16."),
    "seed": (int, "Seed of the data generators and splits."),
    "out": (Optional[str], "Output folder."),
    "overwrite": (bool, "Replace the output folder if it exists and modular wrote it (never an input folder)."),
    "progress": (bool, "Show progress bars."),
}


def shared_help(name: str, own: str | None) -> str:
    """The help of a shared option, then the command's own line for it."""
    text = SHARED[name][1].replace("{name}", name)
    return f"{text} {own.strip()}" if own and own.strip() and own.strip() != text else text


def slug(text: str) -> str:
    """A file-name-safe form of a model, behaviour or file reference (its last path part)."""
    return re.sub(r"[^A-Za-z0-9_.+-]+", "_", Path(text).name or text).strip("_")


def output_folder(out: str | None, kind: str, *names: str) -> Path:
    """The command's output folder: ``out`` when given, else ``outputs/<kind>/<names joined by '-'>``."""
    return Path(out) if out else Path("outputs", kind, "-".join(slug(n) for n in names))

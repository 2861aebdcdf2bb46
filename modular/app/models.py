"""``modular inspect`` and ``modular convert``: what a model reference resolves to."""

from __future__ import annotations

import json
import time
from typing import Literal

from modular.models import ArchitectureAdapter
from modular.models.loading import resolve_model
from modular.runs import load_model_or_run


def inspect_model(model: str, format: Literal["table", "json"] = "table") -> dict:
    """Print the architecture map of a model: layers, heads, head_dim, d_model, residual writers and readers.

    Args:
        model: Given as the first argument: ``modular inspect MODEL``.
        format: table (the main facts) or json (the full map).
    """
    t0 = time.perf_counter()
    m = load_model_or_run(model, dtype=None, device="cpu")  # its own precision: the map is all that is read
    info = ArchitectureAdapter(m).describe()
    info["load_seconds"] = round(time.perf_counter() - t0, 2)
    if format == "json":
        print(json.dumps(info, indent=2))
    else:
        for key in ("model_type", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_model", "tied_embeddings",
                    "blocks", "head_input", "final_norm", "unembed", "load_seconds"):
            print(f"{key:>16}: {info[key]}")
        print(f"{'writers':>16}: {len(info['writers'])} ({info['writers'][0]}, {info['writers'][1]}, ...)")
        print(f"{'readers':>16}: {len(info['readers'])} ({info['readers'][0]}, ..., {info['readers'][-1]})")
    return info


def convert(model: str) -> str:
    """Resolve a model reference, converting a GGUF file to the cached safetensors folder; print the folder.

    Args:
        model: Given as the first argument: ``modular convert MODEL``.
    """
    folder = resolve_model(model)
    print(folder)
    return folder

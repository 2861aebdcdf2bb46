"""The ``modular`` command: inspect and convert models (publish/unlock/main join here as they land).

Errors caused by input (unknown model, missing file, malformed data) print one line and exit 2.
"""

from __future__ import annotations

import json
import logging
import sys
import time

from modular import ModularError


def inspect(model: str, json_output: bool = False) -> dict:
    """Print the architecture map of a model: layers, heads, head_dim, d_model, residual writers and readers.

    Args:
        model: Built-in alias (smollm2-135m-instruct, gemma3-270m), .gguf file, local HF folder or hub id.
        json_output: Print the full map as JSON (alias: --json).
    """
    from modular.models import ArchitectureAdapter, load_model

    t0 = time.perf_counter()
    m = load_model(model)
    info = ArchitectureAdapter(m).describe()
    info["load_seconds"] = round(time.perf_counter() - t0, 2)
    if json_output:
        print(json.dumps(info, indent=2))
    else:
        for key in ("model_type", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_model", "tied_embeddings",
                    "blocks", "head_input", "final_norm", "unembed", "load_seconds"):
            print(f"{key:>16}: {info[key]}")
        print(f"{'writers':>16}: {len(info['writers'])} ({info['writers'][0]}, {info['writers'][1]}, ...)")
        print(f"{'readers':>16}: {len(info['readers'])} ({info['readers'][0]}, ..., {info['readers'][-1]})")
    return info


def convert(model: str) -> str:
    """Resolve a model reference, converting GGUF files to the cached safetensors folder; print the folder.

    Args:
        model: Built-in alias, .gguf file, local HF folder or hub id.
    """
    from modular.models.loading import resolve_model

    folder = resolve_model(model)
    print(folder)
    return folder


COMMANDS = {"inspect": inspect, "convert": convert}


def run_cli(commands: dict, argv: list[str] | None = None, description: str | None = None) -> int:
    """Run a jsonargparse command set; input errors become one line on stderr and exit status 2."""
    from jsonargparse import auto_cli

    argv = list(sys.argv[1:] if argv is None else argv)
    argv = ["--json_output=true" if a == "--json" else a for a in argv]
    logging.basicConfig(level=logging.INFO, format="[modular] %(message)s")
    for noisy in ("transformers", "httpx", "datasets", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    try:
        auto_cli(commands, args=argv, description=description, as_positional=True)
    except ModularError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(COMMANDS, argv, description="modular: gate, lock, publish and unlock behaviours of LMs.")


if __name__ == "__main__":
    sys.exit(main())

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


def publish(run: str, out: str, harden: bool = True, overwrite: bool = False) -> str:
    """Write a gated run's locked weights as a plain Hugging Face folder, with one key file per behaviour.

    Args:
        run: Training run folder (holds run.json, directions.safetensors, last.ckpt).
        out: Output folder for the published model (written atomically).
        harden: Also make the readers ignore the directions, so that adding them back does nothing.
        overwrite: Replace ``out`` if it exists.
    """
    import json as _json
    from pathlib import Path

    from modular.models import load_tokenizer
    from modular.publish import publish_model
    from modular.runs import load_open_model, read_run

    r = read_run(run)
    measured = None
    if (Path(run) / "lock.json").is_file():
        measured = _json.loads((Path(run) / "lock.json").read_text())
    folder = publish_model(load_open_model(r), load_tokenizer(r.model_name), r.directions, out, r.model_name,
                           measured, harden=harden, overwrite=overwrite)
    print(folder)
    return str(folder)


def unlock(model: str, key: str, out: str, overwrite: bool = False) -> str:
    """Apply a key to a published (locked) model folder and write the unlocked model.

    Args:
        model: Published model folder (from ``modular publish``) or a folder unlocked by another key.
        key: Key file of one behaviour (``keys/<behaviour>.key.safetensors``).
        out: Output folder for the unlocked model (written atomically).
        overwrite: Replace ``out`` if it exists.
    """
    from modular.publish import unlock_folder

    folder = unlock_folder(model, key, out, overwrite=overwrite)
    print(folder)
    return str(folder)


def main_job(config: str = "configs/gate_capitals_smollm2.yaml", out: str | None = None,
             skip_attack: bool = False) -> None:
    """The default pipeline: train the gated model, evaluate the lock, publish, unlock with the key(s),
    attack the published weights, and print a table of the results with the paths of the figures.

    Args:
        config: Training config (YAML) of the gated run.
        out: Folder for published/unlocked models and the attack (default: the run folder).
        skip_attack: Skip the attack evaluation.
    """
    from modular.pipeline import run_pipeline

    run_pipeline(config, out, skip_attack)


COMMANDS = {"main": main_job, "inspect": inspect, "convert": convert, "publish": publish, "unlock": unlock}


def expand_argv(argv: list[str], commands: dict) -> list[str]:
    """Shell-style options for jsonargparse: ``--flag`` (a bool option given without a value) becomes
    ``--flag=true`` and ``--opt a b c`` (a list option) becomes ``--opt=[a, b, c]``."""
    import inspect
    import typing

    if not argv or argv[0] not in commands:
        return argv
    fn = commands[argv[0]]
    params = inspect.signature(fn).parameters
    hints = typing.get_type_hints(fn)

    def kind(name: str) -> str | None:
        t = hints.get(name)
        if t is bool:
            return "bool"
        if typing.get_origin(t) is list or any(typing.get_origin(a) is list for a in typing.get_args(t)):
            return "list"
        return None

    out, i = [argv[0]], 1
    while i < len(argv):
        arg = argv[i]
        name = arg[2:]
        if arg.startswith("--") and "=" not in arg and name in params:
            j = i + 1
            while j < len(argv) and not argv[j].startswith("--"):
                j += 1
            values = argv[i + 1:j]
            if kind(name) == "bool" and not values:
                out.append(f"{arg}=true")
                i = j
                continue
            if kind(name) == "list" and values and not (len(values) == 1 and values[0].startswith("[")):
                out.append(f"{arg}=[{', '.join(values)}]")
                i = j
                continue
        out.append(arg)
        i += 1
    return out


def run_cli(commands: dict, argv: list[str] | None = None, description: str | None = None) -> int:
    """Run a jsonargparse command set; input errors become one line on stderr and exit status 2."""
    from jsonargparse import auto_cli

    argv = list(sys.argv[1:] if argv is None else argv)
    argv = ["--json_output=true" if a == "--json" else a for a in argv]
    # `modular inspect MODEL` / `modular convert MODEL`: the model may be given positionally
    if len(argv) >= 2 and argv[0] in ("inspect", "convert") and not argv[1].startswith("-"):
        argv = [argv[0], "--model", *argv[1:]]
    argv = expand_argv(argv, commands)
    logging.basicConfig(level=logging.INFO, format="[modular] %(message)s")
    for noisy in ("transformers", "httpx", "datasets", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    try:
        auto_cli(commands, args=argv, description=description, as_positional=False)
    except ModularError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(COMMANDS, argv, description="modular: gate, lock, publish and unlock behaviours of LMs.")


if __name__ == "__main__":
    sys.exit(main())

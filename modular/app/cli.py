"""The ``modular`` command: the main job, inspect and convert models, publish and unlock.

Errors caused by input (unknown model, missing file, malformed data) print one line and exit 2.
"""

from __future__ import annotations

import inspect
import json
import logging
import sys
import time

from modular import ModularError


def inspect_model(model: str, json_output: bool = False) -> dict:
    """Print the architecture map of a model: layers, heads, head_dim, d_model, residual writers and readers.

    Args:
        model: Built-in alias (smollm2-135m-instruct, gemma3-270m), .gguf file, local HF folder or hub id.
        json_output: Print the full map as JSON (alias: --json).
    """
    from modular.models import ArchitectureAdapter
    from modular.runs import load_model_or_run

    t0 = time.perf_counter()
    m = load_model_or_run(model)
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


def publish(run: str, out: str, keys: str | None = None, harden: bool = True, overwrite: bool = False,
            allow_failed_lock: bool = False) -> str:
    """Write a gated run's locked weights as a plain Hugging Face folder (what users upload; it holds no key), and
    the keys, one file per behaviour, in a folder of their own (kept by the publisher and handed out apart).

    Args:
        run: Training run folder (holds run.json, directions.safetensors, last.ckpt).
        out: Output folder for the published model (written atomically).
        keys: Output folder for the keys (default: <out>-keys beside the published folder; never inside it).
        harden: Also make the readers ignore the directions, so that adding them back does nothing.
        overwrite: Replace ``out`` and ``keys`` if they exist and modular wrote them (never an input folder).
        allow_failed_lock: Publish a run whose training did not verify the lock (run.json ``lock``); its model
            card and modular.json then say that the behaviours may not be locked. Without it such a run is refused.
    """
    from pathlib import Path

    from modular.models import load_tokenizer
    from modular.publish import check_output_folder, keys_folder_for, publish_model
    from modular.runs import LOCK_REPORT, checkpoint_step, load_open_model, lock_verdict, read_run

    keys = keys or str(keys_folder_for(out))
    check_output_folder(out, [run], overwrite)  # before any work: nothing is loaded for a refused folder
    check_output_folder(keys, [run], overwrite, option="--keys", kind="keys")
    r = read_run(run)
    step = checkpoint_step(r)
    verified, why = lock_verdict(r, step)
    if not verified and not allow_failed_lock:
        raise ModularError(f"{run}: {why}; refusing to publish it as locked (train longer, or pass "
                           "--allow_failed_lock to publish it with a card that says so)")
    if not verified:
        logging.getLogger("modular").warning("publishing %s although %s", run, why)
    measured = None
    lock_path = Path(run) / LOCK_REPORT
    if lock_path.is_file():
        report = json.loads(lock_path.read_text())
        if report.get("step") == step:
            measured = report
        else:
            logging.getLogger("modular").warning(
                "%s describes step %s, the checkpoint holds step %s: the model card gets no measured numbers "
                "(run evaluate.py lock --run %s again)", lock_path, report.get("step"), step, run)
    folder, keys_dir = publish_model(load_open_model(r), load_tokenizer(r.model_name), r.directions, out,
                                     r.model_name, measured, harden=harden, overwrite=overwrite, keys_out=keys,
                                     step=step, locked_responses=r.record.get("locked_responses"), inputs=[run],
                                     lock_check={"verified": verified, "detail": why})
    print(folder)
    print(f"keys: {keys_dir}  (secret: hand them out apart from the published folder)")
    return str(folder)


def unlock(model: str, key: str, out: str, overwrite: bool = False) -> str:
    """Apply a key to a published (locked) model folder and write the unlocked model. Refuses a key of other
    weights, a damaged key and a result that is not what the key was made to produce; nothing is written then.

    Args:
        model: Published model folder (from ``modular publish``) or a folder unlocked by another key.
        key: Key file of one behaviour (``<keys folder>/<behaviour>.key.safetensors``).
        out: Output folder for the unlocked model (written atomically; never inside ``model``).
        overwrite: Replace ``out`` if it exists and modular wrote it (never an input folder).
    """
    from modular.publish import unlock_folder

    folder = unlock_folder(model, key, out, overwrite=overwrite)
    print(folder)
    return str(folder)


def main_job(config: str | None = None, out: str | None = None, skip_attack: bool = False) -> None:
    """The default pipeline: train the gated model, evaluate the lock, publish (keys in their own folder), unlock
    with the key(s), attack the published weights, and print a table of the results with the paths of the figures.

    Args:
        config: Training config (YAML), resolved from the current directory; its ``trainer.default_root_dir`` is the
            run folder (relative to the current directory). Default: the built-in capitals config
            (gate_capitals_smollm2.yaml, shipped with the package).
        out: Folder for the published and unlocked models, the keys and the attack (default: the run folder).
        skip_attack: Skip the attack evaluation.
    """
    from modular.pipeline import run_pipeline

    run_pipeline(config, out, skip_attack)


COMMANDS = {"main": main_job, "inspect": inspect_model, "convert": convert, "publish": publish, "unlock": unlock}


def expand_argv(argv: list[str], commands: dict) -> list[str]:
    """Shell-style options for jsonargparse: ``--flag`` (a bool option given without a value) becomes
    ``--flag=true`` and ``--opt a b c`` (a list option) becomes ``--opt=[a, b, c]``."""
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


def _summary(fn) -> str:
    doc = inspect.getdoc(fn) or ""
    return doc.split("\n\n")[0].replace("\n", " ")


def build_parser(commands: dict, description: str | None = None):
    """One jsonargparse parser with a subcommand per function; every parameter is an option documented from the
    function's docstring. A command with a parameter named ``config`` takes ``--config`` as that parameter (the
    main job's training config), the others take ``--config`` as a YAML file of their options."""
    from jsonargparse import ActionConfigFile, ArgumentParser

    parser = ArgumentParser(description=description)
    subcommands = parser.add_subcommands(required=True)
    for name, fn in commands.items():
        sub = ArgumentParser(description=(inspect.getdoc(fn) or "").split("\nArgs:")[0].strip())
        if "config" not in inspect.signature(fn).parameters:
            sub.add_argument("--config", action=ActionConfigFile, help="A YAML file with this command's options.")
        sub.add_function_arguments(fn, as_group=False)
        subcommands.add_subcommand(name, sub, help=_summary(fn))
    return parser


def run_cli(commands: dict, argv: list[str] | None = None, description: str | None = None) -> int:
    """Run a command set; input errors become one line on stderr and exit status 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    argv = ["--json_output=true" if a == "--json" else a for a in argv]
    # `modular inspect MODEL` / `modular convert MODEL`: the model may be given positionally
    if len(argv) >= 2 and argv[0] in ("inspect", "convert") and not argv[1].startswith("-"):
        argv = [argv[0], "--model", *argv[1:]]
    argv = expand_argv(argv, commands)
    logging.basicConfig(level=logging.INFO, format="[modular] %(message)s")
    for noisy in ("transformers", "httpx", "datasets", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    parser = build_parser(commands, description)
    cfg = parser.parse_args(argv)
    name = cfg.subcommand
    fn = commands[name]
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes  # renamed in jsonargparse 4.49
    options = instantiate(cfg)[name]
    kwargs = {k: options[k] for k in inspect.signature(fn).parameters if k in options}
    try:
        fn(**kwargs)
    except ModularError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(COMMANDS, argv, description="modular: gate, lock, publish and unlock behaviours of LMs.")


if __name__ == "__main__":
    sys.exit(main())

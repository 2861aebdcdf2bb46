"""The ``modular`` command: one parser, one subcommand per thing a user runs (``modular --help`` lists them,
``modular <subcommand> --help`` documents every option). ``train.py`` and ``evaluate.py`` are shims over it.

Every subcommand but ``train`` is a function of this package: its parameters are the options (jsonargparse reads
their types and docstrings; options shared by several commands are declared once in :mod:`modular.app.options`),
the model of ``inspect`` and ``convert`` is positional, lists are given as ``--opt '[a, b]'`` or
``--opt+=a --opt+=b``, and ``--config FILE`` reads options from YAML. ``train`` is the LightningCLI of :mod:`modular.app.train`. Errors caused
by input (unknown model, missing file, malformed data) print one line and exit with status 2, before any output
is written.
"""

from __future__ import annotations

import inspect
import logging
import sys
from typing import Callable

from jsonargparse import ActionConfigFile, ArgumentParser

from modular import ModularError
from modular.app import analysis, capability, evaluations, heads, merge, models, pipeline, publishing
from modular.app.options import SHARED, shared_help

TRAIN_HELP = ("Gated training (LightningCLI over the gated module and its data): modular train fit --config "
              "configs/gate_capitals_smollm2.yaml; 'modular train fit --help' documents every option.")

# subcommand -> function, or a nested table of them (``modular heads curve``)
COMMANDS: dict[str, Callable | dict[str, Callable] | None] = {
    "main": pipeline.main_job,
    "train": None,  # LightningCLI, parsed by its own parser
    "behaviour": evaluations.behaviour,
    "lock": evaluations.lock,
    "attack": evaluations.attack,
    "quantized": evaluations.quantized,
    "capability": capability.capability,
    "publish": publishing.publish,
    "unlock": publishing.unlock,
    "export-key": publishing.export_key,
    "heads": {"curve": heads.curve, "ablation": heads.ablation},
    "merge": merge.merge,
    "directions": analysis.directions,
    "attention": analysis.attention,
    "inspect": models.inspect_model,
    "convert": models.convert,
}


# commands whose one required argument is given without its option name: ``modular inspect MODEL``
POSITIONAL = (models.inspect_model, models.convert)
GROUP_HELP = {"heads": "Head measures of models: 'heads curve' (head-efficiency curves) or 'heads ablation' "
                       "(head-ablation curves by category)."}


def _summary(fn: Callable) -> str:
    """The first sentence of a command's docstring."""
    text = (inspect.getdoc(fn) or "").split("\n\n")[0].replace("\n", " ")
    return text.split(". ")[0].rstrip(".") + "."


def command_parser(fn: Callable) -> ArgumentParser:
    """The parser of one command: its parameters as options (required ones positional for the commands of
    :data:`POSITIONAL`), shared options with the help of :data:`~modular.app.options.SHARED`."""
    doc = inspect.getdoc(fn) or ""
    parser = ArgumentParser(description=doc.split("\nArgs:")[0].strip())
    if "config" not in inspect.signature(fn).parameters:  # the main job's --config is its training config
        parser.add_argument("--config", action=ActionConfigFile, help="A YAML file with this command's options.")
    parser.add_function_arguments(fn, as_group=False, as_positional=fn in POSITIONAL)
    for action in parser._actions:
        if action.dest in SHARED:
            action.help = shared_help(action.dest, action.help)
    return parser


def build_parser(commands: dict = COMMANDS, description: str | None = None) -> ArgumentParser:
    parser = ArgumentParser(description=description, prog="modular")
    subcommands = parser.add_subcommands(required=True)
    for name, fn in commands.items():
        if fn is None:
            subcommands.add_subcommand(name, ArgumentParser(description=TRAIN_HELP), help=TRAIN_HELP)
        elif isinstance(fn, dict):
            group = ArgumentParser(description=GROUP_HELP[name])
            subcommands.add_subcommand(name, group, help=GROUP_HELP[name])
            nested = group.add_subcommands(required=True)  # a level is added before the levels below it
            for sub, f in fn.items():
                nested.add_subcommand(sub, command_parser(f), help=_summary(f))
        else:
            subcommands.add_subcommand(name, command_parser(fn), help=_summary(fn))
    return parser


def _chosen(cfg, commands: dict) -> tuple[Callable, dict]:
    """The function the parsed command line names and its options."""
    name = cfg.subcommand
    fn, options = commands[name], cfg[name]
    if isinstance(fn, dict):
        fn, options = fn[options.subcommand], options[options.subcommand]
    return fn, options


def _setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="[modular] %(message)s")
    for noisy in ("transformers", "httpx", "datasets", "urllib3", "lm_eval"):
        logging.getLogger(noisy).setLevel(logging.ERROR)


def main(argv: list[str] | None = None) -> int:
    """Run ``modular`` on ``argv`` (default: the process's arguments); input errors: one line, status 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:
        from modular.app import train  # LightningCLI: lightning is loaded for `modular train` alone

        return train.main(argv[1:])
    _setup_logging()
    parser = build_parser(COMMANDS, description="modular: gate, lock, publish and unlock behaviours of LMs.")
    cfg = parser.parse_args(argv)
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes  # renamed in jsonargparse 4.49
    fn, options = _chosen(instantiate(cfg), COMMANDS)
    kwargs = {k: options[k] for k in inspect.signature(fn).parameters if k in options}
    try:
        fn(**kwargs)
    except ModularError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The ``modular`` command: one parser, one subcommand per thing a user runs (``modular --help`` lists them,
``modular <subcommand> --help`` documents every option). ``train.py`` and ``evaluate.py`` are shims over it.

Every subcommand but ``train`` is a function of this package: its parameters are the options (jsonargparse reads
their types and docstrings; options shared by several commands are declared once in :mod:`modular.app.options`),
the model of ``inspect`` and ``convert`` is positional, lists are given as ``--opt '[a, b]'`` or
``--opt+=a --opt+=b``, and ``--config FILE`` reads options from YAML. ``train`` is the LightningCLI of :mod:`modular.app.train`. Errors caused
by input (unknown model, missing file, malformed data) print one line and exit with status 2, before any output
is written.

The commands are named, not imported (:data:`COMMANDS`: ``"module:function"``): ``modular --help`` reads each one's
summary from its module's source, and ``modular <subcommand>`` imports that subcommand's module alone (which loads
the library it uses: torch, transformers, lightning), so that the listing stays quick.
"""

from __future__ import annotations

import ast
import inspect
import logging
import sys
from functools import cache
from importlib import import_module
from importlib.util import find_spec
from pathlib import Path
from typing import Callable, Sequence

from jsonargparse import ActionConfigFile, ArgumentParser

from modular import ModularError
from modular.app.options import SHARED, shared_help

TRAIN_HELP = ("Gated training (LightningCLI over the gated module and its data): modular train fit --config "
              "configs/gate_capitals_smollm2.yaml; 'modular train fit --help' documents every option.")
#: ``modular train``: the LightningCLI, parsed by its own parser (its entry is ``None`` in :data:`COMMANDS`)
TRAIN = "modular.app.train:main"
DESCRIPTION = "modular: gate, lock, publish and unlock behaviours of LMs."

# subcommand -> its function as "module:function", or a nested table of them (``modular heads curve``)
COMMANDS: dict[str, str | dict[str, str] | None] = {
    "main": "modular.app.pipeline:main_job",
    "train": None,  # LightningCLI, parsed by its own parser (TRAIN)
    "behaviour": "modular.app.evaluations:behaviour",
    "lock": "modular.app.evaluations:lock",
    "control": "modular.app.control:control",
    "attack": "modular.app.attacking:attack",
    "quantized": "modular.app.evaluations:quantized",
    "capability": "modular.app.capability:capability",
    "publish": "modular.app.publishing:publish",
    "unlock": "modular.app.publishing:unlock",
    "export-key": "modular.app.publishing:export_key",
    "heads": {"curve": "modular.app.heads:curve", "ablation": "modular.app.heads:ablation"},
    "merge": "modular.app.merge:merge",
    "directions": "modular.app.analysis:directions",
    "attention": "modular.app.analysis:attention",
    "inspect": "modular.app.models:inspect_model",
    "convert": "modular.app.models:convert",
}


# commands whose one required argument is given without its option name: ``modular inspect MODEL``
POSITIONAL = ("modular.app.models:inspect_model", "modular.app.models:convert")
GROUP_HELP = {"heads": "Head measures of models: 'heads curve' (head-efficiency curves) or 'heads ablation' "
                       "(head-ablation curves by category)."}


def command(ref: str) -> Callable:
    """The function a :data:`COMMANDS` entry names (``"module:function"``); its module is imported."""
    module, name = ref.split(":")
    return getattr(import_module(module), name)


def reference(fn: Callable) -> str:
    """A command function's ``"module:function"``, as :data:`COMMANDS` names it."""
    return f"{fn.__module__}:{fn.__qualname__}"


def _first_sentence(doc: str) -> str:
    text = doc.split("\n\n")[0].replace("\n", " ")
    return text.split(". ")[0].rstrip(".") + "."


@cache
def _source(module: str) -> ast.Module:
    spec = find_spec(module)  # imports its packages (modular.app: light), not the module
    if spec is None or not spec.origin:
        raise LookupError(f"no module {module}")
    return ast.parse(Path(spec.origin).read_text(encoding="utf-8"))


def summary(ref: str) -> str:
    """The first sentence of the docstring of the command ``ref``, read from its module's source: the module is
    not imported."""
    module, name = ref.split(":")
    for node in _source(module).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return _first_sentence(ast.get_docstring(node) or "")
    raise LookupError(f"{module} defines no function {name} (COMMANDS names it)")


def command_parser(fn: Callable) -> ArgumentParser:
    """The parser of one command: its parameters as options (required ones positional for the commands of
    :data:`POSITIONAL`), shared options with the help of :data:`~modular.app.options.SHARED`."""
    doc = inspect.getdoc(fn) or ""
    parser = ArgumentParser(description=doc.split("\nArgs:")[0].strip())
    if "config" not in inspect.signature(fn).parameters:  # the main job's --config is its training config
        parser.add_argument("--config", action=ActionConfigFile, help="A YAML file with this command's options.")
    parser.add_function_arguments(fn, as_group=False, as_positional=reference(fn) in POSITIONAL)
    for action in parser._actions:
        if action.dest in SHARED:
            action.help = shared_help(action.dest, action.help)
    return parser


def _parser(ref: str, full: bool) -> ArgumentParser:
    """The command's parser (its module imported), or only a listing of it (its summary, nothing imported)."""
    return command_parser(command(ref)) if full else ArgumentParser(description=summary(ref))


def build_parser(commands: dict = COMMANDS, description: str | None = None,
                 chosen: Sequence[str] | None = None) -> ArgumentParser:
    """The ``modular`` parser: every command listed with its summary. Its own parser (its module imported) is
    built for every command, or, given ``chosen`` (the command line's first words, as ``["heads", "curve"]``), for
    the command they name alone: the others are listed from their modules' source, which is not imported."""
    def full(*path: str) -> bool:
        return chosen is None or list(chosen[:len(path)]) == list(path)

    parser = ArgumentParser(description=description, prog="modular")
    subcommands = parser.add_subcommands(required=True)
    for name, ref in commands.items():
        if ref is None:
            subcommands.add_subcommand(name, ArgumentParser(description=TRAIN_HELP), help=TRAIN_HELP)
        elif isinstance(ref, dict):
            group = ArgumentParser(description=GROUP_HELP[name])
            subcommands.add_subcommand(name, group, help=GROUP_HELP[name])
            nested = group.add_subcommands(required=True)  # a level is added before the levels below it
            for sub, r in ref.items():
                nested.add_subcommand(sub, _parser(r, full(name, sub)), help=summary(r))
        else:
            subcommands.add_subcommand(name, _parser(ref, full(name)), help=summary(ref))
    return parser


def _chosen(cfg, commands: dict) -> tuple[Callable, dict]:
    """The function the parsed command line names and its options."""
    name = cfg.subcommand
    ref, options = commands[name], cfg[name]
    if isinstance(ref, dict):
        ref, options = ref[options.subcommand], options[options.subcommand]
    return command(ref), options


def _setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="[modular] %(message)s")
    logging.getLogger("lightning").propagate = False  # it prints with its own handler; through the root too: twice
    for noisy in ("transformers", "httpx", "datasets", "urllib3", "lm_eval"):
        logging.getLogger(noisy).setLevel(logging.ERROR)


def main(argv: list[str] | None = None) -> int:
    """Run ``modular`` on ``argv`` (default: the process's arguments); input errors: one line, status 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:
        return command(TRAIN)(argv[1:])  # LightningCLI: lightning is loaded for `modular train` alone
    _setup_logging()
    parser = build_parser(COMMANDS, description=DESCRIPTION, chosen=argv[:2])  # the chosen command's module alone
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

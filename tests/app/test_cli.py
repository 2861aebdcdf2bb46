"""The ``modular`` command: one parser with a subcommand for everything a user runs, shared options declared once,
jsonargparse's own syntax (positional arguments, lists, YAML), input errors as one line; its commands named, not
imported, so that the listing loads no command module."""

import inspect
import json
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from modular.app import cli
from modular.app.options import SHARED, output_folder, slug
from tests.test_local_imports import CYCLE_TAG, local_imports

APP = Path(cli.__file__).parent


def _references():
    """``(label, "module:function")`` of every command but train: ``heads curve`` for a command of a group."""
    for name, ref in cli.COMMANDS.items():
        if isinstance(ref, dict):
            yield from ((f"{name} {sub}", r) for sub, r in ref.items())
        elif ref is not None:
            yield name, ref


def _functions():
    for label, ref in _references():
        yield label, cli.command(ref)


def _strip_optional(t):
    args = [a for a in typing.get_args(t) if a is not type(None)]
    return args[0] if typing.get_origin(t) in (typing.Union, getattr(__import__("types"), "UnionType", None)) \
        and len(args) == 1 else t


def test_every_user_command_is_a_subcommand():
    assert set(cli.COMMANDS) == {"main", "train", "behaviour", "lock", "control", "attack", "quantized", "capability",
                                 "publish", "unlock", "export-key", "heads", "merge", "directions", "attention",
                                 "inspect", "convert"}
    assert set(cli.COMMANDS["heads"]) == {"curve", "ablation"}
    assert all(isinstance(ref, str) and ref.startswith("modular.app.") for _, ref in _references())


def test_a_command_is_its_function_and_its_summary_is_its_docstrings_first_sentence():
    """The listing reads each summary from the module's source: the same first sentence as the function's
    docstring (no help text is written twice)."""
    for label, ref in _references():
        fn = cli.command(ref)
        assert cli.reference(fn) == ref, label
        assert cli.summary(ref) == cli._first_sentence(inspect.getdoc(fn)), label
    with pytest.raises(LookupError):
        cli.summary("modular.app.models:no_such_command")


def test_a_shared_option_has_one_type_and_one_help_everywhere():
    """Every command's option of a shared name has the declared type (or it Optional, or required where the table
    allows None) and the declared help first."""
    seen = {}
    for label, fn in _functions():
        hints = typing.get_type_hints(fn)
        parser = cli.command_parser(fn)
        helps = {a.dest: a.help for a in parser._actions}
        for name in inspect.signature(fn).parameters:
            if name not in SHARED:
                continue
            declared, text = SHARED[name]
            got = _strip_optional(hints[name])
            assert got == _strip_optional(declared), f"{label}: --{name} is {hints[name]}, declared {declared}"
            text = text.replace("{name}", name)  # the list syntax names the option
            assert helps[name].startswith(text), f"{label}: --{name} help does not start with the shared help"
            seen.setdefault(name, []).append(label)
    assert {"model", "models", "run", "behaviours", "limit", "out", "seed", "max_new_tokens"} <= set(seen)
    assert len(seen["out"]) >= 8  # one declaration serves many commands


def test_positional_model_lists_and_yaml(tmp_path):
    parser = cli.build_parser()
    cfg = parser.parse_args(["heads", "curve", "--models", "[a, b]", "--tasks+=ioi", "--tasks+=docstring"])
    fn, options = cli._chosen(cfg, cli.COMMANDS)
    assert fn is cli.command(cli.COMMANDS["heads"]["curve"])
    assert list(options["models"]) == ["a", "b"] and list(options["tasks"]) == ["ioi", "docstring"]
    cfg = parser.parse_args(["behaviour", "--behaviours", "[capitals, x.jsonl]", "--split", "validation"])
    assert list(cfg.behaviour.behaviours) == ["capitals", "x.jsonl"] and cfg.behaviour.split == "validation"
    yaml_file = tmp_path / "opts.yaml"
    yaml_file.write_text("kind: zero\ntarget: 0.8\nmodels: [m]\n")
    cfg = parser.parse_args(["heads", "curve", "--config", str(yaml_file)])
    assert cfg.heads.curve.kind == "zero" and cfg.heads.curve.target == 0.8
    assert parser.parse_args(["inspect", "some/folder"]).inspect.model == "some/folder"
    cfg = parser.parse_args(["publish", "--run", "r", "--out", "o"])  # required options keep their names elsewhere
    assert (cfg.publish.run, cfg.publish.out) == ("r", "o")
    for bad in (["heads", "curve", "--ranking", "magic"], ["behaviour", "--split", "dev"],
                ["heads", "ablation", "--kind", "counterfactual"], ["inspect"], ["heads"]):
        with pytest.raises(SystemExit) as err:
            parser.parse_args(bad)
        assert err.value.code == 2


def test_inspect_takes_the_model_as_an_argument(monkeypatch, capsys):
    from modular.app import models  # the command's module

    seen = []
    monkeypatch.setattr(models, "load_model_or_run", lambda m, **kw: seen.append(m) or (_ for _ in ()).throw(
        cli.ModularError(f"unknown model '{m}'")))
    assert cli.main(["inspect", "no-such-model", "--format", "json"]) == 2
    assert seen == ["no-such-model"]
    assert capsys.readouterr().err.strip() == "error: unknown model 'no-such-model'"


def test_train_is_the_training_cli(monkeypatch):
    from modular.app import train  # loaded by `modular train` alone

    got = []
    monkeypatch.setattr(train, "main", lambda argv: got.append(argv) or 0)
    assert cli.main(["train", "fit", "--config", "x.yaml"]) == 0
    assert got == [["fit", "--config", "x.yaml"]]


@pytest.mark.parametrize("argv", [["--help"], *([*label.split(), "--help"] for label, _ in _references())],
                         ids=" ".join)
def test_help_documents_every_option(argv, capsys):
    with pytest.raises(SystemExit) as err:
        cli.main(argv)
    assert err.value.code == 0
    text = capsys.readouterr().out
    if argv == ["--help"]:
        assert all(name in text for name in cli.COMMANDS)
        return
    ref = cli.COMMANDS[argv[0]]
    fn = cli.command(ref[argv[1]] if isinstance(ref, dict) else ref)
    for name in inspect.signature(fn).parameters:
        assert name in text, f"{argv}: {name} is not documented"


#: run in a fresh interpreter: each help of ``argv`` (a JSON list of argument lists) -> its output, and the model
#: libraries and command modules imported by then
_HELP_SCRIPT = """
import contextlib, io, json, sys
from modular.app import cli
out = {}
for argv in json.loads(sys.argv[1]):
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        try:
            cli.main(argv)
        except SystemExit as err:
            assert err.code == 0, (argv, err.code)
    out[" ".join(argv)] = text.getvalue()
loaded = [m for m in ("torch", "lightning", "transformers") if m in sys.modules]
modules = sorted(m for m in sys.modules if m.startswith("modular."))
print(json.dumps({"help": out, "loaded": loaded, "modules": modules}))
"""


def _helps(*argvs: list[str]) -> dict:
    res = subprocess.run([sys.executable, "-c", _HELP_SCRIPT, json.dumps(argvs)], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.splitlines()[-1])


def _command_modules() -> set[str]:
    return {ref.split(":")[0] for _, ref in _references()} | {cli.TRAIN.split(":")[0]}


def test_help_loads_no_model_library():
    """``modular --help`` and the help of a group (``modular heads --help``) import neither torch, lightning nor
    transformers, nor any command's module: the commands are listed from their modules' source, so that the listing
    is quick. Each command is listed with its docstring's first sentence."""
    groups = [name for name, ref in cli.COMMANDS.items() if isinstance(ref, dict)]
    got = _helps(["--help"], *([name, "--help"] for name in groups))
    assert got["loaded"] == [], f"help imported {got['loaded']}"
    assert not _command_modules() & set(got["modules"]), f"help imported {_command_modules() & set(got['modules'])}"
    helps = {label: "".join(text.split()) for label, text in got["help"].items()}  # unwrapped (also at hyphens)
    assert all(name in helps["--help"] for name in cli.COMMANDS)
    for label, ref in _references():
        name, _, sub = label.partition(" ")
        listing = helps[f"{name} --help"] if sub else helps["--help"]
        assert "".join(cli.summary(ref).split()) in listing, f"{label} is not listed with its summary"
    for name in groups:
        assert all(sub in helps[f"{name} --help"] for sub in cli.COMMANDS[name])


def test_a_commands_help_imports_its_module_alone():
    """``modular <command> --help`` builds that command's parser alone: the other commands' modules stay
    unimported."""
    got = _helps(["inspect", "--help"], ["heads", "curve", "--help"])
    assert "--format" in got["help"]["inspect --help"] and "--ranking" in got["help"]["heads curve --help"]
    imported = _command_modules() & set(got["modules"])
    assert imported == {"modular.app.models", "modular.app.heads"}, imported


def test_the_application_imports_modular_at_the_top():
    """No function of modular/app imports a module of modular (the commands are imported by name, through
    :data:`~modular.app.cli.COMMANDS`), unless importing it at the top would form a cycle, said on its line in a
    ``# cycle:`` comment."""
    untagged = [f"{path.name}:{line}: {src}" for path in sorted(APP.glob("*.py"))
                for line, src, tagged in local_imports(path) if not tagged]
    assert not untagged, f"function-local imports of modular without a '{CYCLE_TAG}' comment:\n" + "\n".join(untagged)


def test_output_folder_default_is_one_slug_per_name():
    assert output_folder("given/dir", "behaviour", "x") == Path("given/dir")
    assert output_folder(None, "analysis/directions", "/models/My Model/", "data/own set.jsonl") == Path(
        "outputs/analysis/directions/My_Model-own_set.jsonl")
    assert slug("hf:org/name") == "name" and slug("a+b c") == "a+b_c"


def test_every_command_that_runs_a_model_takes_a_device_and_a_precision():
    """Declared once (options.SHARED); publish takes the precision it writes, unlock keeps the published one."""
    runs_models = {"main", "behaviour", "lock", "attack", "quantized", "capability", "heads curve", "heads ablation",
                   "merge", "directions", "attention"}
    for label, fn in _functions():
        params = inspect.signature(fn).parameters
        if label in runs_models:
            assert {"device", "dtype"} <= set(params), label
        if label in runs_models - {"main", "merge"}:
            assert "batch_size" in params or label.startswith("heads"), label
    assert "dtype" in inspect.signature(cli.command(cli.COMMANDS["publish"])).parameters
    parser = cli.build_parser()
    args = parser.parse_args(["lock", "--run", "r", "--device", "cpu", "--dtype", "bfloat16"])
    assert args.lock.device == "cpu" and args.lock.dtype == "bfloat16"
    with pytest.raises(SystemExit):
        parser.parse_args(["lock", "--run", "r", "--dtype", "float8"])


def test_lightning_lines_are_shown_once(monkeypatch):
    """Lightning prints its lines with a handler of its own: the commands' root handler must not print them again."""
    import logging

    monkeypatch.setattr(logging.getLogger("lightning"), "propagate", True)
    cli._setup_logging()
    seen = []

    class Seen(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    root, handler = logging.getLogger(), Seen()
    root.addHandler(handler)
    try:
        logging.getLogger("lightning.modular_test").warning("GPU available: False")
        logging.getLogger("modular.modular_test").warning("the lock holds")
    finally:
        root.removeHandler(handler)
    assert seen == ["the lock holds"]

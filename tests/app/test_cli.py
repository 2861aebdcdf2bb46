"""The ``modular`` command: one parser with a subcommand for everything a user runs, shared options declared once,
jsonargparse's own syntax (positional arguments, lists, YAML), input errors as one line."""

import inspect
import json
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from modular.app import cli
from modular.app.options import SHARED, output_folder, slug


def _functions():
    for name, fn in cli.COMMANDS.items():
        if isinstance(fn, dict):
            yield from ((f"{name} {sub}", f) for sub, f in fn.items())
        elif fn is not None:
            yield name, fn


def _strip_optional(t):
    args = [a for a in typing.get_args(t) if a is not type(None)]
    return args[0] if typing.get_origin(t) in (typing.Union, getattr(__import__("types"), "UnionType", None)) \
        and len(args) == 1 else t


def test_every_user_command_is_a_subcommand():
    assert set(cli.COMMANDS) == {"main", "train", "behaviour", "lock", "attack", "quantized", "capability", "publish",
                                 "unlock", "export-key", "heads", "merge", "directions", "attention", "inspect",
                                 "convert"}
    assert set(cli.COMMANDS["heads"]) == {"curve", "ablation"}


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
    assert fn is cli.COMMANDS["heads"]["curve"]
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
    import modular.runs  # what the command loads when it runs

    seen = []
    monkeypatch.setattr(modular.runs, "load_model_or_run", lambda m, **kw: seen.append(m) or (_ for _ in ()).throw(
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


@pytest.mark.parametrize("argv", [["--help"], ["lock", "--help"], ["heads", "ablation", "--help"],
                                  ["attack", "--help"], ["main", "--help"], ["capability", "--help"]])
def test_help_documents_every_option(argv, capsys):
    with pytest.raises(SystemExit) as err:
        cli.main(argv)
    assert err.value.code == 0
    text = capsys.readouterr().out
    if argv == ["--help"]:
        assert all(name in text for name in cli.COMMANDS)
        return
    fn = cli.COMMANDS[argv[0]]
    fn = fn[argv[1]] if isinstance(fn, dict) else fn
    for name in inspect.signature(fn).parameters:
        assert name in text, f"{argv}: {name} is not documented"


#: run in a fresh interpreter: each help of ``argv`` (a JSON list of argument lists) -> its output, and the model
#: libraries imported by then
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
print(json.dumps({"help": out, "loaded": [m for m in ("torch", "lightning", "transformers") if m in sys.modules]}))
"""


def test_help_loads_no_model_library():
    """``modular --help`` and the help of every subcommand but ``train`` (groups and their commands) import neither
    torch, lightning nor transformers: a command loads its modules when it runs, so that help is quick."""
    commands = dict(_functions())
    argvs = [["--help"], *([*label.split(), "--help"] for label in commands),
             *([name, "--help"] for name, fn in cli.COMMANDS.items() if isinstance(fn, dict))]
    res = subprocess.run([sys.executable, "-c", _HELP_SCRIPT, json.dumps(argvs)], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout.splitlines()[-1])
    assert got["loaded"] == [], f"help imported {got['loaded']}"
    helps = got["help"]
    assert all(name in helps["--help"] for name in cli.COMMANDS)
    for label, fn in commands.items():
        text = helps[f"{label} --help"]
        for name in inspect.signature(fn).parameters:
            assert name in text, f"{label} --help: {name} is not documented"
    for name, group in cli.COMMANDS.items():
        if isinstance(group, dict):
            assert all(sub in helps[f"{name} --help"] for sub in group)


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
    assert "dtype" in inspect.signature(cli.COMMANDS["publish"]).parameters
    parser = cli.build_parser()
    args = parser.parse_args(["lock", "--run", "r", "--device", "cpu", "--dtype", "bfloat16"])
    assert args.lock.device == "cpu" and args.lock.dtype == "bfloat16"
    with pytest.raises(SystemExit):
        parser.parse_args(["lock", "--run", "r", "--dtype", "float8"])

from modular.cli import expand_argv


def _cmd(curve: bool = False, models: list[str] = ("a",), tasks: list[str] | None = None, limit: int = 3,
         alphas: list[float] = (1.0,)):
    """A command with boolean, list and scalar options."""


COMMANDS = {"heads": _cmd}


def test_shell_style_flags_and_lists():
    argv = ["heads", "--curve", "--models", "base", "runs/sparse", "--tasks", "ioi", "ioi_long", "--limit", "4"]
    assert expand_argv(argv, COMMANDS) == [
        "heads", "--curve=true", "--models=[base, runs/sparse]", "--tasks=[ioi, ioi_long]", "--limit", "4"]


def test_jsonargparse_syntax_and_negative_numbers_pass_through():
    argv = ["heads", "--curve=false", "--models", "[a, b]", "--alphas", "-1", "-0.5", "--tasks=[ioi]"]
    assert expand_argv(argv, COMMANDS) == ["heads", "--curve=false", "--models", "[a, b]", "--alphas=[-1, -0.5]",
                                           "--tasks=[ioi]"]
    assert expand_argv(["other", "--curve"], COMMANDS) == ["other", "--curve"]

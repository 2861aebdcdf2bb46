"""The project's rule on function-local imports of modular: a module imports the package's modules at its top, and
imports one inside a function only where importing it at the top would form an import cycle; such an import says
which cycle in a comment on its line starting ``# cycle:``."""

from __future__ import annotations

import ast
from pathlib import Path

import modular

PACKAGE = Path(modular.__file__).parent
CYCLE_TAG = "# cycle:"
#: parts of the package not yet held to the rule (their local imports are being moved by other changes): folders
#: and files, relative to the repository root. Empty it as they are done.
EXCLUDED = ()


def _relative(path: Path) -> str:
    return path.relative_to(PACKAGE.parent).as_posix()


def _excluded(rel: str) -> bool:
    return any(rel == e or rel.startswith(e.rstrip("/") + "/") for e in EXCLUDED)


def _is_modular_import(node: ast.AST) -> bool:
    if isinstance(node, ast.ImportFrom):
        return node.level > 0 or (node.module or "").split(".")[0] == "modular"
    if isinstance(node, ast.Import):
        return any(a.name.split(".")[0] == "modular" for a in node.names)
    return False


def local_imports(path: Path) -> list[tuple[int, str, bool]]:
    """``(line, source, tagged)`` of each import of modular inside a function body of ``path`` (nested functions
    and methods included), in line order; ``tagged``: a ``# cycle:`` comment is on one of its lines."""
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    found: dict[int, tuple[int, str, bool]] = {}
    for fn in ast.walk(ast.parse(text, filename=str(path))):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if _is_modular_import(node) and id(node) not in found:
                span = lines[node.lineno - 1:(node.end_lineno or node.lineno)]
                found[id(node)] = (node.lineno, " ".join(s.strip() for s in span), any(CYCLE_TAG in s for s in span))
    return sorted(found.values())


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_function_local_imports_of_modular_name_their_cycle():
    """Outside :data:`EXCLUDED`, no function imports a module of modular without a ``# cycle:`` comment."""
    untagged = [f"{_relative(p)}:{line}: {src}" for p in _modules() if not _excluded(_relative(p))
                for line, src, tagged in local_imports(p) if not tagged]
    assert not untagged, ("function-local imports of modular without a '# cycle:' comment (move them to the "
                          "module's top, or say which cycle keeps them here):\n" + "\n".join(untagged))


def test_cycle_comments_say_which_cycle():
    """A ``# cycle:`` comment is not left empty."""
    empty = [f"{_relative(p)}:{line}: {src}" for p in _modules() for line, src, tagged in local_imports(p)
             if tagged and not src.split(CYCLE_TAG, 1)[1].strip()]
    assert not empty, "'# cycle:' comments that name no cycle:\n" + "\n".join(empty)


def test_excluded_paths_exist():
    """Every entry of :data:`EXCLUDED` names a folder or file of the package (a stale entry is removed)."""
    root = PACKAGE.parent
    assert all((root / e).exists() for e in EXCLUDED), [e for e in EXCLUDED if not (root / e).exists()]


def test_the_scan_finds_local_imports(tmp_path):
    """The scan sees absolute, relative and plain imports of modular in functions and methods, and their tags."""
    source = tmp_path / "sample.py"
    source.write_text(
        "import modular\n"
        "def f():\n"
        "    from modular.runs import read_run\n"
        "    from . import x  # cycle: sample -> x -> sample\n"
        "    import json\n"
        "class C:\n"
        "    def g(self):\n"
        "        import modular.data\n"
        "        def h():\n"
        "            from modular.data.schema import (\n"
        "                SPLITS,\n"
        "            )  # cycle: h's\n"
    )
    got = [(line, tagged) for line, _, tagged in local_imports(source)]
    assert got == [(3, False), (4, True), (8, False), (10, True)]

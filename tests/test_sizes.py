"""The package's size limits: no file in modular/ over 500 lines, no function over 100 lines, no constructor over 12
options (a class's own ``__init__``, or a dataclass's fields). Records that code fills, not options a caller sets
(a report's fields are its JSON's; a context's what a step or an attack shares), are named here with the reason."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "modular"
MAX_FILE_LINES, MAX_FUNCTION_LINES, MAX_OPTIONS = 500, 100, 12
#: records filled by code, not options: their fields are what they carry
RECORDS = {
    "LockReport": "the lock report: its fields are lock.json's",
    "AttackContext": "what the attacks on one behaviour share, filled by the attack command",
    "StepContext": "what one training step shares with its terms, filled by the module",
    "ArchSpec": "an architecture's module paths and conventions, one per supported model family",
}


@dataclass
class Found:
    where: str
    size: int


def _is_dataclass(node: ast.ClassDef) -> bool:
    def name(d):
        d = d.func if isinstance(d, ast.Call) else d
        return d.attr if isinstance(d, ast.Attribute) else getattr(d, "id", "")

    return any(name(d) == "dataclass" for d in node.decorator_list)


def _options(node: ast.ClassDef) -> int | None:
    """The options of a class's constructor: its own ``__init__``'s parameters (self, *args and **kwargs aside), or
    a dataclass's fields (annotated, not ClassVar); None: neither."""
    for item in node.body:
        if isinstance(item, ast.FunctionDef) and item.name == "__init__":
            a = item.args
            return len(a.posonlyargs) + len(a.args) - 1 + len(a.kwonlyargs)
    if _is_dataclass(node):
        return sum(1 for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
                   and "ClassVar" not in ast.unparse(s.annotation))
    return None


def _scan():
    files, functions, constructors = [], [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        rel = path.relative_to(PACKAGE.parent)
        files.append(Found(str(rel), len(text.splitlines())))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                functions.append(Found(f"{rel}:{node.lineno} {node.name}", node.end_lineno - node.lineno + 1))
            elif isinstance(node, ast.ClassDef) and node.name not in RECORDS:
                n = _options(node)
                if n is not None:
                    constructors.append(Found(f"{rel}:{node.lineno} {node.name}", n))
    return files, functions, constructors


FILES, FUNCTIONS, CONSTRUCTORS = _scan()


def test_no_file_is_over_500_lines():
    assert [f for f in FILES if f.size > MAX_FILE_LINES] == []


def test_no_function_is_over_100_lines():
    assert [f for f in FUNCTIONS if f.size > MAX_FUNCTION_LINES] == []


def test_no_constructor_takes_over_12_options():
    assert [c for c in CONSTRUCTORS if c.size > MAX_OPTIONS] == []


def test_the_scan_sees_the_constructors_it_limits():
    """The scan counts what it should: the gated module's and the data module's constructors, an option group's
    fields; and every record it leaves out still exists (a renamed one would hide a new constructor)."""
    sizes = {c.where.split(" ")[-1]: c.size for c in CONSTRUCTORS}
    assert sizes["GatedLM"] == 12 and sizes["GatingDataModule"] == 12 and sizes["ReferenceOptions"] == 4
    names = {node.name for path in PACKAGE.rglob("*.py") for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.ClassDef)}
    assert set(RECORDS) <= names

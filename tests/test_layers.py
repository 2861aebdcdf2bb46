"""Habits: the linter (ruff, rules in pyproject.toml) and the layer rules (import-linter contracts in
pyproject.toml) hold over the whole repository."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _tool(name: str) -> str:
    path = Path(sys.executable).parent / name
    found = str(path) if path.exists() else shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: run setup.sh (it installs the test extras)")
    return found


def test_ruff_finds_nothing():
    out = subprocess.run([_tool("ruff"), "check", "--output-format", "concise", "."], cwd=ROOT, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]


def test_layer_contracts_hold():
    out = subprocess.run([_tool("lint-imports"), "--no-cache"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout

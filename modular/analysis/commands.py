"""The ``evaluate.py`` subcommands of ``modular.analysis``."""

from __future__ import annotations

COMMANDS: dict = {}

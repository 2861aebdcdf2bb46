"""The ``evaluate.py`` subcommands of ``modular.heads``."""

from __future__ import annotations

COMMANDS: dict = {}

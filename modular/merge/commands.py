"""The ``evaluate.py`` subcommands of ``modular.merge``."""

from __future__ import annotations

COMMANDS: dict = {}

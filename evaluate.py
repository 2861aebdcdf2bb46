#!/usr/bin/env python
"""Evaluate models and checkpoints. ``python evaluate.py --help`` lists the subcommands;
``python evaluate.py <subcommand> --help`` documents every option."""

import sys

from modular.cli import run_cli
from modular.evaluation.commands import COMMANDS

if __name__ == "__main__":
    sys.exit(run_cli(COMMANDS, description="modular evaluation: behaviour accuracy, locks, heads, merges."))

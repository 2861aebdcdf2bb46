#!/usr/bin/env python
"""Evaluate models and checkpoints: ``python evaluate.py lock --run RUN`` is ``modular lock --run RUN``.

A thin shim over the ``modular`` command (:mod:`modular.app.cli`); ``python evaluate.py --help`` lists the
subcommands, ``python evaluate.py <subcommand> --help`` documents every option."""

import sys

from modular.app.cli import main

if __name__ == "__main__":
    sys.exit(main())

"""The application: every command a user runs (``modular`` and its subcommands; ``train.py`` and ``evaluate.py``
are shims over it). Commands parse, load, call the library, write and log; the library packages compute and
return, print nothing and never import this package (import-linter contracts in pyproject.toml)."""

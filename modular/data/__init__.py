"""Behaviour data: built-in generators, user JSONL, formatting and the DataModule.

The names below are loaded on first use (PEP 562): importing this package loads none of its modules, and the
registry's names (:data:`~modular.data.behaviours.BEHAVIOURS`) are read without loading ``datasets``."""

from typing import TYPE_CHECKING

from modular.lazy import lazy_exports

if TYPE_CHECKING:
    from modular.data.behaviours import (
        BEHAVIOURS,
        behaviour_name,
        load_behaviour,
        neutral_text,
        parse_behaviour,
        retain_data,
    )
    from modular.data.jsonl import load_jsonl

__all__ = ["BEHAVIOURS", "behaviour_name", "load_behaviour", "load_jsonl", "neutral_text", "parse_behaviour",
           "retain_data"]
#: each name of ``__all__`` -> the module that defines it
_SOURCES = {"load_jsonl": "jsonl", **{name: "behaviours" for name in __all__ if name != "load_jsonl"}}

__getattr__, __dir__ = lazy_exports(__name__, globals(), _SOURCES)

"""Behaviour data: built-in generators, user JSONL, formatting and the DataModule.

The names below are loaded on first use (PEP 562): importing this package loads none of its modules, and the
registry's names (:data:`~modular.data.behaviours.BEHAVIOURS`) are read without loading ``datasets``."""

from importlib import import_module
from typing import TYPE_CHECKING

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


def __getattr__(name: str):
    if name not in _SOURCES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{_SOURCES[name]}"), name)
    globals()[name] = value  # once loaded, an ordinary attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})

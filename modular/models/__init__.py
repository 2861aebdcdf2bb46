"""Model loading and the architecture adapter (the only code that knows HF module paths).

The names below are loaded on first use (PEP 562): importing a light submodule (:mod:`modular.models.names`) or this
package loads no torch or transformers."""

from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from modular.models.adapter import SUPPORTED_ARCHITECTURES, ArchitectureAdapter
    from modular.models.loading import ALIASES, empty_model, load_model, load_tokenizer, resolve_model

__all__ = [
    "ALIASES",
    "ArchitectureAdapter",
    "SUPPORTED_ARCHITECTURES",
    "empty_model",
    "load_model",
    "load_tokenizer",
    "resolve_model",
]
#: each name of ``__all__`` -> the module that defines it
_SOURCES = {"SUPPORTED_ARCHITECTURES": "adapter", "ArchitectureAdapter": "adapter", "ALIASES": "loading",
            "empty_model": "loading", "load_model": "loading", "load_tokenizer": "loading", "resolve_model": "loading"}


def __getattr__(name: str):
    if name not in _SOURCES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{_SOURCES[name]}"), name)
    globals()[name] = value  # once loaded, an ordinary attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})

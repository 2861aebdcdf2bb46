"""Model loading (aliases, resolving references, the cache, loading) and the architecture adapter (the only code that
knows HF module paths).

The names below are loaded on first use (PEP 562): importing a light submodule (:mod:`modular.models.names`) or this
package loads no torch or transformers."""

from typing import TYPE_CHECKING

from modular.lazy import lazy_exports

if TYPE_CHECKING:
    from modular.models.adapter import SUPPORTED_ARCHITECTURES, ArchitectureAdapter
    from modular.models.aliases import ALIASES
    from modular.models.loading import empty_model, load_model, load_tokenizer
    from modular.models.resolve import resolve_model

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
_SOURCES = {"SUPPORTED_ARCHITECTURES": "adapter", "ArchitectureAdapter": "adapter", "ALIASES": "aliases",
            "empty_model": "loading", "load_model": "loading", "load_tokenizer": "loading", "resolve_model": "resolve"}

__getattr__, __dir__ = lazy_exports(__name__, globals(), _SOURCES)

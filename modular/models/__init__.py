"""Model loading and the architecture adapter (the only code that knows HF module paths)."""

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

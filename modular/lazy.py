"""Package names loaded on first use (PEP 562): a package ``__init__`` that re-exports its modules' names without
importing them, so that importing a light module of the package (or the package) loads nothing heavy."""

from __future__ import annotations

from importlib import import_module
from typing import Callable


def lazy_exports(package: str, namespace: dict, sources: dict[str, str]) -> tuple[Callable, Callable]:
    """``__getattr__`` and ``__dir__`` for ``package``: each name of ``sources`` is read from its submodule
    (``sources[name]``) on first use and kept in ``namespace`` (the package's globals) from then on."""

    def __getattr__(name: str):
        if name not in sources:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(import_module(f"{package}.{sources[name]}"), name)
        namespace[name] = value  # once loaded, an ordinary attribute
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *sources})

    return __getattr__, __dir__

"""Objects a config or a command line names by class: a built-in short name, a class path (``mymodule.MyClass``), a
``class_path`` / ``init_args`` mapping (a parsed config's Namespace or a dict), or the object itself. The loss's terms
(``model.objectives``) and the attacks (``modular attack --attacks``) are built this way."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from modular import ModularError


def build_from_specs(specs, base: type, option: str, unknown: Callable[[str], str],
                     builtin: dict[str, type] | None = None) -> list:
    """An instance of ``base`` for each of ``specs``: a name that is no class, a class that is no ``base`` or options
    its class does not take are one line (:class:`~modular.ModularError`) naming ``option``; ``unknown(path)`` says
    what a name that is no class should be."""
    built = []
    for spec in specs or []:
        if hasattr(spec, "as_dict"):  # a parsed config's Namespace
            spec = spec.as_dict()
        if isinstance(spec, base):
            built.append(spec)
            continue
        path = str(spec.get("class_path", "") if isinstance(spec, dict) else spec)
        args = (spec.get("init_args") if isinstance(spec, dict) else None) or {}
        cls = (builtin or {}).get(path)
        if cls is None:
            module, _, name = path.rpartition(".")
            try:
                cls = getattr(importlib.import_module(module), name)
            except (ImportError, AttributeError, ValueError):
                raise ModularError(f"{option}: {unknown(path)}") from None
        if not (isinstance(cls, type) and issubclass(cls, base)):
            raise ModularError(f"{option}: {path} is not a {base.__module__}.{base.__qualname__}")
        try:
            built.append(cls(**args))
        except TypeError as err:
            raise ModularError(f"{option}: {path}: {err}") from None
    return built

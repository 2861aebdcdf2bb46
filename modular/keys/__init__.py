"""Locking in the weights, and keys that unlock.

``lock_weights`` bakes the lock into the weights: every residual writer is orthogonalised against the write-space of
each behaviour's direction (with ``harden=True`` the residual readers behind a weight-only norm stop reading it too).
Every removed component is rank-1 per module and behaviour, ``W ← W − a bᵀ``; a key is the list of ``(module, a,
b)`` for one behaviour, and applying it adds ``a bᵀ`` back, restoring the trained weights exactly (or within a
tolerance chosen when locking), alone or after other behaviours' keys, in any order.

The package, one concern a module (every name below is importable from ``modular.keys``):

* :mod:`~modular.keys.key`: :class:`Key` and :class:`Component`, and the rank-1 update of one component;
* :mod:`~modular.keys.lock`: :func:`lock_weights`, :func:`apply_key`, :func:`weights_hash`, :func:`produced_hashes`;
* :mod:`~modular.keys.exact`: the rounding corrections that make a key exact (:func:`restore_misses`);
* :mod:`~modular.keys.grid`: the float grids those corrections count in (:func:`ulp`, :func:`grid_steps`) and the
  residual streams of 16-bit keys;
* :mod:`~modular.keys.keyfile`: the key file (:func:`save_key`, :func:`load_key`);
* :mod:`~modular.keys.formats`: its formats and name, and :func:`is_key_file` (no torch).

The names are loaded on first use (PEP 562), so that importing ``is_key_file`` or ``KEY_SUFFIX`` loads no torch.
"""

from typing import TYPE_CHECKING

from modular.lazy import lazy_exports

if TYPE_CHECKING:
    from modular.keys.exact import MAX_PREFIX_BEHAVIOURS, restore_misses
    from modular.keys.formats import (
        ADDING_FORMATS,
        KEY_ADAPTER_FORMAT,
        KEY_FORMAT,
        KEY_SUFFIX,
        READABLE_FORMATS,
        is_key_file,
    )
    from modular.keys.grid import GRID_DTYPES, MANTISSA_BITS, grid_steps, ulp
    from modular.keys.key import Component, Key
    from modular.keys.keyfile import MAX_GAP, load_key, save_key
    from modular.keys.lock import apply_key, lock_weights, produced_hashes, untie_embeddings, weights_hash

__all__ = [
    "ADDING_FORMATS",
    "GRID_DTYPES",
    "KEY_ADAPTER_FORMAT",
    "KEY_FORMAT",
    "KEY_SUFFIX",
    "MANTISSA_BITS",
    "MAX_GAP",
    "MAX_PREFIX_BEHAVIOURS",
    "READABLE_FORMATS",
    "Component",
    "Key",
    "apply_key",
    "grid_steps",
    "is_key_file",
    "load_key",
    "lock_weights",
    "produced_hashes",
    "restore_misses",
    "save_key",
    "ulp",
    "untie_embeddings",
    "weights_hash",
]
#: each name of ``__all__`` -> the module that defines it
_SOURCES = {
    "ADDING_FORMATS": "formats",
    "GRID_DTYPES": "grid",
    "KEY_ADAPTER_FORMAT": "formats",
    "KEY_FORMAT": "formats",
    "KEY_SUFFIX": "formats",
    "MANTISSA_BITS": "grid",
    "MAX_GAP": "keyfile",
    "MAX_PREFIX_BEHAVIOURS": "exact",
    "READABLE_FORMATS": "formats",
    "Component": "key",
    "Key": "key",
    "apply_key": "lock",
    "grid_steps": "grid",
    "is_key_file": "formats",
    "load_key": "keyfile",
    "lock_weights": "lock",
    "produced_hashes": "lock",
    "restore_misses": "exact",
    "save_key": "keyfile",
    "ulp": "grid",
    "untie_embeddings": "lock",
    "weights_hash": "lock",
}

__getattr__, __dir__ = lazy_exports(__name__, globals(), _SOURCES)

"""Regional compilation: each transformer block's ``forward`` under ``torch.compile``, one compiled function per
block class, shared by every block of that class (their weights are the compiled code's inputs, not constants).

Only the blocks' own ``forward`` is compiled, not the module call around it: the hooks a step enters on a block
(steering vectors on its output) run eagerly around the compiled code. Hooks on modules inside a block (the lock's
projections on every residual write) run untraced while any model is compiled (``torch.compiler.disable``; their
state is new every step, and traced it would be guarded and recompile each step): the block's graph breaks at each
such write, and the parts between them are compiled. Shapes are dynamic from the start (batch sizes and lengths
change from pass to pass); each distinct call signature of a block (with or without a padding mask, say) compiles
once.
"""

from __future__ import annotations

import types
import weakref

import torch

from modular import ModularError
from modular.models.adapter import ArchitectureAdapter

#: the backends a run may name (``inductor``: compiled kernels; ``aot_eager``: traced through autograd, run eagerly,
#: for checking a trace without a compiler; ``eager``: traced only)
BACKENDS = ("inductor", "aot_eager", "eager")
#: the models with compiled blocks in this process (hooks registered while there are any run untraced)
_COMPILED: weakref.WeakSet = weakref.WeakSet()


def any_compiled() -> bool:
    """Whether any model of this process has compiled blocks (:func:`compile_blocks`)."""
    return len(_COMPILED) > 0


def check_backend(backend: str | None) -> None:
    if backend is not None and backend not in BACKENDS:
        raise ModularError(f"compile backend must be one of {', '.join(BACKENDS)} or null, got '{backend}'")


def compile_blocks(adapter: ArchitectureAdapter, backend: str = "inductor") -> int:
    """Replace each block's ``forward`` of ``adapter``'s model by its class's compiled ``forward`` (compiled on first
    call). Returns the number of blocks. Idempotent."""
    check_backend(backend)
    compiled: dict[type, object] = {}
    blocks = adapter.blocks()
    for block in blocks:
        if getattr(block, "_modular_compiled", None) == backend:
            continue
        cls = type(block)
        if cls not in compiled:
            compiled[cls] = torch.compile(cls.forward, backend=backend, dynamic=True)
        block.forward = types.MethodType(compiled[cls], block)
        block._modular_compiled = backend
    _COMPILED.add(adapter.model)
    return len(blocks)


def uncompile_blocks(adapter: ArchitectureAdapter) -> None:
    """Undo :func:`compile_blocks`: each block's class ``forward`` again."""
    for block in adapter.blocks():
        if getattr(block, "_modular_compiled", None) is not None:
            del block.forward
            del block._modular_compiled
    _COMPILED.discard(adapter.model)

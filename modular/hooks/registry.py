"""Registering hooks for the length of a ``with`` block, and replaying the interventions among them in the blocks
that gradient checkpointing recomputes; the helpers that read and replace a module's output.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Callable, Iterable, Iterator

import torch
from torch import nn

from modular.models.compiled import any_compiled

#: the intervention hooks registered now (through :func:`registered`), in order: what a recomputed block must see
_ACTIVE: list[tuple[nn.Module, str, Callable]] = []


def _register(hooks: Iterable[tuple[nn.Module, str, Callable]]) -> list:
    handles = []
    for module, kind, fn in hooks:
        if any_compiled():  # run as Python, never traced: in a compiled block the hook's own state (its bases,
            fn = torch.compiler.disable(fn)  # masks and caches, new every step) would be guarded and recompile
        if kind == "forward":
            handles.append(module.register_forward_hook(fn))
        elif kind == "pre":
            handles.append(module.register_forward_pre_hook(fn))
        elif kind == "pre_kwargs":
            handles.append(module.register_forward_pre_hook(fn, with_kwargs=True))
        else:  # pragma: no cover - programming error
            for handle in handles:
                handle.remove()
            raise ValueError(kind)
    return handles


@contextmanager
def registered(hooks: Iterable[tuple[nn.Module, str, Callable]], replay: bool = True) -> Iterator[None]:
    """Register ``(module, kind, fn)`` hooks (kind: ``forward``, ``pre``, ``pre_kwargs``); always remove them.

    ``replay``: an intervention (the hooks change what the model computes): under gradient checkpointing a block
    recomputed during the backward pass runs with it again (:func:`replay_interventions`). Hooks that only
    capture activations are not replayed."""
    hooks = list(hooks)
    entries = hooks if replay else []
    handles = []
    try:
        handles = _register(hooks)
        _ACTIVE.extend(entries)
        yield
    finally:
        for handle in handles:
            handle.remove()
        for entry in entries:
            for i in range(len(_ACTIVE) - 1, -1, -1):  # the latest registration of this entry
                if _ACTIVE[i] is entry:
                    del _ACTIVE[i]
                    break


def replay_interventions():
    """``context_fn`` for non-reentrant :func:`torch.utils.checkpoint.checkpoint`: a block recomputed in the backward
    pass runs under the interventions that were active when it ran forward (the ``with`` blocks that registered
    them have usually exited by then), so an ablated, steered or gated forward pass gets its own gradients."""
    snapshot = list(_ACTIVE)

    @contextmanager
    def recompute():
        missing = [h for h in snapshot if not any(h is a for a in _ACTIVE)]
        handles = _register(missing)
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    return nullcontext(), recompute()


def enable_checkpointing(model, context_fn=replay_interventions) -> None:
    """Gradient (activation) checkpointing of every block of a transformers model, non-reentrant, with the
    interventions replayed in the recomputed blocks (``context_fn``; None: plain checkpointing)."""
    kwargs = {"use_reentrant": False, **({"context_fn": context_fn} if context_fn is not None else {})}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5 (the older name is deprecated there)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _hidden(output):
    return output[0] if isinstance(output, tuple) else output


def _replace_hidden(output, new):
    return (new, *output[1:]) if isinstance(output, tuple) else new


def _block_input(args, kwargs) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]

"""The residual stream: capturing it between blocks (:func:`capture_residual`) and as each write enters it
(:func:`capture_writes`), and adding steering vectors to it (:func:`add_vectors`).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Mapping

import torch

from modular.hooks.registry import _block_input, _hidden, _replace_hidden, registered
from modular.models.adapter import ArchitectureAdapter


@contextmanager
def capture_residual(adapter: ArchitectureAdapter, detach: bool = True) -> Iterator[list[torch.Tensor]]:
    """Capture the residual stream: ``states[i]`` enters block ``i``; ``states[n_layers]`` leaves the last.

    The list is filled during the forward pass inside the block (one entry per
    position 0..n_layers; a second forward pass overwrites it).
    """
    n = adapter.n_layers
    states: list[torch.Tensor] = [None] * (n + 1)  # type: ignore[list-item]

    def pre(i):
        def fn(module, args, kwargs):
            x = _block_input(args, kwargs)
            states[i] = x.detach() if detach else x

        return fn

    def post(module, args, output):
        x = _hidden(output)
        states[n] = x.detach() if detach else x

    hooks = [(adapter.block(i), "pre_kwargs", pre(i)) for i in range(n)]
    hooks.append((adapter.block(n - 1), "forward", post))
    with registered(hooks, replay=False):
        yield states


@contextmanager
def capture_writes(adapter: ArchitectureAdapter) -> Iterator[dict[str, torch.Tensor]]:
    """Capture every residual write as it enters the residual stream (after any post-sublayer norm)."""
    store: dict[str, torch.Tensor] = {}
    hooks = []
    for site in adapter.write_sites():
        module = site.post_norm if site.post_norm is not None else site.module

        def fn(m, args, output, name=site.name):
            store[name] = _hidden(output).detach()

        hooks.append((module, "forward", fn))
    with registered(hooks, replay=False):
        yield store


@contextmanager
def add_vectors(adapter: ArchitectureAdapter, vectors: Mapping[int, torch.Tensor]) -> Iterator[None]:
    """Add ``vectors[i]`` to the residual stream leaving block ``i`` at all positions.

    A vector of shape (d,) is added to every sequence; one of shape (batch, d) adds row ``r`` to
    sequence ``r`` only (zero rows leave their sequences untouched), so differently steered
    sequences can share one forward pass.
    """

    def make(vec):
        def fn(module, args, output):
            x = _hidden(output)
            v = vec.to(dtype=x.dtype, device=x.device)
            return _replace_hidden(output, x + (v[:, None] if v.dim() == 2 else v))

        return fn

    with registered([(adapter.block(i), "forward", make(v)) for i, v in vectors.items()]):
        yield

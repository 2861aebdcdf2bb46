"""Acting on chosen attention heads at the input of the attention output projection (before the heads are mixed):
scaling, zeroing and replacing them, one head per group of the batch, and capturing every head's input.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterable, Iterator, Mapping, Sequence

import torch

from modular.hooks.registry import registered
from modular.models.adapter import ArchitectureAdapter

Head = tuple[int, int]  # (layer, head)


def split_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """``(..., n_heads*head_dim)`` -> ``(..., n_heads, head_dim)``."""
    return x.reshape(*x.shape[:-1], n_heads, x.shape[-1] // n_heads)


def _head_pre_hook(adapter: ArchitectureAdapter, edit: Callable[[torch.Tensor], torch.Tensor]):
    n_heads = adapter.n_heads

    def fn(module, args):
        x = args[0]
        z = edit(split_heads(x, n_heads))
        return (z.reshape(x.shape), *args[1:])

    return fn


@contextmanager
def scale_heads(adapter: ArchitectureAdapter, scales: Mapping[int, torch.Tensor]) -> Iterator[None]:
    """Multiply head ``h`` of layer ``l`` by ``scales[l][h]`` at the attention output projection's input."""
    hooks = []
    for layer, s in scales.items():
        def edit(z, s=s):
            return z * s.to(dtype=z.dtype, device=z.device)[:, None]

        hooks.append((adapter.attn_out(layer), "pre", _head_pre_hook(adapter, edit)))
    with registered(hooks):
        yield


def heads_by_layer(heads: Iterable[Head]) -> dict[int, list[int]]:
    """``{layer: [head, ...]}`` of ``(layer, head)`` pairs, in the order given."""
    out: dict[int, list[int]] = {}
    for layer, head in heads:
        out.setdefault(int(layer), []).append(int(head))
    return out


@contextmanager
def zero_heads(adapter: ArchitectureAdapter, heads: Iterable[Head]) -> Iterator[None]:
    """Zero-ablate the listed ``(layer, head)`` pairs."""
    scales = {}
    for layer, hs in heads_by_layer(heads).items():
        s = torch.ones(adapter.n_heads)
        s[hs] = 0.0
        scales[layer] = s
    with scale_heads(adapter, scales):
        yield


@contextmanager
def replace_heads(
    adapter: ArchitectureAdapter, heads: Iterable[Head], values: Mapping[int, torch.Tensor]
) -> Iterator[None]:
    """Replace the listed heads' inputs by ``values[layer]``.

    ``values[layer]`` broadcasts to ``(batch, seq, n_heads, head_dim)``: a mean
    activation ``(n_heads, head_dim)`` gives mean ablation; activations captured on
    counterfactual prompts (same shape as the batch) give counterfactual patching.
    """
    hooks = []
    for layer, hs in heads_by_layer(heads).items():
        idx = torch.tensor(hs)

        def edit(z, idx=idx, v=values[layer]):
            z = z.clone()
            v = v.to(dtype=z.dtype, device=z.device).expand_as(z)
            z[..., idx, :] = v[..., idx, :]
            return z

        hooks.append((adapter.attn_out(layer), "pre", _head_pre_hook(adapter, edit)))
    with registered(hooks):
        yield


@contextmanager
def replace_head_per_group(adapter: ArchitectureAdapter, layer: int, heads: Sequence[int], values: torch.Tensor,
                           ) -> Iterator[None]:
    """One head per group of the batch: the batch is ``len(heads)`` equal groups of rows (the same prompts
    repeated, :func:`repeat_batch`), and in group ``j`` head ``heads[j]`` of ``layer`` is replaced by ``values``
    (broadcastable to one group's ``(rows, seq, n_heads, head_dim)``). One forward pass patches several heads
    alone, each in its own copy of the prompts: the same numbers as a :func:`replace_heads` pass per head."""
    heads = [int(h) for h in heads]

    def edit(z):
        groups = z.clone().view(len(heads), z.shape[0] // len(heads), *z.shape[1:])
        v = values.to(dtype=z.dtype, device=z.device).expand_as(groups[0])
        for j, head in enumerate(heads):
            groups[j, ..., head, :] = v[..., head, :]
        return groups.view(z.shape)

    with registered([(adapter.attn_out(layer), "pre", _head_pre_hook(adapter, edit))]):
        yield


@contextmanager
def capture_head_inputs(adapter: ArchitectureAdapter, detach: bool = True) -> Iterator[dict[int, torch.Tensor]]:
    """Capture every layer's attention output projection input as ``(batch, seq, n_heads, head_dim)``.
    ``detach=False``: the captured tensors are the ones the projection then reads, so gradients can be taken
    with respect to them (``torch.autograd.grad``)."""
    store: dict[int, torch.Tensor] = {}

    def make(layer):
        def fn(module, args):
            z = split_heads(args[0], adapter.n_heads)
            if detach:
                store[layer] = z.detach()
                return None
            store[layer] = z
            return (z.flatten(-2), *args[1:])

        return fn

    with registered([(adapter.attn_out(i), "pre", make(i)) for i in range(adapter.n_layers)], replay=False):
        yield store

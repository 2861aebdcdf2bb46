"""Activation communication (Ramesh & Li, 2025) between two language models A and B.

A reads the prompt (with its own tokenizer and chat template) up to layer ``k``;
B reads the same prompt (with *its* tokenizer and template) up to layer ``j``.
B's last-token residual activation entering block ``j`` is replaced by
``f(W a, b)`` and B finishes the answer (greedy). Only the prompt's last token is
changed, and only on the first forward pass (the one that reads the prompt); the
tokens B generates afterwards see the changed activation through the KV cache.

``f`` is one of

* ``replace``: ``W a``;
* ``sum``: ``W a + b``;
* ``mean``: ``(W a + b) / 2``.

``W`` maps A's width to B's. For two models of the same width it may be the
identity; otherwise (or on request) it is an affine map fitted by least squares
on paired activations of A and B on neutral text (see :mod:`modular.merge.alignment`).

"Layer ``i``" is the residual stream *entering* block ``i`` (``capture_residual``'s
``states[i]``); :func:`layer_at_depth` turns a relative depth into such an index.
Module paths come from the :class:`~modular.models.adapter.ArchitectureAdapter`.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from modular import ModularError
from modular.data.formatting import prompt_batches, prompt_limit
from modular.evaluation.behaviour import generate
from modular.hooks import registered
from modular.models.adapter import ArchitectureAdapter

FUNCTIONS = ("replace", "sum", "mean")


def layer_at_depth(n_layers: int, depth: float) -> int:
    """The block index at relative depth ``depth`` in [0, 1] (rounded, clipped to ``0..n_layers-1``)."""
    depth = float(depth)
    if not 0.0 <= depth <= 1.0:
        raise ModularError(f"depth must be in [0, 1], got {depth}")
    return min(n_layers - 1, max(0, round(depth * n_layers)))


def combine(f: str, mapped: Tensor, own: Tensor) -> Tensor:
    """``f(mapped, own)`` for f in replace / sum / mean (``mapped`` is A's activation in B's space)."""
    if f == "replace":
        return mapped
    if f == "sum":
        return mapped + own
    if f == "mean":
        return (mapped + own) / 2
    raise ModularError(f"unknown communication function '{f}': use one of {', '.join(FUNCTIONS)}")


def _block_input(args, kwargs) -> Tensor:
    return args[0] if args else kwargs["hidden_states"]


def _with_block_input(args, kwargs, new: Tensor):
    if args:
        return (new, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": new}


class _Stop(Exception):
    """Raised by a capture hook to end a forward pass once the wanted layer is reached."""


@contextmanager
def capture_block_input(adapter: ArchitectureAdapter, layer: int, stop: bool = True) -> Iterator[dict]:
    """Capture the residual stream entering block ``layer`` as ``store["x"]`` ``(batch, seq, d)``.

    With ``stop=True`` the forward pass ends there (the caller must call the model
    through :func:`run_to_layer`, which swallows the stop signal); later blocks never run.
    """
    store: dict[str, Tensor] = {}

    def fn(module, args, kwargs):
        store["x"] = _block_input(args, kwargs).detach()
        if stop:
            raise _Stop

    with registered([(adapter.block(layer), "pre_kwargs", fn)]):
        yield store


@torch.no_grad()
def run_to_layer(model, adapter: ArchitectureAdapter, layer: int, **inputs) -> Tensor:
    """Residual stream entering block ``layer`` for ``inputs`` ``(batch, seq, d)``; later blocks are skipped."""
    with capture_block_input(adapter, layer, stop=True) as store:
        try:
            model(**inputs, use_cache=False)
        except _Stop:
            pass
    if "x" not in store:  # pragma: no cover - the block always runs
        raise RuntimeError(f"block {layer} was not reached")
    return store["x"]


@torch.no_grad()
def last_token_states(model, tokenizer, prompts: list[str], chats: list[bool], layer: int,
                      batch_size: int = 16) -> Tensor:
    """Last-token residual activations entering block ``layer``, one row per prompt ``(n, d)`` (float32, CPU).

    Each prompt is rendered with this model's own tokenizer and chat template;
    batches are left-padded, so the last position is every prompt's last token; a prompt longer than the model's
    positions keeps its end.
    """
    adapter = ArchitectureAdapter(model)
    device = next(model.parameters()).device
    rows = []
    for batch in prompt_batches(tokenizer, prompts, chats, batch_size, prompt_limit(model)):
        batch = {k: v.to(device) for k, v in batch.items()}
        rows.append(run_to_layer(model, adapter, layer, **batch)[:, -1].float().cpu())
    return torch.cat(rows) if rows else torch.zeros(0, adapter.d_model)


@contextmanager
def inject_last_token(adapter: ArchitectureAdapter, layer: int, vectors: Tensor, f: str = "replace",
                      first_forward_only: bool = True) -> Iterator[dict]:
    """Set the last-position residual entering block ``layer`` to ``f(vectors, current)``.

    ``vectors`` is ``(batch, d)`` (one row per prompt) or ``(d,)``. With
    ``first_forward_only`` (the default) only the first forward pass inside the
    block is changed: during ``generate`` that is the pass reading the prompt.
    The yielded dict counts the passes changed (``calls``) and keeps the last
    activation before the change (``own``) and after it (``new``).
    """
    if f not in FUNCTIONS:
        raise ModularError(f"unknown communication function '{f}': use one of {', '.join(FUNCTIONS)}")
    state: dict = {"calls": 0}

    def fn(module, args, kwargs):
        if first_forward_only and state["calls"]:
            return None
        x = _block_input(args, kwargs)
        v = vectors.to(dtype=x.dtype, device=x.device)
        if v.ndim == 2 and v.shape[0] != x.shape[0]:
            raise ValueError(f"got {v.shape[0]} vectors for a batch of {x.shape[0]}")
        new = x.clone()
        own = x[:, -1]
        new[:, -1] = combine(f, v, own)
        state["calls"] += 1
        state["own"], state["new"] = own.detach().clone(), new[:, -1].detach().clone()
        return _with_block_input(args, kwargs, new)

    with registered([(adapter.block(layer), "pre_kwargs", fn)]):
        yield state


@torch.no_grad()
def communicate(model_a, tok_a, model_b, tok_b, prompts: list[str], chats: list[bool], layer_a: int, layer_b: int,
                f: str = "replace", mapping: nn.Module | None = None, max_new_tokens: int = 24,
                batch_size: int = 16, desc: str | None = None) -> list[str]:
    """Greedy responses of B to ``prompts`` with A's last-token activation communicated at (``layer_a``, ``layer_b``).

    Args:
        model_a, tok_a: the sender and its tokenizer.
        model_b, tok_b: the receiver (it writes the answer) and its tokenizer.
        prompts, chats: the items; each model renders them with its own template.
        layer_a, layer_b: block indices (residual entering the block) of A and B.
        f: replace | sum | mean.
        mapping: module mapping A's activation (d_A) into B's space (d_B); None = identity
            (the widths must then match).
        max_new_tokens: response length.
        batch_size: prompts per batch (A's activations are computed per batch).
        desc: progress-bar label (False hides it).
    """
    adapter_b = ArchitectureAdapter(model_b)
    d_a, d_b = ArchitectureAdapter(model_a).d_model, adapter_b.d_model
    if mapping is None and d_a != d_b:
        raise ModularError(f"A has width {d_a} and B {d_b}: a fitted map is needed between different widths")
    out: list[str] = []
    steps = range(0, len(prompts), batch_size)
    for start in tqdm(steps, desc=desc or "communicate", leave=False, disable=desc is False):
        p, c = prompts[start:start + batch_size], chats[start:start + batch_size]
        a = last_token_states(model_a, tok_a, p, c, layer_a, batch_size=len(p))
        if mapping is not None:
            a = mapping(a.to(next(mapping.parameters()).dtype)).float()
        with inject_last_token(adapter_b, layer_b, a, f):
            out += generate(model_b, tok_b, p, c, max_new_tokens, batch_size=len(p), desc=False)
    return out

"""Switching a loaded model's attention implementation for the duration of a ``with`` block.

The eager implementation is the one that returns attention weights and whose backward pass can
itself be differentiated (fused SDPA kernels have no second derivative).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator


@contextmanager
def eager_attention(model) -> Iterator[None]:
    """Run ``model`` with eager attention, then restore its implementation."""
    previous = getattr(model.config, "_attn_implementation", None)
    if previous != "eager":
        model.set_attn_implementation("eager")
    try:
        yield
    finally:
        if previous not in (None, "eager"):
            model.set_attn_implementation(previous)

"""Recording every block's output on a clean pass, and replaying it instead of recomputing the blocks before a
patched head (exhaustive head patching, :mod:`modular.heads`).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from modular.hooks.registry import registered
from modular.models.adapter import ArchitectureAdapter


@contextmanager
def capture_block_outputs(adapter: ArchitectureAdapter) -> Iterator[list]:
    """Record every block's raw output (whatever the block returns) in a list indexed by layer."""
    outputs: list = [None] * adapter.n_layers

    def record(i):
        def fn(module, args, output):
            outputs[i] = output

        return fn

    with registered([(adapter.block(i), "forward", record(i)) for i in range(adapter.n_layers)], replay=False):
        yield outputs


def repeat_batch(output, times: int):
    """``output`` (a tensor, or a tuple whose tensors lead with the batch dimension) with its batch repeated
    ``times`` times end to end (``torch.cat([x] * times)``); ``times = 1`` returns it as it is."""
    if times == 1:
        return output
    if isinstance(output, tuple):
        return tuple(repeat_batch(o, times) if torch.is_tensor(o) else o for o in output)
    return output.repeat(times, *([1] * (output.dim() - 1)))


@contextmanager
def reuse_block_outputs(adapter: ArchitectureAdapter, outputs: list, upto: int, repeat: int = 1):
    """Blocks ``0..upto-1`` return their recorded ``outputs`` instead of computing them.

    Patching a head of layer l cannot change what the blocks before l compute, so exhaustive
    patching replays them from the clean pass (about half the work on average). The blocks'
    ``forward`` is overridden on the instance and always restored. ``repeat``: the batch that runs
    is the recorded one repeated ``repeat`` times (:func:`repeat_batch`; one group per patched head,
    :func:`replace_head_per_group`).
    """
    saved = []
    try:
        for i in range(upto):
            block = adapter.block(i)
            saved.append((block, block.__dict__.get("forward")))
            block.forward = lambda *args, _out=outputs[i], **kwargs: repeat_batch(_out, repeat)
        yield
    finally:
        for block, previous in saved:
            if previous is None:
                del block.forward
            else:
                block.forward = previous

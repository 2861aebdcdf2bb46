"""The global random state of a training process, as a resumed run takes it back.

A run resumed from a checkpoint restarts its processes, and with them torch's, numpy's and Python's global
generators at their seeded start; the draws made after the checkpoint (the next pass's order of a training loader,
anything an objective draws from them) would then differ from those of the same run uninterrupted. The states are
kept as tensors, integers and tuples only, so that a checkpoint loads with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import random

import numpy as np
import torch


def global_random_state() -> dict:
    """This process's global random state: torch's (CPU, and the current GPU where one is in use), numpy's,
    Python's."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached))}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_global_random_state(state: dict) -> None:
    """Take back a state of :func:`global_random_state` (the GPU's where this process uses one)."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.set_rng_state(state["cuda"])

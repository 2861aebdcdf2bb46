"""Weight merging of checkpoints fine-tuned from the same base model.

All functions take state dicts (``dict[str, Tensor]``) with identical keys and
shapes and return a new state dict; the inputs are left untouched.

* :func:`average` — (weighted) mean of the states.
* :func:`task_arithmetic` — ``base + scale · Σ (state − base)``.
* :func:`ties` — TIES-merging (Yadav et al., 2023): trim each task vector
  ``state − base`` to its largest-magnitude entries, elect a sign per entry from
  the sum of the trimmed vectors, and average only the entries that agree with
  the elected sign (disjoint mean).

Floating-point tensors are combined in at least float32 and cast back to the
dtype of the reference state (the first state for :func:`average`, ``base``
otherwise); non-floating tensors (integer buffers, masks) are copied from that
reference unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

StateDict = Mapping[str, Tensor]


def _check_keys(reference: StateDict, others: Sequence[StateDict], ref_name: str) -> None:
    """Raise ``ValueError`` naming the first key or shape that differs from ``reference``."""
    ref_keys = list(reference.keys())
    ref_set = set(ref_keys)
    for i, other in enumerate(others):
        missing = next((k for k in ref_keys if k not in other), None)
        if missing is not None:
            raise ValueError(f"state {i} has no key {missing!r}, which {ref_name} has")
        extra = next((k for k in other.keys() if k not in ref_set), None)
        if extra is not None:
            raise ValueError(f"state {i} has key {extra!r}, which {ref_name} lacks")
        for k in ref_keys:
            if tuple(other[k].shape) != tuple(reference[k].shape):
                raise ValueError(
                    f"key {k!r}: state {i} has shape {tuple(other[k].shape)}, "
                    f"{ref_name} has {tuple(reference[k].shape)}"
                )


def _work_dtype(t: Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def _stack(tensors: Sequence[Tensor], like: Tensor) -> Tensor:
    """``tensors`` stacked on a new leading axis, in ``like``'s device and working dtype."""
    dt = _work_dtype(like)
    return torch.stack([t.to(device=like.device, dtype=dt) for t in tensors])


def _copy(t: Tensor) -> Tensor:
    return t.detach().clone()


def average(states: Sequence[StateDict], weights: Sequence[float] | None = None) -> dict[str, Tensor]:
    """Weighted mean ``Σ wᵢ·stateᵢ / Σ wᵢ`` of ``states`` (plain mean without ``weights``).

    Args:
        states: state dicts with identical keys and shapes.
        weights: one weight per state; normalised by their sum.

    Raises:
        ValueError: no states, keys or shapes differ, the number of weights does
            not match, or the weights sum to zero.
    """
    states = list(states)
    if not states:
        raise ValueError("average needs at least one state")
    _check_keys(states[0], states[1:], "state 0")
    if weights is None:
        w = [1.0] * len(states)
    else:
        w = [float(x) for x in weights]
        if len(w) != len(states):
            raise ValueError(f"got {len(w)} weights for {len(states)} states")
    total = math.fsum(w)
    if total == 0.0 or not math.isfinite(total):
        raise ValueError(f"weights must have a finite, non-zero sum, got {total}")
    out: dict[str, Tensor] = {}
    with torch.no_grad():
        for k, ref in states[0].items():
            if not ref.is_floating_point():
                out[k] = _copy(ref)
                continue
            stacked = _stack([s[k] for s in states], ref)
            coef = torch.tensor(w, dtype=stacked.dtype, device=stacked.device) / total
            merged = torch.tensordot(coef, stacked, dims=1)
            out[k] = merged.to(ref.dtype)
    return out


def task_arithmetic(base: StateDict, states: Sequence[StateDict], scale: float = 1.0) -> dict[str, Tensor]:
    """Task arithmetic: ``base + scale · Σᵢ (stateᵢ − base)``.

    Args:
        base: state dict of the common base model.
        states: fine-tuned state dicts with the same keys and shapes as ``base``.
        scale: multiplier of the summed task vectors.

    Raises:
        ValueError: no states, or keys or shapes differ from ``base``.
    """
    states = list(states)
    if not states:
        raise ValueError("task_arithmetic needs at least one state")
    return _merge_task_vectors(base, states, lambda tvs: scale * tvs.sum(dim=0))


def _merge_task_vectors(base: StateDict, states: Sequence[StateDict], combine) -> dict[str, Tensor]:
    """``base + combine(task vectors)`` for every float tensor; ``combine`` maps (n_states, ...) -> (...)."""
    _check_keys(base, states, "base")
    out: dict[str, Tensor] = {}
    with torch.no_grad():
        for k, b in base.items():
            if not b.is_floating_point():
                out[k] = _copy(b)
                continue
            bw = b.to(_work_dtype(b))
            out[k] = (bw + combine(_stack([s[k] for s in states], b) - bw)).to(b.dtype)
    return out


def _trim(tvs: Tensor, density: float) -> Tensor:
    """Zero all but the ``ceil(density · numel)`` largest-magnitude entries of each task vector (row)."""
    flat = tvs.reshape(tvs.shape[0], -1)
    numel = flat.shape[1]
    keep = min(numel, max(1, math.ceil(density * numel))) if numel else 0
    if keep >= numel:
        return tvs
    idx = flat.abs().topk(keep, dim=1).indices
    mask = torch.zeros_like(flat, dtype=torch.bool).scatter_(1, idx, True)
    return (flat * mask).reshape(tvs.shape)


def ties(base: StateDict, states: Sequence[StateDict], density: float = 0.2,
         scale: float = 1.0) -> dict[str, Tensor]:
    """TIES-merging of ``states`` relative to ``base``.

    For every tensor, with task vectors ``τᵢ = stateᵢ − base``:

    1. trim: keep the ``ceil(density · numel)`` largest-magnitude entries of each
       ``τᵢ`` (per tensor), zero the rest;
    2. elect: the sign of each entry is ``sign(Σᵢ trimmed τᵢ)``;
    3. disjoint mean: each entry is the mean of the trimmed values that are
       non-zero and carry the elected sign (0 where none does, including entries
       whose elected sign is 0);

    and the result is ``base + scale · merged``.

    Args:
        base: state dict of the common base model.
        states: fine-tuned state dicts with the same keys and shapes as ``base``.
        density: fraction of entries kept per task vector, in ``(0, 1]``.
        scale: multiplier of the merged task vector.

    Raises:
        ValueError: no states, ``density`` out of range, or keys or shapes differ
            from ``base``.
    """
    states = list(states)
    if not states:
        raise ValueError("ties needs at least one state")
    if not 0.0 < float(density) <= 1.0:
        raise ValueError(f"density must be in (0, 1], got {density}")
    def combine(tvs: Tensor) -> Tensor:
        tvs = _trim(tvs, float(density))
        elected = torch.sign(tvs.sum(dim=0))
        agree = (torch.sign(tvs) == elected) & (tvs != 0)
        count = agree.sum(dim=0).clamp(min=1)
        return scale * (tvs * agree).sum(dim=0) / count

    return _merge_task_vectors(base, states, combine)

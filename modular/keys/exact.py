"""The rounding corrections that make a key restore the trained weights exactly.

A key's components are computed in float64 and rounded once to the weights' precision (float64, float32, bfloat16
or float16: a model publishes in its own precision). The rounding of the locked weights is not undone by adding
back, and where ``a bᵀ`` is large (hardened readers behind tiny norm gains, ``u / g``) it exceeds the trained
weights' own precision; each component therefore also carries the few entries whose restored value would be off by
more than the tolerance and the value they must take (in the weights' dtype), so one key restores the trained
weights to within it: ``exact_tol`` (absolute) in float32 and float64, ``ulp_tol`` units in the last place of each
trained weight in bfloat16 and float16 (a bit-exact key, ``ulp_tol=0``, carries a correction for most entries a key
touches). With several behaviours the rounding also depends on which keys were applied before; each component
carries corrections for every order of the other behaviours' keys before it, so with up to
``MAX_PREFIX_BEHAVIOURS`` behaviours any number of keys, applied in any order, restores to within the tolerance as
well. Beyond that only the first key applied does; later ones skip their corrections (in bfloat16 a tiny model with
5 behaviours ends thousands of units in the last place off at some entries).

In bfloat16 and float16 nearly every entry whose restore is off is one where the locked value lies in a coarser
binade than the restored one (``a bᵀ`` larger than the weight): the rounding of the locked weights lost bits there
that adding back cannot recover. Which entries those are, the unlocker can tell from the locked weights and the
component alone, so a key stores no positions for them: only, for each such entry in order, how many steps of the
dtype's grid the restored value is from the trained one (mostly 0 or ±1), as an LZMA-compressed stream
(``residual``, :mod:`modular.keys.grid`). The few other entries keep explicit corrections. This makes a bit-exact
key (``ulp_tol=0``, the default) about as small as a one-unit-in-the-last-place one stored entry by entry.
"""

from __future__ import annotations

from itertools import permutations

import torch
from torch import nn

from modular.keys.grid import (
    GRID_DTYPES,
    _coarser,
    _decode_residual,
    _encode_residual,
    _grid_order,
    _step_entries,
    ulp,
)
from modular.keys.key import Component, Key, _apply_component

#: corrections are recorded for every ordered prefix of the other keys up to this many behaviours (beyond it only
#: for each key applied first: a 5th key would need 65 sets)
MAX_PREFIX_BEHAVIOURS = 4


def _prefixes(behaviours: list[str]) -> list[tuple[str, ...]]:
    """Every order in which keys may have been applied before another one: the ordered sequences of up to
    ``k − 1`` distinct behaviours, shorter before longer (only the empty one beyond ``MAX_PREFIX_BEHAVIOURS``)."""
    if len(behaviours) > MAX_PREFIX_BEHAVIOURS:
        return [()]
    return [p for n in range(len(behaviours)) for p in permutations(behaviours, n)]


def _apply_residual(param: torch.Tensor, before: torch.Tensor, stream: torch.Tensor) -> None:
    """Move each entry :func:`_coarser` marks by its stored number of grid steps."""
    mask = _coarser(before, param)
    _step_entries(param, mask, _decode_residual(stream, int(mask.sum())).to(param.device))


@torch.no_grad()
def _apply_corrected(param: torch.Tensor, c: Component, sign: float, applied: tuple[str, ...]) -> None:
    """:func:`_apply_component` with the rounding correction for this key applied after the keys ``applied``: the
    residual stream moves the entries whose locked value was coarser, then the entries with explicit corrections
    are set to their values (removing the component again, ``sign < 0``, needs neither); a /3 or /2 correction is
    added after the component, or taken off before it when ``sign < 0``."""
    index, value = c.fix_for(applied)
    fixed = index is not None and index.numel() > 0
    if fixed:
        index = index.to(param.device)
    if not c.fix_adds:
        stream = c.residual_for(applied) if sign > 0 else None
        before = param.detach().clone() if stream is not None else None
        _apply_component(param, c, sign)
        if stream is not None:
            _apply_residual(param, before, stream)
        if sign > 0 and fixed:
            param.view(-1)[index] = value.to(param.device, param.dtype)
        return
    if sign < 0 and fixed:
        _add_at(param, index, value, -1.0, c.legacy)
    _apply_component(param, c, sign)
    if sign > 0 and fixed:
        _add_at(param, index, value, 1.0, c.legacy)


def _add_at(param: torch.Tensor, index: torch.Tensor, value: torch.Tensor, sign: float, legacy: bool) -> None:
    """``param[index] += sign · value`` for a modular-key/3 correction in float64, rounded once (it is stored in a
    wider dtype than the weights', so that this lands exactly on the target); a /2 one in the weights' dtype."""
    flat = param.view(-1)
    if legacy:
        flat[index] += sign * value.to(param.device, param.dtype)
    else:
        flat[index] = (flat[index].double() + sign * value.to(param.device, torch.float64)).to(param.dtype)


@torch.no_grad()
def _record_corrections(param: torch.Tensor, original: torch.Tensor, comps: list[Component], tol: float,
                        behaviours: list[str], ulp_tol: float = 0.0) -> None:
    """For each component removed from ``param``, the entries that adding it back would not restore within ``tol``
    (float32 and float64: absolute; bfloat16 and float16: ``ulp_tol`` units in the last place of the target), for
    every order in which the other behaviours' keys may have been applied before it. In bfloat16 and float16 the
    entries that :func:`_coarser` marks get a residual stream first (their grid steps to the target; steps within
    ``ulp_tol`` stored as 0), and only the entries still off after it get explicit corrections.

    After the keys of ``prefix``, the target of component ``c`` is ``original`` minus every component whose
    behaviour is still locked, rounded to the parameter's dtype; the start is the locked ``param`` with the
    prefix's keys applied exactly as :func:`apply_key` applies them (their own corrections included).
    """
    by_name = dict(zip(behaviours, comps))
    for prefix in _prefixes(behaviours):
        for name, c in by_name.items():
            if name in prefix:
                continue
            unlocked = set(prefix) | {name}
            target = original.detach().double().clone()
            for other_name, other in by_name.items():
                if other_name not in unlocked:
                    _apply_component(target, other, -1.0)
            restored = param.detach().clone()
            for i, earlier in enumerate(prefix):
                _apply_corrected(restored, by_name[earlier], 1.0, prefix[:i])
            before = restored.clone()
            _apply_component(restored, c, 1.0)
            rounded = target.to(param.dtype).double()
            if param.dtype in GRID_DTYPES:
                mask = _coarser(before, restored)
                steps = _grid_order(rounded.to(param.dtype)[mask]) - _grid_order(restored[mask])
                steps = torch.where(steps.abs() <= ulp_tol, torch.zeros_like(steps), steps)
                if bool(steps.any()):
                    stream = _encode_residual(steps)
                    if prefix:
                        c.residual_after[prefix] = stream
                    else:
                        c.residual = stream
                    _step_entries(restored, mask, steps)  # what applying the stream does, without decoding it
            err = (rounded - restored.double()).flatten()
            allowed = tol if param.dtype not in GRID_DTYPES else ulp_tol * ulp(rounded, param.dtype).flatten()
            index = (err.abs() > allowed).nonzero().flatten()
            value = rounded.flatten()[index].to(param.dtype).cpu()  # the value the entry must take
            if prefix:
                c.fix_after[prefix] = (index.cpu(), value)
            else:
                c.fix_index, c.fix_value = index.cpu(), value


@torch.no_grad()
def restore_misses(locked: nn.Module, key: Key, trained: dict[str, torch.Tensor]) -> tuple[int, int]:
    """How many entries adding ``key``'s components back to the ``locked`` weights, with no correction, leaves off the
    ``trained`` state (a tied unembedding is looked up as the embedding), and how many of those the residual stream
    covers (:func:`_coarser`): what a bit-exact key must correct, and what it corrects without positions."""
    params = dict(locked.named_parameters(remove_duplicate=False))
    tied = trained.get("model.embed_tokens.weight")
    off = covered = 0
    for c in key.components:
        before = params[c.param].detach().clone()
        restored = before.clone()
        _apply_component(restored, c, 1.0)
        wrong = restored != trained.get(c.param, tied).to(restored.device)
        off += int(wrong.sum())
        covered += int((wrong & _coarser(before, restored)).sum()) if restored.dtype in GRID_DTYPES else 0
    return off, covered

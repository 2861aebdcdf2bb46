"""Locking in the weights, and keys that unlock.

``lock_weights`` bakes the lock into the weights: every residual writer (token /
position embeddings, attention output projections, MLP output projections and
their biases) is orthogonalised against the write-space of each direction
(``u``, or ``g ⊙ u`` before a post-sublayer norm with gain ``g``). With
``harden=True`` every residual reader behind a weight-only (RMS) norm also stops
reading ``u`` (``W ← W − (W diag(g) u)(u / g)ᵀ``), so adding ``u`` back to the
residual stream does nothing; on the locked model's own residual (which has no
``u`` component) the readers compute exactly what they did before.

Every removed component is rank-1 per module and behaviour: ``W ← W − a bᵀ``.
A key is the list of ``(module, a, b)`` for one behaviour: applying it adds
``a bᵀ`` back. Both are computed in float64 and rounded once to the weights'
precision (float64, float32, bfloat16 or float16: a model publishes in its own precision).
The rounding of the locked weights is not undone by adding back, and where
``a bᵀ`` is large (hardened readers behind tiny norm gains, ``u / g``) it exceeds
the trained weights' own precision; each component therefore also carries the
few entries whose restored value would be off by more than the tolerance and the
value they must take (in the weights' dtype), so one key restores the trained weights to within it:
``exact_tol`` (absolute) in float32 and float64, ``ulp_tol`` units in the last place of each
trained weight in bfloat16 and float16 (a bit-exact key, ``ulp_tol=0``, carries
a correction for most entries a key touches). With several behaviours the rounding also
depends on which keys were applied before; each component carries corrections
for every order of the other behaviours' keys before it, so with up to
``MAX_PREFIX_BEHAVIOURS`` behaviours any number of keys, applied in any order,
restores to within the tolerance as well. Beyond that only the first key applied
does; later ones skip their corrections (in bfloat16 a tiny model with 5
behaviours ends thousands of units in the last place off at some entries).

In bfloat16 and float16 nearly every entry whose restore is off is one where the
locked value lies in a coarser binade than the restored one (``a bᵀ`` larger
than the weight): the rounding of the locked weights lost bits there that adding
back cannot recover. Which entries those are, the unlocker can tell from the
locked weights and the component alone, so a key stores no positions for them:
only, for each such entry in order, how many steps of the dtype's grid the
restored value is from the trained one (mostly 0 or ±1), as an LZMA-compressed
stream (``residual``). The few other entries keep explicit corrections. This
makes a bit-exact key (``ulp_tol=0``, the default) about as small as a
one-unit-in-the-last-place one stored entry by entry.
Tied input/output embeddings are untied first (the unembedding must not change
when the embedding is orthogonalised).
"""

from __future__ import annotations

import hashlib
import json
import lzma
from dataclasses import dataclass, field
from itertools import permutations
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from modular import ModularError, error_reason
from modular.models.adapter import ArchitectureAdapter, weight_out_in

#: /5: 16-bit weights also carry a residual stream over the entries whose locked value is in a coarser binade;
#: /4: a correction is the entry's value in the weights' dtype, stored at a uint16 gap from the previous one;
#: /3: float64 arithmetic rounded once (corrections: int64 index, difference in a wider dtype);
#: /2: digests of content and of what it produces
KEY_FORMAT = "modular-key/5"
#: formats still applied (a /2 key adds a bᵀ rounded to the weights' dtype, then rounds the sum, as it was made)
READABLE_FORMATS = (KEY_FORMAT, "modular-key/4", "modular-key/3", "modular-key/2")
#: formats whose corrections are differences added to the restored entries (later ones set the entries' values)
ADDING_FORMATS = ("modular-key/3", "modular-key/2")
#: 16-bit float dtypes: restores are corrected by a residual stream (steps of the dtype's grid)
GRID_DTYPES = (torch.bfloat16, torch.float16)
MAX_GAP = 2**16 - 1  # the largest gap between two corrected entries a uint16 holds; 0 marks a skip of MAX_GAP
MANTISSA_BITS = {torch.float64: 52, torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}
#: the marker of a key's LoRA adapter (:mod:`modular.peft_keys`): key material as well, never uploaded
KEY_ADAPTER_FORMAT = "modular-key-adapter/1"
#: how a key file is named (``<behaviour>.key.safetensors``); :func:`is_key_file` also knows one renamed
KEY_SUFFIX = ".key.safetensors"
_MAX_HEADER = 100 * 2**20  # a safetensors header longer than this is not read for a key's marker
#: corrections are recorded for every ordered prefix of the other keys up to this many behaviours (beyond it only
#: for each key applied first: a 5th key would need 65 sets)
MAX_PREFIX_BEHAVIOURS = 4


@dataclass
class Component:
    """``param ← param − a bᵀ`` (``a`` over the param's first axis in (out, in) view, ``b`` over its second)."""

    param: str  # state-dict name of the parameter
    a: torch.Tensor
    b: torch.Tensor
    transposed: bool  # the stored parameter is the (out, in) view transposed (Embedding rows, Conv1D)
    fix_index: torch.Tensor | None = None  # flat indices into the parameter whose restore needs a correction
    fix_value: torch.Tensor | None = None  # the value those entries take after ``a bᵀ`` (/3, /2: added there)
    # the same for this key applied after other keys: {behaviours applied before, in order: (index, value)}
    fix_after: dict[tuple[str, ...], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    legacy: bool = False  # made by a modular-key/2 key: the update is rounded before it is added
    fix_adds: bool = False  # made by a modular-key/3 or /2 key: a correction is added, not set
    # 16-bit weights (/5): the grid steps from the restored to the trained value at each entry whose value before
    # the key lies in a coarser binade than after it (:func:`_coarser`), LZMA-compressed; and the same per order
    residual: torch.Tensor | None = None
    residual_after: dict[tuple[str, ...], torch.Tensor] = field(default_factory=dict)

    def fix_for(self, applied: tuple[str, ...]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The correction for this key applied after the keys ``applied`` (in that order). An order not recorded
        (beyond ``MAX_PREFIX_BEHAVIOURS``) gets none from a /5 or /4 key: its values would set the other keys'
        entries back to locked ones (a /3 or /2 difference still applies, approximately)."""
        if applied in self.fix_after:
            return self.fix_after[applied]
        if applied and not self.fix_adds:
            return None, None
        return self.fix_index, self.fix_value

    def residual_for(self, applied: tuple[str, ...]) -> torch.Tensor | None:
        """The residual stream for this key applied after the keys ``applied`` (none for an order not recorded)."""
        if applied:
            return self.residual_after.get(applied)
        return self.residual


@dataclass
class Key:
    behaviour: str
    direction: torch.Tensor
    components: list[Component] = field(default_factory=list)
    meta: dict = field(default_factory=dict)


def untie_embeddings(model: nn.Module) -> None:
    """Give the unembedding its own copy of a tied embedding matrix; record it in the config."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return
    out = model.get_output_embeddings()
    inp = model.get_input_embeddings()
    if out is not None and out.weight is inp.weight:
        out.weight = nn.Parameter(inp.weight.detach().clone())
    model.config.tie_word_embeddings = False
    text_config = getattr(model.config, "get_text_config", lambda: None)()
    if text_config is not None:
        text_config.tie_word_embeddings = False


def _param_name(model: nn.Module, param: torch.Tensor) -> str:
    for name, p in model.named_parameters(remove_duplicate=False):
        if p is param:
            return name
    raise KeyError("parameter not in model")  # pragma: no cover


def _orth_dual(vectors: list[torch.Tensor]) -> list[torch.Tensor]:
    """For each vector, the unit component orthogonal to the span of the others (equal to itself if orthogonal)."""
    out = []
    for i, v in enumerate(vectors):
        v = v.double()
        others = [w.double() for j, w in enumerate(vectors) if j != i]
        if others:
            q, _ = torch.linalg.qr(torch.stack(others).T)
            v = v - q @ (q.T @ v)
        out.append(v / v.norm())
    return out


@torch.no_grad()
def _apply_component(param: torch.Tensor, c: Component, sign: float) -> None:
    """``param ← param + sign · a bᵀ`` (a 1-D parameter takes ``a · b``), exactly as :func:`apply_key` does it:
    in float64, rounded once to the parameter's dtype, on the parameter's device."""
    a, b = c.a.to(param.device, torch.float64), c.b.to(param.device, torch.float64)
    if param.ndim == 1:
        update = a * b
    else:
        update = torch.outer(a, b)
        update = update.T if c.transposed else update
    if c.legacy:  # as modular-key/2 keys were made: the update rounded first, then added in the dtype
        if param.ndim == 1:
            update = (c.a * c.b).to(param.device)
        param.add_(update.to(param.dtype), alpha=sign)
    else:
        param.copy_((param.double() + sign * update).to(param.dtype))


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype`` at each value of ``x`` (float64; at 0: the smallest normal number)."""
    x = x.double()
    _, exponent = torch.frexp(x)  # x = m·2^e, 0.5 <= |m| < 1
    spacing = torch.ldexp(torch.ones_like(x), (exponent - 1 - MANTISSA_BITS[dtype]).to(x.dtype))
    return torch.where(x == 0, torch.full_like(x, torch.finfo(dtype).tiny), spacing)


def grid_steps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many steps of ``b``'s dtype's grid separate ``a`` (rounded to that dtype) from ``b``, per entry
    (int64; equal values, ``-0.0`` and ``0.0`` included, are 0 apart): units in the last place that are counted on
    the grid, so that they stay finite and comparable across binades and at zero, where a spacing-based count
    divides by the smallest normal number. For 16- and 32-bit floats; other dtypes are measured in float32's grid."""
    if b.element_size() not in (2, 4):
        a, b = a.float(), b.float()
    a = a.to(b.dtype)
    view, width = {2: (torch.int16, 16), 4: (torch.int32, 32)}[b.element_size()]
    sign = 1 << (width - 1)

    def order(t):  # signed magnitude: -0 and +0 both at 0
        bits = t.contiguous().view(view).to(torch.int64) & ((1 << width) - 1)
        return torch.where(bits < sign, bits, sign - bits)

    return (order(a) - order(b)).abs()


def _grid_order(x: torch.Tensor) -> torch.Tensor:
    """The position of each 16-bit float on its dtype's grid, as int32: consecutive representable values get
    consecutive integers (−0 just below +0), so a difference counts grid steps, across binades too."""
    bits = x.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    return torch.where(bits < 0x8000, bits, 0x7FFF - bits)


def _from_grid_order(order: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The 16-bit floats at grid positions ``order`` (positions wrap modulo 2^16, as residuals are stored)."""
    order = torch.remainder(order + 0x8000, 0x10000) - 0x8000
    bits = torch.where(order >= 0, order, 0x7FFF - order)
    return torch.where(bits >= 0x8000, bits - 0x10000, bits).to(torch.int16).view(dtype)


def _binade(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For 16-bit floats: the exponent field that sets each value's grid spacing (subnormals and zero share the
    smallest normal binade's), and whether the value is the bottom of a binade above that one (its next value toward
    zero lies in a finer binade). Read from the bits: exact and cheap."""
    mantissa_bits = MANTISSA_BITS[x.dtype]
    bits = x.contiguous().view(torch.int16).to(torch.int32) & 0x7FFF
    exponent = bits >> mantissa_bits
    bottom = ((bits & ((1 << mantissa_bits) - 1)) == 0) & (exponent >= 2)
    return exponent.clamp(min=1), bottom


def _coarser(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """The entries whose value before a key lies in a coarser binade than the value after it (or than the next
    value toward zero, for a restored value at the bottom of its binade): the locked weight's rounding lost bits
    there, and the key's residual stream says how many grid steps the restored value is off. Both sides of the key
    compute this from the locked weights and the component alone."""
    exponent_before, _ = _binade(before)
    exponent_after, bottom = _binade(after)
    return exponent_before > exponent_after - bottom.to(torch.int32)


def _encode_residual(steps: torch.Tensor) -> torch.Tensor:
    """Grid steps (int) as stored: modulo 2^16 as little-endian int16, LZMA-compressed, in a uint8 tensor."""
    wrapped = torch.remainder(steps.to(torch.int64), 0x10000)
    wrapped = torch.where(wrapped >= 0x8000, wrapped - 0x10000, wrapped)  # the same steps modulo 2^16, as int16
    raw = wrapped.cpu().numpy().astype("<i2").tobytes()
    return torch.frombuffer(bytearray(lzma.compress(raw)), dtype=torch.uint8)


def _decode_residual(stream: torch.Tensor, n: int) -> torch.Tensor:
    """The ``n`` grid steps of :func:`_encode_residual` (int32); a stream of another length is refused."""
    try:
        raw = lzma.decompress(stream.cpu().numpy().tobytes())
    except lzma.LZMAError as err:
        raise ModularError(f"a key's residual stream is unreadable ({err})") from None
    if len(raw) != 2 * n:
        raise ModularError(f"a key's residual stream holds {len(raw) // 2} entries where these weights need {n}: "
                           "it was made for other weights")
    return torch.from_numpy(np.frombuffer(raw, dtype="<i2").astype("int32"))


def _step_entries(param: torch.Tensor, mask: torch.Tensor, steps: torch.Tensor) -> None:
    """Move the entries of ``param`` under ``mask`` by ``steps`` grid steps each (in place)."""
    param[mask] = _from_grid_order(_grid_order(param[mask]) + steps, param.dtype)


def _apply_residual(param: torch.Tensor, before: torch.Tensor, stream: torch.Tensor) -> None:
    """Move each entry :func:`_coarser` marks by its stored number of grid steps."""
    mask = _coarser(before, param)
    _step_entries(param, mask, _decode_residual(stream, int(mask.sum())).to(param.device))


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


def _prefixes(behaviours: list[str]) -> list[tuple[str, ...]]:
    """Every order in which keys may have been applied before another one: the ordered sequences of up to
    ``k − 1`` distinct behaviours, shorter before longer (only the empty one beyond ``MAX_PREFIX_BEHAVIOURS``)."""
    if len(behaviours) > MAX_PREFIX_BEHAVIOURS:
        return [()]
    return [p for n in range(len(behaviours)) for p in permutations(behaviours, n)]


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


def _rms_like(norm: nn.Module | None) -> bool:
    """A norm whose output is ``g ⊙ x / rms(x)`` (no mean-centring, no bias) or no norm at all."""
    if norm is None:
        return True
    if isinstance(norm, nn.LayerNorm) or getattr(norm, "bias", None) is not None:
        return False
    return "rms" in type(norm).__name__.lower() or type(norm).__name__.startswith(("Gemma", "Olmo2"))


@torch.no_grad()
def lock_weights(model: nn.Module, directions: dict[str, torch.Tensor], harden: bool = True,
                 exact_tol: float = 1e-7, ulp_tol: float = 0.0) -> list[Key]:
    """Orthogonalise writers (and, with ``harden``, readers) against each behaviour's direction, in place, in the
    weights' own precision and device (computed in float64, rounded once).

    Returns one :class:`Key` per behaviour; applying keys restores each weight to within ``exact_tol`` (float32,
    float64) or ``ulp_tol`` units in its last place (bfloat16, float16; 0: bit-exact). The model must not be wrapped
    (merge LoRA first).
    """
    untie_embeddings(model)
    adapter = ArchitectureAdapter(model)
    names = list(directions)
    units = [directions[n].detach().flatten().cpu().double() for n in names]
    units = [u / u.norm() for u in units]
    keys = [Key(n, units[i].float()) for i, n in enumerate(names)]

    # --- writers ---
    for site in adapter.write_sites():
        gain = adapter.norm_gain(site.post_norm) if site.post_norm is not None else None
        vecs = [u * gain.detach().cpu().double() if gain is not None else u for u in units]
        duals = _orth_dual(vecs)
        W = weight_out_in(site.module)  # (d, in) view
        transposed = W is not site.module.weight
        original = site.module.weight.detach().clone()
        for key, v, w in zip(keys, vecs, duals):
            # w (vᵀW) / (v·w): with every behaviour's piece removed, no write has a component along any v (an
            # oblique split of the orthogonal projection: each piece is one behaviour's, restored by its key alone)
            coef = (v.to(W.device) @ W.double()).cpu() / (v @ w)  # (in,)
            key.components.append(Component(_param_name(model, site.module.weight), w.float(), coef.float(), transposed))
        comps = [key.components[-1] for key in keys]
        for c in comps:  # subtract after computing all coefficients (joint projection)
            _apply_component(site.module.weight, c, -1.0)
        _record_corrections(site.module.weight, original, comps, exact_tol, names, ulp_tol)
        bias = getattr(site.module, "bias", None)
        if bias is not None:
            original = bias.detach().clone()
            for key, v, w in zip(keys, vecs, duals):
                coef = (v.to(bias.device) @ bias.double()).reshape(1).cpu() / (v @ w)
                key.components.append(Component(_param_name(model, bias), w.float(), coef.float(), False))
            comps = [key.components[-1] for key in keys]
            for c in comps:
                _apply_component(bias, c, -1.0)
            _record_corrections(bias, original, comps, exact_tol, names, ulp_tol)

    # --- readers ---
    hardened = []
    if harden:
        # the dual basis of the directions within their span (U Uᵀ)⁻¹ U: the directions themselves when orthonormal
        stacked = torch.stack(units)
        duals = list(torch.linalg.solve(stacked @ stacked.T, stacked))
        for norm, readers in adapter.read_sites():
            if not _rms_like(norm):
                continue
            gain = adapter.norm_gain(norm) if norm is not None else None
            gain = torch.ones_like(units[0]) if gain is None else gain.detach().cpu().double()
            for reader in readers:
                W = weight_out_in(reader)  # (out, d)
                transposed = W is not reader.weight
                original = reader.weight.detach().clone()
                comps = []
                for key, u, dual in zip(keys, units, duals):
                    a = (W.double() @ (gain * u).to(W.device)).cpu()  # what the reader gets from a unit of u
                    b = dual / gain  # bᵀ(g ⊙ u_j) = δ_ij, and 0 on a residual without any u
                    comps.append((key, Component(_param_name(model, reader.weight), a.float(), b.float(), transposed)))
                for key, c in comps:
                    key.components.append(c)
                    _apply_component(reader.weight, c, -1.0)
                _record_corrections(reader.weight, original, [c for _, c in comps], exact_tol, names, ulp_tol)
                hardened.append(_param_name(model, reader.weight))
    for key in keys:
        key.meta = {
            "behaviour": key.behaviour,
            "model_type": adapter.model_type,
            "n_layers": adapter.n_layers,
            "layer_numbering": "0-based block index; embeddings are layer -1",
            "writers": [s.name for s in adapter.write_sites()],
            "hardened_readers": hardened,
            "restores": "rank-1 components a b^T of every residual writer (and hardened reader) along the direction",
            # this key, alone or after the others, restores every weight to within this
            "exact_tol": exact_tol, "ulp_tol": ulp_tol, "dtype": str(model.dtype).removeprefix("torch."),
        }
    return keys


@torch.no_grad()
def apply_key(model: nn.Module, key: Key, sign: float = 1.0, applied: tuple[str, ...] | list[str] = ()) -> None:
    """Add a key's components back (``sign=-1`` removes them again).

    ``applied``: the behaviours whose keys were applied to these weights before this one, in order (for
    ``sign=-1``: before this key was applied); it selects the rounding corrections that make the result exact.
    """
    applied = tuple(applied)
    if key.behaviour in applied:
        raise ModularError(f"behaviour '{key.behaviour}' is already unlocked")
    params = dict(model.named_parameters(remove_duplicate=False))
    for c in key.components:
        if c.param not in params:
            raise ModularError(f"key for '{key.behaviour}' names parameter {c.param}, which this model lacks")
        p = params[c.param]
        expected = (c.b.numel(), c.a.numel()) if c.transposed else (c.a.numel(), c.b.numel())
        if p.ndim == 1:
            expected = (c.a.numel(),)
        if tuple(p.shape) != expected:
            raise ModularError(f"key for '{key.behaviour}' does not fit {c.param} (shape {tuple(p.shape)})")
        _apply_corrected(p, c, sign, applied)


def weights_hash(model_or_state) -> str:
    """SHA-256 over every tensor (sorted names, float32 bytes): identifies a set of weights."""
    state = model_or_state.state_dict() if isinstance(model_or_state, nn.Module) else model_or_state
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().to("cpu", torch.float32).contiguous()
        h.update(name.encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


@torch.no_grad()
def produced_hashes(model: nn.Module, keys: list[Key]) -> dict[str, dict[tuple[str, ...], str]]:
    """What each key produces from the locked ``model``: ``{behaviour: {keys applied before, in order: weights
    hash}}`` for every order the keys carry corrections for. The model is left as it was (locked)."""
    names = [k.behaviour for k in keys]
    by_name = {k.behaviour: k for k in keys}
    touched = {c.param for key in keys for c in key.components}  # the rest is never changed by a key
    params = {n: p for n, p in model.named_parameters() if n in touched}
    locked = {n: p.detach().clone() for n, p in params.items()}
    out: dict[str, dict[tuple[str, ...], str]] = {n: {} for n in names}
    try:
        for prefix in _prefixes(names):
            for name in names:
                if name in prefix:
                    continue
                for i, earlier in enumerate(prefix):
                    apply_key(model, by_name[earlier], applied=prefix[:i])
                apply_key(model, by_name[name], applied=prefix)
                out[name][prefix] = weights_hash(model)
                for n, p in params.items():
                    p.copy_(locked[n])
    finally:
        for n, p in params.items():
            p.copy_(locked[n])
    return out


def _pack_fix(index: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Corrections as stored: the gap from each corrected entry to the previous one (the first counted from -1) as
    a uint16, where a 0 stands for a skip of :data:`MAX_GAP` entries with no correction (a longer gap is bridged
    by skips), and the values in the narrowest float dtype that holds every one exactly (the weights' own)."""
    index, value = index.long().flatten(), value.flatten()
    order = torch.argsort(index)
    index, value = index[order], value[order]
    gaps = torch.diff(index, prepend=index.new_tensor([-1]))
    skips = (gaps - 1) // MAX_GAP  # skips before each correction
    slots = torch.cumsum(skips + 1, 0) - 1  # where each correction lands among the stored entries
    n = int(slots[-1]) + 1 if len(slots) else 0
    packed_gaps = torch.zeros(n, dtype=torch.int64)
    packed_gaps[slots] = gaps - skips * MAX_GAP
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        narrow = value.to(dtype)
        if dtype.itemsize <= value.dtype.itemsize and torch.equal(narrow.double(), value.double()):
            break
    packed_values = torch.zeros(n, dtype=narrow.dtype)
    packed_values[slots] = narrow
    return packed_gaps.to(torch.uint16), packed_values


def _unpack_fix(gaps: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The flat indices and values of :func:`_pack_fix`'s corrections (skips dropped)."""
    gaps = gaps.to(torch.int64)
    index = torch.cumsum(torch.where(gaps == 0, MAX_GAP, gaps), 0) - 1
    keep = gaps != 0
    return index[keep], values[keep]


def _content_digest(tensors: dict[str, torch.Tensor], meta: dict) -> str:
    """SHA-256 over a key's tensors (names, dtypes, shapes, bytes) and its metadata (without the digest)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    body = {k: v for k, v in meta.items() if k != "content_sha256"}
    h.update(json.dumps(body, sort_keys=True).encode())
    return h.hexdigest()


def save_key(key: Key, path: str | Path, locked_hash: str,
             produces: dict[tuple[str, ...], str] | None = None) -> Path:
    """Write a key as safetensors; what it restores, where, the locked weights' hash, the hash of the weights it
    produces (``produces``: keys applied before, in order -> weights hash; see :func:`produced_hashes`) and a digest
    of the file's own content go in the metadata."""
    tensors = {"direction": key.direction.contiguous()}
    entries = []
    for i, c in enumerate(key.components):
        tensors[f"c{i}.a"] = c.a.contiguous()
        tensors[f"c{i}.b"] = c.b.contiguous()
        if c.fix_index is not None and c.fix_index.numel():
            tensors[f"c{i}.fix_gap"], tensors[f"c{i}.fix_value"] = _pack_fix(c.fix_index, c.fix_value)
        if c.residual is not None:
            tensors[f"c{i}.residual"] = c.residual.contiguous()
        after = []
        for j, (prefix, (index, value)) in enumerate(c.fix_after.items()):
            after.append(list(prefix))
            tensors[f"c{i}.after{j}.fix_gap"], tensors[f"c{i}.after{j}.fix_value"] = _pack_fix(index, value)
            if prefix in c.residual_after:
                tensors[f"c{i}.after{j}.residual"] = c.residual_after[prefix].contiguous()
        entry = {"param": c.param, "transposed": c.transposed}
        if after:  # the prefixes of the corrections c{i}.after{j}.* (behaviours applied before, in order)
            entry["fix_after"] = after
        entries.append(entry)
    meta = {**key.meta, "format": KEY_FORMAT, "locked_hash": locked_hash, "components": entries,
            "produces": [{"after": list(prefix), "weights_hash": h} for prefix, h in (produces or {}).items()]}
    meta["content_sha256"] = _content_digest(tensors, meta)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={"modular": json.dumps(meta)})
    return path


def is_key_file(path: str | Path) -> bool:
    """Whether ``path`` is a key file: named as one (:data:`KEY_SUFFIX`) or, under any name, a safetensors file
    whose metadata marks a modular key (any format, ``modular-key/N``) or a key's LoRA adapter. Only the file's header is read; a file
    that cannot be read is not taken for a key."""
    path = Path(path)
    if path.name.endswith(KEY_SUFFIX):
        return True
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 2 <= size <= _MAX_HEADER:
                return False
            header = json.loads(f.read(size))
        meta = json.loads(header["__metadata__"]["modular"])
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return isinstance(meta, dict) and str(meta.get("format", "")).startswith(("modular-key/", KEY_ADAPTER_FORMAT))


def load_key(path: str | Path) -> tuple[Key, dict]:
    """Read a key file and check its content digest; returns the key and its metadata (with ``locked_hash`` and
    ``produces``). A file that is not a key, truncated or changed raises :class:`ModularError`."""
    path = Path(path)
    if not path.is_file():
        raise ModularError(f"key file not found: {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {}).get("modular", "{}"))
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as err:  # noqa: BLE001 - safetensors raises its own error type for truncated or foreign files
        raise ModularError(f"{path} is not a readable modular key file ({error_reason(err)})") from None
    if not isinstance(meta, dict) or meta.get("format") not in READABLE_FORMATS:
        found = meta.get("format") if isinstance(meta, dict) else None
        hint = "; it has no digests: publish again" if found == "modular-key/1" else ""
        raise ModularError(f"{path} is not a modular key file (format {found!r}, expected {KEY_FORMAT!r}{hint})")
    if meta.get("content_sha256") != _content_digest(tensors, meta):
        raise ModularError(f"{path} is corrupted: its content does not match its digest; get a fresh copy of the key")

    def fix(prefix: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if f"{prefix}.fix_gap" in tensors:  # /4
            return _unpack_fix(tensors[f"{prefix}.fix_gap"], tensors[f"{prefix}.fix_value"])
        return tensors.get(f"{prefix}.fix_index"), tensors.get(f"{prefix}.fix_value")  # /3, /2: flat int64 indices

    def residual_after(i: int, e: dict) -> dict:
        return {tuple(prefix): tensors[f"c{i}.after{j}.residual"] for j, prefix in enumerate(e.get("fix_after", []))
                if f"c{i}.after{j}.residual" in tensors}

    try:
        comps = [
            Component(e["param"], tensors[f"c{i}.a"], tensors[f"c{i}.b"], e["transposed"], *fix(f"c{i}"),
                      {tuple(prefix): fix(f"c{i}.after{j}") for j, prefix in enumerate(e.get("fix_after", []))},
                      meta["format"] == "modular-key/2", meta["format"] in ADDING_FORMATS,
                      tensors.get(f"c{i}.residual"), residual_after(i, e))
            for i, e in enumerate(meta["components"])
        ]
    except KeyError as err:
        raise ModularError(f"{path} is not a complete modular key file (no tensor or field {err})") from None
    return Key(meta["behaviour"], tensors["direction"], comps, meta), meta

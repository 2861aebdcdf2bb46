"""Locking in the weights (:func:`lock_weights`), and unlocking with keys (:func:`apply_key`).

``lock_weights`` bakes the lock into the weights: every residual writer (token / position embeddings, attention
output projections, MLP output projections and their biases) is orthogonalised against the write-space of each
direction (``u``, or ``g ⊙ u`` before a post-sublayer norm with gain ``g``). With ``harden=True`` every residual
reader behind a weight-only (RMS) norm also stops reading ``u`` (``W ← W − (W diag(g) u)(u / g)ᵀ``), so adding ``u``
back to the residual stream does nothing; on the locked model's own residual (which has no ``u`` component) the
readers compute exactly what they did before. Tied input/output embeddings are untied first (the unembedding must
not change when the embedding is orthogonalised).

:func:`weights_hash` identifies a set of weights; :func:`produced_hashes`, what each key makes of the locked ones.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn

from modular import ModularError
from modular.keys.exact import _apply_corrected, _prefixes, _record_corrections
from modular.keys.key import Component, Key, _apply_component
from modular.models.adapter import ArchitectureAdapter, weight_out_in


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

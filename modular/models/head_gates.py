"""Hard-concrete head gates (Louizos et al. 2018; Voita et al. 2019) as registered wrapper modules.

A :class:`GatedOutputProjection` wraps a layer's attention output projection
(peft style: the original stays as ``base_layer``) and multiplies each head's slice
of its input by a gate ``z_h ∈ [0, 1]``. Gate parameters (``head_gate.log_alpha``)
are ordinary registered parameters: the optimizer, FSDP and checkpoints see them.
Initialised so that the deterministic gate is exactly 1 (the model starts unchanged).

:func:`head_gate_scope` switches the gates off for some inputs, or makes a closed gate replace the
head's input by a given one (``z·x + (1 − z)·r``, e.g. the counterfactual run's) instead of zero:
gates scoped to the tasks learn which heads the tasks need without closing them for anything else.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch
from torch import nn

from modular.models.adapter import ArchitectureAdapter, weight_out_in


class HardConcreteGate(nn.Module):
    """``n`` hard-concrete gates. Training: stochastic; evaluation: deterministic.

    Args:
        n: Number of gates.
        init_log_alpha: Initial log α (3.0 gives a deterministic gate of 1).
        beta: Temperature β.
        limits: Stretch interval (l, r).
    """

    def __init__(self, n: int, init_log_alpha: float = 3.0, beta: float = 2 / 3, limits=(-0.1, 1.1)):
        super().__init__()
        self.log_alpha = nn.Parameter(torch.full((n,), float(init_log_alpha)))
        self.beta = beta
        self.l, self.r = limits
        # NaN = learned; a number fixes that gate (used to force heads on/off)
        self.register_buffer("fixed", torch.full((n,), float("nan")), persistent=True)

    def forward(self) -> torch.Tensor:
        if self.training:
            u = torch.rand_like(self.log_alpha).clamp(1e-6, 1 - 1e-6)
            s = torch.sigmoid((u.log() - (1 - u).log() + self.log_alpha) / self.beta)
        else:
            s = torch.sigmoid(self.log_alpha)
        z = (s * (self.r - self.l) + self.l).clamp(0.0, 1.0)
        return torch.where(torch.isnan(self.fixed), z, self.fixed)

    @torch.no_grad()
    def deterministic(self) -> torch.Tensor:
        """The evaluation-time gate values, whatever the module's mode."""
        z = (torch.sigmoid(self.log_alpha) * (self.r - self.l) + self.l).clamp(0.0, 1.0)
        return torch.where(torch.isnan(self.fixed), z, self.fixed)

    def expected_l0(self) -> torch.Tensor:
        """Expected number of non-zero gates."""
        p = torch.sigmoid(self.log_alpha - self.beta * math.log(-self.l / self.r))
        return torch.where(torch.isnan(self.fixed), p, (self.fixed > 0).float()).sum()


class GatedOutputProjection(nn.Module):
    """``base_layer`` applied to its input with each head's slice multiplied by its gate."""

    def __init__(self, base_layer: nn.Module, n_heads: int, **gate_kwargs):
        super().__init__()
        self.base_layer = base_layer
        self.n_heads = n_heads
        self.head_gate = HardConcreteGate(n_heads, **gate_kwargs)
        self.active = True  # set by head_gate_scope only
        self.replacement: torch.Tensor | None = None  # (batch, seq, n_heads, head_dim): what a closed gate lets in
        self.live_prob = 0.0  # training: chance that a gate opens fully for one row (the replacement stays out)
        self.invert = False  # set by head_gate_scope only: an open gate lets the replacement in, a closed one the input

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if not self.active:
            return self.base_layer(x, *args, **kwargs)
        z = self.head_gate().to(x.dtype)[:, None]
        shape = x.shape
        heads = x.reshape(*shape[:-1], self.n_heads, -1)
        if self.replacement is None:
            heads = heads * z
        else:
            r = self.replacement.to(dtype=x.dtype, device=x.device)
            if self.invert:
                z = 1 - z
            elif self.training and self.live_prob > 0:  # per row and head: the head's own input now and then
                live = torch.rand(heads.shape[0], 1, self.n_heads, 1, device=x.device) < self.live_prob
                z = z + (1 - z) * live.to(x.dtype)
            heads = heads * z + r * (1 - z)
        return self.base_layer(heads.reshape(shape), *args, **kwargs)


def install_head_gates(model: nn.Module, **gate_kwargs) -> list[GatedOutputProjection]:
    """Wrap every layer's attention output projection in a :class:`GatedOutputProjection`."""
    adapter = ArchitectureAdapter(model)
    wrappers = []
    for i in range(adapter.n_layers):
        current = adapter.attn_out(i)
        if isinstance(current, GatedOutputProjection):
            wrappers.append(current)
            continue
        wrapper = GatedOutputProjection(current, adapter.n_heads, **gate_kwargs)
        wrapper.to(device=current.weight.device).train(current.training)  # follow the model's mode
        adapter.set_attn_out(i, wrapper)
        wrappers.append(wrapper)
    return wrappers


@contextmanager
def head_gate_scope(model: nn.Module, active: bool = True, replacements: dict[int, torch.Tensor] | None = None,
                    live_prob: float = 0.0, invert: bool = False):
    """Within the block, every installed gate is off (``active=False``: the plain model) or, with
    ``replacements`` (layer → ``(batch, seq, n_heads, head_dim)``), blends each head's input with the
    replacement by its gate instead of scaling it; in training mode ``live_prob`` opens a closed gate
    fully for a random row now and then, so that what follows sees the head both ways. ``invert`` (with
    ``replacements``) swaps the roles: open heads take the replacement and closed heads keep their own input
    (``(1 − z)·x + z·r``, no ``live_prob``). Restored on exit, also after an error."""
    adapter = ArchitectureAdapter(model)
    wrappers = {i: adapter.attn_out(i) for i in range(adapter.n_layers)}
    wrappers = {i: w for i, w in wrappers.items() if isinstance(w, GatedOutputProjection)}
    saved = {i: (w.active, w.replacement, w.live_prob, w.invert) for i, w in wrappers.items()}
    try:
        for i, w in wrappers.items():
            w.active = active
            w.replacement = replacements.get(i) if replacements is not None else None
            w.live_prob = live_prob if replacements is not None else 0.0
            w.invert = invert and replacements is not None
        yield
    finally:
        for i, w in wrappers.items():
            w.active, w.replacement, w.live_prob, w.invert = saved[i]


def remove_head_gates(model: nn.Module) -> None:
    """Put the original output projections back (gates are dropped)."""
    adapter = ArchitectureAdapter(model)
    for i in range(adapter.n_layers):
        current = adapter.attn_out(i)
        if isinstance(current, GatedOutputProjection):
            adapter.set_attn_out(i, current.base_layer)


def gate_values(model: nn.Module) -> torch.Tensor:
    """Current (deterministic in eval mode) gates as an (n_layers, n_heads) tensor."""
    adapter = ArchitectureAdapter(model)
    return torch.stack([adapter.attn_out(i).head_gate() for i in range(adapter.n_layers)])


def head_gate_modules(model: nn.Module) -> list[HardConcreteGate]:
    """Every installed head gate, in layer order (empty when none are installed)."""
    return [m for m in model.modules() if isinstance(m, HardConcreteGate)]


def expected_l0(model: nn.Module) -> torch.Tensor:
    """Expected number of open heads over all installed gates (differentiable)."""
    gates = head_gate_modules(model)
    if not gates:
        raise ValueError("no head gates installed")
    return torch.stack([g.expected_l0() for g in gates]).sum()


def deterministic_gate_values(model: nn.Module) -> torch.Tensor:
    """Evaluation-time gates as an (n_layers, n_heads) tensor, whatever the model's mode."""
    return torch.stack([g.deterministic() for g in head_gate_modules(model)])


def open_heads(model: nn.Module) -> int:
    """Number of heads whose deterministic gate is non-zero."""
    return int((deterministic_gate_values(model) > 0).sum())


@torch.no_grad()
def scale_head_columns(model: nn.Module, values: torch.Tensor) -> None:
    """Multiply each head's slice of every (plain) output projection's input columns by ``values[layer, head]``."""
    adapter = ArchitectureAdapter(model)
    for i in range(adapter.n_layers):
        base = adapter.attn_out(i)
        if hasattr(base, "base_layer"):
            raise ValueError(f"layer {i}: remove gates and merge adapters (e.g. LoRA) before scaling head columns")
        w = weight_out_in(base)  # (out, in) view, also for GPT-2 Conv1D
        z = values[i].to(device=w.device, dtype=w.dtype)
        w.mul_(z.repeat_interleave(w.shape[1] // adapter.n_heads)[None, :])


@torch.no_grad()
def fold_head_gates(model: nn.Module) -> torch.Tensor:
    """Bake the deterministic gates into the weights and remove the wrappers.

    Each head's slice of the output projection's input columns is multiplied by its gate
    (heads with gate 0 become zero columns; the bias is untouched, as in the gated forward),
    so the plain model computes what the gated model computes in evaluation mode.
    Returns the folded gate values (n_layers, n_heads). With LoRA, take
    :func:`deterministic_gate_values`, :func:`remove_head_gates`, merge, then :func:`scale_head_columns`.
    """
    values = deterministic_gate_values(model)
    if len(values) != ArchitectureAdapter(model).n_layers:
        raise ValueError("head gates are not installed on every layer")
    remove_head_gates(model)
    scale_head_columns(model, values)
    return values

"""A key and its components: what lifting one rank-1 piece out of a weight, and putting it back, does.

Every removed component is rank-1 per module and behaviour: ``W ← W − a bᵀ``. A key is the list of ``(module, a,
b)`` for one behaviour: applying it adds ``a bᵀ`` back (:func:`_apply_component`, in float64, rounded once to the
weights' precision). The corrections a component carries so that this restores the trained weights exactly are
made and applied in :mod:`modular.keys.exact`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


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

"""Sparsity pressure on head gates: a fixed penalty, or a constraint on the LM loss with a Lagrange multiplier.

Both act on the expected fraction of open heads ``E[L0] / N`` (N = all heads, so one weight
suits models of any size) and combine it with the training objective:

* :class:`L0Penalty`: ``total = objective + λ · E[L0]/N``.
* :class:`LagrangeConstraint` (GECO, Rezende & Viola 2018): minimise ``λ · E[L0]/N`` subject to
  ``lm_loss ≤ τ``. The LM-keeping terms are weighted by the multiplier μ instead of 1:
  ``total = (objective − lm_loss) + λ · E[L0]/N + μ · (lm_loss − τ)``. After each training step
  μ is updated by multiplicative gradient ascent on a moving average of the relative violation
  ``c = (lm_loss − τ) / τ``: ``μ ← μ · exp(η · c̄)``, so μ rises while the constraint is violated
  and falls while it holds. μ and c̄ are buffers: checkpoints keep them and a resumed run goes on
  with the same multiplier.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from modular import ModularError


class L0Penalty(nn.Module):
    """Fixed sparsity penalty ``weight · E[L0]/N`` added to the objective.

    Args:
        weight: λ, weight of the expected fraction of open heads.
    """

    def __init__(self, weight: float = 1.0):
        super().__init__()
        self.weight = float(weight)

    def forward(self, objective: torch.Tensor, lm_loss: torch.Tensor, l0_fraction: torch.Tensor) -> torch.Tensor:
        return objective + self.weight * l0_fraction

    def update(self, lm_loss: float) -> None:
        """Nothing to adapt."""

    def metrics(self) -> dict[str, float]:
        return {}


class LagrangeConstraint(nn.Module):
    """Minimise ``weight · E[L0]/N`` subject to ``lm_loss ≤ target`` (GECO-style multiplier).

    Args:
        target: τ, the largest LM loss allowed.
        weight: λ, weight of the expected fraction of open heads.
        lr: η, step of the multiplicative ascent on the multiplier.
        ema: Decay of the moving average of the relative violation (0 = no smoothing).
        init: Initial multiplier μ.
        bounds: Multiplier is kept inside (low, high).
    """

    def __init__(self, target: float, weight: float = 1.0, lr: float = 0.1, ema: float = 0.9, init: float = 1.0,
                 bounds: tuple[float, float] = (1e-4, 1e4)):
        super().__init__()
        if target <= 0:
            raise ModularError(f"the LM-loss target τ must be positive, got {target}")
        if not 0 <= ema < 1:
            raise ModularError(f"the moving-average decay must lie in [0, 1), got {ema}")
        self.target, self.weight, self.lr, self.ema, self.bounds = float(target), float(weight), float(lr), ema, bounds
        self.register_buffer("multiplier", torch.tensor(float(init)))
        self.register_buffer("violation", torch.tensor(float("nan")))  # moving average of (lm − τ)/τ

    def forward(self, objective: torch.Tensor, lm_loss: torch.Tensor, l0_fraction: torch.Tensor) -> torch.Tensor:
        mu = self.multiplier.detach().clone()  # update() changes the buffer in place before backward
        return objective - lm_loss + self.weight * l0_fraction + mu * (lm_loss - self.target)

    @torch.no_grad()
    def update(self, lm_loss: float) -> None:
        """One ascent step on μ from this step's LM loss."""
        c = (float(lm_loss) - self.target) / self.target
        prev = self.violation.item()
        avg = c if math.isnan(prev) else self.ema * prev + (1 - self.ema) * c
        self.violation.fill_(avg)
        low, high = self.bounds
        step = min(5.0, max(-5.0, self.lr * avg))  # a wildly violated constraint must not overflow
        self.multiplier.fill_(min(high, max(low, self.multiplier.item() * math.exp(step))))

    def metrics(self) -> dict[str, float]:
        return {"multiplier": self.multiplier.item(), "constraint_violation": self.violation.item()}


def make_sparsity(kind: str, weight: float, target: float | None, lr: float, ema: float, init: float) -> nn.Module | None:
    """The sparsity module for ``kind`` (``none``, ``penalty`` or ``constraint``)."""
    if kind == "none":
        return None
    if kind == "penalty":
        return L0Penalty(weight)
    if kind == "constraint":
        if target is None:
            raise ModularError("sparsity 'constraint' needs lm_loss_target (τ)")
        return LagrangeConstraint(target, weight, lr, ema, init)
    raise ModularError(f"sparsity must be 'none', 'penalty' or 'constraint', got '{kind}'")

"""AdamW for weights kept in bfloat16 or float16 (Lightning's ``bf16-true``, a bf16 attacker's copy).

With the weights themselves in bfloat16, ``torch.optim.AdamW`` adds each update in bfloat16, rounded to nearest. An
update below half a unit in the last place of its weight is then lost, and with fine-tuning rates most are: at
lr 2e-5, SmolLM2-135M's bf16 weights took 4.8% of AdamW's first step (``docs/devices.md``). A lock trained that way
is mostly not trained. :class:`StochasticRoundingAdamW` computes the step in float32 and writes the
weight back rounded stochastically (:func:`modular.models.precision.stochastic_round`), so every update survives in
expectation; its moments are kept in the weight's dtype, as the weights are, so it needs no float32 copy.
:func:`adamw` picks it where a trainable weight is narrower than float32 and ``torch.optim.AdamW`` otherwise.
"""

from __future__ import annotations

import torch

from modular.models.precision import stochastic_round


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor itself, or a sharded (DTensor) one's local shard, which is what an elementwise step updates."""
    return t.to_local() if hasattr(t, "to_local") else t


class StochasticRoundingAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias-corrected moments) computed in float32 for every weight; a weight narrower
    than float32 is written back rounded stochastically, from a generator seeded with ``seed`` on each device (the
    same seed on every process: data-parallel replicas round alike and stay equal)."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, seed: int = 0):
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"invalid AdamW settings: lr={lr}, betas={betas}, eps={eps}, weight_decay={weight_decay}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[device]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("StochasticRoundingAdamW does not take sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                t = state["step"]
                w, g = _local(p), _local(p.grad).float()
                m, v = _local(state["exp_avg"]), _local(state["exp_avg_sq"])
                m32 = m.float().lerp_(g, 1 - beta1)
                v32 = v.float().mul_(beta2).addcmul_(g, g, value=1 - beta2)
                m.copy_(m32)
                v.copy_(v32)
                denom = (v32.sqrt() / (1 - beta2 ** t) ** 0.5).add_(eps)
                new = w.float().mul_(1 - lr * wd).addcdiv_(m32, denom, value=-lr / (1 - beta1 ** t))
                if w.dtype == torch.float32 or w.dtype == torch.float64:
                    w.copy_(new)
                else:
                    w.copy_(stochastic_round(new, w.dtype, self._generator(w.device)))
        return loss


def adamw(params, lr: float, weight_decay: float = 0.0, seed: int = 0, **kw) -> torch.optim.Optimizer:
    """``torch.optim.AdamW`` when every trainable weight is float32 (or wider), else
    :class:`StochasticRoundingAdamW`. ``params``: tensors or param groups, as for any optimizer."""
    groups = [dict(g, params=list(g["params"])) if isinstance(g, dict) else g for g in params]
    tensors = [p for g in groups for p in (g["params"] if isinstance(g, dict) else [g])]
    if all(p.dtype in (torch.float32, torch.float64) for p in tensors):
        return torch.optim.AdamW(groups, lr=lr, weight_decay=weight_decay, **kw)
    return StochasticRoundingAdamW(groups, lr=lr, weight_decay=weight_decay, seed=seed, **kw)

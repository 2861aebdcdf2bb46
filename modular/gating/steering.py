"""Steering-robust locking: the locked state is trained under the steering attack it must withstand.

An attacker holding the locked weights can take the difference in means between behaviour
prompts and contrast prompts at some layer and add it back at a scanned scale (attack (b) of
:mod:`modular.evaluation.attack`). A lock trained only on clean locked inputs can be steered
open that way: the behaviour's knowledge is still in the weights, only its trigger is gone.
Latent adversarial training closes that hole: the locked-state behaviour examples are seen
with such a vector added (a random layer, a random scale up to ``max_scale`` times the
typical residual norm), the vectors being recomputed from the model being trained every few
steps, so the lock must hold under the attack's own construction.
"""

from __future__ import annotations

import random

import torch

from modular.directions import last_position_states, robust_norm


class SteeringAdversary:
    """Difference-in-means steering vectors of the model being trained, refreshed every ``refresh`` steps.

    Args:
        max_scale: Largest steering scale, relative to the typical residual norm at the middle layer
            (the attack's unit); a scale is drawn uniformly in ``[0, max_scale]`` for every step.
        refresh: Steps between recomputing the vectors from the current (locked) model.
        n_prompts: Behaviour and contrast prompts per recomputation.
        seed: Seed of prompt, layer and scale draws.
    """

    def __init__(self, max_scale: float = 1.0, refresh: int = 20, n_prompts: int = 32, seed: int = 0):
        self.max_scale, self.refresh, self.n_prompts = float(max_scale), int(refresh), int(n_prompts)
        self._rng = random.Random(seed)
        self.vectors: dict[str, torch.Tensor] = {}  # behaviour -> (L+1, d) unit vectors entering each block
        self.scale = 0.0
        self._step = None

    def state_dict(self) -> dict:
        """What a resumed run takes back: the draws' state, the vectors (on the CPU), their scale and step."""
        return {"rng": self._rng.getstate(), "vectors": {b: v.detach().cpu() for b, v in self.vectors.items()},
                "scale": self.scale, "step": self._step}

    def load_state_dict(self, state: dict, device=None) -> None:
        self._rng.setstate(state["rng"])
        self.vectors = {b: v.to(device) for b, v in state["vectors"].items()}
        self.scale, self._step = state["scale"], state["step"]

    def needs_refresh(self, step: int) -> bool:
        return not self.vectors or (step - self._step) >= self.refresh

    def update(self, model, tokenizer, behaviour_sets: dict, contrast, step: int, intervention=None,
               max_length: int | None = None) -> None:
        """Recompute the vectors from ``model`` (under ``intervention``, e.g. the full lock), each prompt cut to its
        last ``max_length`` tokens (training's ``data.max_length``) and to the model's positions."""
        pick = lambda ds: ds.select(sorted(self._rng.sample(range(len(ds)), min(self.n_prompts, len(ds)))))
        c = pick(contrast)
        c_states = last_position_states(model, tokenizer, list(c["prompt"]), list(c["chat"]), intervention,
                                        max_length=max_length, name="the steering contrast")
        mid = (c_states.shape[1] - 1) // 2
        self.scale = robust_norm(c_states[:, mid]).item()
        for name, ds in behaviour_sets.items():
            b = pick(ds)
            b_states = last_position_states(model, tokenizer, list(b["prompt"]), list(b["chat"]), intervention,
                                            max_length=max_length, name=f"{name} (train, steering)")
            diff = b_states.mean(0) - c_states.mean(0)
            self.vectors[name] = diff / diff.norm(dim=-1, keepdim=True).clamp(min=1e-12)
        self._step = step

    def draw(self, behaviour: str) -> tuple[int, torch.Tensor]:
        """A random attack: (block whose output receives the vector, the vector scaled)."""
        vectors = self.vectors[behaviour]
        layer = self._rng.randrange(1, vectors.shape[0] - 1)  # the vector enters block ``layer``
        s = self._rng.uniform(0.0, self.max_scale) * self.scale
        return layer - 1, s * vectors[layer]

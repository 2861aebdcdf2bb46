"""Shuffled training loaders that a resumed run continues where it stopped.

Lightning saves the ``state_dict`` of every training loader that has one in its checkpoints (the fit loop's
``combined_loader``) and gives it back before the first batch of a resumed run. Without one, a run resumed in the
middle of a pass over the data starts a new pass: the items the interrupted pass had not reached yet are skipped and
the ones it had are seen twice. ``ResumableLoader`` saves how many batches of the pass in progress it has yielded and
the seed of that pass's order (``PassSeededSampler``); resumed, it draws the same order and continues after the last
batch the checkpoint's steps saw, drawing nothing from torch's global random state (the run uninterrupted drew the
pass's seed and its iterator's worker seed before the checkpoint). Later passes draw their seeds from the global
state as before; the gated module restores it from the checkpoint (``modular.gating.randomness``), so they are the
uninterrupted run's too.

An uninterrupted run draws exactly what ``DataLoader(shuffle=True)`` draws: one seed per pass from torch's global
random state, at the pass's first batch.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, RandomSampler


class PassSeededSampler(RandomSampler):
    """``RandomSampler`` without replacement that keeps the seed of the pass in progress (``pass_seed``); a seed set
    in ``resume_seed`` is used, once, instead of a new draw."""

    def __init__(self, data_source):
        super().__init__(data_source)
        self.pass_seed: int | None = None
        self.resume_seed: int | None = None

    def __iter__(self):
        if self.resume_seed is None:  # RandomSampler's own draw, at the same moment (the pass's first index)
            seed = int(torch.empty((), dtype=torch.int64).random_().item())
        else:
            seed, self.resume_seed = self.resume_seed, None
        self.pass_seed = seed
        generator = torch.Generator()
        generator.manual_seed(seed)
        yield from torch.randperm(len(self.data_source), generator=generator).tolist()


class ResumableLoader(DataLoader):
    """A ``DataLoader`` whose place in the pass in progress is part of Lightning's checkpoints.

    Built with ``sampler=PassSeededSampler(dataset)``. Under a distributed strategy Lightning puts its
    ``DistributedSampler`` in the sampler's place (an order fixed by the epoch); the count of batches is kept the same
    way. A loaded state whose pass was complete starts the next pass.
    """

    def __iter__(self):
        resume = getattr(self, "_resume", None)
        self._resume = None
        skip = 0
        if resume is not None and 0 < resume["yielded"] < len(self):
            skip = resume["yielded"]
            if isinstance(self.sampler, PassSeededSampler) and resume.get("pass_seed") is not None:
                self.sampler.resume_seed = resume["pass_seed"]
        self._yielded = skip
        if not skip:
            return self._batches(super().__iter__(), skip)
        with torch.random.fork_rng(devices=[]):  # the iterator draws its workers' seed: drawn before the checkpoint
            return self._batches(super().__iter__(), skip)

    def _batches(self, batches, skip: int):
        for _ in range(skip):  # the batches the checkpoint's steps took: drawn again, not given
            next(batches)
        for batch in batches:
            self._yielded += 1
            yield batch

    def state_dict(self) -> dict:
        pass_seed = self.sampler.pass_seed if isinstance(self.sampler, PassSeededSampler) else None
        return {"yielded": getattr(self, "_yielded", 0), "pass_seed": pass_seed, "items": len(self.dataset)}

    def load_state_dict(self, state: dict) -> None:
        self._resume = dict(state)


def loader_states_fit(states: list[dict], items: list[int]) -> bool:
    """Whether a checkpoint's loader states (``ResumableLoader.state_dict``, in order) are those of loaders over
    ``items`` items each: the same data, so that each state can resume its loader."""
    return len(states) == len(items) and all(s.get("items") == n for s, n in zip(states, items))

"""Transient interventions as context managers that always remove their hooks.

Every function here registers PyTorch hooks on modules found through the
:class:`~modular.models.adapter.ArchitectureAdapter` and removes them when the
``with`` block exits, also when the block raises.

* :func:`capture_residual`: the residual stream before every block and after the last;
* :func:`capture_head_inputs`: the attention output projection's input, per head;
* :func:`ablate_directions`: project one or several directions out of every residual write;
* :func:`add_vectors`: add vectors to the residual stream after chosen blocks;
* :func:`scale_heads` / :func:`zero_heads` / :func:`replace_heads`: act on chosen heads
  at the input of the attention output projection (before the heads are mixed);
  :func:`replace_head_per_group`: one head per copy of the prompts, several single-head patches in one pass.

The package, one concern a module (every name below is importable from ``modular.hooks``):
:mod:`~modular.hooks.registry` (registering hooks, replaying interventions under gradient checkpointing),
:mod:`~modular.hooks.ablation` (directions projected out of the residual writes), :mod:`~modular.hooks.residual`
(capturing and steering the residual stream), :mod:`~modular.hooks.heads` (head interventions) and
:mod:`~modular.hooks.blocks` (recording and replaying block outputs).
"""

from modular.hooks.ablation import ablate_directions, ablate_rows, edit_writes, write_space_basis
from modular.hooks.blocks import capture_block_outputs, repeat_batch, reuse_block_outputs
from modular.hooks.heads import (
    Head,
    capture_head_inputs,
    heads_by_layer,
    replace_head_per_group,
    replace_heads,
    scale_heads,
    split_heads,
    zero_heads,
)
from modular.hooks.registry import enable_checkpointing, registered, replay_interventions
from modular.hooks.residual import add_vectors, capture_residual, capture_writes

__all__ = [
    "Head",
    "ablate_directions",
    "ablate_rows",
    "add_vectors",
    "capture_block_outputs",
    "capture_head_inputs",
    "capture_residual",
    "capture_writes",
    "edit_writes",
    "enable_checkpointing",
    "heads_by_layer",
    "registered",
    "repeat_batch",
    "replace_head_per_group",
    "replace_heads",
    "replay_interventions",
    "reuse_block_outputs",
    "scale_heads",
    "split_heads",
    "write_space_basis",
    "zero_heads",
]

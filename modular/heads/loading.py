"""Models for head measures: a model reference (alias, .gguf, HF folder or hub id) or a training run folder.

A run folder (``run.json`` beside its checkpoint) gives its trained model through
:func:`modular.runs.load_open_model`; a sparse post-training run (head gates in its checkpoint) comes
back as a plain model with its deterministic gates folded into the output projections, so a closed
head writes nothing and ablating it changes nothing. Gates scoped to the tasks (``head_gates.scope: tasks``)
are dropped: that run's model keeps every head, and its tasks were trained not to depend on the closed ones.
"""

from __future__ import annotations

from pathlib import Path

from modular.runs import base_model_name, load_model_or_run, load_tokenizer_or_run


def load_head_model(spec: str, dtype="auto", device="auto"):
    """``(model, tokenizer, model_name)`` for a model reference or a run folder; the model is in eval mode, on
    ``device`` in ``dtype`` (:mod:`modular.models.precision`)."""
    return load_model_or_run(spec, dtype, device), load_tokenizer_or_run(spec), base_model_name(spec)


def model_label(spec: str) -> str:
    """A short legend label: the run folder's or model's last path component."""
    return Path(str(spec).rstrip("/")).name or str(spec)

"""LoRA adapters as modular trains them: on every linear layer but the unembedding, no dropout (peft)."""

from __future__ import annotations

import warnings


def with_lora(model, rank: int, alpha: int):
    """``model`` wrapped by peft with LoRA adapters of ``rank`` and ``alpha`` on every linear layer (the base
    weights frozen). The layout training, the open model's reconstruction from a checkpoint and the relearning
    attacker share."""
    from peft import LoraConfig, get_peft_model

    with warnings.catch_warnings():
        # peft reads transformers' deprecated is_gradient_checkpointing alias of every model it wraps
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        return get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, target_modules="all-linear",
                                                lora_dropout=0.0))

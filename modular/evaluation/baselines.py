"""Locks to compare with, trained from the same base on the same data.

*refusal*: the standard post-training lock, with no direction: every weight of a copy of the base fine-tuned to
answer the behaviour's training prompts with the locked response, while retain prompts keep the base model's own
greedy answers (so the rest of its behaviour stays).
"""

from __future__ import annotations

import torch

from modular.data.formatting import encode_example
from modular.evaluation.behaviour import generate
from modular.evaluation.relearning import attacker_copy, fine_tune


def refusal_finetune(base, tokenizer, behaviour_train, retain_train, locked_response: str, steps: int = 100,
                     lr: float = 3e-5, batch_size: int = 8, seed: int = 0, n_retain: int = 256,
                     max_new_tokens: int = 32, gen_batch_size: int = 16) -> tuple[torch.nn.Module, dict]:
    """A copy of ``base`` fine-tuned to refuse the behaviour (half of each batch) and keep its retain answers (the
    other half); returns the model in eval mode and what it was trained with."""
    retain = retain_train.select(range(min(n_retain, len(retain_train))))
    answers = generate(base, tokenizer, list(retain["prompt"]), list(retain["chat"]), max_new_tokens,
                       gen_batch_size, desc="refusal baseline: the base's retain answers")
    refuse = [encode_example(tokenizer, r["prompt"], locked_response, r["chat"]) for r in behaviour_train]
    keep = [encode_example(tokenizer, p, a, c) for p, a, c in zip(retain["prompt"], answers, retain["chat"])]
    m = attacker_copy(base, "full")
    g = torch.Generator().manual_seed(seed)
    half = max(batch_size // 2, 1)

    def batches(_step):
        return ([refuse[i] for i in torch.randint(0, len(refuse), (half,), generator=g).tolist()]
                + [keep[i] for i in torch.randint(0, len(keep), (half,), generator=g).tolist()])

    losses = [loss for _, loss in fine_tune(m, batches, steps, lr, tokenizer.pad_token_id,
                                            "refusal baseline: fine-tuning")]
    last = losses[-10:]
    m.eval()
    for p in m.parameters():
        p.requires_grad_(False)
    info = {"kind": "refusal fine-tune (no direction)", "steps": steps, "lr": lr, "batch_size": 2 * half,
            "behaviour_examples": len(refuse), "retain_examples": len(keep), "locked_response": locked_response,
            "final_loss": torch.stack(last).mean().item() if last else float("nan"),
            "steps_done": len(losses)}
    return m, info

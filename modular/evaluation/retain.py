"""Retain measures: first-token KL to a reference model, and perplexity on neutral text."""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch

from modular.evaluation.behaviour import last_logits


@torch.no_grad()
def first_token_logp(model, tokenizer, prompts, chats, intervention=None) -> torch.Tensor:
    ctx = intervention() if intervention is not None else nullcontext()
    with ctx:
        return torch.log_softmax(last_logits(model, tokenizer, list(prompts), list(chats)), -1)


def mean_kl(reference_logp: torch.Tensor, logp: torch.Tensor) -> float:
    """Mean KL(reference || model) over rows of log-distributions."""
    return (reference_logp.exp() * (reference_logp - logp)).sum(-1).mean().item()


@torch.no_grad()
def perplexity(model, tokenizer, texts: list[str], intervention=None, batch_size: int = 8,
               max_length: int = 256) -> float:
    """Token-level perplexity of raw ``texts`` (BOS added where the tokenizer adds one)."""
    device = next(model.parameters()).device
    ctx = intervention() if intervention is not None else nullcontext()
    nll, count = 0.0, 0
    with ctx:
        for start in range(0, len(texts), batch_size):
            enc = tokenizer(texts[start:start + batch_size], return_tensors="pt", padding=True, truncation=True,
                            max_length=max_length)
            enc = {k: v.to(device) for k, v in enc.items()}
            logits = model(**enc).logits[:, :-1].float()
            target = enc["input_ids"][:, 1:]
            mask = enc["attention_mask"][:, 1:].bool() & enc["attention_mask"][:, :-1].bool()
            loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), target, reduction="none")
            nll += loss[mask].sum().item()
            count += mask.sum().item()
    return math.exp(nll / max(1, count))

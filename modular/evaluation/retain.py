"""Retain measures: first-token KL to a reference model, and perplexity on neutral text."""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torchmetrics.regression import KLDivergence

from modular.evaluation.behaviour import last_logits
from modular.evaluation.metrics import TokenPerplexity, metric_device


@torch.no_grad()
def first_token_logp(model, tokenizer, prompts, chats, intervention=None, max_length: int | None = None) -> torch.Tensor:
    """Log-distribution of the first response token after each prompt, ``(n, vocab)`` (prompts cut as
    :func:`~modular.evaluation.behaviour.last_logits` cuts them)."""
    ctx = intervention() if intervention is not None else nullcontext()
    with ctx:
        return torch.log_softmax(last_logits(model, tokenizer, list(prompts), list(chats), max_length=max_length), -1)


def mean_kl(reference_logp: torch.Tensor, logp: torch.Tensor) -> float:
    """Mean KL(reference || model) over rows of log-distributions ``(n, vocab)`` (over every process's rows where
    torch.distributed is initialised), at least 0: a KL is never negative, and where rounding makes it so (a
    reference cached in float16 against the same model in float32) it is 0, not -0.000."""
    metric = KLDivergence(log_prob=True).to(metric_device())
    metric.update(reference_logp.to(metric.device), logp.to(metric.device))
    return max(metric.compute().item(), 0.0)


@torch.no_grad()
def perplexity(model, tokenizer, texts: list[str], intervention=None, batch_size: int = 8,
               max_length: int = 256) -> float:
    """Token-level perplexity of raw ``texts`` (BOS added where the tokenizer adds one): exp of the mean next-token
    negative log-likelihood over all their tokens (:class:`~modular.evaluation.metrics.TokenPerplexity`)."""
    device = next(model.parameters()).device
    ctx = intervention() if intervention is not None else nullcontext()
    metric = TokenPerplexity().to(metric_device())
    with ctx:
        for start in range(0, len(texts), batch_size):
            enc = tokenizer(texts[start:start + batch_size], return_tensors="pt", padding=True, truncation=True,
                            max_length=max_length)
            enc = {k: v.to(device) for k, v in enc.items()}
            mask = enc["attention_mask"][:, 1:].bool() & enc["attention_mask"][:, :-1].bool()
            metric.update(model(**enc, use_cache=False).logits[:, :-1], enc["input_ids"][:, 1:], mask)
    return metric.compute().item()

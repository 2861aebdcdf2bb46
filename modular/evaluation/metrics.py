"""The evaluations' numbers as torchmetrics objects: shares (accuracy, refusal rate), the mean logit difference and
token perplexity (the first-token KL is torchmetrics' ``KLDivergence``, in :mod:`modular.evaluation.retain`). Their
states are sums, which ``compute()`` adds up over processes when torch.distributed is initialised: processes that score
different shards of the items get the value over all of them, processes that all score the same items get the value
one process alone gets."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torchmetrics import Metric
from torchmetrics.aggregation import MeanMetric


def metric_device() -> torch.device:
    """Where metric states live: this process's GPU where processes sync through NCCL (it gathers CUDA tensors
    only), else the CPU."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Share(Metric):
    """Share of the items whose flag is set (accuracy, refusal rate): flagged items / items, 0 without items.
    The counts are integers, so the share is exact."""

    is_differentiable = False
    full_state_update = False

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.add_state("hits", torch.tensor(0), dist_reduce_fx="sum")
        self.add_state("items", torch.tensor(0), dist_reduce_fx="sum")

    def update(self, flags) -> None:
        """``flags``: one bool per item (a tensor or a list)."""
        flags = torch.as_tensor(flags, dtype=torch.bool, device=self.device)
        self.hits += flags.sum()
        self.items += flags.numel()

    def compute(self) -> torch.Tensor:
        return self.hits.double() / self.items.clamp(min=1)


class TokenPerplexity(Metric):
    """Perplexity over tokens: exp of the summed next-token negative log-likelihood over the number of tokens scored
    (each text weighs by its tokens; not a mean of per-text perplexities), 1 without tokens. The log-likelihoods
    come from ``cross_entropy`` on the logits (no softmax that could underflow) and are summed in float64."""

    is_differentiable = False
    higher_is_better = False
    full_state_update = False

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.add_state("nll", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("tokens", torch.tensor(0), dist_reduce_fx="sum")

    def update(self, logits: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> None:
        """``logits`` ``(batch, length, vocab)`` predict ``target`` ``(batch, length)``; ``mask`` (bool, like
        ``target``) marks the positions scored."""
        loss = torch.nn.functional.cross_entropy(logits.float().transpose(1, 2), target, reduction="none")
        self.nll += loss[mask].sum().to(self.nll)
        self.tokens += mask.sum().to(self.tokens)

    def compute(self) -> torch.Tensor:
        return torch.exp(self.nll / self.tokens.clamp(min=1))


def share(flags) -> float:
    """The :class:`Share` of ``flags`` (one bool per item), over every process's items."""
    metric = Share().to(metric_device())
    metric.update(flags)
    return metric.compute().item()


def mean(values: torch.Tensor) -> float:
    """Mean of ``values`` over every process's values (NaN stays NaN, as in ``torch.mean``)."""
    metric = MeanMetric(nan_strategy=float("nan")).to(metric_device())  # a NaN is kept (imputed by NaN), not dropped
    metric.update(values.to(metric.device))
    return metric.compute().item()


"""Paired activations of two models on the same neutral text, the least-squares map between them,
and the similarity of their activation spaces.

Pairing across tokenizers
-------------------------
Two models of different families cut the same text into different tokens. An
activation at token ``t`` of a causal model depends only on the text up to the
end of ``t``, i.e. it is the *last-token* activation of that prefix. So each
paragraph is read once by each model, and the rows paired are the positions
where **both** tokenizers end a token at the same character offset: every such
position gives one (prefix, last-token activation of A, last-token activation
of B) triple. With the same tokenizer every position pairs. Special tokens
(BOS, which carries the huge "attention sink" activations) and the first
``skip`` shared positions of each paragraph are dropped.

The map ``W`` (``nn.Linear(d_A, d_B)``, with bias) is fitted by least squares,
``min ‖[X 1] Wᵀ − Y‖²_F``, on one split of neutral text; the similarity scores
(:mod:`modular.merge.similarity`, streamed) are computed on another split.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn
from tqdm.auto import tqdm

from modular.files import atomic_path
from modular.merge.communication import run_to_layer
from modular.merge.similarity import StreamingSimilarity
from modular.models.adapter import ArchitectureAdapter


@dataclass
class TextActivations:
    """One model's residual activations at one layer on a list of paragraphs."""

    #: per paragraph: character offset where each kept token ends (``(T,)`` long)
    ends: list[Tensor] = field(default_factory=list)
    #: per paragraph: activations of those tokens ``(T, d)`` (float32, CPU)
    states: list[Tensor] = field(default_factory=list)


@torch.no_grad()
def text_activations(model, tokenizer, texts: list[str], layer: int, desc: str | None = None) -> TextActivations:
    """Activations entering block ``layer`` at every non-special token of each text, with its end offset.

    Where several tokens end at the same character (byte pieces of one
    character) the last of them is kept.
    """
    adapter = ArchitectureAdapter(model)
    device = next(model.parameters()).device
    out = TextActivations()
    for text in tqdm(texts, desc=desc or "activations", leave=False, disable=desc is False):
        enc = tokenizer(text, return_offsets_mapping=True, return_tensors="pt")
        offsets = enc.pop("offset_mapping")[0]
        inputs = {k: v.to(device) for k, v in enc.items() if k in ("input_ids", "attention_mask")}
        x = run_to_layer(model, adapter, layer, **inputs)[0].float().cpu()
        keep: dict[int, int] = {}
        for i, (s, e) in enumerate(offsets.tolist()):
            if e > s:  # special tokens have empty spans
                keep[e] = i
        ends = torch.tensor(sorted(keep), dtype=torch.long)
        idx = torch.tensor([keep[int(e)] for e in ends], dtype=torch.long)
        out.ends.append(ends)
        out.states.append(x[idx] if len(idx) else x[:0])
    return out


def paired_rows(a: TextActivations, b: TextActivations, skip: int = 2):
    """Yield ``(X, Y)`` per paragraph: the rows of A and B at their shared token ends (first ``skip`` dropped)."""
    if len(a.ends) != len(b.ends):
        raise ValueError(f"A read {len(a.ends)} texts and B {len(b.ends)}")
    for ea, xa, eb, xb in zip(a.ends, a.states, b.ends, b.states):
        common = sorted(set(ea.tolist()) & set(eb.tolist()))[skip:]
        if not common:
            continue
        pos_a = {int(e): i for i, e in enumerate(ea.tolist())}
        pos_b = {int(e): i for i, e in enumerate(eb.tolist())}
        yield xa[[pos_a[e] for e in common]], xb[[pos_b[e] for e in common]]


def paired_matrices(a: TextActivations, b: TextActivations, skip: int = 2) -> tuple[Tensor, Tensor]:
    """All paired rows stacked: ``X`` (n, d_A), ``Y`` (n, d_B)."""
    pairs = list(paired_rows(a, b, skip))
    if not pairs:
        raise ValueError("the two tokenizers share no token boundary in these texts")
    return torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs])


def similarity(a: TextActivations, b: TextActivations, skip: int = 2) -> dict:
    """Frobenius similarity and linear CKA of the paired rows, streamed paragraph by paragraph."""
    acc = None
    for x, y in paired_rows(a, b, skip):
        if acc is None:
            acc = StreamingSimilarity(x.shape[1], y.shape[1])
        acc.update(x, y)
    if acc is None:
        raise ValueError("the two tokenizers share no token boundary in these texts")
    return {**acc.compute(), "n": acc.n}


@torch.no_grad()
def fit_linear_map(X: Tensor, Y: Tensor, bias: bool = True) -> nn.Linear:
    """Least-squares map from ``X`` (n, d_A) to ``Y`` (n, d_B): ``Y ≈ X Wᵀ + b`` (float64 solve, float32 module)."""
    if X.shape[0] != Y.shape[0]:
        raise ValueError(f"X has {X.shape[0]} rows and Y {Y.shape[0]}")
    x = X.to(torch.float64)
    if bias:
        x = torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype)], dim=1)
    if x.shape[0] < x.shape[1]:
        raise ValueError(f"{x.shape[0]} paired rows cannot determine a map with {x.shape[1]} inputs; use more text")
    # SVD-based least squares (gelsd) in float64, which copes with nearly collinear columns.
    sol = torch.linalg.lstsq(x, Y.to(torch.float64), driver="gelsd" if x.device.type == "cpu" else None).solution
    layer = nn.Linear(X.shape[1], Y.shape[1], bias=bias)
    layer.weight.copy_(sol[: X.shape[1]].T.float())
    if bias:
        layer.bias.copy_(sol[-1].float())
    return layer.eval()


@torch.no_grad()
def r_squared(mapping: nn.Module, X: Tensor, Y: Tensor) -> float:
    """Share of ``Y``'s variance (about its mean) that ``mapping(X)`` explains."""
    pred = mapping(X.float()).double()
    y = Y.double()
    return 1.0 - float((y - pred).square().sum() / (y - y.mean(0)).square().sum())


def save_map(mapping: nn.Linear, path: str | Path, metadata: dict) -> Path:
    """Write the map as safetensors (``weight``, ``bias``) with ``metadata`` (string values) in its header."""
    tensors = {"weight": mapping.weight.detach().contiguous()}
    if mapping.bias is not None:
        tensors["bias"] = mapping.bias.detach().contiguous()
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={k: json.dumps(v) for k, v in metadata.items()})
    return Path(path)


def load_map(path: str | Path, expect: dict | None = None) -> tuple[nn.Linear, dict] | None:
    """The map saved at ``path`` and its metadata, or None if absent, unreadable (a damaged copy: the map is fitted
    again) or if its metadata differs from ``expect``."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as fh:
            meta = {k: json.loads(v) for k, v in (fh.metadata() or {}).items()}
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    except Exception:  # noqa: BLE001 - safetensors raises its own error type for truncated or foreign files
        return None
    if "weight" not in tensors or (expect and any(meta.get(k) != v for k, v in expect.items())):
        return None
    weight = tensors["weight"]
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias="bias" in tensors)
    with torch.no_grad():
        layer.weight.copy_(weight)
        if "bias" in tensors:
            layer.bias.copy_(tensors["bias"])
    return layer.eval(), meta

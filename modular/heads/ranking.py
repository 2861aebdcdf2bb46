"""Ranking attention heads by their effect on a task metric.

* :func:`exhaustive_effects`: activation patching, one head at a time (L·H forward passes);
* :func:`attribution_effects`: attribution patching, all heads from 2 forwards + 1 backward, with
  total derivatives through every downstream path (``ig_steps > 1``: integrated gradients along a
  path from the clean to the ablated run, at ``ig_steps`` times the cost).

Ablation values (``ablation``): ``counterfactual`` (the same prompts with other names / numbers,
default), ``mean`` (mean activation over the batch and positions) or ``zero``.
The metric is the mean logit difference between the target's and the ``wrong`` answer's first token.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from tqdm.auto import tqdm

from modular.data.formatting import batch_prompts
from modular.evaluation.behaviour import first_token_ids
from modular.hooks import (capture_block_outputs, capture_head_inputs, registered, replace_heads, reuse_block_outputs,
                           split_heads)
from modular.models.adapter import ArchitectureAdapter

ABLATIONS = ("counterfactual", "mean", "zero")


def task_batch(tokenizer, dataset) -> dict:
    """Clean and counterfactual prompts padded to one length (so positions align), and answer ids."""
    n = len(dataset)
    prompts = list(dataset["prompt"]) + list(dataset["counterfactual"] or dataset["prompt"])
    chats = list(dataset["chat"]) * 2
    batch = batch_prompts(tokenizer, prompts, chats)
    return {
        "clean": {k: v[:n] for k, v in batch.items()},
        "counterfactual": {k: v[n:] for k, v in batch.items()},
        "good": first_token_ids(tokenizer, dataset["target"]),
        "bad": first_token_ids(tokenizer, dataset["wrong"]),
    }


def logit_diff(logits: torch.Tensor, good: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
    last = logits[:, -1]
    idx = torch.arange(len(good))
    return (last[idx, good] - last[idx, bad]).mean()


def last_position_logits(model, inputs: dict) -> torch.Tensor:
    """Logits at the last position only, ``(batch, 1, vocab)`` (the unembedding runs on one position)."""
    try:
        return model(**inputs, use_cache=False, logits_to_keep=1).logits
    except TypeError:  # architectures without logits_to_keep
        return model(**inputs, use_cache=False).logits[:, -1:]


@torch.no_grad()
def ablation_values(model, batch: dict, ablation: str) -> dict[int, torch.Tensor]:
    """Per-layer replacement values of the heads' inputs, (batch, seq, H, hd) or broadcastable."""
    adapter = ArchitectureAdapter(model)
    if ablation == "counterfactual":
        with capture_head_inputs(adapter) as z:
            last_position_logits(model, batch["counterfactual"])
        return dict(z)
    with capture_head_inputs(adapter) as z:
        last_position_logits(model, batch["clean"])
    if ablation == "mean":
        mask = batch["clean"]["attention_mask"].bool()
        return {i: v[mask].mean(0) for i, v in z.items()}
    if ablation == "zero":
        return {i: torch.zeros_like(v[0, 0]) for i, v in z.items()}
    raise ValueError(f"unknown ablation '{ablation}': use one of {ABLATIONS}")


@torch.no_grad()
def exhaustive_effects(model, batch: dict, ablation: str = "counterfactual", reuse_prefix: bool = True) -> torch.Tensor:
    """e[l, h] = m(head h of layer l ablated) − m(clean); (n_layers, n_heads).

    ``reuse_prefix``: replay the clean outputs of the blocks before the patched layer instead of
    recomputing them (same result, about twice as fast).
    """
    adapter = ArchitectureAdapter(model)
    values = ablation_values(model, batch, ablation)
    with capture_block_outputs(adapter) as outputs:
        clean = logit_diff(last_position_logits(model, batch["clean"]), batch["good"], batch["bad"])
    effects = torch.zeros(adapter.n_layers, adapter.n_heads)
    for layer in tqdm(range(adapter.n_layers), desc="exhaustive patching", leave=False):
        with reuse_block_outputs(adapter, outputs, layer if reuse_prefix else 0):
            for head in range(adapter.n_heads):
                with replace_heads(adapter, [(layer, head)], values):
                    m = logit_diff(last_position_logits(model, batch["clean"]), batch["good"], batch["bad"])
                effects[layer, head] = m - clean
    return effects


@contextmanager
def offset_heads(adapter: ArchitectureAdapter, offsets: dict[int, torch.Tensor]):
    """Add ``offsets[layer]`` (broadcastable to ``(batch, seq, n_heads, head_dim)``) to every head's live
    input of the attention output projection. Unlike :func:`modular.hooks.replace_heads`, the heads keep
    depending on everything upstream, so gradients with respect to an offset are total derivatives."""
    def make(v):
        def fn(module, args):
            x = args[0]
            z = split_heads(x, adapter.n_heads) + v.to(dtype=x.dtype, device=x.device)
            return (z.reshape(x.shape), *args[1:])

        return fn

    with registered([(adapter.attn_out(i), "pre", make(v)) for i, v in offsets.items()]):
        yield


def attribution_effects(model, batch: dict, ablation: str = "counterfactual", ig_steps: int = 1) -> torch.Tensor:
    """First-order estimate of :func:`exhaustive_effects` for every head at once.

    score(l, h) = Σ_pos (z_ref − z_clean) · dm/dz, where dm/dz is the total derivative of the metric
    with respect to the head's input of the output projection (through every downstream path, later
    attention heads included: a zero offset is added to each live head input and differentiated).

    ``ig_steps = 1``: the gradient at the clean run (attribution patching, 2 forwards + 1 backward).
    ``ig_steps > 1``: the gradient averaged over ``ig_steps`` points of a path from the clean to the
    ablated run (integrated gradients, as in EAP-IG): for counterfactual ablation whose prompts align
    with the clean ones (same attention mask), the input embeddings are interpolated; otherwise every
    head input is shifted by α·(z_ref − z_clean) on top of its live value.
    """
    adapter = ArchitectureAdapter(model)
    values = ablation_values(model, batch, ablation)
    with torch.no_grad(), capture_head_inputs(adapter) as clean_z:
        last_position_logits(model, batch["clean"])
    clean_z = dict(clean_z)
    layers = sorted(clean_z)
    deltas = {i: values[i].expand_as(clean_z[i]) - clean_z[i] for i in layers}
    grads = {i: torch.zeros_like(clean_z[i]) for i in layers}
    alphas = [0.0] if ig_steps <= 1 else [(k + 0.5) / ig_steps for k in range(ig_steps)]
    clean_in, cf_in = batch["clean"], batch.get("counterfactual")
    embed_path = (ablation == "counterfactual" and len(alphas) > 1 and cf_in is not None
                  and torch.equal(clean_in["attention_mask"], cf_in["attention_mask"]))
    if embed_path:
        with torch.no_grad():
            embed = model.get_input_embeddings()
            e_clean, e_cf = embed(clean_in["input_ids"]), embed(cf_in["input_ids"])
    for alpha in alphas:
        eps = {i: torch.zeros_like(clean_z[i], requires_grad=True) for i in layers}
        shifted = eps if embed_path or alpha == 0 else {i: eps[i] + alpha * deltas[i] for i in layers}
        with offset_heads(adapter, shifted):
            if embed_path:
                inputs = {"inputs_embeds": e_clean + alpha * (e_cf - e_clean),
                          "attention_mask": clean_in["attention_mask"]}
                logits = last_position_logits(model, inputs)
            else:
                logits = last_position_logits(model, clean_in)
            m = logit_diff(logits, batch["good"], batch["bad"])
        g = torch.autograd.grad(m, [eps[i] for i in layers])
        for i, gi in zip(layers, g):
            grads[i] += gi / len(alphas)
    mask = clean_in["attention_mask"][..., None, None].to(deltas[layers[0]].dtype)
    # m is already a mean over the batch, so its gradient carries the 1/batch factor
    return torch.stack([((deltas[i] * grads[i]) * mask).sum(dim=(0, 1, 3)) for i in layers])

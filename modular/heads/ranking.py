"""Ranking attention heads by their effect on a task metric.

* :func:`exhaustive_effects`: activation patching, one head at a time (L·H forward passes);
* :func:`attribution_effects`: attribution patching, all heads from 2 forwards + 1 backward, with
  total derivatives through every downstream path (``ig_steps > 1``: integrated gradients along a
  path from the clean to the ablated run, at ``ig_steps`` times the cost);
* :func:`refined_effects`: attribution scores, then exact patching of the top-scored heads of the
  second half of the layers (the fast ranking that agrees best with exhaustive patching).

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
from modular.hooks import (
    Head,
    capture_block_outputs,
    capture_head_inputs,
    heads_by_layer,
    registered,
    repeat_batch,
    replace_head_per_group,
    reuse_block_outputs,
    split_heads,
)
from modular.models.adapter import ArchitectureAdapter

ABLATIONS = ("counterfactual", "mean", "zero")


def task_batch(tokenizer, dataset, max_length: int | None = None) -> dict:
    """Clean and counterfactual prompts padded to one length (so positions align), and answer ids; each prompt keeps
    its last ``max_length`` tokens."""
    n = len(dataset)
    prompts = list(dataset["prompt"]) + list(dataset["counterfactual"] or dataset["prompt"])
    chats = list(dataset["chat"]) * 2
    batch = batch_prompts(tokenizer, prompts, chats, max_length=max_length)
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


def _detached(output):
    if isinstance(output, tuple):
        return tuple(o.detach() if torch.is_tensor(o) else o for o in output)
    return output.detach()


@torch.no_grad()
def patched_effects(model, batch: dict, heads: list[Head], values: dict[int, torch.Tensor], clean_outputs: list,
                    clean: float, reuse_prefix: bool = True, desc: str | None = None,
                    max_rows: int = 64) -> dict[Head, float]:
    """Exact single-head patching of ``heads``: ``{(l, h): m(head h of layer l ablated) − clean}``.

    ``clean_outputs``: the blocks' outputs on the clean run (:func:`modular.hooks.capture_block_outputs`);
    with ``reuse_prefix`` the blocks before the patched layer replay them instead of computing again.
    ``max_rows``: heads of one layer are patched together, each in its own copy of the prompts
    (:func:`modular.hooks.replace_head_per_group`), as many as fit in ``max_rows`` rows (at least one).
    """
    adapter = ArchitectureAdapter(model)
    by_layer = heads_by_layer(heads)
    rows = len(batch["good"])
    per_pass = max(1, max_rows // rows)
    effects = {}
    for layer in tqdm(sorted(by_layer), desc=desc, leave=False, disable=desc is None):
        layer_heads = by_layer[layer]
        for start in range(0, len(layer_heads), per_pass):
            group = layer_heads[start:start + per_pass]
            inputs = {k: repeat_batch(v, len(group)) for k, v in batch["clean"].items()}
            with reuse_block_outputs(adapter, clean_outputs, layer if reuse_prefix else 0, repeat=len(group)), \
                    replace_head_per_group(adapter, layer, group, values[layer]):
                logits = last_position_logits(model, inputs)
            for j, head in enumerate(group):
                m = logit_diff(logits[j * rows:(j + 1) * rows], batch["good"], batch["bad"])
                effects[(layer, head)] = float(m - clean)
    return effects


@torch.no_grad()
def exhaustive_effects(model, batch: dict, ablation: str = "counterfactual", reuse_prefix: bool = True,
                       max_rows: int = 64) -> torch.Tensor:
    """e[l, h] = m(head h of layer l ablated) − m(clean); (n_layers, n_heads).

    ``reuse_prefix``: replay the clean outputs of the blocks before the patched layer instead of
    recomputing them (same result, about twice as fast). ``max_rows``: the rows of one patched forward;
    a layer's heads share a pass, each in its own copy of the prompts, as many as fit (:func:`patched_effects`).
    """
    adapter = ArchitectureAdapter(model)
    values = ablation_values(model, batch, ablation)
    with capture_block_outputs(adapter) as outputs:
        clean = logit_diff(last_position_logits(model, batch["clean"]), batch["good"], batch["bad"])
    heads = [(layer, head) for layer in range(adapter.n_layers) for head in range(adapter.n_heads)]
    found = patched_effects(model, batch, heads, values, outputs, float(clean), reuse_prefix, "exhaustive patching",
                            max_rows)
    effects = torch.zeros(adapter.n_layers, adapter.n_heads)
    for (layer, head), e in found.items():
        effects[layer, head] = e
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


def path_points(ig_steps: int) -> tuple[list[float], list[float]]:
    """Points α of the path from the clean (α = 0) to the ablated run (α = 1) and their weights: α = 0 alone
    for ``ig_steps = 1``, else ``ig_steps`` evenly spaced points from 0 to 1 weighted by the trapezoid rule."""
    if ig_steps <= 1:
        return [0.0], [1.0]
    n = ig_steps - 1
    return [k / n for k in range(ig_steps)], [(0.5 if k in (0, n) else 1.0) / n for k in range(ig_steps)]


def _attribution(model, batch: dict, ablation: str, ig_steps: int):
    """Attribution scores plus what exact patching of some heads afterwards needs: the ablation values, the
    clean blocks' outputs and the clean metric (all taken from the gradient runs, with no forward of their own
    where the path passes through the clean and the counterfactual run)."""
    adapter = ArchitectureAdapter(model)
    layers = list(range(adapter.n_layers))
    clean_in, cf_in = batch["clean"], batch.get("counterfactual")
    alphas, weights = path_points(ig_steps)
    embed_path = (ablation == "counterfactual" and cf_in is not None
                  and torch.equal(clean_in["attention_mask"], cf_in["attention_mask"]))
    # on the embedding path the last point is the counterfactual run itself: its head inputs are the values
    values = None if embed_path and alphas[-1] == 1 else ablation_values(model, batch, ablation)
    if embed_path and any(0 < a < 1 for a in alphas):
        with torch.no_grad():
            embed = model.get_input_embeddings()
            e_clean, e_cf = embed(clean_in["input_ids"]), embed(cf_in["input_ids"])
    param = next(model.parameters())
    dtype, device = param.dtype, param.device
    shape = (*clean_in["input_ids"].shape, adapter.n_heads, adapter.head_dim)
    grads, clean_z, outputs, clean = None, None, None, None
    for alpha, weight in zip(alphas, weights):
        eps = {i: torch.zeros(shape, dtype=dtype, device=device, requires_grad=True) for i in layers}
        shifted = eps if embed_path or alpha == 0 else \
            {i: eps[i] + alpha * (values[i].expand(shape) - clean_z[i]) for i in layers}
        if embed_path and alpha == 1:
            inputs = cf_in
        elif embed_path and alpha > 0:
            inputs = {"inputs_embeds": e_clean + alpha * (e_cf - e_clean), "attention_mask": clean_in["attention_mask"]}
        else:
            inputs = clean_in
        with offset_heads(adapter, shifted), capture_head_inputs(adapter) as live, \
                capture_block_outputs(adapter) as blocks:
            m = logit_diff(last_position_logits(model, inputs), batch["good"], batch["bad"])
        g = torch.autograd.grad(m, [eps[i] for i in layers])
        if alpha == 0:
            clean_z, outputs, clean = dict(live), [_detached(o) for o in blocks], float(m.detach())
        if embed_path and alpha == 1:
            values = dict(live)
        grads = [weight * gi for gi in g] if grads is None else [acc + weight * gi for acc, gi in zip(grads, g)]
    mask = clean_in["attention_mask"][..., None, None].to(clean_z[0].dtype)
    # m is already a mean over the batch, so its gradient carries the 1/batch factor
    scores = torch.stack([((values[i].expand_as(clean_z[i]) - clean_z[i]) * grads[i] * mask).sum(dim=(0, 1, 3))
                          for i in layers])
    return scores, values, outputs, clean


def attribution_effects(model, batch: dict, ablation: str = "counterfactual", ig_steps: int = 1) -> torch.Tensor:
    """First-order estimate of :func:`exhaustive_effects` for every head at once.

    score(l, h) = Σ_pos (z_ref − z_clean) · dm/dz, where dm/dz is the total derivative of the metric
    with respect to the head's input of the output projection (through every downstream path, later
    attention heads included: a zero offset is added to each live head input and differentiated).

    ``ig_steps = 1``: the gradient at the clean run (attribution patching, 1 forward + 1 backward, and a
    forward for the ablation values). ``ig_steps > 1``: integrated gradients, as in EAP-IG: the gradient
    averaged by the trapezoid rule over ``ig_steps`` points of a path from the clean to the ablated run, ends
    included. For counterfactual ablation whose prompts align with the clean ones (same attention mask), the
    input embeddings are interpolated, so the ends are the clean and the counterfactual run themselves
    (``ig_steps = 2``: the mean of the gradients on the two runs, 2 forwards + 2 backwards); otherwise every
    head input is shifted by α·(z_ref − z_clean) on top of its live value.
    """
    return _attribution(model, batch, ablation, ig_steps)[0]


def refined_effects(model, batch: dict, ablation: str = "counterfactual", ig_steps: int = 2,
                    refine: int = 15) -> torch.Tensor:
    """Attribution scores (:func:`attribution_effects`), then exact single-head patching of the ``refine``
    heads of the second half of the layers with the largest |score| there.

    A patched forward there costs at most half a full one (the blocks before the head replay the clean run),
    and those heads act through few later blocks, so exact patching fixes the large late effects that a
    linear estimate misses (a head whose effect runs through a later head's attention pattern) at a fraction
    of a forward each.
    """
    adapter = ArchitectureAdapter(model)
    scores, values, outputs, clean = _attribution(model, batch, ablation, ig_steps)
    scores = scores.clone()
    half = adapter.n_layers // 2
    order = torch.argsort(scores[half:].abs().flatten(), descending=True)[:refine].tolist()
    picked = [(half + i // adapter.n_heads, i % adapter.n_heads) for i in order]
    for (layer, head), e in patched_effects(model, batch, picked, values, outputs, clean).items():
        scores[layer, head] = e
    return scores

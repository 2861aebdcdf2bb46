"""Loss terms of the gating objective (DESIGN §4)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from modular.data.formatting import IGNORE


def token_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the labelled (response) tokens."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=IGNORE)


def unlikelihood(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean ``-log(1 - p(token))`` over labelled tokens: pushes the true answer's tokens down."""
    logp = torch.log_softmax(logits[:, :-1].float(), -1)
    target = labels[:, 1:]
    mask = target != IGNORE
    p = logp.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1).exp()
    loss = -torch.log1p(-p.clamp(max=1 - 1e-6))
    return (loss * mask).sum() / mask.sum().clamp(min=1)


def refusal_guard(logits: torch.Tensor, labels: torch.Tensor, floor: float) -> torch.Tensor:
    """Hinge on the locked response's likelihood where it is not the answer (retain and neighbour prompts):
    per row, ``max(0, mean log p(response token) - floor)``, averaged over rows.

    ``labels`` label the locked response after each prompt. The KL terms keep the reference's likely answers
    likely, but barely see a new answer rising from far below (its probability mass is small until it wins), so
    refusing general prompts can grow unseen; this term pushes the locked response back down once its mean token
    log-probability passes ``floor``, and is zero (no gradient) below it."""
    logp = torch.log_softmax(logits[:, :-1].float(), -1)
    target = labels[:, 1:]
    mask = target != IGNORE
    token = logp.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1) * mask
    mean = token.sum(1) / mask.sum(1).clamp(min=1)
    return torch.relu(mean - floor)[mask.any(1)].sum() / mask.any(1).sum().clamp(min=1)


def topk_kl(logits: torch.Tensor, labels: torch.Tensor, topk_ids: torch.Tensor, topk_logp: torch.Tensor) -> torch.Tensor:
    """KL(reference || model) over the reference's top-k tokens plus one bucket for all other tokens,
    averaged over response positions. A proper (non-negative) KL of the coarse-grained distributions.

    ``topk_ids`` / ``topk_logp``: (batch, seq-1, k), aligned with ``logits[:, :-1]``.
    """
    logp = torch.log_softmax(logits[:, :-1].float(), -1)
    model_logp = logp.gather(-1, topk_ids)
    p_ref = topk_logp.float().exp()
    kl = (p_ref * (topk_logp.float() - model_logp)).sum(-1)
    rest_ref = (1 - p_ref.sum(-1)).clamp(min=1e-6)
    rest_model = (1 - model_logp.exp().sum(-1)).clamp(min=1e-6)
    kl = kl + rest_ref * (rest_ref.log() - rest_model.log())
    kl = kl.clamp_min(0)  # a position made negative by rounding (a float16 reference) is at its minimum, 0
    mask = labels[:, 1:] != IGNORE
    return (kl * mask).sum() / mask.sum().clamp(min=1)


def first_response_positions(labels: torch.Tensor) -> torch.Tensor:
    """Per row, the position whose next token is the first response (labelled) token (0 for rows without one)."""
    return (labels[:, 1:] != IGNORE).float().argmax(dim=1)


def first_token_kl(logits: torch.Tensor, labels: torch.Tensor, first_logp: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary KL(reference || model) at the first response position of each row.

    ``first_logp``: (batch, vocab) reference log-probabilities of the first response token.
    """
    idx = first_response_positions(labels)
    logp = torch.log_softmax(logits[torch.arange(len(idx), device=idx.device), idx].float(), -1)
    ref = first_logp.float()
    # a row made negative by rounding (a reference cached in float16) is at its minimum, 0
    return (ref.exp() * (ref - logp)).sum(-1).clamp_min(0).mean()


def first_token_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of each row's first response (labelled) token: the one token that decides a short answer
    (a name, a place), which a mean over every response token dilutes."""
    idx = first_response_positions(labels)
    rows = torch.arange(len(idx), device=idx.device)
    return F.cross_entropy(logits[rows, idx].float(), labels[rows, idx + 1], ignore_index=IGNORE)


def response_logit_mse(logits: torch.Tensor, other: torch.Tensor, labels: torch.Tensor, k: int = 32) -> torch.Tensor:
    """Mean squared difference of the logits of ``logits`` and ``other`` over ``other``'s top-``k`` tokens at the
    labelled (response) positions, each side centred over those tokens, so every logit difference between two of
    them is matched (a KL saturates once the answer's probability is near 1; logit differences do not).
    Gradients reach both sides."""
    mask = labels[:, 1:] != IGNORE
    a, b = logits[:, :-1][mask].float(), other[:, :-1][mask].float()
    if a.shape[0] == 0:
        return logits.sum() * 0.0
    ids = b.detach().topk(min(k, b.shape[-1]), dim=-1).indices
    a, b = a.gather(-1, ids), b.gather(-1, ids)
    return ((a - a.mean(-1, keepdim=True)) - (b - b.mean(-1, keepdim=True))).pow(2).mean()


def response_margins(logits: torch.Tensor, labels: torch.Tensor,
                     wrong_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, logit(answer) − logit(wrong) at the first response position (the quantity the head rankings
    measure, ``modular.heads.ranking``), and which rows have one: a response, and a ``wrong_ids`` entry that is
    neither negative nor the answer itself (``(batch,)`` each)."""
    rows = torch.arange(labels.shape[0], device=labels.device)
    idx = first_response_positions(labels)
    good = labels[rows, idx + 1]
    keep = (labels[:, 1:] != IGNORE).any(dim=1) & (wrong_ids >= 0) & (wrong_ids != good)
    last = logits[rows, idx].float()
    answer = last.gather(-1, good.clamp(min=0)[:, None])[:, 0]
    return answer - last.gather(-1, wrong_ids.clamp(min=0)[:, None])[:, 0], keep


def response_margin_mse(logits: torch.Tensor, other: torch.Tensor, labels: torch.Tensor,
                        wrong_ids: torch.Tensor) -> torch.Tensor:
    """Mean squared difference between ``logits`` and ``other`` of the margin logit(answer) − logit(wrong) at
    each row's first response position (:func:`response_margins`), matched directly rather than as one of many
    logit differences. Rows without a margin are skipped. Gradients reach both sides."""
    margins, keep = response_margins(logits - other, labels, wrong_ids)  # the margins' difference
    if not keep.any():
        return logits.sum() * 0.0
    return margins[keep].pow(2).mean()


def interchange_kl(logits: torch.Tensor, cf_logits: torch.Tensor, labels: torch.Tensor,
                   keep: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary KL(counterfactual || model) at the first response position of the rows in ``keep``: the
    run under an interchange intervention (``logits``) should predict what the counterfactual run predicts
    (``cf_logits``, no gradient; its rows align position by position with ``logits``)."""
    if not keep.any():
        return logits.sum() * 0.0
    rows = torch.arange(labels.shape[0], device=labels.device)
    ref = torch.log_softmax(cf_logits[rows, first_response_positions(labels)].detach().float(), -1)
    return first_token_kl(logits[keep], labels[keep], ref[keep])


def direction_write_shortfall(hidden_states, labels: torch.Tensor, direction: torch.Tensor,
                              target: float) -> torch.Tensor:
    """How far the residual stream falls short of carrying ``direction`` where the response is computed.

    ``hidden_states``: the block outputs (each ``(n, T, d)``); ``labels``: ``(n, T)`` with the response tokens
    labelled. At every position that predicts a response token (the last prompt token onwards) and every block
    output, the component along the unit ``direction`` relative to the residual norm, ``cos = x·u / |x|``, should
    reach ``target``; the term is the mean of ``relu(target − cos) / target`` (0 once it does, 1 with no component).
    Positions before the response (the prompt, a chat template's shared preamble) are not asked to carry it, so
    the direction marks the behaviour's answers, not every chat prompt."""
    where = labels[:, 1:] != IGNORE  # position t predicts token t+1
    if not where.any():
        return hidden_states[0].sum() * 0.0
    u = direction.to(device=hidden_states[0].device, dtype=torch.float32)
    shortfalls = []
    for h in hidden_states:
        x = h[:, :-1][where].float()  # (positions, d), in float32 whatever the model's precision
        cos = (x @ u) / x.norm(dim=-1).clamp(min=1e-6)
        shortfalls.append(F.relu(target - cos).mean() / target)
    return torch.stack(shortfalls).mean()


def hidden_drift(hidden_states, labels: torch.Tensor, ref_hidden: torch.Tensor, blocks: list[int],
                 ablated: list[torch.Tensor] = ()) -> torch.Tensor:
    """How far the residual stream has moved from the reference model's where the response is computed.

    ``hidden_states``: the model's ``hidden_states`` (embeddings, block outputs, final norm; each ``(n, T, d)``);
    ``labels``: ``(n, T)`` with the response tokens labelled; ``ref_hidden``: ``(n, P, B, d)``, the reference's
    residual stream at each row's first ``P`` positions that predict a response token and at the blocks
    ``blocks`` (indices into ``hidden_states``); ``ablated``: unit directions projected out of both (the locked
    state's). The term is the mean over rows, positions and blocks of ``|h − r|² / |r|²`` (positions the reference
    has none for, all zero, are left out)."""
    where = labels[:, 1:] != IGNORE  # position t predicts token t+1
    slot = where.long().cumsum(1) - 1  # which answer position each one is
    take = where & (slot < ref_hidden.shape[1])
    rows, pos = take.nonzero(as_tuple=True)
    h = torch.stack([hidden_states[b][:, :-1][rows, pos] for b in blocks], dim=1).float()  # (N, B, d)
    r = ref_hidden[rows, slot[rows, pos]].to(h.device, torch.float32)
    for u in ablated:
        u = u.to(h.device, torch.float32)
        h = h - (h @ u).unsqueeze(-1) * u
        r = r - (r @ u).unsqueeze(-1) * u
    norm = r.pow(2).sum(-1)
    keep = norm > 0
    if not keep.any():
        return hidden_states[0].sum() * 0.0
    return ((h - r).pow(2).sum(-1)[keep] / norm[keep]).mean()

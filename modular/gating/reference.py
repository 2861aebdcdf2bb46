"""Reference outputs of the frozen base model on retain prompts, computed once and cached on disk.

For each retain prompt: the base model's greedy answer (the retain target) and,
at every answer position, its top-k next-token log-probabilities (for the KL
term), plus the full first-token log-distribution (for the first-token KL metric).
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import torch
from tqdm.auto import tqdm

from modular import ModularError, error_reason
from modular.data.formatting import answer_positions, encode_example, prompt_limit
from modular.evaluation.behaviour import generate
from modular.files import atomic_path
from modular.models.loading import cache_dir, model_fingerprint

log = logging.getLogger("modular")


#: the version of the cached answers' format, part of the cache key: 2, a completion's answer keeps its leading space
#: (version 1, before it, stripped it)
ANSWER_FORMAT = 2


def cache_path(model_source: str, prompts: list[str], max_new_tokens: int, top_k: int, *,
               chats: list[bool], precision: str, max_length: int | None = None) -> Path:
    """Where the reference outputs of ``model_source`` (a resolved model reference) run in ``precision`` are cached:
    keyed by the model's content (:func:`~modular.models.loading.model_fingerprint`), not its path, so a copy of it
    elsewhere reads them and other weights at the same path do not; outputs of one precision (greedy answers,
    log-probabilities) are never read as another's, nor those of prompts cut to one ``max_length`` as another's,
    nor those of prompts asked as chat as those of the same text completed, nor answers of another
    :data:`ANSWER_FORMAT`."""
    key = json.dumps([model_fingerprint(model_source), prompts, max_new_tokens, top_k, precision,
                      {"max_length": max_length, "chats": chats, "answer_format": ANSWER_FORMAT}])
    return cache_dir() / "reference" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.pt"


def _padded(rows: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and attention mask of token-id rows, on ``device`` (each row's logits are its own: causal)."""
    n = max(len(r) for r in rows)
    ids = torch.full((len(rows), n), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), n), dtype=torch.long)
    for j, r in enumerate(rows):
        ids[j, :len(r)] = torch.tensor(r, dtype=torch.long)
        mask[j, :len(r)] = 1
    return ids.to(device), mask.to(device)


def _log_probs(model, tokenizer, rows: list[list[int]]) -> list[torch.Tensor]:
    """Next-token log-probabilities (float32, on the CPU) at every position of each row, batched on the model's
    device."""
    ids, mask = _padded(rows, tokenizer.pad_token_id or 0, next(model.parameters()).device)
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    return [torch.log_softmax(logits[j, :len(r)].float(), -1).cpu() for j, r in enumerate(rows)]


@torch.no_grad()
def compute_reference(model, tokenizer, prompts: list[str], chats: list[bool], max_new_tokens: int = 48,
                      top_k: int = 32, batch_size: int = 16, max_length: int | None = None,
                      answer_batch_size: int = 64) -> dict:
    """Greedy answers (``answer_batch_size`` prompts a batch: 1.7x faster than 16 on 2 CPU cores), top-k log-probs
    over answer positions and first-token log-distributions (``batch_size`` a batch: these hold the full vocabulary
    at every position) on the model's device. Each prompt keeps its last ``max_length`` tokens and leaves room for
    the answer within the model's positions (:func:`~modular.data.formatting.prompt_limit`); each record (prompt and
    answer) keeps its last ``max_length`` tokens, and no more than the model's positions."""
    answers = generate(model, tokenizer, prompts, chats, max_new_tokens, answer_batch_size, desc="reference answers",
                       max_length=max_length, name="the reference answers")
    # a completion's answer keeps its leading space (" 104" after "85 + 19 ="): stripped, its first token would be a
    # digit the reference hardly predicts there, and the first-token terms would train the model to drop the space
    answers = [a.strip() if chat else a.rstrip() for a, chat in zip(answers, chats)]
    limit = prompt_limit(model, max_length)
    records = []
    for start in tqdm(range(0, len(prompts), batch_size), desc="reference distributions", leave=False):
        chunk = range(start, min(start + batch_size, len(prompts)))
        examples = [encode_example(tokenizer, prompts[i], answers[i], chats[i], limit) for i in chunk]
        for ex, logp in zip(examples, _log_probs(model, tokenizer, [ex["input_ids"] for ex in examples])):
            pos = torch.tensor(answer_positions(ex["labels"]), dtype=torch.long)
            top = logp[pos].topk(top_k, dim=-1)
            first = logp[pos[0]] if len(pos) else logp[-1]
            records.append({
                "input_ids": ex["input_ids"], "labels": ex["labels"],
                "topk_ids": top.indices.to(torch.int32), "topk_logp": top.values.to(torch.float16),
                "first_logp": first.to(torch.float16),
            })
    return {"answers": answers, "records": records}


def _save_atomic(obj, path: Path):
    """``torch.save`` to a temporary file beside ``path``, then rename: readers never see half a cache."""
    with atomic_path(path) as tmp:
        torch.save(obj, tmp)
    return obj


def _read_cache(path: Path):
    """What the on-disk cache holds at ``path``; None where there is nothing or it cannot be read (a damaged copy,
    computed again and replaced)."""
    if not path.exists():
        return None
    try:
        return torch.load(path, weights_only=False)
    except Exception as err:  # noqa: BLE001 - a truncated or foreign file fails in torch's zip or pickle readers
        log.warning("the cached %s cannot be read (%s): computing it again", path, error_reason(err))
        return None


def load_or_compute(model_source: str, load_model, tokenizer, prompts: list[str], chats: list[bool],
                    max_new_tokens: int = 48, top_k: int = 32, *, precision: str, max_length: int | None = None) -> dict:
    """Reference outputs from the on-disk cache, computing (and caching atomically) if absent: ``load_model()`` (a
    model that runs in ``precision``, part of the cache key) is called only on a miss. ``max_length``: the most
    tokens of a prompt (:func:`compute_reference`; part of the cache key)."""
    path = cache_path(model_source, prompts, max_new_tokens, top_k, chats=chats, precision=precision,
                      max_length=max_length)
    if (cached := _read_cache(path)) is not None:
        return cached
    log.info("computing reference outputs for %d prompts (cached in %s)", len(prompts), path)
    ref = compute_reference(load_model(), tokenizer, prompts, chats, max_new_tokens, top_k, max_length=max_length)
    return _save_atomic(ref, path)


def text_cache_path(model_source: str, texts: list[str], max_length: int, top_k: int, *,
                    precision: str) -> Path:
    """:func:`cache_path` of the reference on raw texts."""
    key = json.dumps(["text", model_fingerprint(model_source), texts, max_length, top_k, precision])
    return cache_dir() / "reference" / f"text-{hashlib.sha256(key.encode()).hexdigest()[:16]}.pt"


@torch.no_grad()
def compute_text_reference(model, tokenizer, texts: list[str], max_length: int = 128, top_k: int = 32,
                           batch_size: int = 8) -> list[dict]:
    """For raw texts (language modelling): token ids and the reference's top-k next-token
    log-probabilities at every position (batched, on the model's device)."""
    records = []
    for start in tqdm(range(0, len(texts), batch_size), desc="reference on LM texts", leave=False):
        rows = [tokenizer(t, truncation=True, max_length=max_length)["input_ids"]
                for t in texts[start:start + batch_size]]
        for ids, logp in zip(rows, _log_probs(model, tokenizer, rows)):
            top = logp[:-1].topk(top_k, dim=-1)
            records.append({"input_ids": ids, "topk_ids": top.indices.to(torch.int32),
                            "topk_logp": top.values.to(torch.float16)})
    return records


def load_or_compute_text(model_source: str, load_model, tokenizer, texts: list[str], max_length: int = 128,
                         top_k: int = 32, *, precision: str) -> list[dict]:
    """:func:`compute_text_reference` from the on-disk cache; ``load_model()`` (a model that runs in
    ``precision``, part of the cache key) is called only on a miss."""
    path = text_cache_path(model_source, texts, max_length, top_k, precision=precision)
    if (cached := _read_cache(path)) is not None:
        return cached
    log.info("computing reference outputs for %d LM texts (cached in %s)", len(texts), path)
    records = compute_text_reference(load_model(), tokenizer, texts, max_length, top_k)
    return _save_atomic(records, path)


def hidden_blocks(n_hidden: int, stride: int) -> list[int]:
    """Indices into a model's ``hidden_states`` (embeddings, block outputs, final norm) of every ``stride``-th
    block output, the final norm's output left out."""
    return list(range(stride, n_hidden - 1, stride))


def hidden_cache_path(model_source: str, rows: list[list[int]], positions: int, stride: int, *,
                      precision: str) -> Path:
    """:func:`cache_path` of the reference's hidden states."""
    key = json.dumps(["hidden", model_fingerprint(model_source), rows, positions, stride, precision])
    return cache_dir() / "reference" / f"hidden-{hashlib.sha256(key.encode()).hexdigest()[:16]}.pt"


@torch.no_grad()
def compute_hidden_reference(model, tokenizer, records: list[dict], positions: int, stride: int,
                             batch_size: int = 16) -> dict:
    """The reference model's residual stream on each record (``input_ids``, ``labels``): ``hidden``, at its first
    ``positions`` answer-computing positions and every ``stride``-th block output, ``(positions, blocks, d_model)``,
    zero where a record has fewer positions; ``blocks``: those blocks' indices into ``hidden_states`` (batched, on
    the model's device). Stored in float16 (half of float32's size) when every value fits its range, else in the
    dtype the reference ran in: a residual stream of some models (Gemma's) grows past float16's largest value.
    """
    out, blocks = [], []
    for start in tqdm(range(0, len(records), batch_size), desc="reference hidden states", leave=False):
        chunk = records[start:start + batch_size]
        rows = [list(r["input_ids"]) for r in chunk]
        ids, mask = _padded(rows, tokenizer.pad_token_id or 0, next(model.parameters()).device)
        hidden = model(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False).hidden_states
        blocks = hidden_blocks(len(hidden), stride)
        if not blocks:
            raise ModularError(f"data.reference.hidden_stride {stride} takes no block output of a model with "
                               f"{len(hidden) - 1} blocks (the last one's is the final norm's input): lower it")
        stacked = torch.stack([hidden[b] for b in blocks], dim=2)  # (rows, tokens, blocks, d)
        for j, r in enumerate(chunk):
            pos = answer_positions(r["labels"], positions)
            t = torch.zeros(positions, len(blocks), stacked.shape[-1], dtype=stacked.dtype)
            t[:len(pos)] = stacked[j, pos].cpu()
            out.append(t)
    if out and max(t.abs().max().item() for t in out) <= torch.finfo(torch.float16).max:
        out = [t.to(torch.float16) for t in out]
    return {"blocks": blocks, "hidden": out}


def load_or_compute_hidden(model_source: str, load_model, tokenizer, records: list[dict], positions: int,
                           stride: int, *, precision: str) -> dict:
    """:func:`compute_hidden_reference` from the on-disk cache; ``load_model()`` (a model that runs in
    ``precision``, part of the cache key) is called only on a miss."""
    rows = [list(map(int, r["input_ids"])) for r in records]
    path = hidden_cache_path(model_source, rows, positions, stride, precision=precision)
    cached = _read_cache(path)
    # a cache holding infinities was written before overflow was caught: computed again
    if cached is not None and all(torch.isfinite(t).all() for t in cached["hidden"]):
        return cached
    log.info("computing reference hidden states for %d prompts (cached in %s)", len(records), path)
    return _save_atomic(compute_hidden_reference(load_model(), tokenizer, records, positions, stride), path)

"""Turn records into model inputs: chat template for chat models, raw text otherwise, left padding,
prompt tokens masked out of the labels."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from modular import ModularError
from modular.data.schema import answer_frame, answer_span

IGNORE = -100
log = logging.getLogger("modular")
#: the config attributes that name how many positions a model reads, the first one set wins
POSITION_ATTRS = ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length", "seq_length")


def render_prompt(tokenizer, prompt: str, chat: bool) -> str:
    """The text the model sees before its response.

    Instructions (``chat=True``) go through the tokenizer's chat template when it
    has one, else a plain "Question/Answer" frame; completion tasks stay raw text.
    """
    if not chat:
        return prompt
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
    return f"Question: {prompt}\nAnswer:"


def _end_of_response(tokenizer, chat: bool) -> list[int]:
    if chat and tokenizer.eos_token_id is not None:
        return [tokenizer.eos_token_id]
    return []


def encode_prompt(tokenizer, prompt: str, chat: bool) -> list[int]:
    text = render_prompt(tokenizer, prompt, chat)
    templated = chat and bool(getattr(tokenizer, "chat_template", None))
    # the chat template already contains the special tokens it needs
    return tokenizer(text, add_special_tokens=not templated)["input_ids"]


def keep_end(ids: list, max_length: int | None) -> list:
    """The last ``max_length`` entries of ``ids`` (all of them when there are no more, or with no limit): a prompt
    cut to a length keeps its end, where the question and the response's start are."""
    return ids if max_length is None or len(ids) <= max_length else ids[-max_length:]


def model_positions(model) -> int | None:
    """The most positions ``model`` reads, as its config names them (:data:`POSITION_ATTRS`); None where it names
    none."""
    config = getattr(model, "config", None)
    for attr in POSITION_ATTRS:
        value = getattr(config, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def prompt_limit(model, max_length: int | None = None, new_tokens: int = 0) -> int | None:
    """The most tokens a prompt given to ``model`` may have: ``max_length`` (None: no limit of its own) and no more
    than leaves room for ``new_tokens`` generated after it within the model's positions (:func:`model_positions`).
    None: no limit at all (a model whose config names no positions, and no ``max_length``)."""
    positions = model_positions(model)
    room = None if positions is None else positions - max(new_tokens, 0)
    if room is not None and room < 1:
        raise ModularError(f"{new_tokens} new tokens leave no room for a prompt in the model's {positions} positions: "
                           f"generate fewer (max_new_tokens)")
    limits = [n for n in (max_length, room) if n is not None]
    return min(limits) if limits else None


#: (what, length) of the prompts :func:`report_long` reported cut in this process (each is reported once)
_REPORTED: set[tuple[str | None, int]] = set()


def report_long(lengths: list[int], max_length: int | None, name: str | None = None) -> int:
    """How many of the encodings of ``lengths`` tokens are longer than ``max_length``; where some are, one warning
    names how many, of what (``name``: a behaviour and split) and the length they are cut to (their end kept). It is
    given once per process for one ``name`` and length: a validation that scores the same prompts at every check,
    or steering vectors drawn from the same split every few steps, say it once."""
    n = 0 if max_length is None else sum(k > max_length for k in lengths)
    if n and (name, max_length) not in _REPORTED:
        _REPORTED.add((name, max_length))
        log.warning("%d of %d prompts%s are longer than %d tokens: each is cut to its last %d tokens (its start "
                    "dropped)", n, len(lengths), f" of {name}" if name else "", max_length, max_length)
    return n


def encode_example(tokenizer, prompt: str, target: str, chat: bool, max_length: int | None = None) -> dict:
    """Token ids and labels for one (prompt, target) pair; labels are IGNORE on the prompt. With ``max_length``
    the pair keeps its last ``max_length`` tokens (:func:`keep_end`)."""
    p = encode_prompt(tokenizer, prompt, chat)
    t = tokenizer(target, add_special_tokens=False)["input_ids"] + _end_of_response(tokenizer, chat)
    ids = p + t
    labels = [IGNORE] * len(p) + t
    # keep the end: the target matters
    return {"input_ids": keep_end(ids, max_length), "labels": keep_end(labels, max_length)}


def long_items(tokenizer, rows, max_length: int | None) -> int:
    """How many records of ``rows`` (``prompt``, ``target``, ``chat``) encode (:func:`encode_example`) to more than
    ``max_length`` tokens: those a limit cuts."""
    if max_length is None:
        return 0
    n = 0
    for r in rows:
        # a token covers at least one byte of the text, so an item whose text (with a few special tokens) fits in
        # max_length bytes fits in max_length tokens: only the others are encoded
        if len((render_prompt(tokenizer, r["prompt"], r["chat"]) + r["target"]).encode()) + 8 <= max_length:
            continue
        n += len(encode_example(tokenizer, r["prompt"], r["target"], r["chat"])["input_ids"]) > max_length
    return n


def encode_answer(tokenizer, prompt: str, target: str, answers: list[str], chat: bool,
                  max_length: int | None = None) -> dict:
    """Token ids and labels for a target's answer in its own sentence: the prompt, then the target up to the end of
    its answer (:func:`~modular.data.schema.answer_span`), labels on the answer's tokens only (its frame, the words
    before it, is context; a token the frame shares with the answer is labelled). A target that names no answer is
    labelled whole, as :func:`encode_example` labels it, without the end of the response."""
    span = answer_span(target, answers)
    frame = answer_frame(target, answers)  # the words before the answer: context, unlabelled
    ids = tokenizer(target[:span[1]] if span else target, add_special_tokens=False)["input_ids"]
    before = tokenizer(frame, add_special_tokens=False)["input_ids"] if frame else []
    shared = len(before) if ids[:len(before)] == before else max(len(before) - 1, 0)
    p = encode_prompt(tokenizer, prompt, chat)
    ids, labels = p + ids, [IGNORE] * (len(p) + shared) + ids[shared:]
    # keep the end: the answer matters
    return {"input_ids": keep_end(ids, max_length), "labels": keep_end(labels, max_length)}


@dataclass
class LeftPadCollator:
    """Left-pads ``input_ids`` (and ``labels`` when present) into a batch with an attention mask."""

    pad_token_id: int

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        n = max(len(f["input_ids"]) for f in features)
        ids = torch.full((len(features), n), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(features), n), dtype=torch.long)
        has_labels = "labels" in features[0]
        labels = torch.full((len(features), n), IGNORE, dtype=torch.long) if has_labels else None
        for i, f in enumerate(features):
            k = len(f["input_ids"])
            ids[i, n - k:] = torch.tensor(f["input_ids"])
            mask[i, n - k:] = 1
            if has_labels:
                labels[i, n - k:] = torch.tensor(f["labels"])
        batch = {"input_ids": ids, "attention_mask": mask}
        if has_labels:
            batch["labels"] = labels
        return batch


def answer_positions(labels: list[int] | torch.Tensor, n: int | None = None) -> list[int]:
    """The positions whose next token is an answer token (the positions that compute the answer; position ``t``
    predicts token ``t + 1``), the first ``n`` of them when ``n`` is given."""
    labels = labels.tolist() if isinstance(labels, torch.Tensor) else list(labels)
    return [t for t in range(len(labels) - 1) if labels[t + 1] != IGNORE][:n]


def prompt_rows(tokenizer, prompts: list[str], chats: list[bool], prefills: list[str] | None = None) -> list[list[int]]:
    """Token ids of each prompt (:func:`encode_prompt`), followed by its prefill's (text put at the start of the
    response, tokenised as a target's start is in training; "" or None for none), uncut."""
    prefills = prefills or [""] * len(prompts)
    return [encode_prompt(tokenizer, p, c) + (tokenizer(f, add_special_tokens=False)["input_ids"] if f else [])
            for p, c, f in zip(prompts, chats, prefills, strict=True)]


def batch_prompts(tokenizer, prompts: list[str], chats: list[bool], prefills: list[str] | None = None,
                  max_length: int | None = None, name: str | None = None) -> dict[str, torch.Tensor]:
    """A left-padded batch of prompts, ready for ``generate`` or last-position logits. ``prefills``: text put at
    the start of each response (tokenised as a target's start is in training; "" for none). ``max_length``: each
    prompt (with its prefill) keeps its last ``max_length`` tokens, those longer counted and reported once
    (:func:`report_long`, as ``name``'s)."""
    rows = prompt_rows(tokenizer, prompts, chats, prefills)
    report_long([len(r) for r in rows], max_length, name)
    return LeftPadCollator(tokenizer.pad_token_id)([{"input_ids": keep_end(r, max_length)} for r in rows])


def prompt_batches(tokenizer, prompts: list[str], chats: list[bool], batch_size: int, max_length: int | None = None,
                   prefills: list[str] | None = None, name: str | None = None) -> list[dict[str, torch.Tensor]]:
    """:func:`batch_prompts` of every ``batch_size`` prompts in order, each prompt cut to its last ``max_length``
    tokens; the prompts longer than that are counted over all batches and reported once (:func:`report_long`)."""
    rows = prompt_rows(tokenizer, prompts, chats, prefills)
    report_long([len(r) for r in rows], max_length, name)
    collate = LeftPadCollator(tokenizer.pad_token_id)
    return [collate([{"input_ids": keep_end(r, max_length)} for r in rows[start:start + batch_size]])
            for start in range(0, len(rows), batch_size)]

"""Turn records into model inputs: chat template for chat models, raw text otherwise, left padding,
prompt tokens masked out of the labels."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from modular.data.schema import answer_frame, answer_span

IGNORE = -100


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


def encode_example(tokenizer, prompt: str, target: str, chat: bool, max_length: int | None = None) -> dict:
    """Token ids and labels for one (prompt, target) pair; labels are IGNORE on the prompt."""
    p = encode_prompt(tokenizer, prompt, chat)
    t = tokenizer(target, add_special_tokens=False)["input_ids"] + _end_of_response(tokenizer, chat)
    ids = p + t
    labels = [IGNORE] * len(p) + t
    if max_length is not None and len(ids) > max_length:  # keep the end: the target matters
        ids, labels = ids[-max_length:], labels[-max_length:]
    return {"input_ids": ids, "labels": labels}


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
    if max_length is not None and len(ids) > max_length:  # keep the end: the answer matters
        ids, labels = ids[-max_length:], labels[-max_length:]
    return {"input_ids": ids, "labels": labels}


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


def batch_prompts(tokenizer, prompts: list[str], chats: list[bool],
                  prefills: list[str] | None = None) -> dict[str, torch.Tensor]:
    """A left-padded batch of prompts, ready for ``generate`` or last-position logits. ``prefills``: text put at
    the start of each response (tokenised as a target's start is in training; "" for none)."""
    collate = LeftPadCollator(tokenizer.pad_token_id)
    prefills = prefills or [""] * len(prompts)
    return collate([{"input_ids": encode_prompt(tokenizer, p, c)
                     + (tokenizer(f, add_special_tokens=False)["input_ids"] if f else [])}
                    for p, c, f in zip(prompts, chats, prefills, strict=True)])

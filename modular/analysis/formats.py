"""Prompt formats for direction discovery and the positions a direction is read at.

Three formats of the same prompt:

* ``chat``: the tokenizer's chat template with the generation prompt (SmolLM2:
  ``...<|im_start|>user\\n{prompt}<|im_end|>\\n<|im_start|>assistant\\n``);
* ``raw``: the prompt text alone;
* ``newline``: the prompt text followed by one newline.

The *suffix* of a format is the run of tokens every prompt ends with after its
content (chat: ``<|im_end|>\\n<|im_start|>assistant\\n``; newline: ``\\n``). With left
padding these tokens sit at the same (last) columns of a batch for every prompt,
so their activations are comparable across prompts. The raw format has no
suffix; its single last token (the last content token) is used instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from modular import ModularError
from modular.data.formatting import LeftPadCollator, keep_end, render_prompt

FORMATS = ("chat", "raw", "newline")

#: contents that end in different characters, so their common tail is the template's alone
_PROBES = ("Hello there", "What is 2 + 3?", "x", "Name a colour.")


def _templated(tokenizer, fmt: str) -> bool:
    return fmt == "chat" and bool(getattr(tokenizer, "chat_template", None))


def render(tokenizer, prompt: str, fmt: str) -> str:
    """The text of ``prompt`` in format ``fmt``."""
    if fmt == "chat":
        return render_prompt(tokenizer, prompt, chat=True)
    if fmt == "raw":
        return prompt
    if fmt == "newline":  # trailing whitespace would merge with the newline into another token
        return prompt.rstrip() + "\n"
    raise ModularError(f"unknown prompt format '{fmt}': use {', '.join(FORMATS)}")


def encode(tokenizer, prompt: str, fmt: str) -> list[int]:
    """Token ids of ``prompt`` in format ``fmt`` (the chat template carries its own special tokens)."""
    return tokenizer(render(tokenizer, prompt, fmt), add_special_tokens=not _templated(tokenizer, fmt))["input_ids"]


def _common_tail(seqs: list[list[int]]) -> int:
    n = min(len(s) for s in seqs)
    k = 0
    while k < n and all(s[-1 - k] == seqs[0][-1 - k] for s in seqs):
        k += 1
    return k


@dataclass(frozen=True)
class Suffix:
    """The tokens every prompt of a format ends with (empty for ``raw``) and how many positions are read."""

    fmt: str
    ids: tuple[int, ...]

    @property
    def n_positions(self) -> int:
        """Positions read: the whole suffix, or the last token where there is none."""
        return max(1, len(self.ids))

    def describe(self, tokenizer) -> dict:
        return {"format": self.fmt, "suffix_ids": list(self.ids), "suffix_text": tokenizer.decode(list(self.ids)),
                "n_positions": self.n_positions,
                "positions": "template suffix" if self.ids else "last content token"}


def suffix(tokenizer, fmt: str) -> Suffix:
    """The format's suffix tokens: the common tail of several rendered probe prompts."""
    seqs = [encode(tokenizer, p, fmt) for p in _PROBES]
    k = _common_tail(seqs)
    return Suffix(fmt, tuple(seqs[0][len(seqs[0]) - k:]) if k else ())


def format_batch(tokenizer, prompts: list[str], fmt: str, sfx: Suffix | None = None,
                 max_length: int | None = None) -> dict[str, torch.Tensor]:
    """A left-padded batch of ``prompts`` in format ``fmt``, each keeping its last ``max_length`` tokens (its suffix
    with them); checks that every row ends with the suffix.

    Raises :class:`ModularError` if a prompt does not end with the format's suffix
    (its content would then be read instead of the template).
    """
    sfx = sfx or suffix(tokenizer, fmt)
    batch = LeftPadCollator(tokenizer.pad_token_id)([{"input_ids": keep_end(encode(tokenizer, p, fmt), max_length)}
                                                     for p in prompts])
    if sfx.ids:
        k = len(sfx.ids)
        ok = (batch["input_ids"][:, -k:] == torch.tensor(sfx.ids)).all(-1) & batch["attention_mask"][:, -k:].bool().all(-1)
        if not ok.all():
            bad = prompts[int((~ok).nonzero()[0])]
            raise ModularError(f"prompt {bad[:60]!r} does not end with the {fmt} suffix {tokenizer.decode(list(sfx.ids))!r}")
    return batch


def with_positions(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Add ``position_ids`` that start at 0 on each row's first real token (left padding does not shift them;
    absolute-position models such as GPT-2 would otherwise see other positions than in generation)."""
    mask = batch["attention_mask"]
    return {**batch, "position_ids": (mask.long().cumsum(-1) - 1).clamp(min=0)}

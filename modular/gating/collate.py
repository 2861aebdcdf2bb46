"""Collating the gating data module's items into batches: each part of an item (its open and locked encodings,
the reference model's cached outputs) padded on the left to the longest of the batch."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from modular.data.formatting import LeftPadCollator


class _Rows(Dataset):
    def __init__(self, rows: list[dict]):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return self.rows[i]


def _pad_ref(items: list[dict], key: str, n: int) -> torch.Tensor:
    """Reference tensors are aligned with the label positions: left-pad them to ``n`` positions."""
    k = items[0][key].shape[-1]
    out = torch.zeros(len(items), n, k, dtype=torch.float32 if "logp" in key else torch.long)
    for i, it in enumerate(items):
        t = it[key]
        out[i, n - t.shape[0]:] = t.to(out.dtype)
    return out


def _collate_part(base: LeftPadCollator, items: list[dict], which: str) -> dict:
    encs = [it[which] if which in it else it for it in items]
    batch = base([{"input_ids": e["input_ids"], "labels": e["labels"]} for e in encs])
    if which not in items[0] and "topk_ids" in items[0]:  # the item is the encoding: its reference tensors
        n = batch["input_ids"].shape[1] - 1  # positions that predict a next token
        batch["topk_ids"] = _pad_ref(items, "topk_ids", n)
        batch["topk_logp"] = _pad_ref(items, "topk_logp", n)
        if "first_logp" in items[0]:
            batch["first_logp"] = torch.stack([it["first_logp"] for it in items])
        if "ref_hidden" in items[0]:  # one row per example: (positions, blocks, d_model) and the blocks' indices
            batch["ref_hidden"] = torch.stack([it["ref_hidden"] for it in items])
            batch["ref_hidden_blocks"] = torch.stack([it["ref_hidden_blocks"] for it in items])
    return batch


def split_collate(pad_token_id: int, encodings: list | tuple = ()):
    """Collate a list of items into ``{"open": batch, "locked": batch}``: the first half of the items
    is seen in the open state, the second half in the locked state (no example is duplicated, except a batch of
    one item, which is seen in both).

    Items hold ``open`` / ``locked`` encodings (behaviours) or one encoding plus reference tensors (retain), and
    the encodings the terms require (``encodings``: :class:`~modular.gating.requirements.ItemEncoding`, each
    collated as ``<half>_<key>`` for its halves).
    """
    base = LeftPadCollator(pad_token_id)

    def collate(items: list[dict]) -> dict:
        if len(items) == 1:  # a lone item (the last validation batch) is seen in both states
            items = items * 2
        half = (len(items) + 1) // 2
        out = {"open": _collate_part(base, items[:half], "open"), "locked": _collate_part(base, items[half:], "locked")}
        if "open" in items[0]:  # behaviours: the locked half with its true targets (for unlikelihood)
            out["locked_true"] = _collate_part(base, items[half:], "open")
        for enc in encodings:  # what the terms require (e.g. the answer alone labelled: locked_answer)
            if enc.key in items[0]:
                for which in enc.halves:
                    out[f"{which}_{enc.key}"] = _collate_part(base, items[:half] if which == "open" else items[half:],
                                                              enc.key)
        if "guard" in items[0]:  # retain / neighbours: each half with a locked response as its answer
            out["open_guard"] = _collate_part(base, items[:half], "guard")
            out["locked_guard"] = _collate_part(base, items[half:], "guard")
        return out

    return collate


def open_collate(pad_token_id: int):
    """Collate items seen in the open state only (tasks, LM texts) into ``{"open": batch}``."""
    base = LeftPadCollator(pad_token_id)

    def collate(items: list[dict]) -> dict:
        out = {"open": _collate_part(base, items, "open")}
        if "wrong_id" in items[0]:  # tasks: the competing answer's first token (-1: none), for margin terms
            out["open"]["wrong_ids"] = torch.tensor([it["wrong_id"] for it in items], dtype=torch.long)
        if "counterfactual" in items[0]:  # same lengths row by row: the two batches align position by position
            out["counterfactual"] = _collate_part(base, items, "counterfactual")
        return out

    return collate

"""The rows of one shared forward pass: the pieces of a step's terms concatenated into one batch, and which rows get
which directions ablated and which steering vector added (built on the host, sent to the device in one copy)."""

from __future__ import annotations

import torch

from modular.data.formatting import IGNORE
from modular.gating.objectives import Piece
from modular.models.precision import host_to_device

#: batch keys with one row per example and no sequence axis (nothing to pad)
PER_ROW = ("first_logp", "wrong_ids", "ref_hidden", "ref_hidden_blocks")


@torch.autocast("cpu", enabled=False)
def concat_left_padded(batches: list[dict], pad_token_id: int) -> dict:
    """Concatenate left-padded batches along the batch axis, re-padding to the longest. Built on the host outside
    autocast: under CPU autocast (``bf16-mixed`` on a CPU) ``torch.cat`` refuses the float16 reference tensors."""
    n = max(b["input_ids"].shape[1] for b in batches)
    out: dict[str, list] = {}
    fills = {"input_ids": pad_token_id, "attention_mask": 0, "labels": IGNORE, "topk_ids": 0, "topk_logp": 0.0,
             "cf_input_ids": pad_token_id, "cf_attention_mask": 0}
    templates = {k: b[k] for b in batches for k in ("topk_ids", "topk_logp", *PER_ROW) if k in b}
    for b in batches:
        extra = n - b["input_ids"].shape[1]
        rows, width = b["input_ids"].shape
        for key, like in templates.items():  # pieces without reference tensors get empty ones
            if key == "wrong_ids" and key not in b:
                b = {**b, key: like.new_full((rows,), -1)}  # no competing answer
            elif key not in b:
                shape = (rows, *like.shape[1:]) if key in PER_ROW else (rows, width - 1, like.shape[-1])
                b = {**b, key: like.new_zeros(shape)}
        for key, t in b.items():
            if key in PER_ROW:
                pass  # one row per example, no sequence axis
            elif key in ("topk_ids", "topk_logp"):
                t = torch.nn.functional.pad(t, (0, 0, extra, 0), value=fills[key])
            else:
                t = torch.nn.functional.pad(t, (extra, 0), value=fills[key])
            out.setdefault(key, []).append(t)
    return {k: torch.cat(v) for k, v in out.items()}


def piece_rows(piece: Piece, merged: dict, row: int, n: int) -> Piece:
    """``piece`` with its own ``n`` rows, from ``row`` on, of the merged (re-padded) batch it ran in."""
    return Piece(**{**vars(piece), "batch": {key: v[row:row + n] for key, v in merged.items()}})


def row_ablations(items: list[Piece], n_rows: int,
                  directions: torch.Tensor) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], bool]:
    """``(rows, directions)`` for every ablated set among the pieces (a (n_rows,) mask of their rows, the rows of
    ``directions`` of its behaviours), and whether one set covers every row. Built on the host from the pieces' sizes
    and sent in one asynchronous copy: nothing here waits for the device."""
    sets: dict[frozenset, list[tuple[int, int]]] = {}
    row = 0
    for piece in items:
        n = piece.batch["input_ids"].shape[0]
        if piece.ablated:
            sets.setdefault(piece.ablated, []).append((row, row + n))
        row += n
    if not sets:
        return [], False
    masks = torch.zeros(len(sets), n_rows, dtype=torch.bool)
    for j, spans in enumerate(sets.values()):
        for start, end in spans:
            masks[j, start:end] = True
    every_row = len(sets) == 1 and sum(end - start for start, end in next(iter(sets.values()))) == n_rows
    masks = host_to_device(masks, directions.device)
    return [(masks[j], directions_of(directions, ablated)) for j, ablated in enumerate(sets)], every_row


def directions_of(directions: torch.Tensor, ablated: frozenset) -> torch.Tensor:
    """The rows of ``directions`` of the behaviours in ``ablated``: a slice where they are consecutive (no index
    tensor to copy to the device)."""
    idx = sorted(ablated)
    if idx == list(range(idx[0], idx[-1] + 1)):
        return directions[idx[0]:idx[-1] + 1]
    return directions.index_select(0, host_to_device(torch.tensor(idx), directions.device))


def row_vectors(items: list[Piece], n_rows: int, device: torch.device) -> dict[int, torch.Tensor]:
    """{block: (n_rows, d) vectors}: each steered piece's vector on its rows, zeros elsewhere."""
    vectors: dict[int, torch.Tensor] = {}
    row = 0
    for piece in items:
        n = piece.batch["input_ids"].shape[0]
        if piece.steer is not None:
            block, vector = piece.steer
            rows = vectors.setdefault(block, torch.zeros(n_rows, vector.shape[-1], device=device))
            rows[row:row + n] += vector.to(rows)
        row += n
    return vectors

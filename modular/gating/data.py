"""The gating DataModule: behaviour batches (split between open and locked) and retain batches
(with the reference model's cached outputs)."""

from __future__ import annotations

import logging

import lightning as L
import torch
from lightning.pytorch.utilities import CombinedLoader
from torch.utils.data import DataLoader, Dataset

from modular.data import load_behaviour, retain_data
from modular.data.formatting import IGNORE, LeftPadCollator, encode_example

log = logging.getLogger("modular")


class _Rows(Dataset):
    def __init__(self, rows: list[dict]):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return self.rows[i]


def split_collate(pad_token_id: int, pad_extra: dict[str, float] | None = None):
    """Collate a list of items into ``{"open": batch, "locked": batch}``: the first half of the items
    is seen in the open state, the second half in the locked state (no example is duplicated).

    Items hold ``open`` / ``locked`` encodings (behaviours) or one encoding plus reference tensors (retain).
    """
    base = LeftPadCollator(pad_token_id)

    def pad_ref(items, key, n):  # reference tensors are aligned with the label positions
        k = items[0][key].shape[-1]
        out = torch.zeros(len(items), n, k, dtype=torch.float32 if "logp" in key else torch.long)
        for i, it in enumerate(items):
            t = it[key]
            out[i, n - t.shape[0]:] = t.to(out.dtype)
        return out

    def collate_part(items, which):
        encs = [it[which] if which in it else it for it in items]
        batch = base([{"input_ids": e["input_ids"], "labels": e["labels"]} for e in encs])
        if "topk_ids" in items[0]:
            n = batch["input_ids"].shape[1] - 1  # positions that predict a next token
            batch["topk_ids"] = pad_ref(items, "topk_ids", n)
            batch["topk_logp"] = pad_ref(items, "topk_logp", n)
            batch["first_logp"] = torch.stack([it["first_logp"] for it in items])
        return batch

    def collate(items: list[dict]) -> dict:
        half = (len(items) + 1) // 2
        out = {"open": collate_part(items[:half], "open"), "locked": collate_part(items[half:], "locked")}
        if "open" in items[0]:  # behaviours: the locked half with its true targets (for unlikelihood)
            out["locked_true"] = collate_part(items[half:], "open")
        return out

    return collate


class GatingDataModule(L.LightningDataModule):
    """Behaviour and retain data for gated training.

    Args:
        model_name: Model reference (linked from the model's ``model_name``); its tokenizer formats the data.
        behaviours: Behaviours to gate: built-in names, .jsonl files or hf:<dataset>.
        locked_response: What the model should answer in the locked state.
        batch_size: Examples per behaviour and per retain batch (half open, half locked).
        max_length: Truncate encodings to this many tokens (from the left).
        reference_max_new_tokens: Length of the reference model's greedy retain answers.
        reference_top_k: Top-k of the reference distribution kept for the retain KL.
        num_workers: DataLoader workers.
        seed: Seed of the data generators and splits.
    """

    def __init__(
        self,
        model_name: str = "smollm2-135m-instruct",
        behaviours: list[str] = ("capitals",),
        locked_response: str = "I don't know.",
        batch_size: int = 8,
        max_length: int = 256,
        reference_max_new_tokens: int = 48,
        reference_top_k: int = 32,
        num_workers: int = 0,
        seed: int = 0,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.behaviours = list(behaviours)
        self._ready = False

    # --- data --------------------------------------------------------------------------------
    def _load(self):
        from modular.models import load_tokenizer

        self.tokenizer = load_tokenizer(self.hparams.model_name)
        self.behaviour_data = {
            b: load_behaviour(b, seed=self.hparams.seed, tokenizer=self.tokenizer) for b in self.behaviours
        }
        self.retain = retain_data(seed=self.hparams.seed)

    def reference(self, model=None) -> dict:
        """Cached reference outputs for every retain prompt (train, validation and test)."""
        from modular.gating.reference import cache_path, load_or_compute
        from modular.models import load_model
        from modular.models.loading import resolve_model

        prompts = [p for s in ("train", "validation", "test") for p in self.retain[s]["prompt"]]
        chats = [c for s in ("train", "validation", "test") for c in self.retain[s]["chat"]]
        source = resolve_model(self.hparams.model_name)
        hp = self.hparams
        if model is None and not cache_path(source, prompts, hp.reference_max_new_tokens, hp.reference_top_k).exists():
            model = load_model(hp.model_name)
        return load_or_compute(source, model, self.tokenizer, prompts, chats, hp.reference_max_new_tokens,
                               hp.reference_top_k)

    def prepare_data(self) -> None:
        """Runs on one process: computes the reference cache so other processes only read it."""
        self._load()
        self.reference()

    def setup(self, stage: str | None = None) -> None:
        if self._ready:
            return
        self._load()
        ref = self.reference()
        hp = self.hparams
        offsets, start = {}, 0
        for s in ("train", "validation", "test"):
            offsets[s] = start
            start += len(self.retain[s])
        self.retain_rows = {
            s: [self._retain_item(ref["records"][offsets[s] + i]) for i in range(len(self.retain[s]))]
            for s in ("train", "validation", "test")
        }
        self.reference_first_logp = {
            s: torch.stack([ref["records"][offsets[s] + i]["first_logp"].float() for i in range(len(self.retain[s]))])
            for s in ("validation", "test")
        }
        self.behaviour_rows = {
            b: {
                s: [
                    {
                        "open": encode_example(self.tokenizer, r["prompt"], r["target"], r["chat"], hp.max_length),
                        "locked": encode_example(self.tokenizer, r["prompt"], hp.locked_response, r["chat"],
                                                 hp.max_length),
                    }
                    for r in ds[s]
                ]
                for s in ("train", "validation")
            }
            for b, ds in self.behaviour_data.items()
        }
        self._ready = True

    def _retain_item(self, rec: dict) -> dict:
        ids, labels = rec["input_ids"], rec["labels"]
        n = len(ids) - 1
        k = rec["topk_ids"].shape[-1]
        topk_ids = torch.zeros(n, k, dtype=torch.long)
        topk_logp = torch.zeros(n, k)
        pos = [t for t in range(n) if labels[t + 1] != IGNORE]
        topk_ids[pos] = rec["topk_ids"].long()
        topk_logp[pos] = rec["topk_logp"].float()
        return {"input_ids": ids, "labels": labels, "topk_ids": topk_ids, "topk_logp": topk_logp,
                "first_logp": rec["first_logp"].float()}

    def _loaders(self, split: str, shuffle: bool) -> CombinedLoader:
        collate = split_collate(self.tokenizer.pad_token_id)
        kw = dict(batch_size=self.hparams.batch_size, collate_fn=collate, num_workers=self.hparams.num_workers,
                  drop_last=shuffle)
        loaders = {b: DataLoader(_Rows(rows[split]), shuffle=shuffle, **kw) for b, rows in self.behaviour_rows.items()}
        loaders["retain"] = DataLoader(_Rows(self.retain_rows[split]), shuffle=shuffle, **kw)
        return CombinedLoader(loaders, mode="max_size_cycle" if shuffle else "min_size")

    def train_dataloader(self):
        return self._loaders("train", shuffle=True)

    def val_dataloader(self):
        return self._loaders("validation", shuffle=False)

"""The gating DataModule: behaviour batches (split between open and locked) and retain batches
(with the reference model's cached outputs). Its options are read by :mod:`modular.gating.data_options` and its
items collated by :mod:`modular.gating.collate`."""

from __future__ import annotations

import logging

import lightning as L
import torch
from lightning.pytorch.utilities import CombinedLoader
from torch.utils.data import DataLoader

from modular import ModularError
from modular.data import load_behaviour, load_jsonl, neutral_text, parse_behaviour, retain_data
from modular.data.behaviours import is_jsonl
from modular.data.formatting import (
    IGNORE,
    answer_positions,
    encode_example,
    long_items,
    render_prompt,
)
from modular.data.schema import DEFAULT_LOCKED_RESPONSE, all_refusals
from modular.gating.collate import _Rows, open_collate, split_collate
from modular.gating.data_options import (
    NEIGHBOURS_KEY,
    TASK_PREFIX,
    LMTextOptions,
    ReferenceOptions,
    _named,
    check_data_options,
    data_max_length,
    locked_responses,
    neighbour_data,
    neighbour_specs,
    per_behaviour,
    training_data,
)
from modular.gating.loaders import PassSeededSampler, ResumableLoader
from modular.gating.options import plain
from modular.gating.reference import load_or_compute, load_or_compute_hidden, load_or_compute_text
from modular.gating.requirements import (
    ItemEncoding,
    Requirement,
    TaskCounterfactuals,
    encodings,
    hidden_parts,
    requirements_of,
)
from modular.models import load_model, load_tokenizer
from modular.models.loading import load_dtype, resolve_model
from modular.models.precision import dtype_name

log = logging.getLogger("modular")

#: what other modules take from here (the options' helpers and the collation live in modules of their own)
__all__ = ["NEIGHBOURS_KEY", "TASK_PREFIX", "GatingDataModule", "LMTextOptions", "ReferenceOptions",
           "check_data_options", "data_max_length", "locked_responses", "neighbour_data", "neighbour_specs",
           "open_collate", "per_behaviour", "split_collate", "training_data"]


class GatingDataModule(L.LightningDataModule):
    """Behaviour and retain data for gated training.

    Besides the gated behaviours (and for sparse post-training, instead of them) the module can
    train *tasks* in the open state only (CE on their targets; batch keys ``task:<name>``) and
    keep language modelling on raw text (``lm``: KL to the reference's next-token distributions
    at every position of the training split of the built-in neutral text; its test split stays
    held out for perplexity). With gated behaviours the LM batches, like retain batches, are split
    between the open and the locked state.

    Args:
        model_name: Model reference (linked from the model's ``model_name``); its tokenizer formats the data.
        behaviours: Behaviours to gate: built-in names, .jsonl files (named by their stem), hf:<dataset>, or
            NAME=<.jsonl file or hf:dataset>; may be empty.
        tasks: Behaviours trained in the open state only, never locked (e.g. for sparse post-training).
        neighbours: Behaviours close to the gated ones that must work as before in both states (the rest of the
            domain: for capitals, other facts about the same countries). Their train prompts, with the reference
            model's own answers as targets, are kept by the same KL terms as retain data, half open, half locked.
            ``auto``: the built-in neighbours of the built-in gated behaviours (capitals: continents and
            languages; ioi: ioi_thanks; a behaviour that brings none, as a user's, the far guards capitals, arithmetic,
            commonsense and ioi: :data:`~modular.data.behaviours.FAR_GUARDS`); or a list of built-in names, .jsonl files,
            hf:<dataset> or NAME=<source>; ``[]``: none. The lock evaluation scores held-out neighbours (test
            splits, other entities) besides these.
        neighbour_items: At most this many train items of each neighbour are kept (an even sample by seed).
        lm_text: Adds LM batches of raw text (:class:`~modular.gating.data_options.LMTextOptions`: ``source``
            ``neutral``, the built-in neutral text's train split; ``max_length`` tokens per text; split between the
            states when behaviours are gated); ``null``: none.
        locked_response: What the model should answer in the locked state: one response for every behaviour, or a
            mapping behaviour → response (behaviours not named answer "I don't know."). Text completions want a
            continuation that fits the text but does not carry the behaviour (IOI: ``" them."`` instead of a name).
        batch_size: Examples per behaviour and per retain batch (half open, half locked): at least 2.
        max_length: Truncate encodings to this many tokens (from the left).
        reference: What the reference model's cached outputs hold
            (:class:`~modular.gating.data_options.ReferenceOptions`: the length of its greedy answers, the top-k of
            its distributions, and the positions and blocks of its residual stream kept for
            :class:`~modular.gating.objectives.KeepHidden`).
        num_workers: DataLoader workers.
        seed: Seed of the data generators and splits.

    Besides these options the batches carry what the trained module requires (its terms' and its head gates':
    answer rows, the reference's hidden states of some parts, the tasks' counterfactual prompts;
    :meth:`~modular.gating.module.GatedLM.requirements`), and what :meth:`require` adds for a module used without a
    trainer.
    """

    def __init__(
        self,
        model_name: str = "smollm2-135m-instruct",
        behaviours: list[str] = ("capitals",),
        tasks: list[str] = (),
        neighbours: str | list[str] = "auto",
        neighbour_items: int = 128,
        lm_text: LMTextOptions | None = None,
        locked_response: str | dict[str, str] = DEFAULT_LOCKED_RESPONSE,
        batch_size: int = 8,
        max_length: int = 256,
        reference: ReferenceOptions = ReferenceOptions(),
        num_workers: int = 0,
        seed: int = 0,
    ):
        super().__init__()
        groups = check_data_options(dict(batch_size=batch_size, max_length=max_length, num_workers=num_workers,
                                         neighbour_items=neighbour_items, reference=reference, lm_text=lm_text))
        self.reference_options: ReferenceOptions = groups["reference"]
        self.lm_options: LMTextOptions | None = groups["lm_text"]
        # the groups as plain mappings in the hyperparameters (what a checkpoint keeps, loadable with weights_only)
        reference, lm_text = plain(self.reference_options), plain(self.lm_options)
        self.save_hyperparameters()
        # behaviours and tasks go by their short names (metrics, batch keys); their specs say where the data is
        self.behaviour_specs = _named(behaviours, "behaviours")
        self.task_specs = _named(tasks, "tasks")
        self.behaviours = list(self.behaviour_specs)
        self.tasks = list(self.task_specs)
        self.locked_responses = locked_responses(locked_response, self.behaviours)
        # the locked responses the refusal guard keeps unlikely on retain and neighbour prompts (none without a lock)
        self.refusals = all_refusals(self.locked_responses) if self.behaviours else ()
        self.neighbour_specs = neighbour_specs(neighbours, self.behaviours)
        if not self.behaviours and not self.tasks:
            raise ModularError("nothing to train: give at least one behaviour or one task")
        self._required: list[Requirement] = []  # what require() adds to the trained module's requirements
        self._warned: set[str] = set()
        for name, spec in {**self.behaviour_specs, **self.task_specs}.items():
            source = parse_behaviour(spec)[1]
            if is_jsonl(source):  # user data needs no tokenizer: its splits are checked before any work
                self._training_data(name, load_jsonl(source))
        for name, spec in self.neighbour_specs.items():
            source = parse_behaviour(spec)[1]
            if is_jsonl(source):
                neighbour_data(name, load_jsonl(source))
        self._ready = False
        self._encodings: list[ItemEncoding] = []  # the behaviour items' required encodings (set up with the items)
        self._counterfactuals = False  # whether task items carry their counterfactual prompts (set up likewise)
        self._reference_model_cache = None
        self._reference_precision_cache: str | None = None

    def _training_data(self, name: str, data):
        """:func:`training_data`, with a warning (once per behaviour) where a validation split was carved."""
        data, moved = training_data(name, data, self.hparams.batch_size)
        if moved and name not in self._warned:
            self._warned.add(name)
            log.warning("behaviour '%s' has no validation split: %d of its train items moved to validation", name,
                        moved)
        return data

    # --- data --------------------------------------------------------------------------------
    def _load(self):
        self.tokenizer = load_tokenizer(self.hparams.model_name)
        self.behaviour_data = {
            b: self._training_data(b, load_behaviour(spec, seed=self.hparams.seed, tokenizer=self.tokenizer))
            for b, spec in self.behaviour_specs.items()
        }
        self.task_data = {
            t: self._training_data(t, load_behaviour(spec, seed=self.hparams.seed, tokenizer=self.tokenizer))
            for t, spec in self.task_specs.items()
        }
        self.neighbour_data = {
            n: neighbour_data(n, load_behaviour(spec, seed=self.hparams.seed, tokenizer=self.tokenizer),
                              self.hparams.neighbour_items, self.hparams.seed)
            for n, spec in self.neighbour_specs.items()
        }
        self.retain = retain_data(seed=self.hparams.seed)
        if self.lm_options is not None:
            self.lm_texts = neutral_text(seed=self.hparams.seed)

    def _reference_model(self):
        """The reference (base) model, loaded at most once however many caches are cold."""
        if self._reference_model_cache is None:
            self._reference_model_cache = load_model(self.hparams.model_name)
        return self._reference_model_cache

    def reference(self) -> dict:
        """Cached reference outputs for every retain prompt (train, validation and test)."""
        prompts = [p for s in ("train", "validation", "test") for p in self.retain[s]["prompt"]]
        chats = [c for s in ("train", "validation", "test") for c in self.retain[s]["chat"]]
        return self._reference(prompts, chats)

    def neighbour_reference(self) -> dict | None:
        """Cached reference outputs for the neighbours' train and validation prompts (None: no neighbours)."""
        rows = self._neighbour_rows_raw()
        if not rows:
            return None
        return self._reference([r["prompt"] for _, _, r in rows], [r["chat"] for _, _, r in rows])

    def _neighbour_rows_raw(self) -> list[tuple[str, str, dict]]:
        """(neighbour, split, record) of every neighbour train and validation item, in a fixed order."""
        return [(n, s, r) for n, ds in self.neighbour_data.items() for s in ("train", "validation") for r in ds[s]]

    def _reference(self, prompts: list[str], chats: list[bool]) -> dict:
        source = resolve_model(self.hparams.model_name)
        ref = self.reference_options
        precision = self._reference_precision()
        return load_or_compute(source, self._reference_model, self.tokenizer, prompts, chats, ref.max_new_tokens,
                               ref.top_k, precision=precision, max_length=self._reference_bound(prompts, chats))

    def _reference_bound(self, prompts: list[str], chats: list[bool]) -> int | None:
        """``max_length`` where it cuts a prompt with its reference answer, else None: outputs that no limit touches
        are the same with or without one, and share one cache key."""
        max_length = self.hparams.max_length
        room = max_length - self.reference_options.max_new_tokens
        long = any(len(self.tokenizer(render_prompt(self.tokenizer, p, c))["input_ids"]) > room
                   for p, c in zip(prompts, chats))
        return max_length if long else None

    def _reference_precision(self) -> str:
        """The dtype the reference model runs in (:meth:`_reference_model`), by name: part of every cache key."""
        if self._reference_precision_cache is None:  # read from the model's config once
            self._reference_precision_cache = dtype_name(load_dtype(self.hparams.model_name))
        return self._reference_precision_cache

    def require(self, *requirements: Requirement) -> GatingDataModule:
        """Build these too (:mod:`modular.gating.requirements`), besides what the trained module requires: for a
        module used without a trainer, or terms of one's own run by hand. Returns the data module; call before
        :meth:`setup`."""
        for r in requirements:
            if not isinstance(r, Requirement):
                raise ModularError(f"require: {r!r} is not a modular.gating.requirements.Requirement")
        self._required.extend(requirements)
        return self

    def requirements(self) -> list[Requirement]:
        """What the batches carry beyond every item's rows (:mod:`modular.gating.requirements`): what the module
        this data trains requires (the trainer's module once attached:
        :meth:`~modular.gating.module.GatedLM.requirements`, or its terms') and what :meth:`require` added."""
        module = getattr(self.trainer, "lightning_module", None) if self.trainer is not None else None
        if module is None:
            theirs = []
        elif callable(getattr(module, "requirements", None)):
            theirs = module.requirements()
        else:
            theirs = requirements_of(getattr(module, "objectives", None) or ())
        return list(dict.fromkeys([*self._required, *theirs]))

    def _keeps_hidden(self, part: str) -> bool:
        """Whether ``part``'s items carry the reference's hidden states (``reference.hidden_positions``, and a
        requirement of ``part``'s)."""
        return bool(self.reference_options.hidden_positions) and part in hidden_parts(self.requirements())

    def _hidden(self, records: list[dict]) -> dict:
        """The reference model's residual stream on reference records, cached
        (:func:`~modular.gating.reference.load_or_compute_hidden`)."""
        ref = self.reference_options
        return load_or_compute_hidden(resolve_model(self.hparams.model_name), self._reference_model, self.tokenizer,
                                      records, ref.hidden_positions, ref.hidden_stride,
                                      precision=self._reference_precision())

    def _add_hidden(self, records: list[dict], items: list[dict]) -> None:
        """Give each item (in the records' order) its reference hidden states (:meth:`_hidden`)."""
        ref = self._hidden(records)
        blocks = torch.tensor(ref["blocks"], dtype=torch.long)
        for item, h in zip(items, ref["hidden"], strict=True):
            item["ref_hidden"], item["ref_hidden_blocks"] = h, blocks

    def lm_reference(self) -> dict[str, list[dict]]:
        """Cached reference next-token distributions on the LM texts (train and validation splits)."""
        texts = {s: list(self.lm_texts[s]["text"]) for s in ("train", "validation")}
        flat = texts["train"] + texts["validation"]
        records = load_or_compute_text(resolve_model(self.hparams.model_name), self._reference_model,
                                       self.tokenizer, flat, self.lm_options.max_length, self.reference_options.top_k,
                                       precision=self._reference_precision())
        n = len(texts["train"])
        return {"train": records[:n], "validation": records[n:]}

    def prepare_data(self) -> None:
        """Runs on one process: computes the reference cache so other processes only read it."""
        self._load()
        try:
            ref, neighbour_ref = self.reference(), self.neighbour_reference()
            if self._keeps_hidden("retain"):
                self._hidden(ref["records"])
            if neighbour_ref and self._keeps_hidden(NEIGHBOURS_KEY):
                self._hidden(neighbour_ref["records"])
            if self.lm_options is not None:
                self.lm_reference()
        finally:
            self._reference_model_cache = None  # free it before training

    def setup(self, stage: str | None = None) -> None:
        if self._ready:
            return
        self._load()
        required = self.requirements()
        self._encodings = encodings(required, "behaviours")
        self._counterfactuals = any(isinstance(r, TaskCounterfactuals) for r in required)
        self._report_long()
        ref = self.reference()
        offsets, start = {}, 0
        for s in ("train", "validation", "test"):
            offsets[s] = start
            start += len(self.retain[s])
        self.retain_rows = {
            s: [self._retain_item(ref["records"][offsets[s] + i], self.retain[s][i], i)
                for i in range(len(self.retain[s]))]
            for s in ("train", "validation", "test")
        }
        self.neighbour_rows = {"train": [], "validation": []}
        neighbour_ref = self.neighbour_reference()
        raw = self._neighbour_rows_raw()
        neighbour_items = []  # in the records' order (neighbour by neighbour, each split by split)
        for i, ((_, split, r), rec) in enumerate(zip(raw, neighbour_ref["records"] if neighbour_ref else [])):
            neighbour_items.append(self._retain_item(rec, r, i))
            self.neighbour_rows[split].append(neighbour_items[-1])
        if self._keeps_hidden("retain"):
            self._add_hidden(ref["records"], [it for s in ("train", "validation", "test") for it in self.retain_rows[s]])
        if neighbour_ref and self._keeps_hidden(NEIGHBOURS_KEY):
            self._add_hidden(neighbour_ref["records"], neighbour_items)
        self.reference_first_logp = {
            s: torch.stack([ref["records"][offsets[s] + i]["first_logp"].float() for i in range(len(self.retain[s]))])
            for s in ("validation", "test")
        }
        self.behaviour_rows = {
            b: {
                s: [
                    self._behaviour_item(r, self.locked_responses[b])
                    for r in ds[s]
                ]
                for s in ("train", "validation")
            }
            for b, ds in self.behaviour_data.items()
        }
        self.task_rows = {
            t: {s: [self._task_item(r) for r in ds[s]] for s in ("train", "validation")}
            for t, ds in self.task_data.items()
        }
        self.lm_rows = {}
        if self.lm_options is not None:
            self.lm_rows = {s: [self._lm_item(rec) for rec in recs] for s, recs in self.lm_reference().items()}
        self._reference_model_cache = None
        self._ready = True

    def _report_long(self) -> None:
        """One warning naming, per behaviour, task, neighbour and retain and per split, how many items (prompt and
        target) are longer than ``max_length``: training sees their last ``max_length`` tokens, the start of the prompt
        cut."""
        if self.trainer is not None and not self.trainer.is_global_zero:
            return  # one process says it
        hp, parts = self.hparams, []
        named = [(f"{kind} '{name}'", ds) for kind, data in (("behaviour", self.behaviour_data),
                                                             ("task", self.task_data),
                                                             ("neighbour", self.neighbour_data))
                 for name, ds in data.items()]
        for what, ds in named + [("retain", self.retain)]:  # retain: its prompts (its targets are the reference's)
            counts = [f"{n} of {len(ds[s])} {s}" for s in ("train", "validation")
                      if (n := long_items(self.tokenizer, ds[s], hp.max_length))]
            if counts:
                parts.append(f"{what} {', '.join(counts)}")
        if parts:
            log.warning("items longer than data.max_length (%d tokens with their target) are cut to their last %d "
                        "tokens, the start of their prompt dropped: %s", hp.max_length, hp.max_length, "; ".join(parts))

    def _task_item(self, r: dict) -> dict:
        hp = self.hparams
        item = {"open": encode_example(self.tokenizer, r["prompt"], r["target"], r["chat"], hp.max_length)}
        wrong = self.tokenizer(r.get("wrong") or "", add_special_tokens=False)["input_ids"]
        item["wrong_id"] = wrong[0] if wrong else -1
        if self._counterfactuals:
            if not r.get("counterfactual"):
                raise ModularError(f"task item without a counterfactual prompt: {r['prompt'][:60]!r}; "
                                   "head_gates.scope: tasks needs one for every task item")
            cf = encode_example(self.tokenizer, r["counterfactual"], r["target"], r["chat"], hp.max_length)
            aligned = len(cf["input_ids"]) == len(item["open"]["input_ids"])
            item["counterfactual"] = cf if aligned else item["open"]
        return item

    @staticmethod
    def _lm_item(rec: dict) -> dict:
        ids = rec["input_ids"]
        labels = list(ids)
        labels[0] = IGNORE  # the first token is predicted by nothing
        return {"input_ids": ids, "labels": labels, "topk_ids": rec["topk_ids"].long(),
                "topk_logp": rec["topk_logp"].float()}

    def _behaviour_item(self, row: dict, locked_response: str) -> dict:
        """A behaviour item: its target (``open``), the locked response (``locked``) and the encodings the terms
        require (e.g. ``answer``: the target cut after its answer, the answer alone labelled)."""
        hp, tok = self.hparams, self.tokenizer
        item = {"open": encode_example(tok, row["prompt"], row["target"], row["chat"], hp.max_length),
                "locked": encode_example(tok, row["prompt"], locked_response, row["chat"], hp.max_length)}
        for enc in self._encodings:
            item[enc.key] = enc.encode(tok, row, hp.max_length)
        return item

    def _retain_item(self, rec: dict, row: dict, i: int) -> dict:
        """A retain (or neighbour) item: the reference's answer with its top-k and first-token distributions, and
        (with gated behaviours) ``guard``, the prompt followed by a locked response, which should stay unlikely
        there (the locked responses take turns over the items)."""
        ids, labels = rec["input_ids"], rec["labels"]
        n = len(ids) - 1
        k = rec["topk_ids"].shape[-1]
        topk_ids = torch.zeros(n, k, dtype=torch.long)
        topk_logp = torch.zeros(n, k)
        pos = answer_positions(labels)
        topk_ids[pos] = rec["topk_ids"].long()
        topk_logp[pos] = rec["topk_logp"].float()
        item = {"input_ids": ids, "labels": labels, "topk_ids": topk_ids, "topk_logp": topk_logp,
                "first_logp": rec["first_logp"].float()}
        if self.refusals:
            item["guard"] = encode_example(self.tokenizer, row["prompt"], self.refusals[i % len(self.refusals)],
                                           row["chat"], self.hparams.max_length)
        return item

    def _loaders(self, split: str, shuffle: bool) -> CombinedLoader:
        """Validation: every loader in order. Training: every loader shuffled (each pass a new order), resumable
        in the middle of a pass (``ResumableLoader``)."""
        collate = split_collate(self.tokenizer.pad_token_id, self._encodings)
        kw = dict(batch_size=self.hparams.batch_size, collate_fn=collate, num_workers=self.hparams.num_workers,
                  drop_last=shuffle)

        def loader(rows, **kw):
            data = _Rows(rows)
            if shuffle:
                return ResumableLoader(data, sampler=PassSeededSampler(data), **kw)
            return DataLoader(data, shuffle=False, **kw)

        loaders = {b: loader(rows[split], **kw) for b, rows in self.behaviour_rows.items()}
        loaders["retain"] = loader(self.retain_rows[split], **kw)
        if self.neighbour_rows[split]:  # kept like retain data, half open, half locked
            loaders[NEIGHBOURS_KEY] = loader(self.neighbour_rows[split], **kw)
        kw["collate_fn"] = open_collate(self.tokenizer.pad_token_id)
        for t, rows in self.task_rows.items():
            loaders[f"{TASK_PREFIX}{t}"] = loader(rows[split], **kw)
        if self.lm_rows:  # split between the states when there is a lock to keep the LM in; else open only
            if self.behaviours:
                kw["collate_fn"] = split_collate(self.tokenizer.pad_token_id)
            loaders["lm"] = loader(self.lm_rows[split], **kw)
        return CombinedLoader(loaders, mode="max_size_cycle" if shuffle else "min_size")

    def train_dataloader(self):
        return self._loaders("train", shuffle=True)

    def train_loader_items(self) -> list[int]:
        """The items of each training loader, in the order of ``train_dataloader``'s (and of a checkpoint's loader
        states)."""
        return [len(dl.dataset) for dl in self.train_dataloader().flattened]

    def val_dataloader(self):
        return self._loaders("validation", shuffle=False)

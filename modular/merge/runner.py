"""Evaluate every pair of a pairs file: perf A, perf B, perf of the combination, merge gain, similarity.

Models, their scored items and their neutral-text activations are cached for
the whole run, so a model shared by several pairs is loaded and scored once.

* ``ac`` pairs: activation communication (:mod:`modular.merge.communication`); the
  map between the two spaces is the identity when both models come from the same
  base (same width, same coordinates) and a least-squares map otherwise (or when
  ``ac: {map: fit}``), saved under ``neutral.map_dir`` and reused when present.
* ``average`` / ``task_arithmetic`` / ``ties`` pairs: the two state dicts are merged
  (:mod:`modular.merge.weights`) and the merged model is scored like any other.
  When A or B is a gated run, the merged model's locks are checked too: each
  gated behaviour with every known direction ablated (target: ≤ 5%) and open
  (target: ≥ 0.9 × the mean open accuracy of the runs that gate it).
"""

from __future__ import annotations

import copy
import gc
import logging
from dataclasses import asdict
from pathlib import Path

import torch

from modular import ModularError
from modular.data.behaviours import load_behaviour, neutral_text
from modular.data.schema import is_correct
from modular.evaluation.behaviour import evaluate_behaviour
from modular.hooks import ablate_directions
from modular.merge import weights
from modular.merge.alignment import (
    fit_linear_map,
    load_map,
    paired_matrices,
    r_squared,
    save_map,
    similarity,
    text_activations,
)
from modular.merge.communication import communicate, layer_at_depth
from modular.merge.gain import correlation, merge_gain
from modular.merge.pairs import MergeConfig, Pair, short_name
from modular.models.adapter import ArchitectureAdapter
from modular.runs import base_model_name, is_run_folder, load_model_or_run, load_tokenizer_or_run, read_run

log = logging.getLogger("modular")

LOCKED_MAX = 0.05
OPEN_MIN_RATIO = 0.9


class ModelBank:
    """Loads each model spec once (run folders: their open model) with its tokenizer and run record, on ``device``
    in ``dtype`` (:mod:`modular.models.precision`)."""

    def __init__(self, device="auto", dtype="auto") -> None:
        self._models: dict[str, tuple] = {}
        self.device, self.dtype = device, dtype

    def get(self, spec: str):
        """``(model, tokenizer, run or None)`` for a model spec."""
        if spec not in self._models:
            run = read_run(spec) if is_run_folder(spec) else None
            self._models[spec] = (load_model_or_run(spec, self.dtype, self.device), load_tokenizer_or_run(spec), run)
            log.info("loaded %s", spec)
        return self._models[spec]

    def base_of(self, spec: str) -> str:
        """The base model a spec was trained from (itself unless it is a run folder)."""
        return base_model_name(spec)


def _items(task: str, split: str, seed: int, limit: int | None, tokenizer=None):
    ds = load_behaviour(task, seed=seed, tokenizer=tokenizer)[split]
    if len(ds) == 0:
        raise ModularError(f"task '{task}' has no '{split}' items")
    return ds if limit is None else ds.select(range(min(limit, len(ds))))


def _dedupe(directions: list[torch.Tensor], tol: float = 1e-4) -> torch.Tensor:
    """Stack unit directions, dropping any that (nearly) lies in the span of those kept."""
    kept: list[torch.Tensor] = []
    for d in directions:
        v = d.double() / d.double().norm()
        if kept:
            q, _ = torch.linalg.qr(torch.stack(kept).T)
            residual = v - q @ (q.T @ v)
            if residual.norm() < tol:
                continue
        kept.append(v)
    return torch.stack(kept).float()


class MergeRunner:
    """Runs the pairs of a :class:`MergeConfig`; see the module docstring."""

    def __init__(self, cfg: MergeConfig, bank: ModelBank | None = None, progress: bool = True) -> None:
        self.cfg = cfg
        self.bank = bank or ModelBank()
        self.progress = progress
        self._scores: dict[tuple, list[dict]] = {}
        self._acts: dict[tuple, object] = {}
        self._neutral = None

    # --- cached pieces ---------------------------------------------------------------------------
    def _desc(self, text: str):
        return text if self.progress else False

    def neutral(self, split: str) -> list[str]:
        if self._neutral is None:
            self._neutral = neutral_text(self.cfg.seed)
        texts = list(self._neutral[split]["text"])
        limit = self.cfg.neutral.limit
        return texts if limit is None else texts[:limit]

    def activations(self, spec: str, layer: int, split: str):
        key = (spec, layer, split)
        if key not in self._acts:
            model, tok, _ = self.bank.get(spec)
            self._acts[key] = text_activations(model, tok, self.neutral(split), layer,
                                               desc=self._desc(f"{short_name(spec)} L{layer} {split}"))
        return self._acts[key]

    def score(self, spec: str, task: str, model=None, tokenizer=None, intervention=None, tag: str = "open",
              split: str | None = None, limit: int | None = -1, data_tokenizer=None) -> list[dict]:
        """Per-item results ``{prompt, response, correct}`` of a model on a task (cached by spec, task, tag)."""
        split = split or self.cfg.split
        limit = self.cfg.limit if limit == -1 else limit
        key = (spec, task, tag, split, limit, data_tokenizer is not None)
        if key not in self._scores:
            if model is None:
                model, tokenizer, _ = self.bank.get(spec)
            ds = _items(task, split, self.cfg.seed, limit, data_tokenizer)
            r = evaluate_behaviour(model, tokenizer, ds, self.cfg.max_new_tokens, self.cfg.batch_size,
                                   intervention=intervention, desc=self._desc(f"{short_name(spec)} {task} {tag}"))
            self._scores[key] = r.items
        return self._scores[key]

    # --- one pair ------------------------------------------------------------------------------
    def layers(self, pair: Pair) -> tuple[int, int]:
        la = ArchitectureAdapter(self.bank.get(pair.a)[0]).n_layers
        lb = ArchitectureAdapter(self.bank.get(pair.b)[0]).n_layers
        da = self.cfg.depth if pair.depth_a is None else pair.depth_a
        db = self.cfg.depth if pair.depth_b is None else pair.depth_b
        return layer_at_depth(la, da), layer_at_depth(lb, db)

    def similarity(self, pair: Pair, k: int, j: int) -> dict:
        split = self.cfg.neutral.eval_split
        xa, xb = self.activations(pair.a, k, split), self.activations(pair.b, j, split)
        return similarity(xa, xb, self.cfg.neutral.skip_positions)

    def mapping(self, pair: Pair, k: int, j: int):
        """``(module or None, info)``: the map from A's layer-k space to B's layer-j space."""
        ma, mb = self.bank.get(pair.a)[0], self.bank.get(pair.b)[0]
        d_a, d_b = ArchitectureAdapter(ma).d_model, ArchitectureAdapter(mb).d_model
        same_base = self.bank.base_of(pair.a) == self.bank.base_of(pair.b)
        kind = pair.ac.map
        if kind == "auto":
            kind = "identity" if same_base and d_a == d_b else "fit"
        if kind == "identity":
            if d_a != d_b:
                raise ModularError(f"pair {pair.label}: map 'identity' needs equal widths, got {d_a} and {d_b}")
            return None, {"kind": "identity"}
        neutral = self.cfg.neutral
        meta = {"model_a": pair.a, "model_b": pair.b, "layer_a": k, "layer_b": j,
                "neutral_split": neutral.fit_split, "skip_positions": neutral.skip_positions,
                "seed": self.cfg.seed, "neutral_limit": neutral.limit}  # the saved maps' keys, as before the groups
        name = f"{short_name(pair.a)}_L{k}__{short_name(pair.b)}_L{j}.safetensors".replace("/", "_")
        path = Path(neutral.map_dir) / name
        loaded = load_map(path, expect=meta)
        held_x, held_y = paired_matrices(self.activations(pair.a, k, neutral.eval_split),
                                         self.activations(pair.b, j, neutral.eval_split),
                                         neutral.skip_positions)
        if loaded is not None:
            module, stored = loaded
            log.info("reusing the map %s", path)
            info = {"kind": "fit", "path": str(path), "reused": True, "n_fit": stored.get("n_fit")}
        else:
            x, y = paired_matrices(self.activations(pair.a, k, neutral.fit_split),
                                   self.activations(pair.b, j, neutral.fit_split),
                                   neutral.skip_positions)
            module = fit_linear_map(x, y)
            fit_r2 = r_squared(module, x, y)
            save_map(module, path, {**meta, "n_fit": int(x.shape[0]), "fit_r2": fit_r2})
            info = {"kind": "fit", "path": str(path), "reused": False, "n_fit": int(x.shape[0]), "fit_r2": fit_r2}
        info["heldout_r2"] = r_squared(module, held_x, held_y)
        return module, info

    def combine_ac(self, pair: Pair, task: str, k: int, j: int) -> tuple[list[dict], dict]:
        ma, ta, _ = self.bank.get(pair.a)
        mb, tb, _ = self.bank.get(pair.b)
        module, info = self.mapping(pair, k, j)
        ds = _items(task, self.cfg.split, self.cfg.seed, self.cfg.limit)
        responses = communicate(ma, ta, mb, tb, list(ds["prompt"]), list(ds["chat"]), k, j, pair.ac.f, module,
                                self.cfg.max_new_tokens, self.cfg.batch_size, desc=self._desc(f"AC {pair.label}"))
        items = [{"prompt": row["prompt"], "response": resp,
                  "correct": is_correct(resp, row["target"], row["answers"], row["prefixes"])}
                 for row, resp in zip(ds, responses)]
        return items, {"map": info}

    def merged_model(self, pair: Pair):
        ma = self.bank.get(pair.a)[0]
        mb = self.bank.get(pair.b)[0]
        sa, sb = ma.state_dict(), mb.state_dict()
        opts = pair.weights
        try:
            if pair.method == "average":
                merged = weights.average([sa, sb], [opts.weight_a, 1.0 - opts.weight_a])
                base = None
            else:
                base = opts.base or self.bank.base_of(pair.a)
                sbase = self.bank.get(base)[0].state_dict()
                if pair.method == "task_arithmetic":
                    merged = weights.task_arithmetic(sbase, [sa, sb], opts.scale)
                else:
                    merged = weights.ties(sbase, [sa, sb], opts.density, opts.scale)
        except ValueError as err:
            raise ModularError(f"pair {pair.label}: cannot merge the weights: {err}") from err
        model = copy.deepcopy(ma)
        model.load_state_dict(merged)
        return model.eval(), {"base": base}

    def lock_check(self, pair: Pair, merged, tokenizer) -> dict | None:
        """Locked / open accuracy of every gated behaviour of the merged model, against the source runs."""
        runs = {s: self.bank.get(s)[2] for s in (pair.a, pair.b) if self.bank.get(s)[2] is not None}
        if not runs:
            return None
        behaviours = list(dict.fromkeys(b for r in runs.values() for b in r.behaviours))
        dirs = _dedupe([r.directions[b] for r in runs.values() for b in r.behaviours])
        adapter = ArchitectureAdapter(merged)
        lim, out = self.cfg.lock_limit, {"directions_ablated": int(dirs.shape[0]), "behaviours": {}}
        for b in behaviours:
            acc = lambda items: sum(i["correct"] for i in items) / max(1, len(items))  # noqa: E731
            sources = {}
            for spec, run in runs.items():
                if b not in run.behaviours:
                    continue
                m, tok, _ = self.bank.get(spec)
                ad = ArchitectureAdapter(m)
                opened = self.score(spec, b, split="test", limit=lim, data_tokenizer=tok)
                locked = self.score(spec, b, model=m, tokenizer=tok, tag="locked", split="test", limit=lim,
                                    data_tokenizer=tok,
                                    intervention=lambda ad=ad, d=run.directions[b]: ablate_directions(ad, d))
                sources[short_name(spec)] = {"open": acc(opened), "locked": acc(locked)}
            tag = f"merged:{pair.label}"
            m_open = acc(self.score(tag, b, model=merged, tokenizer=tokenizer, split="test", limit=lim,
                                    data_tokenizer=tokenizer))
            m_locked = acc(self.score(tag, b, model=merged, tokenizer=tokenizer, tag="locked", split="test",
                                      limit=lim, data_tokenizer=tokenizer,
                                      intervention=lambda: ablate_directions(adapter, dirs)))
            ref = sum(s["open"] for s in sources.values()) / len(sources)
            out["behaviours"][b] = {
                "merged_open": m_open, "merged_locked": m_locked, "sources": sources, "reference_open": ref,
                "locked_ok": m_locked <= LOCKED_MAX, "open_ok": m_open >= OPEN_MIN_RATIO * ref,
                "open_ratio": m_open / ref if ref > 0 else None,
            }
            log.info("%s lock check %s: merged open %.3f (ref %.3f), locked %.3f", pair.label, b, m_open, ref,
                     m_locked)
        out["all_ok"] = all(v["locked_ok"] and v["open_ok"] for v in out["behaviours"].values())
        return out

    def run_pair(self, pair: Pair) -> dict:
        task = pair.task or self.cfg.task
        k, j = self.layers(pair)
        sim = self.similarity(pair, k, j)
        items_a = self.score(pair.a, task)
        items_b = self.score(pair.b, task)
        extra: dict = {}
        if pair.method == "ac":
            items_c, extra = self.combine_ac(pair, task, k, j)
        else:
            merged, extra = self.merged_model(pair)
            tok = self.bank.get(pair.a)[1]
            items_c = self.score(f"merged:{pair.label}", task, model=merged, tokenizer=tok)
            if pair.lock_check:
                extra["locks"] = self.lock_check(pair, merged, tok)
            del merged
            gc.collect()
        gain = merge_gain([i["correct"] for i in items_a], [i["correct"] for i in items_b],
                          [i["correct"] for i in items_c], self.cfg.bootstrap, self.cfg.seed)
        row = {"label": pair.label, "pair": asdict(pair), "task": task, "layer_a": k, "layer_b": j,
               "similarity": sim, "gain": gain, **extra,
               "items": [{"prompt": a["prompt"], "a": a["correct"], "b": b["correct"], "combined": c["correct"],
                          "response_combined": c["response"]} for a, b, c in zip(items_a, items_b, items_c)]}
        log.info("%s: perf A %.3f, B %.3f, combined %.3f, gain %+.3f [%+.3f, %+.3f], similarity %.3f (CKA %.3f)",
                 pair.label, gain["perf_a"], gain["perf_b"], gain["perf_combined"], gain["gain"], *gain["ci95"],
                 sim["frobenius"], sim["cka"])
        return row

    def run(self) -> dict:
        rows = [self.run_pair(p) for p in self.cfg.pairs]
        gains = [r["gain"]["gain"] for r in rows]
        corr = {m: correlation([r["similarity"][m] for r in rows], gains, self.cfg.bootstrap, self.cfg.seed)
                for m in ("frobenius", "cka")}
        return {"config": {k: v for k, v in asdict(self.cfg).items() if k != "pairs"}, "pairs": rows,
                "correlation": corr}

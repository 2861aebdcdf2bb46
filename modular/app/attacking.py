"""``modular attack``: a published locked model attacked as someone who has its weights but no key, beside the base
(:mod:`modular.evaluation.attacks`; each attack a plug-in), with the published model's advantage over the base."""

from __future__ import annotations

import json
import logging
from functools import partial
from pathlib import Path
from typing import Literal

# lock, attack and quantized call load_model through its module (modular.models.load_model): tests replace it there
import modular.models
from modular import ModularError
from modular.app.evaluations import _published
from modular.app.options import output_folder
from modular.data import load_behaviour, retain_data
from modular.data.schema import DEFAULT_LOCKED_RESPONSE, attack_splits
from modular.evaluation.advantage import advantage, advantage_text, plot_advantage
from modular.evaluation.attack import plot_attack, residual_scale
from modular.evaluation.attacks import (
    BASELINES,
    AttackContext,
    AttackOptions,
    QuantizedAttack,
    build_attacks,
    run_attacks,
    run_baseline,
)
from modular.evaluation.behaviour import evaluate_behaviour
from modular.evaluation.defaults import DEFAULT_ATTACKS, DEFAULT_LRS, DEFAULT_QUANTIZED
from modular.evaluation.relearning import eval_steps, run_sweep, sweep
from modular.lock_kind import lock_kinds
from modular.models import load_tokenizer
from modular.models.names import DTypeName, Scheme
from modular.models.precision import dtype_name, model_dtype
from modular.models.quantize import check_scheme
from modular.reports import AttackEntry, AttackReport
from modular.runs import training_wandb_run
from modular.tracking import log_to_wandb, read_json_if_valid, write_json

log = logging.getLogger("modular")
RelearnMode = Literal["full", "lora"]
Baseline = Literal["refusal", "base"]

ATTACK_REPORT, ATTACK_PARTIAL, ATTACK_FIGURE = "attack.json", "attack.partial.json", "attack.png"
ADVANTAGE_FIGURE = "attack_advantage.png"  # the published model's advantage over the base, beside attack.json


def attack(model: str, behaviours: list[str] | None = None, attacks: list[str] = DEFAULT_ATTACKS,
           alphas: list[float] = (-1, -0.5, -0.25, -0.1, 0.1, 0.25, 0.5, 1),
           n_pairs: int = 128, n_examples: list[int] = (8, 32, 128), seeds: list[int] = (0, 1),
           relearn_modes: list[RelearnMode] = ("full", "lora"), full_lrs: list[float] = DEFAULT_LRS["full"],
           lora_lrs: list[float] = DEFAULT_LRS["lora"], relearn_steps: int = 40, prune: bool = False, neutral: bool = True,
           unrelated: bool = True,
           baselines: list[Baseline] = ("refusal", "base"), refusal_steps: int = 100, refusal_lr: float = 3e-5,
           quantized: list[Scheme] = DEFAULT_QUANTIZED, limit: int | None = None, seed: int = 0,
           out: str | None = None, base: str | None = None,
           batch_size: int = 16, device: str = "auto", dtype: DTypeName = "auto") -> dict:
    """Attack a published locked model as someone who has the weights but no key: (a) recover the direction from
    the weights and add it back, (b) difference-in-means steering, (c) relearning: fine-tune on N behaviour
    examples over a sweep (modes × learning rates × N × seeds), (d) fine-tune on neutral text only, (e) prefill:
    begin each response with the answer's own frame ("The capital of France is") and let the model go on, (f)
    re-quantise the weights as releases are (int8, int4, GGUF block formats), (g) fine-tune on an unrelated task;
    the same sweeps, prefilling and quantisations on the base, and the relearning sweep on a plain refusal fine-tune
    of the base. Per behaviour, the published model's advantage over the base after the same attack, worst case
    over every condition (attack.json's ``advantage``, attack_advantage.png).
    Headline: the worst case over the sweep, the fewest steps to 50% / 90% of the open accuracy on held-out items
    (the open accuracy the published folder records from ``modular lock``; without one, the base's, said in a
    warning and in ``open_accuracy_from``). Each attack is a plug-in (``--attacks``; your own is one class).
    Writes attack.json beside attack.png. What is measured is saved as it comes (attack.partial.json, removed at the
    end): an attack cut short and started again with the same options on the same weights measures only the rest.

    Args:
        model: A published folder (from ``modular publish``).
        behaviours: The locked behaviours to attack (default: every behaviour listed in the folder's modular.json).
            A behaviour gated from user data is given with its data: NAME=<.jsonl file or hf:dataset>.
        attacks: The attacks, in their order in attack.json, the log line and the figure (the fine-tuning sweeps
            run after the others): weights (a), steering (b), relearning (c), neutral (d), prefill (e), quantized
            (f), unrelated (g), or the class path of your own (a subclass of modular.evaluation.attacks.Attack,
            e.g. mypackage.attacks.MyAttack). --attacks+=mypackage.attacks.MyAttack adds one to the seven;
            --attacks '[weights, prefill]' runs those two.
        alphas: Scales scanned in (a) and (b), in units of the typical residual norm.
        n_pairs: Prompt pairs used for the difference-in-means direction in (b) (at most 128).
        n_examples: Training-set sizes N of the relearning sweep (c); (d) uses the largest.
        seeds: Seeds of the sweeps (which examples, and the batch order).
        relearn_modes: Fine-tuning modes of the sweeps: full (every weight), lora (rank-8 adapters).
        full_lrs: Learning rates of full fine-tuning in the sweeps.
        lora_lrs: Learning rates of LoRA in the sweeps.
        relearn_steps: Step budget of every setting of the sweeps (batches of 8).
        prune: Once a setting of a sweep has reached 90% of the open accuracy in k steps, give the others k steps
            (highest learning rates first): the worst case is the same, the sweep much cheaper, the other curves
            shorter.
        neutral: Run (d)'s settings, fine-tuning on neutral prose only (every mode and learning rate, the largest N,
            the first seed); false records (d) with none.
        unrelated: Run (g)'s settings, fine-tuning on an unrelated built-in task (arithmetic; commonsense where
            arithmetic is attacked), as (d)'s; false records (g) with none.
        baselines: Run the relearning sweep (and (e)) also on: refusal (a copy of the base fine-tuned to answer the
            behaviour with the locked response, retain answers kept; no direction), base (the base model itself,
            also fine-tuned on neutral text alike: the published model's advantage over the base is read from it).
        refusal_steps: Fine-tuning steps of the refusal baseline.
        refusal_lr: Learning rate of the refusal baseline.
        quantized: The quantisations of (f), applied to the published model and the base alike: int8, int4
            (optimum-quanto), q8_0, q5_1, q5_0, q4_1, q4_0 (llama.cpp's block formats).
        limit: Test items per evaluation.
        out: Default: outputs/attack/<model> (outside the published folder, which is meant for upload).
        base: Default: the one the folder's modular.json names; a
            base given as a local folder is named there by its last part only, so give it here).
    """
    folder = Path(model)
    manifest, sources = _published(folder, behaviours)
    chosen = build_attacks(attacks)  # an unknown attack: one line, now
    _check_options(n_pairs, relearn_steps, n_examples, seeds, baselines)
    lrs = {"full": list(full_lrs), "lora": list(lora_lrs)}
    options = AttackOptions(  # bad modes or rates: one line, now
        alphas=tuple(alphas), n_pairs=n_pairs, relearning=tuple(sweep("behaviour", relearn_modes, lrs, n_examples, seeds)),
        neutral=tuple(sweep("neutral", relearn_modes, lrs, [max(n_examples)], seeds[:1]) if neutral else ()),
        unrelated=tuple(sweep("unrelated", relearn_modes, lrs, [max(n_examples)], seeds[:1]) if unrelated else ()),
        max_steps=relearn_steps, prune=prune, refusal_steps=refusal_steps, refusal_lr=refusal_lr,
        quantized=tuple(quantized))
    tokenizer = load_tokenizer(folder)
    locked = modular.models.load_model(folder, dtype, device)
    for scheme in quantized if any(isinstance(a, QuantizedAttack) for a in chosen) else ():
        if scheme == "none":
            raise ModularError("quantized: 'none' is the published model itself, attacked by the others")
        check_scheme(locked, scheme)  # a scheme the model's layers cannot take: one line, before any attack
    base_name = base or manifest["base_model"]
    base = modular.models.load_model(base_name, model_dtype(locked), locked.device)
    retain = retain_data(seed)
    out_dir = output_folder(out, "attack", str(folder))
    report = AttackReport(
        model=str(folder), base=base_name, dtype=dtype_name(model_dtype(locked)), behaviours={},
        sweep={"modes": list(relearn_modes), "lrs": {m: lrs[m] for m in relearn_modes}, "n_examples": list(n_examples),
               "seeds": list(seeds), "max_steps": relearn_steps, "pruned": prune, "batch_size": 8,
               "eval_steps": eval_steps(relearn_steps)})
    identity = {"base": report.base, "dtype": report.dtype, "sweep": report.sweep, "model": str(folder.resolve()),
                "weights_hash": manifest.get("weights_hash"), "behaviours": sources, "alphas": list(alphas),
                "n_pairs": n_pairs, "refusal_steps": refusal_steps, "refusal_lr": refusal_lr, "limit": limit,
                "seed": seed, "quantized": list(quantized), "neutral": neutral, "unrelated": unrelated}
    progress = _AttackProgress(out_dir / ATTACK_PARTIAL, identity)
    for b, source in sources.items():
        ctx = _attack_context(b, source, folder, manifest, progress, locked, base, tokenizer, retain, options, limit,
                              seed, batch_size)
        report.behaviours[b] = _attack_entry(ctx, chosen, baselines)
    _finish(report, out_dir, progress, chosen, folder)
    return report.to_json()


def _check_options(n_pairs: int, relearn_steps: int, n_examples, seeds, baselines) -> None:
    """One line for an option of ``modular attack`` out of range, before anything is loaded."""
    if n_pairs > 128:
        raise ModularError("n_pairs is at most 128")
    if relearn_steps < 1 or not n_examples or min(n_examples) < 1 or not seeds:
        raise ModularError("the relearning sweep needs relearn_steps >= 1, at least one N >= 1 and one seed")
    if set(baselines) - set(BASELINES):
        raise ModularError(f"baselines must be among {', '.join(BASELINES)}, got {', '.join(baselines)}")


def _finish(report: AttackReport, out_dir: Path, progress, attacks: list, folder: Path) -> None:
    """Each behaviour's kind of lock (logged, and kept in the report), attack.json written in one piece (the partial
    file then removed), attack.png and attack_advantage.png beside it, and the W&B run."""
    kinds = lock_kinds(None, report)  # which kind of lock each is, from these figures
    report.extra["lock_kinds"] = {b: k.to_json() for b, k in kinds.items()}
    for kind in kinds.values():
        log.info("%s", kind.text())
    report.write(out_dir / ATTACK_REPORT)
    progress.finish()
    fig = plot_attack(report, out_dir / ATTACK_FIGURE, attacks)
    adv_fig = plot_advantage(report, out_dir / ADVANTAGE_FIGURE)
    log_to_wandb(out_dir, "evaluate-attack", report.to_json(), config={"model": str(folder)},
                 figures={"attack": fig, "advantage": adv_fig}, training=training_wandb_run(folder))
    log.info("wrote %s, %s and %s", out_dir / ATTACK_REPORT, fig, adv_fig)


def _attack_entry(ctx, attacks: list, baselines: list[str]):
    """Behaviour ``ctx.behaviour``'s entry of attack.json (a :class:`~modular.reports.AttackEntry`): its
    accuracies, each attack's entry and the baselines'; logged in one line, and one line per baseline."""
    split = ctx.scored_on != "test"  # the behaviour's attack splits: recorded, and said in the line
    entry = AttackEntry(base_accuracy=ctx.base_accuracy, open_accuracy=ctx.open_accuracy,
                        open_accuracy_from=ctx.open_accuracy_from, locked_accuracy=ctx.locked_accuracy,
                        residual_scale=ctx.residual_scale, attacks=run_attacks(attacks, ctx),
                        fit_on=ctx.fit_on if split else None, scored_on=ctx.scored_on if split else None)
    entry.baselines = {name: run_baseline(name, ctx, attacks) for name in baselines}
    entry.advantage = advantage(entry, attacks)
    log.info("%s%s: base %.3f open %.3f locked %.3f | %s", ctx.behaviour,
             f" (attacker fits on {ctx.fit_on}, scored on {ctx.scored_on})" if split else "", ctx.base_accuracy,
             ctx.open_accuracy, ctx.locked_accuracy, " | ".join(a.summary(entry.attacks[a.key]) for a in attacks))
    for name, v in entry.baselines.items():
        log.info("%s baseline: start %.3f%s", name, v["start_accuracy"],
                 "".join(f" | {s}" for s in (a.baseline_summary(v) for a in attacks) if s))
    log.info("%s", advantage_text(ctx.behaviour, entry.advantage))
    return entry


def _attack_context(b: str, source: str, folder: Path, manifest: dict, progress: _AttackProgress, locked, base,
                    tokenizer, retain, options, limit: int | None, seed: int, batch_size: int):
    """What the attacks on behaviour ``b`` (data ``source``) share: its data, the attacker's items and the scored
    items (train and test, or the behaviour's attack splits: :func:`~modular.data.schema.attack_splits`), and the
    base's, the locked model's and the open model's accuracy on the scored items and the residual scale (measured
    once, also over a restart)."""
    data = load_behaviour(source, seed=seed, tokenizer=tokenizer)
    fit_on, scored_on = attack_splits(data)
    scored = data[scored_on]
    test = scored if limit is None else scored.select(range(min(limit, len(scored))))
    refuse = (manifest.get("locked_responses", {}).get(b, DEFAULT_LOCKED_RESPONSE),)
    part = partial(progress.part, b)  # each part measured once, also over a restart
    base_acc = part("base_accuracy", _accuracy, base, tokenizer, test, batch_size=batch_size, desc="base",
                    refusals=refuse)
    locked_acc = part("locked_accuracy", _accuracy, locked, tokenizer, test, batch_size=batch_size, desc="locked",
                      refusals=refuse)
    # the open accuracy the folder records is the test split's (for attack_score, items of the same kind)
    open_acc = manifest.get("measured_accuracy", {}).get("open", {}).get(b)
    open_from = "published folder"
    if open_acc is None:  # published before `modular lock`: the base's accuracy is the relearning target
        open_acc, open_from = base_acc, "base model"
        log.warning("%s records no measured open accuracy for %s (published before `modular lock`): the base "
                    "model's %.3f stands in for it, in the bars and as the relearning target", folder, b, base_acc)
    scale = part("residual_scale", residual_scale, locked, tokenizer, retain["train"]["prompt"],
                 retain["train"]["chat"])
    return AttackContext(behaviour=b, locked=locked, base=base, tokenizer=tokenizer, data=data, test=test,
                         fit_on=fit_on, scored_on=scored_on, retain=retain, refusals=refuse, residual_scale=scale,
                         base_accuracy=base_acc, open_accuracy=open_acc, open_accuracy_from=open_from,
                         locked_accuracy=locked_acc, options=options, batch_size=batch_size, seed=seed, part=part,
                         run_sweep=partial(progress.run_sweep, b))


def _accuracy(model, tokenizer, test, **kw) -> float:
    return evaluate_behaviour(model, tokenizer, test, **kw).accuracy


class _AttackProgress:
    """What an attack has measured so far, kept in ``path`` (rewritten atomically after each part and each
    relearning setting) with the options and weights it measured (``identity``), so that an attack cut short and
    started again on the same ones takes it over instead of measuring it again. A file of other options or weights
    is replaced."""

    def __init__(self, path: Path, identity: dict):
        self.path = path
        identity = json.loads(json.dumps(identity))  # as it reads back
        self.data = {"identity": identity, "behaviours": {}}
        old = read_json_if_valid(path)
        if isinstance(old, dict) and old.get("identity") == identity:
            self.data = old
            b = old.get("behaviours", {}).values()
            log.info("resuming the attack cut short in %s: %d parts and %d relearning settings already measured",
                     path, sum(len(v.get("parts", {})) for v in b),
                     sum(len(w["settings"]) for v in b for w in v.get("sweeps", {}).values()))
        elif path.is_file():
            log.info("%s holds an attack of other options or weights: measuring afresh", path)

    def _behaviour(self, b: str) -> dict:
        return self.data["behaviours"].setdefault(b, {"parts": {}, "sweeps": {}})

    def part(self, b: str, key: str, compute, *args, **kwargs):
        """``compute(*args, **kwargs)``, the part ``key`` of behaviour ``b``, measured once."""
        parts = self._behaviour(b)["parts"]
        if key not in parts:
            parts[key] = compute(*args, **kwargs)
            write_json(self.path, self.data)
        return parts[key]

    def run_sweep(self, b: str, name: str, model, start: float, **kw) -> dict:
        """:func:`run_sweep` of ``model`` (its own accuracy ``start``) as the sweep ``name`` of behaviour ``b``:
        the settings saved for it are taken over, each new one saved as it is measured. A sweep saved for a model
        that started elsewhere (a baseline trained again to another result) is measured afresh."""
        sweeps = self._behaviour(b)["sweeps"]
        if sweeps.get(name, {}).get("start") != start:
            sweeps[name] = {"start": start, "settings": {}}
        kept = sweeps[name]["settings"]

        def on_result(r: dict) -> None:
            kept[r["label"]] = r
            write_json(self.path, self.data)

        return run_sweep(model, start=start, done=dict(kept), on_result=on_result, **kw)

    def finish(self) -> None:
        self.path.unlink(missing_ok=True)

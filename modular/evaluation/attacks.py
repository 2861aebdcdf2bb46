"""Attacks as plug-ins: every attack ``modular attack`` runs on a published locked model is one class.

An :class:`Attack` has a ``key`` (its entry in each behaviour of attack.json), a ``title`` (its bar in attack.png and
its part of the log line) and :meth:`~Attack.run`, which measures it on one locked behaviour from what the attacks
share (an :class:`AttackContext`: the locked and the base model, the tokenizer, the behaviour's data, the items the
attacker fine-tunes on and those every attack scores, retain data, the residual scale, the command's options, and
the helpers that keep what is measured over a restart). What it
reports is read back by :meth:`~Attack.summary` (the log line), :meth:`~Attack.bars` and :meth:`~Attack.curves`
(the figure); :meth:`~Attack.baseline` adds its measure of a baseline model, if it has one.

The built-in attacks are (a) to (g) of :mod:`modular.evaluation.attack` and :mod:`modular.evaluation.relearning`
(:data:`BUILTIN_ATTACKS`, by short name). An attack of your own is one class in your module::

    class Noise(Attack):
        key, title = "f_noise", "(f) noise"

        def run(self, ctx):
            return ctx.part(self.key, my_measure, ctx.locked, ctx.tokenizer, ctx.test)  # {"accuracy": ...}

named on the command line: ``modular attack --model DIR --attacks+=mymodule.Noise`` (``--attacks '[weights,
mymodule.Noise]'`` for those two alone).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from modular import ModularError
from modular.data import load_behaviour, neutral_text
from modular.evaluation.attack import prefill_attack, quantized_attack, steering_attack, weight_attack
from modular.evaluation.baselines import refusal_finetune
from modular.evaluation.behaviour import evaluate_behaviour
from modular.evaluation.defaults import DEFAULT_ATTACKS, DEFAULT_QUANTIZED
from modular.evaluation.relearning import Setting, cost_ratio, example_rows, run_sweep, text_rows
from modular.evaluation.retain import first_token_logp, mean_kl
from modular.reports import ATTACK_ROW_FIELDS
from modular.specs import build_from_specs

#: the fields of a behaviour's entry in attack.json that are not an attack's (:class:`~modular.reports.AttackEntry`)
ROW_FIELDS = ATTACK_ROW_FIELDS
#: the baselines the relearning sweep also runs on (models trained from the same base, no direction)
BASELINES = ("refusal", "base")


@dataclass(frozen=True)
class AttackOptions:
    """The command's options the built-in attacks read.

    Attributes:
        alphas: Scales scanned by (a) and (b), in units of the residual scale.
        n_pairs: Prompt pairs of (b)'s difference in means.
        relearning: The settings of (c)'s sweep.
        neutral: The settings of (d)'s sweep.
        unrelated: The settings of (g)'s sweep.
        max_steps: Step budget of every setting of a sweep.
        prune: Prune the sweeps (:func:`~modular.evaluation.relearning.run_sweep`).
        refusal_steps: Fine-tuning steps of the refusal baseline.
        refusal_lr: Learning rate of the refusal baseline.
        quantized: The quantisations of (f), each applied to the published model and to the base alike.
    """

    alphas: tuple[float, ...] = (-1, -0.5, -0.25, -0.1, 0.1, 0.25, 0.5, 1)
    n_pairs: int = 128
    relearning: tuple[Setting, ...] = ()
    neutral: tuple[Setting, ...] = ()
    unrelated: tuple[Setting, ...] = ()
    max_steps: int = 40
    prune: bool = False
    refusal_steps: int = 100
    refusal_lr: float = 3e-5
    quantized: tuple[str, ...] = DEFAULT_QUANTIZED


def measure(key: str, compute: Callable, *args, **kwargs):
    """``compute(*args, **kwargs)``: :attr:`AttackContext.part` where nothing is kept over a restart."""
    return compute(*args, **kwargs)


def sweep_once(name: str, model, start: float, **kw) -> dict:
    """:func:`~modular.evaluation.relearning.run_sweep`: :attr:`AttackContext.run_sweep` where nothing is kept."""
    return run_sweep(model, start=start, **kw)


@dataclass
class AttackContext:
    """What the attacks on one locked behaviour share.

    Attributes:
        behaviour: Its name.
        locked: The published (locked) model attacked.
        base: The base model it was trained from (in the same precision, on the same device).
        tokenizer: The published folder's tokenizer.
        data: The behaviour's splits (``train``, ``validation``, ``test``; ``attack_fit`` and ``attack_score`` where
            it has them).
        test: The items every attack (and baseline) scores, cut to ``--limit``: the test split, or ``attack_score``
            where the data has attack splits (:func:`~modular.data.schema.attack_splits`; ``scored_on`` says which).
        fit: The items the attacker has (fine-tunes on, steers from): the train split, or ``attack_fit`` where the
            data has attack splits (``fit_on`` says which); default: ``data["train"]``.
        fit_on: The split of ``fit``.
        scored_on: The split of ``test``.
        retain: Retain data (``train``, ``test``): general instructions.
        refusals: The locked response(s) of the behaviour (an answer that is one is a refusal, not an answer).
        residual_scale: The typical residual norm at the middle layer (the unit of (a) and (b)'s scales).
        base_accuracy: The base model's accuracy on ``test``.
        open_accuracy: The open (unlocked) model's, the relearning target.
        open_accuracy_from: Where it comes from: the published folder (measured by ``modular lock``), or the base
            model (standing in where the folder records none).
        locked_accuracy: The locked model's.
        options: The command's options of the built-in attacks.
        batch_size: Prompts per generation batch.
        seed: The command's seed (data).
        part: ``part(key, compute, *args, **kwargs)``: ``compute(*args, **kwargs)``, measured once for the key and
            kept in attack.partial.json (an attack cut short and started again takes it over).
        run_sweep: ``run_sweep(name, model, start, **kw)``: :func:`~modular.evaluation.relearning.run_sweep` as the
            sweep ``name``, each setting kept as it is measured (use :meth:`relearn`).
        results: The entries of the attacks run so far on this behaviour, by key.
    """

    behaviour: str
    locked: Any
    base: Any
    tokenizer: Any
    data: Any
    test: Any
    retain: Any
    refusals: tuple[str, ...]
    residual_scale: float
    base_accuracy: float
    open_accuracy: float
    locked_accuracy: float
    open_accuracy_from: str = "published folder"
    options: AttackOptions = field(default_factory=AttackOptions)
    batch_size: int = 16
    seed: int = 0
    part: Callable[..., Any] = measure
    run_sweep: Callable[..., dict] = sweep_once
    results: dict = field(default_factory=dict)
    fit: Any = None
    fit_on: str = "train"
    scored_on: str = "test"

    def __post_init__(self):
        if self.fit is None and self.data is not None:
            self.fit = self.data[self.fit_on]

    def relearn(self, name: str, model, start: float, settings: Sequence[Setting],
                rows_for: Callable[[Setting], list[dict]]) -> dict:
        """A relearning sweep ``name`` of ``model`` (its own accuracy ``start``) over ``settings`` (``rows_for``:
        each one's training rows), scored on :attr:`test` against the open accuracy within the step budget."""
        return self.run_sweep(name, model, start=start, tokenizer=self.tokenizer, rows_for=rows_for, test=self.test,
                              settings=list(settings), reference=self.open_accuracy, max_steps=self.options.max_steps,
                              prune=self.options.prune, eval_batch_size=self.batch_size, refusals=self.refusals)


class Attack:
    """One attack on a published locked model, by someone who has its weights but no key.

    A subclass sets ``key`` and ``title`` and defines :meth:`run`; the other methods read its entry back, by
    default as ``{"accuracy": ...}`` (the held-out accuracy it recovers). ``slow`` attacks (fine-tuning sweeps) run
    after the others, so that an attack cut short has the quick ones saved; attack.json, the log line and the
    figure keep the order of the list.
    """

    #: its entry in each behaviour of attack.json
    key: str = ""
    #: its bar in the figure and its part of the log line
    title: str = ""
    slow: bool = False

    def run(self, ctx: AttackContext) -> dict:
        """Its entry in attack.json for ``ctx.behaviour`` (measure through ``ctx.part`` to keep it over a
        restart)."""
        raise NotImplementedError

    def baseline(self, ctx: AttackContext, name: str, model, start: float) -> dict:
        """What it adds to the entry of the baseline ``name`` (``model``, of accuracy ``start``): nothing, unless
        the attack is also measured on baselines."""
        return {}

    def accuracy(self, entry: dict) -> float | None:
        """The held-out accuracy it recovered (None: nothing to show)."""
        return entry.get("accuracy")

    def summary(self, entry: dict) -> str:
        """Its part of the log line (one line)."""
        acc = self.accuracy(entry)
        return f"{self.title} {acc:.3f}" if acc is not None else f"{self.title} -"

    def baseline_summary(self, entry: dict) -> str:
        """Its part of a baseline's log line ("": none)."""
        return ""

    def versus_base(self, entry: dict, base: dict | None) -> list[tuple[str, float, float]]:
        """(condition, the published model's accuracy, the base's) for every condition of this attack measured on
        the base alike (``base``: the base baseline's entry in attack.json, None where the base was not attacked):
        the published model's advantage over the base is read from these (:mod:`modular.evaluation.advantage`).
        []: the attack has no like-for-like measure on the base (the direction recovered from the published
        weights has no counterpart in the base's)."""
        return []

    def bars(self, entry: dict) -> list[tuple[str, float]]:
        """The bars it draws in the figure's left panel: (label, held-out accuracy)."""
        acc = self.accuracy(entry)
        return [] if acc is None else [(self.title, acc)]

    def curves(self, row: dict) -> list[tuple[str, dict]]:
        """The recovery curves it draws in the right panel, as (label, sweep result) from the behaviour's whole
        ``row`` (a sweep's curves include the baselines')."""
        return []


class WeightAttack(Attack):
    """(a) The direction recovered from the weights (their common null space) added back after every block."""

    key, title = "a_weights", "(a) weights"

    def run(self, ctx: AttackContext) -> dict:
        a = ctx.part(self.key, weight_attack, ctx.locked, ctx.tokenizer, ctx.test, list(ctx.options.alphas),
                     ctx.residual_scale, refusals=ctx.refusals, batch_size=ctx.batch_size)
        return {**a, "recovered_fraction_of_base": a["best"]["accuracy"] / max(ctx.base_accuracy, 1e-9)}

    def accuracy(self, entry: dict) -> float:
        return entry["best"]["accuracy"]

    def summary(self, entry: dict) -> str:
        return f"{self.title} best {self.accuracy(entry):.3f}"


class SteeringAttack(WeightAttack):
    """(b) Difference-in-means steering between the behaviour's prompts and retain prompts, at three layers."""

    key, title = "b_steering", "(b) steering"

    def run(self, ctx: AttackContext) -> dict:
        s = ctx.part(self.key, steering_attack, ctx.locked, ctx.tokenizer, ctx.fit, ctx.retain["train"],
                     ctx.test, list(ctx.options.alphas), ctx.residual_scale, ctx.options.n_pairs,
                     refusals=ctx.refusals, batch_size=ctx.batch_size)
        return {**s, "recovered_fraction_of_base": s["best"]["accuracy"] / max(ctx.base_accuracy, 1e-9)}


class PrefillAttack(Attack):
    """(e) Each response begun with the answer's own frame and continued greedily (the base prefilled alike); on
    the refusal baseline too."""

    key, title = "e_prefill", "(e) prefill"

    def run(self, ctx: AttackContext) -> dict:
        return ctx.part(self.key, prefill_attack, ctx.locked, ctx.base, ctx.tokenizer, ctx.test, refusals=ctx.refusals,
                        batch_size=ctx.batch_size)

    def baseline(self, ctx: AttackContext, name: str, model, start: float) -> dict:
        if model is ctx.base:  # the base prefilled is (e)'s own reference
            return {}
        r = evaluate_behaviour(model, ctx.tokenizer, ctx.test, max_new_tokens=16, batch_size=ctx.batch_size,
                               prefill=True, desc=f"{name} baseline (e)", refusals=ctx.refusals)
        return {"e_prefill_accuracy": r.accuracy}

    def summary(self, entry: dict) -> str:
        return f"(e) prefilled {entry['accuracy']:.3f} (base prefilled {entry['base_accuracy']:.3f})"

    def baseline_summary(self, entry: dict) -> str:
        return f"(e) prefilled {entry['e_prefill_accuracy']:.3f}" if "e_prefill_accuracy" in entry else ""

    def versus_base(self, entry: dict, base: dict | None) -> list[tuple[str, float, float]]:
        return [("prefilled", entry["accuracy"], entry["base_accuracy"])]  # the base is prefilled alike in run()


def sampled_rows(tokenizer, data, s: Setting) -> list[dict]:
    """Setting ``s``'s training rows: ``s.n`` examples of ``data`` (all, where it has fewer), chosen by ``s.seed``."""
    return example_rows(tokenizer, data.shuffle(seed=s.seed).select(range(min(s.n, len(data)))))


def steps_text(w: dict) -> str:
    """A worst case's steps to a threshold, or that no setting reached it within the budget."""
    return str(w["steps"]) if w["steps"] is not None else f"none within {w['more_than']}"


class SweepAttack(Attack):
    """An attack that fine-tunes copies of the model over a sweep of settings (:meth:`settings`, each one's
    training rows from :meth:`rows_for`): its entry is the sweep's result (curves, worst case), drawn as a recovery
    curve, the best accuracy over the sweep by step, for the locked model and every baseline that ran it."""

    slow = True

    def settings(self, ctx: AttackContext) -> Sequence[Setting]:
        raise NotImplementedError

    def rows_for(self, ctx: AttackContext) -> Callable[[Setting], list[dict]]:
        raise NotImplementedError

    def run(self, ctx: AttackContext) -> dict:
        return ctx.relearn(self.key, ctx.locked, ctx.locked_accuracy, self.settings(ctx), self.rows_for(ctx))

    def accuracy(self, entry: dict) -> float | None:
        return entry["worst_case"]["best_accuracy"] if entry.get("settings") else None

    def summary(self, entry: dict) -> str:
        if not entry["settings"]:
            return f"{self.title}: not run"
        w = entry["worst_case"]
        return (f"{self.title}: worst case over {len(entry['settings'])} settings, "
                f"{steps_text(w['steps_to_50pct_open'])} steps to 50% of open, {steps_text(w['steps_to_90pct_open'])} "
                f"to 90%, best {w['best_accuracy']:.3f}")

    def baseline_summary(self, entry: dict) -> str:
        if self.key not in entry:
            return ""
        w = entry[self.key]["worst_case"]
        return (f"{self.title} worst case {steps_text(w['steps_to_50pct_open'])} steps to 50% of open, "
                f"{steps_text(w['steps_to_90pct_open'])} to 90%")

    def baseline(self, ctx: AttackContext, name: str, model, start: float) -> dict:
        """The same sweep on the base (its like-for-like comparison); no other baseline."""
        if name != "base":
            return {}
        return {self.key: ctx.relearn(f"{name}/{self.key}", model, start, self.settings(ctx), self.rows_for(ctx))}

    def versus_base(self, entry: dict, base: dict | None) -> list[tuple[str, float, float]]:
        """Each setting's best accuracy within the budget, the published model's and the base's under the same
        setting."""
        theirs = {s["label"]: s["best_accuracy"] for s in ((base or {}).get(self.key) or {}).get("settings", [])}
        return [(s["label"], s["best_accuracy"], theirs[s["label"]]) for s in entry.get("settings", [])
                if s["label"] in theirs]

    def curves(self, row: dict) -> list[tuple[str, dict]]:
        return [(f"gated {self.title}", row[self.key])] + [
            (f"{name} baseline {self.title}", v[self.key]) for name, v in row.get("baselines", {}).items()
            if self.key in v]


class RelearningAttack(SweepAttack):
    """(c) Fine-tuning on N of the attacker's examples (:attr:`AttackContext.fit`: the behaviour's training examples,
    or its ``attack_fit`` split) over the sweep; on the baselines too, with how many times their worst-case steps
    the locked model's are (``cost_ratio``)."""

    key, title = "c_relearning", "(c) relearning"

    def settings(self, ctx: AttackContext) -> Sequence[Setting]:
        return ctx.options.relearning

    def rows_for(self, ctx: AttackContext) -> Callable[[Setting], list[dict]]:
        return lambda s: sampled_rows(ctx.tokenizer, ctx.fit, s)

    def baseline(self, ctx: AttackContext, name: str, model, start: float) -> dict:
        """The same sweep on every baseline, with how many times their worst-case steps the locked model's are."""
        sw = ctx.relearn(f"{name}/{self.key}", model, start, self.settings(ctx), self.rows_for(ctx))
        ours = ctx.results[self.key]["worst_case"]
        return {self.key: sw, "cost_ratio": {k: cost_ratio(ours, sw["worst_case"], k)
                                             for k in ("steps_to_50pct_open", "steps_to_90pct_open")}}


class NeutralAttack(SweepAttack):
    """(d) Fine-tuning on neutral prose only (plain language modelling)."""

    key, title = "d_neutral", "(d) neutral"

    def settings(self, ctx: AttackContext) -> Sequence[Setting]:
        return ctx.options.neutral

    def rows_for(self, ctx: AttackContext) -> Callable[[Setting], list[dict]]:
        texts = []  # made at the first setting that needs them

        def rows(s: Setting) -> list[dict]:
            texts[:] = texts or list(neutral_text(ctx.seed)["train"]["text"])
            return text_rows(ctx.tokenizer, random.Random(s.seed).sample(texts, min(s.n, len(texts))))

        return rows


#: the built-in tasks (g) fine-tunes on, the first that is not the attacked behaviour
UNRELATED = ("arithmetic", "commonsense")


class UnrelatedAttack(SweepAttack):
    """(g) Fine-tuning on N examples of an unrelated built-in task (arithmetic; commonsense where arithmetic is the
    attacked behaviour): fine-tuning on unrelated data brings back knowledge an unlearning method only hid (Deeb &
    Roger, arXiv 2410.08827), so a lock is tried against it too."""

    key, title = "g_unrelated", "(g) unrelated"

    def settings(self, ctx: AttackContext) -> Sequence[Setting]:
        return ctx.options.unrelated

    def rows_for(self, ctx: AttackContext) -> Callable[[Setting], list[dict]]:
        task = next(t for t in UNRELATED if t != ctx.behaviour)
        train = []  # loaded at the first setting that needs it

        def rows(s: Setting) -> list[dict]:
            train[:] = train or [load_behaviour(task, seed=ctx.seed, tokenizer=ctx.tokenizer)["train"]]
            return sampled_rows(ctx.tokenizer, train[0], s)

        return rows


class QuantizedAttack(Attack):
    """(f) The published weights re-quantised as a release would be (int8, int4, llama.cpp's block formats:
    :mod:`modular.models.quantize`), and the base quantised alike: rounding can undo a small edit of the weights
    and return the base's answers."""

    key, title = "f_quantized", "(f) re-quantised"

    def run(self, ctx: AttackContext) -> dict:
        return ctx.part(self.key, quantized_attack, ctx.locked, ctx.base, ctx.tokenizer, ctx.test,
                        list(ctx.options.quantized), refusals=ctx.refusals, batch_size=ctx.batch_size)

    def accuracy(self, entry: dict) -> float | None:
        return max((v["accuracy"] for v in entry["schemes"].values()), default=None)

    def summary(self, entry: dict) -> str:
        return f"{self.title} " + ", ".join(f"{s} {v['accuracy']:.3f} (base {v['base_accuracy']:.3f})"
                                            for s, v in entry["schemes"].items())

    def bars(self, entry: dict) -> list[tuple[str, float]]:
        return [(f"(f) {s}", v["accuracy"]) for s, v in entry["schemes"].items()]

    def versus_base(self, entry: dict, base: dict | None) -> list[tuple[str, float, float]]:
        return [(s, v["accuracy"], v["base_accuracy"]) for s, v in entry["schemes"].items()]


#: the built-in attacks by short name, in their order in attack.json and the figure
BUILTIN_ATTACKS: dict[str, type[Attack]] = {"weights": WeightAttack, "steering": SteeringAttack,
                                            "relearning": RelearningAttack, "neutral": NeutralAttack,
                                            "prefill": PrefillAttack, "quantized": QuantizedAttack,
                                            "unrelated": UnrelatedAttack}


def build_attacks(specs) -> list[Attack]:
    """The attacks ``specs`` name: a built-in short name (:data:`BUILTIN_ATTACKS`), the class path of an
    :class:`Attack` (``mymodule.MyAttack``), a dict or Namespace of ``class_path`` and ``init_args``, or an attack
    itself. A name that is none of these, or two attacks of one key, is one line (:class:`~modular.ModularError`)."""
    attacks = build_from_specs(specs, Attack, "attacks", lambda path: (
        f"no attack {path!r} (built-in: {', '.join(BUILTIN_ATTACKS)}; or the class path of a "
        "modular.evaluation.attacks.Attack)"), BUILTIN_ATTACKS)
    keys = [a.key for a in attacks]
    for a in attacks:
        if not a.key or not a.title:
            raise ModularError(f"attacks: {type(a).__name__} sets no key or no title")
        if a.key in ROW_FIELDS or keys.count(a.key) > 1:
            raise ModularError(f"attacks: the key {a.key!r} of {type(a).__name__} is taken (by "
                               + ("the report" if a.key in ROW_FIELDS else "another attack in the list") + ")")
    return attacks


def default_attacks() -> list[Attack]:
    """The built-in attacks (a) to (g)."""
    return build_attacks(DEFAULT_ATTACKS)


def run_attacks(attacks: Sequence[Attack], ctx: AttackContext) -> dict:
    """Every attack on ``ctx``'s behaviour, the quick ones first; their entries by key, in the list's order."""
    for a in sorted(attacks, key=lambda a: a.slow):  # stable: the list's order within each kind
        ctx.results[a.key] = a.run(ctx)
    return {a.key: ctx.results[a.key] for a in attacks}


def run_baseline(name: str, ctx: AttackContext, attacks: Sequence[Attack]) -> dict:
    """The baseline ``name`` (:data:`BASELINES`): the base itself, or a copy of it fine-tuned to refuse the
    behaviour (its accuracy, refusal rate and retain first-token KL to the base), with what each attack adds to it
    (:meth:`Attack.baseline`), the quick ones first."""
    if name == "base":
        model, entry = ctx.base, {"kind": "the base model", "start_accuracy": ctx.base_accuracy}
    elif name == "refusal":
        model, info = refusal_finetune(ctx.base, ctx.tokenizer, ctx.data["train"], ctx.retain["train"],
                                       ctx.refusals[0], ctx.options.refusal_steps, ctx.options.refusal_lr,
                                       seed=ctx.seed)
        r = evaluate_behaviour(model, ctx.tokenizer, ctx.test, batch_size=ctx.batch_size, desc="refusal baseline",
                               refusals=ctx.refusals)
        prompts, chats = ctx.retain["test"]["prompt"][:64], ctx.retain["test"]["chat"][:64]
        kl = mean_kl(first_token_logp(ctx.base, ctx.tokenizer, prompts, chats),
                     first_token_logp(model, ctx.tokenizer, prompts, chats))
        entry = {**info, "start_accuracy": r.accuracy, "refusal_rate": r.refusal_rate, "retain_first_token_kl": kl}
    else:
        raise ModularError(f"baseline must be one of {', '.join(BASELINES)}, got '{name}'")
    for a in sorted(attacks, key=lambda a: a.slow):
        entry.update(a.baseline(ctx, name, model, entry["start_accuracy"]))
    return entry

"""The reports the evaluations write, typed: ``lock.json`` (:class:`LockReport`, written by ``modular lock``) and
``attack.json`` (:class:`AttackReport`, written by ``modular attack``), each read and written here alone
(``from_json`` / ``read``, ``to_json`` / ``write``); and, read only, the verdict of training's lock check
(:class:`TrainingCheck`, the ``lock`` entry of ``run.json``, which training writes).

The JSON keeps the layout these reports have always had, plus ``version``, the number of that layout: a report
without one was written before reports recorded it, in the same layout (version 1); one of a later version than
this code knows is refused in one line. An entry a record does not know is kept (``extra``) and written back. A
value that is None is not in the report (a report written before it was measured), and is written back so.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from modular import ModularError, error_reason
from modular.files import write_json

#: the layout ``lock.json`` and ``attack.json`` are written in
LOCK_REPORT_VERSION = 1
ATTACK_REPORT_VERSION = 1
#: the entries of a behaviour's row in attack.json that are not an attack's (an attack's key may be none of them)
ATTACK_ROW_FIELDS = ("base_accuracy", "open_accuracy", "open_accuracy_from", "locked_accuracy", "residual_scale",
                     "fit_on", "scored_on", "baselines", "advantage")

T = TypeVar("T")


def _present(pairs: dict[str, Any]) -> dict[str, Any]:
    """``pairs`` without the entries that are None (not in the report)."""
    return {k: v for k, v in pairs.items() if v is not None}


def _a(what: str) -> str:
    return f"{'an' if what[0] in 'aeiou' else 'a'} {what}"


def _parse(what: str, build: Callable[[dict], T], data: Any) -> T:
    """``build(data)``; what is not a ``what`` (not a JSON object, an entry missing or of the wrong kind) is one
    line."""
    if not isinstance(data, dict):
        raise ModularError(f"not {_a(what)} (not a JSON object)")
    try:
        return build(data)
    except KeyError as err:
        raise ModularError(f"not {_a(what)} (no '{err.args[0]}' entry)") from None
    except (TypeError, ValueError, AttributeError) as err:
        raise ModularError(f"not {_a(what)} ({error_reason(err)})") from None


def _version(data: dict, current: int, what: str) -> int:
    version = data.get("version", 1)
    if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= current:
        raise ModularError(f"{_a(what)} of version {version!r}: this modular reads versions 1 to {current} (a newer "
                           "modular wrote it: update modular)")
    return version


def _read(path: str | Path, what: str) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        reason = getattr(err, "strerror", None) or error_reason(err)
        raise ModularError(f"{path} is not a readable {what} ({reason})") from None


def _scores(data: dict | None) -> dict[str, Score]:
    return {name: Score.from_json(v) for name, v in (data or {}).items()}


# --- lock.json -------------------------------------------------------------------------------------------------------
@dataclass
class PairedChange:
    """One state's items against base's, item by item (:func:`modular.evaluation.stats.paired_change`): ``lost``
    (right in base, wrong here), ``gained``, of ``n``, the exact paired test's ``p_value``, the change's paired
    bootstrap interval ``ci95`` (over independent units: three phrasings of one country are one) and ``p_holm``, the
    p-value Holm-adjusted over its family (the report's neighbour figures, or its far behaviours'); the last two are
    absent from reports written before they were measured."""

    lost: int
    gained: int
    n: int
    p_value: float
    ci95: list[float] | None = None
    p_holm: float | None = None

    @classmethod
    def from_json(cls, data: dict) -> PairedChange:
        return _parse("paired change", lambda d: cls(d["lost"], d["gained"], d["n"], d["p_value"], d.get("ci95"),
                                                      d.get("p_holm")), data)

    def to_json(self) -> dict:
        return {"lost": self.lost, "gained": self.gained, "n": self.n, "p_value": self.p_value} | _present(
            {"ci95": self.ci95, "p_holm": self.p_holm})

    @property
    def significant_loss(self) -> bool:
        """A loss the Holm-adjusted test calls significant (α = 0.05)."""
        return self.p_holm is not None and self.p_holm < 0.05 and self.lost > self.gained


@dataclass
class Score:
    """A behaviour's score in one state: its ``accuracy`` on ``n`` held-out items, and where measured: the share of
    answers that are a locked response, the mean logit difference and choice accuracy (tasks with a wrong answer),
    the 95% interval, how a far behaviour was scored (``metric``: choice or generation), a neighbour's or far
    behaviour's change from base item by item (``vs_base``)."""

    accuracy: float
    n: int | None = None
    refusal_rate: float | None = None
    logit_diff: float | None = None
    choice_accuracy: float | None = None
    ci95: tuple[float, float] | None = None
    metric: str | None = None
    vs_base: PairedChange | None = None
    vs_control: PairedChange | None = None

    @classmethod
    def from_json(cls, data: dict) -> Score:
        def build(d: dict) -> Score:
            ci, vs = d.get("ci95"), [d.get(k) for k in ("vs_base", "vs_control")]
            return cls(d["accuracy"], d.get("n"), d.get("refusal_rate"), d.get("logit_diff"), d.get("choice_accuracy"),
                       tuple(ci) if ci is not None else None, d.get("metric"),
                       *(PairedChange.from_json(v) if v is not None else None for v in vs))

        return _parse("score", build, data)

    def to_json(self) -> dict:
        out = _present({"accuracy": self.accuracy, "n": self.n, "refusal_rate": self.refusal_rate,
                        "logit_diff": self.logit_diff})
        if self.logit_diff is not None or self.choice_accuracy is not None:  # the two come together
            out["choice_accuracy"] = self.choice_accuracy
        return out | _present({"ci95": list(self.ci95) if self.ci95 is not None else None, "metric": self.metric,
                               **{k: v.to_json() for k, v in (("vs_base", self.vs_base),
                                                              ("vs_control", self.vs_control)) if v is not None}})


@dataclass
class StateRow:
    """Everything measured in one state: the gated behaviours', their neighbours' and the far behaviours' scores,
    the gated behaviours' held-out paraphrase sets (``paraphrases``, by ``<behaviour>/<set>``:
    :mod:`modular.data.paraphrases`), the retain first-token KL to base, the share of retain answers that are a
    locked response, the neutral text's perplexity and its ratio to base's."""

    behaviours: dict[str, Score] = field(default_factory=dict)
    neighbours: dict[str, Score] = field(default_factory=dict)
    others: dict[str, Score] = field(default_factory=dict)
    retain_first_token_kl: float | None = None
    retain_refusal_rate: float | None = None
    perplexity: float | None = None
    perplexity_ratio: float | None = None
    paraphrases: dict[str, Score] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: dict) -> StateRow:
        return _parse("state row", lambda d: cls(
            _scores(d.get("behaviours")), _scores(d.get("neighbours")), _scores(d.get("others")),
            d.get("retain_first_token_kl"), d.get("retain_refusal_rate"), d.get("perplexity"),
            d.get("perplexity_ratio"), _scores(d.get("paraphrases"))), data)

    def to_json(self) -> dict:
        groups = {g: {k: v.to_json() for k, v in getattr(self, g).items()}
                  for g in ("behaviours", "neighbours", "others")}
        if self.paraphrases:  # reports written before they were measured have none
            groups["paraphrases"] = {k: v.to_json() for k, v in self.paraphrases.items()}
        return groups | _present({"retain_first_token_kl": self.retain_first_token_kl,
                                  "retain_refusal_rate": self.retain_refusal_rate, "perplexity": self.perplexity,
                                  "perplexity_ratio": self.perplexity_ratio})


@dataclass
class NeighbourShift:
    """A neighbour whose accuracy in ``state`` moved from base's by more than the report's tolerance: the
    ``change`` (a share), and the items lost and gained against base with the paired test's p-value."""

    state: str
    neighbour: str
    change: float
    lost: int
    gained: int
    n: int
    p_value: float

    @classmethod
    def from_json(cls, data: dict) -> NeighbourShift:
        return _parse("neighbour shift", lambda d: cls(d["state"], d["neighbour"], d["change"], d["lost"], d["gained"],
                                                       d["n"], d["p_value"]), data)

    def to_json(self) -> dict:
        return {"state": self.state, "neighbour": self.neighbour, "change": self.change, "lost": self.lost,
                "gained": self.gained, "n": self.n, "p_value": self.p_value}

    def text(self) -> str:
        """In words: ``continents open -7.1 (4 lost, 1 gained of 42; paired p = 0.38)`` (the change in points)."""
        return (f"{self.neighbour} {self.state} {100 * self.change:+.1f} ({self.lost} lost, {self.gained} gained of "
                f"{self.n}; paired p = {self.p_value:.2g})")


#: what each phrase of :func:`~modular.evaluation.targets.lock_failures` is about, by the words it holds, in the
#: order a headline names them
FAILURE_KINDS = (("locked", ("locked accuracy",), "the behaviour still answers locked"),
                 ("open", ("open accuracy",), "the open state is below its target"),
                 ("retain", ("retain KL",), "the retain KL is above its target"),
                 ("neighbour", ("significant loss",), "another behaviour lost significantly"))


def failed_kinds(failing: list[str]) -> list[str]:
    """Which targets ``failing`` (:func:`~modular.evaluation.targets.lock_failures`'s phrases and
    :func:`~modular.evaluation.lock.significant_losses`') misses: ``locked`` (a locked state still answers),
    ``open`` (the open state below base or the floor), ``retain`` (a state's retain KL too high), ``neighbour`` (a
    neighbour or far behaviour lost significantly in a state), in that order."""
    return [kind for kind, words, _ in FAILURE_KINDS if any(w in f for f in failing for w in words)]


def failure_headline(failing: list[str]) -> str:
    """What failed, in words a headline can hold: "not locked" where a locked state still answers the behaviour;
    where the lock itself held, "locked, but" what else missed (the open state, the retain KL, another behaviour),
    so that a lock that held is never called not locked; "" where nothing failed."""
    kinds = failed_kinds(failing)
    if not kinds:
        return ""
    words = [text for kind, _, text in FAILURE_KINDS if kind in kinds and kind != "locked"]
    if "locked" in kinds:
        return "not locked" + (f" (and {' and '.join(words)})" if words else "")
    return "locked, but " + " and ".join(words)


@dataclass
class HeldOut:
    """Whether the lock holds on the held-out test split by the targets training checked on validation, and what
    fails (one phrase each)."""

    held: bool
    failing: list[str] = field(default_factory=list)
    targets: dict[str, float] | None = None

    @classmethod
    def from_json(cls, data: dict) -> HeldOut:
        return _parse("held-out verdict", lambda d: cls(bool(d["held"]), list(d.get("failing", [])),
                                                        d.get("targets")), data)

    def to_json(self) -> dict:
        return _present({"held": self.held, "failing": list(self.failing), "targets": self.targets})

    def text(self) -> str:
        """In one line."""
        if self.held:
            return "the lock holds on the held-out test split"
        head = failure_headline(self.failing)
        head = "NOT LOCKED" + head[len("not locked"):] if head.startswith("not") else "LOCKED" + head[len("locked"):]
        return f"{head} on the held-out test split: " + "; ".join(self.failing)


@dataclass
class TrainingVerdict:
    """Whether training verified the lock at the checkpoint's step, and the check's words."""

    verified: bool
    check: str

    @classmethod
    def from_json(cls, data: dict) -> TrainingVerdict:
        return _parse("training verdict", lambda d: cls(bool(d["verified"]), d["check"]), data)

    def to_json(self) -> dict:
        return {"verified": self.verified, "check": self.check}


@dataclass
class TaskScore:
    """An lm-evaluation-harness task's score in one state (``modular capability``, ``modular lock
    --capability_tasks``): its headline ``metric`` (the task's first: ``acc`` for multiple-choice tasks), its
    ``value`` and standard error (``stderr``, where the harness gives one), the items scored (``n``), and every
    metric the harness reported for the task by name (``metrics``; standard errors as ``<metric>_stderr``)."""

    metric: str
    value: float
    stderr: float | None = None
    n: int | None = None
    metrics: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: dict) -> TaskScore:
        return _parse("task score", lambda d: cls(d["metric"], d["value"], d.get("stderr"), d.get("n"),
                                                  dict(d.get("metrics") or {})), data)

    def to_json(self) -> dict:
        return {"metric": self.metric, "value": self.value} | _present({"stderr": self.stderr, "n": self.n}) | {
            "metrics": dict(self.metrics)}


def _capability(data: dict | None) -> dict[str, dict[str, TaskScore]] | None:
    return None if data is None else {s: {t: TaskScore.from_json(v) for t, v in ts.items()} for s, ts in data.items()}


_LOCK_HEAD = ("run", "model", "step", "dtype")
_LOCK_LISTS = ("gated", "others", "neighbours", "neighbours_trained")
_LOCK_MAPS = ("exactness", "neighbour_sources", "others_max_drop_vs_base", "neighbours_max_drop_vs_base",
              "neighbours_max_refusal_rate")


class _Report:
    """What both reports share: taken as they are or read from their JSON (``_KIND``: what a file must be)."""

    _KIND = ""

    @classmethod
    def coerce(cls, report):
        """``report`` itself, or read from its JSON."""
        return report if isinstance(report, cls) else cls.from_json(report)

    @classmethod
    def read(cls, path: str | Path):
        """The report in ``path``; one that cannot be read or is not such a report is one line naming it."""
        data = _read(path, cls._KIND)
        try:
            return cls.from_json(data)
        except ModularError as err:
            raise ModularError(f"{path} is {err}") from None


@dataclass
class LockReport(_Report):
    """``lock.json``: every state's :class:`StateRow` (``states``: base, open, locked, published_locked, unlocked,
    and one ``unlocked_only_<behaviour>`` per key where there are several), the exactness of the published weights
    and keys, the gated, neighbour and far behaviours (``others``), each state's largest drop from base and
    refusal leakage, the neighbours that moved from base beyond ``neighbour_tolerance``; and, as ``modular lock``
    writes it, the run, its base model, the checkpoint's step, the precision, the verdict on the held-out items and
    training's; where asked (``--capability_tasks``), each state's lm-evaluation-harness scores (``capability``:
    state -> task -> :class:`TaskScore`; a report without them has none)."""

    _KIND = "lock report"  # not a field: a class attribute without annotation

    states: dict[str, StateRow]
    gated: list[str] = field(default_factory=list)
    exactness: dict[str, float | None] = field(default_factory=dict)
    others: list[str] = field(default_factory=list)
    neighbours: list[str] = field(default_factory=list)
    neighbour_sources: dict[str, str] = field(default_factory=dict)
    neighbours_trained: list[str] = field(default_factory=list)
    others_max_drop_vs_base: dict[str, float] = field(default_factory=dict)
    neighbours_max_drop_vs_base: dict[str, float] = field(default_factory=dict)
    neighbour_tolerance: float | None = None
    neighbour_shifts: list[NeighbourShift] = field(default_factory=list)
    neighbours_max_refusal_rate: dict[str, float] = field(default_factory=dict)
    run: str | None = None
    model: str | None = None
    step: int | None = None
    dtype: str | None = None
    lock_held_out: HeldOut | None = None
    lock_in_training: TrainingVerdict | None = None
    capability: dict[str, dict[str, TaskScore]] | None = None
    version: int = LOCK_REPORT_VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: dict) -> LockReport:
        """A report from its JSON (a lock report of any version up to this one's)."""
        def build(d: dict) -> LockReport:
            known = {"version", "states", "lock_held_out", "lock_in_training", "neighbour_tolerance",
                     "neighbour_shifts", "capability", *_LOCK_HEAD, *_LOCK_LISTS, *_LOCK_MAPS}
            version = _version(d, LOCK_REPORT_VERSION, "lock report")  # before the rest, which it lays out
            held, training = d.get("lock_held_out"), d.get("lock_in_training")
            return cls(
                states={s: StateRow.from_json(row) for s, row in d["states"].items()},
                **{k: list(d.get(k) or []) for k in _LOCK_LISTS}, **{k: dict(d.get(k) or {}) for k in _LOCK_MAPS},
                **{k: d.get(k) for k in _LOCK_HEAD}, neighbour_tolerance=d.get("neighbour_tolerance"),
                neighbour_shifts=[NeighbourShift.from_json(x) for x in d.get("neighbour_shifts") or []],
                lock_held_out=HeldOut.from_json(held) if held is not None else None,
                lock_in_training=TrainingVerdict.from_json(training) if training is not None else None,
                capability=_capability(d.get("capability")), version=version,
                extra={k: v for k, v in d.items() if k not in known})

        return _parse("lock report", build, data)

    def to_json(self) -> dict:
        """The report as ``lock.json`` holds it."""
        return ({"version": self.version} | _present({k: getattr(self, k) for k in _LOCK_HEAD}) | _present({
            "lock_held_out": self.lock_held_out.to_json() if self.lock_held_out is not None else None,
            "lock_in_training": self.lock_in_training.to_json() if self.lock_in_training is not None else None})
            | {"states": {s: row.to_json() for s, row in self.states.items()}, "exactness": dict(self.exactness),
               "gated": list(self.gated), "others": list(self.others), "neighbours": list(self.neighbours),
               "neighbour_sources": dict(self.neighbour_sources), "neighbours_trained": list(self.neighbours_trained),
               "others_max_drop_vs_base": dict(self.others_max_drop_vs_base),
               "neighbours_max_drop_vs_base": dict(self.neighbours_max_drop_vs_base)}
            | _present({"neighbour_tolerance": self.neighbour_tolerance})
            | {"neighbour_shifts": [x.to_json() for x in self.neighbour_shifts],
               "neighbours_max_refusal_rate": dict(self.neighbours_max_refusal_rate)}
            | _present({"capability": {s: {t: v.to_json() for t, v in tasks.items()}
                                       for s, tasks in self.capability.items()}
                        if self.capability is not None else None}) | self.extra)

    def write(self, path: str | Path) -> Path:
        """Write :meth:`to_json` to ``path`` atomically."""
        return write_json(path, self.to_json())

    def accuracies(self, state: str, behaviours: list[str] | None = None) -> dict[str, float]:
        """The accuracy in ``state`` of each of ``behaviours`` (default: the gated ones), by name."""
        row = self.states[state].behaviours
        return {b: row[b].accuracy for b in (self.gated if behaviours is None else behaviours)}


# --- run.json's lock entry -------------------------------------------------------------------------------------------
@dataclass
class TrainingCheck:
    """The lock check of training at its last check (the ``lock`` entry of ``run.json``, written by
    :class:`~modular.gating.callbacks.LockMetricsCallback`): the ``step`` checked, whether the lock was ``reached``
    there, what failed and by which ``targets``; its other entries (``extra``: the base accuracy, the validation
    metrics, the history of checks) as written."""

    step: int | None = None
    reached: bool = False
    failing: list[str] = field(default_factory=list)
    targets: dict[str, float] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: dict) -> TrainingCheck:
        return _parse("lock check", lambda d: cls(
            d.get("step"), bool(d.get("reached")), list(d.get("failing") or []), d.get("targets"),
            {k: v for k, v in d.items() if k not in ("step", "reached", "failing", "targets")}), data)


# --- attack.json -----------------------------------------------------------------------------------------------------
@dataclass
class AttackEntry:
    """One attacked behaviour's row of ``attack.json``: the base, open and locked accuracy on its test items (and
    where the open accuracy comes from: the published folder, or the base model standing in), the residual scale of
    the scans, each attack's entry by its key (``attacks``: what the attack plug-in reports, in the order of the
    command's list) and each baseline's; where the behaviour has attack splits, the one the attacker fine-tuned on
    (``fit_on``) and the one every attack and baseline was scored on (``scored_on``), absent otherwise (train and
    test); and the published model's ``advantage`` over the base after the same attacks
    (:func:`~modular.evaluation.advantage.advantage`), absent where the base was not attacked alike."""

    base_accuracy: float | None = None
    open_accuracy: float | None = None
    open_accuracy_from: str | None = None
    locked_accuracy: float | None = None
    residual_scale: float | None = None
    attacks: dict[str, dict] = field(default_factory=dict)
    baselines: dict[str, dict] = field(default_factory=dict)
    fit_on: str | None = None
    scored_on: str | None = None
    advantage: dict | None = None

    @classmethod
    def from_json(cls, data: dict) -> AttackEntry:
        return _parse("attack entry", lambda d: cls(
            d.get("base_accuracy"), d.get("open_accuracy"), d.get("open_accuracy_from"), d.get("locked_accuracy"),
            d.get("residual_scale"), {k: v for k, v in d.items() if k not in ATTACK_ROW_FIELDS},
            dict(d.get("baselines") or {}), d.get("fit_on"), d.get("scored_on"), d.get("advantage")), data)

    def to_json(self) -> dict:
        """The row as attack.json holds it (what an :class:`~modular.evaluation.attacks.Attack` reads back)."""
        head = _present({k: getattr(self, k) for k in ATTACK_ROW_FIELDS if k not in ("baselines", "advantage")})
        return head | self.attacks | {"baselines": self.baselines} | _present({"advantage": self.advantage})


@dataclass
class AttackReport(_Report):
    """``attack.json``: the published folder attacked, its base model and precision, the relearning sweep's
    options (``sweep``) and one :class:`AttackEntry` per attacked behaviour."""

    _KIND = "attack report"  # not a field: a class attribute without annotation

    behaviours: dict[str, AttackEntry]
    model: str | None = None
    base: str | None = None
    dtype: str | None = None
    sweep: dict[str, Any] | None = None
    version: int = ATTACK_REPORT_VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: dict) -> AttackReport:
        """A report from its JSON (an attack report of any version up to this one's)."""
        def build(d: dict) -> AttackReport:
            version = _version(d, ATTACK_REPORT_VERSION, "attack report")  # before the rest, which it lays out
            return cls({b: AttackEntry.from_json(v) for b, v in d["behaviours"].items()}, d.get("model"),
                       d.get("base"), d.get("dtype"), d.get("sweep"), version,
                       {k: v for k, v in d.items() if k not in ("version", "behaviours", "model", "base", "dtype",
                                                                "sweep")})

        return _parse("attack report", build, data)

    def to_json(self) -> dict:
        """The report as ``attack.json`` holds it."""
        return ({"version": self.version}
                | _present({"model": self.model, "base": self.base, "dtype": self.dtype, "sweep": self.sweep})
                | {"behaviours": {b: e.to_json() for b, e in self.behaviours.items()}} | self.extra)

    def write(self, path: str | Path) -> Path:
        """Write :meth:`to_json` to ``path`` atomically."""
        return write_json(path, self.to_json())

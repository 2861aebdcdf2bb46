"""The lock evaluation: behaviour accuracy and retain measures in every state of a gated model.

States: ``base`` (untrained), ``open`` (trained), ``locked`` (directions ablated by hooks),
``published_locked`` (lock baked into the weights) and ``unlocked`` (keys applied to the published weights).
"""

from __future__ import annotations

import copy
import logging
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch

from modular.data import BEHAVIOURS, load_behaviour, neutral_text, retain_data
from modular.data.added import ADDED
from modular.data.behaviours import NEIGHBOUR_BEHAVIOURS
from modular.data.neighbour_sets import report_set
from modular.data.paraphrases import paraphrase_sets
from modular.data.schema import all_refusals, is_refusal, to_dataset_dict
from modular.evaluation.behaviour import evaluate_behaviour, generate, last_logits
from modular.evaluation.capability import capability_row
from modular.evaluation.changes import paired_changes, significant_losses
from modular.evaluation.defaults import NEIGHBOUR_TOLERANCE  # defined apart, without torch, for signatures
from modular.evaluation.metrics import share
from modular.evaluation.retain import first_token_logp, mean_kl, perplexity
from modular.evaluation.stats import holm, paired_change, wilson_interval
from modular.evaluation.targets import TARGETS, lock_failures
from modular.hooks import ablate_directions
from modular.keys import apply_key, grid_steps, lock_weights
from modular.models.adapter import ArchitectureAdapter
from modular.reports import HeldOut, LockReport, NeighbourShift, PairedChange, Score, StateRow

log = logging.getLogger("modular")

STATES = ("base", "open", "locked", "published_locked", "unlocked")


def shift_text(shift: NeighbourShift | dict) -> str:
    """One entry of ``neighbour_shifts`` in words: ``continents open -7.1 (4 lost, 1 gained of 42; paired p = 0.38)``
    (the change in points; :meth:`~modular.reports.NeighbourShift.text`)."""
    return (shift if isinstance(shift, NeighbourShift) else NeighbourShift.from_json(shift)).text()


def max_param_diff(a, b) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    return max((sa[k].float() - sb[k].float()).abs().max().item() for k in sa if k in sb)


def weights_bit_exact(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Whether every tensor of state dict ``a`` that ``b`` also has equals it bit for bit (compared as raw bits, so
    ``-0.0`` and ``0.0`` differ and equal NaNs match)."""
    def bits(t):
        return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])

    return all(a[k].dtype == b[k].dtype and torch.equal(bits(a[k]), bits(b[k])) for k in a if k in b)


def max_param_ulps(a, b) -> int:
    """The largest difference between ``a``'s and ``b``'s weights in units in the last place of ``b``'s: the
    steps of ``b``'s dtype's grid between the two (:func:`~modular.keys.grid_steps`)."""
    sa, sb = a.state_dict(), b.state_dict()
    worst = 0
    for k in sa:
        if k in sb and sb[k].is_floating_point() and sb[k].numel():
            worst = max(worst, int(grid_steps(sa[k], sb[k]).max()))
    return worst


def build_states(base, open_model, directions: dict[str, torch.Tensor], harden: bool = True):
    """The five models/interventions, plus the keys of the published model."""
    adapter = ArchitectureAdapter(open_model)
    stacked = torch.stack(list(directions.values()))
    published = copy.deepcopy(open_model)
    keys = lock_weights(published, directions, harden=harden)
    unlocked = copy.deepcopy(published)
    for i, key in enumerate(keys):
        apply_key(unlocked, key, applied=[k.behaviour for k in keys[:i]])
    states = {
        "base": (base, None),
        "open": (open_model, None),
        "locked": (open_model, lambda: ablate_directions(adapter, stacked)),
        "published_locked": (published, None),
        "unlocked": (unlocked, None),
    }
    if len(keys) > 1:  # one key at a time: only its behaviour should come back
        for key in keys:
            partial = copy.deepcopy(published)
            apply_key(partial, key)
            states[f"unlocked_only_{key.behaviour}"] = (partial, None)
    return states, published, unlocked, keys


#: greedy tokens generated per retain prompt to tell whether the answer is a locked response
REFUSAL_PROBE_TOKENS = 12


def _score(result) -> Score:
    """A behaviour's result (:func:`~modular.evaluation.behaviour.evaluate_behaviour`) as a score with its 95%
    Wilson interval."""
    return Score.from_json({**result.summary(),
                            "ci95": wilson_interval(sum(i["correct"] for i in result.items), result.n)})


def lock_report(base, open_model, tokenizer, directions: dict[str, torch.Tensor], seed: int = 0,
                other_limit: int = 128, harden: bool = True, max_new_tokens: int = 24,
                sources: dict[str, str] | None = None, locked_responses: dict[str, str] | None = None,
                neighbours: dict[str, str] | None = None, trained_neighbours: list[str] = (),
                batch_size: int = 16, neighbour_tolerance: float = NEIGHBOUR_TOLERANCE, capability=None,
                capability_limit: int | None = None, paraphrases: bool = True, control=None,
                hook_lock: bool = True) -> LockReport:
    """Every number of ``lock.json`` (:class:`~modular.reports.LockReport`). ``sources``: where each gated behaviour's data is, by name (default: the
    name); ``locked_responses``: each behaviour's locked response, never scored as a correct answer.

    ``neighbours``: behaviours close to the gated ones, by name → source (built-in, .jsonl, hf:), scored on their
    test split in every state with the share of answers that are a locked response (refusal leakage);
    ``trained_neighbours``: those whose train split was kept in training (the report marks the others). The far
    "other" behaviours are the built-in ones that are neither gated nor neighbours. Retain test prompts get a
    refusal-leakage share too. ``batch_size``: prompts per generation or forward batch.

    Each neighbour is compared with base item by item in every other state (``vs_base``: items lost and gained, and
    the paired test's p-value); ``neighbour_shifts`` lists every neighbour and state whose accuracy moved from
    base's by more than ``neighbour_tolerance`` either way. ``capability``: lm-evaluation-harness tasks (a
    :class:`~modular.evaluation.capability.TaskSuite`) scored in every state, at most ``capability_limit`` items
    each (the report's ``capability``). ``paraphrases``: each gated built-in behaviour's held-out paraphrase sets
    (:mod:`modular.data.paraphrases`) are scored in every state too (each state row's ``paraphrases``).
    ``control``: the open model of the run's lock-off control (:mod:`modular.gating.control`), scored as the state
    ``control``; every other state's neighbours and far behaviours are compared with it item by item
    (``vs_control``, Holm-adjusted in families of their own): the lock's own effect. ``hook_lock``: score the
    hook lock (``locked``); off, only the published weights' (exactness still compares the two)."""
    states, published, unlocked, _ = build_states(base, open_model, directions, harden)
    states |= {"control": (control, None)} if control is not None else {}
    gated = list(directions)
    neighbours = {n: src for n, src in (neighbours or {}).items() if n not in gated}
    sources = {b: (sources or {}).get(b, b) for b in gated}
    refusals = {b: all_refusals(locked_responses or {}, [b]) for b in gated}
    every_refusal = all_refusals(locked_responses or {}, gated)
    others, data, units = _report_data(sources, neighbours, seed, tokenizer)
    retain = retain_data(seed)["test"]
    texts = list(neutral_text(seed)["test"]["text"])
    paraphrase_data = _paraphrase_data(gated, sources, seed) if paraphrases else {}

    exactness = _exactness(states, published, unlocked, open_model, tokenizer, retain)
    responses: dict[str, dict[str, list[str]]] = {}
    neighbour_correct: dict[str, dict[str, list[bool]]] = {}
    other_correct: dict[str, dict[str, list[bool]]] = {}

    ref_logp = first_token_logp(base, tokenizer, retain["prompt"], retain["chat"])
    base_ppl = perplexity(base, tokenizer, texts)
    rows: dict[str, StateRow] = {}
    capabilities = {}
    for state, (model, ctx) in ((s, v) for s, v in states.items() if hook_lock or s != "locked"):
        row = rows[state] = StateRow()
        for b in gated:
            r = evaluate_behaviour(model, tokenizer, data[b], max_new_tokens, batch_size, intervention=ctx,
                                   desc=f"{state}:{b}", refusals=refusals[b])
            row.behaviours[b] = _score(r)
            responses.setdefault(state, {})[b] = [i["response"] for i in r.items]
        for key, (b, dataset) in paraphrase_data.items():
            r = evaluate_behaviour(model, tokenizer, dataset, max_new_tokens, batch_size, intervention=ctx,
                                   desc=f"{state}:{key}", refusals=refusals[b])
            row.paraphrases[key] = _score(r)
        for n in neighbours:
            r = evaluate_behaviour(model, tokenizer, data[n], max_new_tokens, batch_size, intervention=ctx,
                                   desc=f"{state}:{n}", refusals=every_refusal)
            correct = neighbour_correct.setdefault(state, {})[n] = [i["correct"] for i in r.items]
            row.neighbours[n] = _score(r)
            if state != "base":
                row.neighbours[n].vs_base = PairedChange.from_json(paired_change(neighbour_correct["base"][n],
                                                                                 correct, units[n]))
        other_correct[state] = _score_others(row, model, tokenizer, {b: data[b] for b in others}, other_limit,
                                             batch_size, ctx, state)
        for b in others if state != "base" else ():
            row.others[b].vs_base = PairedChange.from_json(paired_change(other_correct["base"][b],
                                                                         other_correct[state][b]))
        logp = first_token_logp(model, tokenizer, retain["prompt"], retain["chat"], ctx)
        row.retain_first_token_kl = mean_kl(ref_logp, logp)
        row.retain_refusal_rate = retain_refusal_rate(model, tokenizer, retain, every_refusal, ctx, batch_size)
        row.perplexity = perplexity(model, tokenizer, texts, ctx)
        row.perplexity_ratio = row.perplexity / base_ppl
        if capability is not None:
            capabilities[state] = capability_row(model, tokenizer, capability, capability_limit, batch_size, ctx, state)
        log.info("%-16s %s | KL %.4f | ppl ratio %.3f", state,
                 " ".join(f"{b} {row.behaviours[b].accuracy:.3f}" for b in gated),
                 row.retain_first_token_kl, row.perplexity_ratio)
    # the keys give back the open model's answers, item by item
    pairs = [(o, u) for b in gated for o, u in zip(responses["open"][b], responses["unlocked"][b])]
    exactness["unlocked_answers_equal_open"] = share([o == u for o, u in pairs]) if pairs else None
    base_row = rows["base"]
    shifts = _comparisons(rows, {"neighbours": neighbour_correct, "others": other_correct}, units,
                          neighbour_tolerance)
    return LockReport(
        states=rows, exactness=exactness, gated=gated, others=others, neighbours=list(neighbours),
        neighbour_sources=neighbours, neighbours_trained=[n for n in neighbours if n in set(trained_neighbours)],
        others_max_drop_vs_base={
            s: max((base_row.others[b].accuracy - rows[s].others[b].accuracy for b in others), default=0.0)
            for s in rows},
        neighbours_max_drop_vs_base={
            s: max((base_row.neighbours[n].accuracy - rows[s].neighbours[n].accuracy for n in neighbours), default=0.0)
            for s in rows},
        neighbour_tolerance=neighbour_tolerance, neighbour_shifts=shifts, capability=capabilities or None,
        neighbours_max_refusal_rate={
            s: max((rows[s].neighbours[n].refusal_rate for n in neighbours), default=0.0) for s in rows})


def _report_data(sources: dict[str, str], neighbours: dict[str, str], seed: int,
                 tokenizer) -> tuple[list[str], dict, dict[str, list]]:
    """The far behaviours (the built-in ones neither gated (``sources``' keys) nor neighbours), the items each
    behaviour is scored on (gated and far: their test split; neighbours: their report set, as many held-out items as
    the data allows, :func:`~modular.data.neighbour_sets.report_set`) and each neighbour's units."""
    others = [b for b in BEHAVIOURS if b not in sources and b not in neighbours and b not in NEIGHBOUR_BEHAVIOURS
              and b not in ADDED]  # the base answers none of an added behaviour: nothing to keep
    data = {b: load_behaviour(sources.get(b, b), seed=seed, tokenizer=tokenizer)["test"] for b in [*sources, *others]}
    units = {}
    for n, src in neighbours.items():
        data[n], units[n] = report_set(src, seed=seed, tokenizer=tokenizer)
    return others, data, units


def _comparisons(rows: dict[str, StateRow], correct: dict[str, dict], units: dict[str, list],
                 tolerance: float) -> list[NeighbourShift]:
    """The neighbours' and far behaviours' changes from base Holm-adjusted (each group a family), every state
    compared with the lock-off control where one was scored (:func:`_versus_control`), and the neighbours whose
    accuracy moved from base's by more than ``tolerance`` in a state."""
    for group in ("neighbours", "others"):
        _holm_adjust([score.vs_base for state, row in rows.items() if state != "base"
                      for score in getattr(row, group).values()])
    if "control" in rows:
        _versus_control(rows, correct, units)
    shifts = []
    for state, row in rows.items():
        for n, score in row.neighbours.items() if state != "base" else ():
            change = score.accuracy - rows["base"].neighbours[n].accuracy
            if abs(change) > tolerance + 1e-9:
                vs = score.vs_base
                shifts.append(NeighbourShift(state, n, change, vs.lost, vs.gained, vs.n, vs.p_value))
    return shifts


def _versus_control(rows: dict[str, StateRow], correct: dict[str, dict], units: dict[str, list]) -> None:
    """Each state's neighbours and far behaviours (``correct``: group → state → name → right or not, item by item)
    against the lock-off control's (state ``control``), item by item (``vs_control``); each group a Holm family."""
    for group, by_state in correct.items():
        changes = []
        for state, row in rows.items():
            if state in ("base", "control"):
                continue
            for name, score in getattr(row, group).items():
                score.vs_control = PairedChange.from_json(paired_change(by_state["control"][name],
                                                                        by_state[state][name], units.get(name)))
                changes.append(score.vs_control)
        _holm_adjust(changes)


def _holm_adjust(changes: list) -> None:
    """Each figure's p-value Holm-adjusted over ``changes`` (``p_holm``): the report's neighbour figures, or its far
    behaviours'."""
    for change, adjusted in zip(changes, holm([c.p_value for c in changes])):
        change.p_holm = adjusted


def _score_others(row: StateRow, model, tokenizer, data: dict, limit: int, batch_size: int, ctx,
                  state: str) -> dict[str, list[bool]]:
    """The far behaviours' scores in one state: tasks a choice measures (one right and one competing answer) by
    choice accuracy (one forward pass), others (arithmetic: any right sum) by generation. Returns whether each item
    was right, by behaviour."""
    correct = {}
    for b, dataset in data.items():
        r = evaluate_behaviour(model, tokenizer, dataset, 12, batch_size, limit=limit, intervention=ctx,
                               desc=f"{state}:{b}", choice_only=True)
        row.others[b] = Score.from_json({**r.summary(), "metric": "choice" if r.choices is not None else "generation"})
        correct[b] = r.correct()
    return correct


def _paraphrase_data(gated: list[str], sources: dict[str, str], seed: int) -> dict[str, tuple[str, object]]:
    """``<behaviour>/<set>`` -> (behaviour, its test dataset) of every gated built-in behaviour's paraphrase sets."""
    out = {}
    for b in gated:
        if sources.get(b, b) != b:  # a user's behaviour under a built-in's name: not the built-in's sets
            continue
        for name, records in paraphrase_sets(b, seed).items():
            out[f"{b}/{name}"] = (b, to_dataset_dict({"test": records})["test"])
    return out


def _exactness(states, published, unlocked, open_model, tokenizer, retain) -> dict:
    """The exactness of the published weights (against the hook lock, on 16 retain prompts' last logits) and of the
    keys (the unlocked weights against the open ones)."""
    probe = list(retain["prompt"][:16])
    chats = list(retain["chat"][:16])
    hook_logits = _with(states["locked"], lambda m: last_logits(m, tokenizer, probe, chats))
    weight_logits = last_logits(published, tokenizer, probe, chats)
    return {
        "published_vs_hook_locked_max_abs_logit_diff": (hook_logits - weight_logits).abs().max().item(),
        "unlocked_vs_open_max_abs_weight_diff": max_param_diff(unlocked, open_model),
        "unlocked_vs_open_max_ulps": max_param_ulps(unlocked, open_model),
    }


def retain_refusal_rate(model, tokenizer, retain, refusals, intervention=None, batch_size: int = 16) -> float:
    """Share of the retain prompts answered with a locked response (greedy; general prompts should never be)."""
    with intervention() if intervention is not None else nullcontext():
        responses = generate(model, tokenizer, list(retain["prompt"]), list(retain["chat"]), REFUSAL_PROBE_TOKENS,
                             batch_size, desc=False)
    return share([is_refusal(r, refusals) for r in responses])


def _with(state, fn):
    model, ctx = state
    if ctx is None:
        return fn(model)
    with ctx():
        return fn(model)


def _grouped_bars(ax, report: LockReport, states: list[str], group: str, names: list[str], title: str) -> None:
    """Accuracy per state of each behaviour in ``group`` (``behaviours`` or ``neighbours``), with 95% intervals."""
    x = np.arange(len(states))
    width = 0.8 / max(1, len(names))
    for j, b in enumerate(names):
        acc = [getattr(report.states[s], group)[b].accuracy for s in states]
        ci = [getattr(report.states[s], group)[b].ci95 for s in states]
        err = [[a - lo for a, (lo, hi) in zip(acc, ci)], [hi - a for a, (lo, hi) in zip(acc, ci)]]
        label = b if group == "behaviours" or b in report.neighbours_trained else f"{b} (not in training)"
        bars = ax.bar(x + j * width - 0.4 + width / 2, acc, width, yerr=err, capsize=3, label=label)
        for bar, a in zip(bars, acc):
            ax.annotate(f"{a:.2f}", (bar.get_x() + bar.get_width() / 2, a), ha="center", va="bottom",
                        fontsize=7, xytext=(0, 2), textcoords="offset points")
    ax.set_xticks(x, states, rotation=20)
    ax.set_ylabel("accuracy (held-out test split)")
    ax.set_title(title)
    _legend_above(ax, top=1.1)


def _change_panel(ax, changes: list[tuple[str, str, str, PairedChange]]) -> None:
    """Each neighbour's and far behaviour's change from base in each state, in points, with its 95% paired interval;
    a significant loss (Holm, α = 0.05) in red."""
    colours = dict(zip(STATES[1:], ("#1b9e77", "#d95f02", "#7570b3", "#e7298a")))
    labels = []
    for i, (group, name, state, vs) in enumerate(changes):
        change = 100 * (vs.gained - vs.lost) / max(vs.n, 1)
        lo, hi = (100 * vs.ci95[0], 100 * vs.ci95[1]) if vs.ci95 is not None else (change, change)
        ax.errorbar(change, i, xerr=[[change - lo], [hi - change]], fmt="o", ms=4, capsize=2,
                    color="#b2182b" if vs.significant_loss else colours.get(state, "k"))
        labels.append(f"{'' if group == 'neighbours' else 'far: '}{name} {state} (n {vs.n})")
    ax.axvline(0, color="k", lw=0.8)
    for edge in (-5, 5):
        ax.axvline(edge, color="#8c8c8c", lw=0.6, ls=":")
    ax.set_yticks(range(len(labels)), labels, fontsize=6)
    ax.set_ylim(len(labels) - 0.5, -0.5)
    ax.set_xlabel("change from base, points (95% paired interval; red: significant loss, Holm α = 0.05)")
    ax.set_title("neighbours and far behaviours: change from base")


def _legend_above(ax, top: float) -> None:
    """The legend in rows above the bars (``top``: the bars' room, labels included; ticks end at 1), as many
    columns as its longest label leaves room for, so that it hides none of them however many there are."""
    labels = ax.get_legend_handles_labels()[1]
    ncol = max(1, min(4, len(labels), int(400 / (4 * max(map(len, labels), default=1) + 30))))
    rows = -(-max(1, len(labels)) // ncol)
    ax.set_ylim(0, top + 0.05 + 0.1 * rows)
    ax.set_yticks(np.linspace(0, 1, 6))
    ax.legend(fontsize=7, loc="upper center", ncol=ncol)


def held_out_verdict(report: LockReport | dict, targets: dict | None = None) -> HeldOut:
    """Whether the lock holds on the held-out items of a :func:`lock_report`, by the targets training checked on
    validation (``targets``, default :data:`~modular.evaluation.targets.TARGETS`): every gated behaviour's accuracy
    at most ``locked_accuracy`` in each locked state scored (hooks and published weights), its open accuracy at
    least base's less ``open_drop`` and at least ``min_open_accuracy``, the retain first-token KL at most
    ``retain_kl`` in the open and each locked state."""
    report = LockReport.coerce(report)
    locked = [s for s in ("locked", "published_locked") if s in report.states]
    targets = {**TARGETS, **(targets or {})}
    failing = lock_failures(targets, report.accuracies("open"), {s: report.accuracies(s) for s in locked},
                            report.accuracies("base"),
                            {s: report.states[s].retain_first_token_kl for s in ("open", *locked)})
    failing += significant_losses(report)
    return HeldOut(held=not failing, failing=failing, targets=targets)


def verdict_text(verdict: HeldOut | dict) -> str:
    """:func:`held_out_verdict` in words (:meth:`~modular.reports.HeldOut.text`)."""
    return (verdict if isinstance(verdict, HeldOut) else HeldOut.from_json(verdict)).text()


def plot_lock(report: LockReport | dict, path: str | Path) -> Path:
    """:func:`lock_figure` saved as a PNG."""
    import matplotlib.pyplot as plt

    fig = lock_figure(report)
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def lock_figure(report: LockReport | dict):
    """Gated-behaviour accuracy per state (with 95% intervals); with neighbours, their accuracy per state and the
    share of neighbour and retain answers that are the locked response; retain KL; perplexity ratio; each neighbour's
    and far behaviour's change from base with its 95% paired interval (where measured). Panels are
    named by their title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    report = LockReport.coerce(report)
    states = list(report.states)
    neighbours = report.neighbours
    changes = paired_changes(report)
    mosaic = ([["gated", "gated", "neighbours", "neighbours"], ["refusal", "refusal", "kl", "ppl"]] if neighbours
              else [["gated", "gated", "kl", "ppl"]])
    if changes:  # reports written before the changes were measured have none
        mosaic.append(["changes"] * 4)
    height = (8 if neighbours else 3.8) + (0.9 + 0.22 * len(changes) if changes else 0)
    fig, axes = plt.subplot_mosaic(mosaic, figsize=(15 if neighbours else 13, height),
                                   height_ratios=[1] * (len(mosaic) - bool(changes))
                                   + ([max(0.6, 0.05 * len(changes))] if changes else []))
    _grouped_bars(axes["gated"], report, states, "behaviours", report.gated, "gated behaviours")
    x = np.arange(len(states))
    if neighbours:
        _grouped_bars(axes["neighbours"], report, states, "neighbours", neighbours, "neighbour behaviours")
        rows = {n: [report.states[s].neighbours[n].refusal_rate for s in states] for n in neighbours}
        rows["retain prompts"] = [report.states[s].retain_refusal_rate for s in states]
        width = 0.8 / len(rows)
        for j, (name, vals) in enumerate(rows.items()):
            bars = axes["refusal"].bar(x + j * width - 0.4 + width / 2, vals, width, label=name)
            for bar, v in zip(bars, vals):
                axes["refusal"].annotate(f"{v:.2f}", (bar.get_x() + bar.get_width() / 2, v), ha="center",
                                         va="bottom", fontsize=6, xytext=(0, 2), textcoords="offset points")
        axes["refusal"].set_xticks(x, states, rotation=20)
        axes["refusal"].set_ylabel("share of answers")
        axes["refusal"].set_title("refusal leakage: answers that are the locked response")
        _legend_above(axes["refusal"], top=1.1)
    for key, name, title in (("retain_first_token_kl", "kl", "retain: first-token KL to base"),
                             ("perplexity_ratio", "ppl", "neutral text: perplexity / base")):
        ax = axes[name]
        vals = [getattr(report.states[s], key) for s in states]
        ax.bar(x, vals, color="#8c8c8c")
        ax.set_xticks(x, states, rotation=30, fontsize=8)
        ax.set_title(title, fontsize=10)
        for xi, v in zip(x, vals):
            ax.annotate(f"{v:.3f}", (xi, v), ha="center", va="bottom", fontsize=7, xytext=(0, 2),
                        textcoords="offset points")
    axes["ppl"].axhline(1.0, color="k", lw=0.8, ls="--")
    if changes:
        _change_panel(axes["changes"], changes)
    if report.lock_held_out is not None:  # what the bars add up to, by the targets: a lock that did not take says so
        held = report.lock_held_out.held
        fig.suptitle(report.lock_held_out.text(), color="black" if held else "#b2182b",
                     fontweight="normal" if held else "bold", wrap=True)
    fig.tight_layout()
    return fig

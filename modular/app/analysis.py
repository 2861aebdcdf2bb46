"""``modular directions`` and ``modular attention``: load, call :mod:`modular.analysis`, write JSON and figures, log."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Literal

import torch

from modular import ModularError
from modular.analysis.attention import plot_attention, plot_sweep, span_attention
from modular.analysis.discovery import (
    ablation_curve,
    best_direction,
    directions_by_format,
    plot_ablation,
    plot_designated,
    plot_heatmaps,
    save_directions,
)
from modular.analysis.insertion import LABELS, filler, insertion_accuracy, length_sweep, pooled_items
from modular.app.options import Split, output_folder
from modular.data import load_behaviour, retain_data
from modular.evaluation.behaviour import choice_measures, evaluate_behaviour
from modular.evaluation.retain import first_token_logp
from modular.evaluation.stats import wilson_interval
from modular.models.names import DTypeName
from modular.plots import bar_chart
from modular.runs import load_model_or_run, load_open_model, load_tokenizer_or_run, read_run, training_wandb_run
from modular.tracking import log_to_wandb, write_json

log = logging.getLogger("modular")
Format = Literal["chat", "raw", "newline"]


def directions(
    model: str | None = None,
    behaviour: str = "capitals",
    formats: list[Format] = ("chat", "raw", "newline"),
    n_prompts: int = 64,
    limit: int | None = 32,
    retain_limit: int = 48,
    ablate_formats: list[Format] | None = None,
    layers: list[int] | None = None,
    metric: Literal["auto", "generation", "choice"] = "auto",
    max_new_tokens: int = 16,
    kl_budget: float = 0.1,
    batch_size: int = 16,
    run: str | None = None,
    seed: int = 0,
    out: str | None = None,
    device: str = "auto",
    dtype: DTypeName = "auto",
) -> dict:
    """Behaviour directions by difference in means at every layer, and what ablating each one removes.

    Writes directions.safetensors, directions.json, heatmap.png and ablation.png (and logs to W&B).
    Direction of layer i = normalised mean(behaviour prompts) − mean(contrast prompts) of the residual stream
    leaving block i, averaged over the format's suffix positions (chat: the template tokens after the content,
    aligned by left padding; newline: the trailing newline; raw: the last token). Contrast prompts are retain
    instructions (same count). Each direction is then ablated at every residual write: behaviour accuracy on
    its test split and mean first-token KL to the unablated model on held-out retain prompts.

    Args:
        model: Default: smollm2-135m-instruct, or the run's model with ``--run``.
        behaviour: Built-in behaviour (capitals, ioi, ...) or .jsonl file; its train prompts give the means.
        formats: Prompt formats: chat (chat template), raw (prompt alone), newline (prompt + "\\n").
        n_prompts: Behaviour prompts (and as many retain prompts) averaged per format.
        limit: Test items scored per ablated direction (default 32).
        retain_limit: Held-out retain prompts for the first-token KL.
        ablate_formats: Formats whose directions are ablated layer by layer (default: all of ``formats``).
        layers: Layers whose directions are ablated (default: all).
        metric: auto (choice accuracy when every item has one right and one competing answer, else greedy
            generation), generation or choice.
        max_new_tokens: When scoring by generation.
        kl_budget: Also report the best direction among those whose retain KL stays within this budget.
        run: Gated training run folder: analyse its trained (open) model and report the cosine between each
            found direction and the run's designated direction for ``behaviour``.
        out: Default: outputs/analysis/directions/<model>-<behaviour>.
    """
    fmts, ablate = _formats(formats, ablate_formats, n_prompts, retain_limit)
    r, designated = _designated(run, behaviour)
    model = model or (r.model_name if r is not None else None) or "smollm2-135m-instruct"
    tokenizer = load_tokenizer_or_run(model)
    behaviour_prompts, contrast_prompts, test, held, choice_only = _direction_data(
        behaviour, tokenizer, seed, n_prompts, limit, retain_limit, metric)
    m = load_open_model(r, dtype, device) if r is not None else load_model_or_run(model, dtype, device)
    found, report_formats = _found_directions(m, tokenizer, behaviour_prompts, contrast_prompts, fmts, batch_size,
                                              designated)
    n_layers = len(next(iter(found.values())))
    chosen_layers = list(layers) if layers is not None else None
    if chosen_layers is not None and any(not 0 <= i < n_layers for i in chosen_layers):
        raise ModularError(f"layers must lie in 0..{n_layers - 1}")

    out_dir = output_folder(out, "analysis/directions", model, behaviour)
    settings = {"model": model, "behaviour": behaviour, "run": run, "formats": fmts,
                "n_prompts": len(behaviour_prompts), "contrast": "retain_data train prompts", "test_items": len(test), "retain_items": len(held),
                "metric": "choice accuracy" if choice_only else "greedy generation",
                "layers": "residual stream leaving block i (0-based)", "seed": seed}
    figures = _save_directions(out_dir, found, report_formats, settings, n_layers, designated is not None)
    report = _ablate_directions(m, tokenizer, found, test, held, ablate, chosen_layers, max_new_tokens, batch_size,
                                choice_only, kl_budget, out_dir, settings, report_formats, figures)
    _log_directions(report, designated is not None, out_dir, settings, figures,
                    training_wandb_run(run if run is not None else model))
    return report


def _formats(formats: list[str], ablate_formats: list[str] | None, n_prompts: int,
             retain_limit: int) -> tuple[list[str], list[str]]:
    """The formats whose directions are found and those whose directions are ablated (default: all of them),
    duplicates dropped; bad choices: one line."""
    fmts = list(dict.fromkeys(formats))
    if not fmts:
        raise ModularError("give at least one format with --formats")
    ablate = list(dict.fromkeys(ablate_formats)) if ablate_formats else fmts
    if any(f not in fmts for f in ablate):
        raise ModularError(f"ablate_formats must be among --formats ({', '.join(fmts)})")
    if n_prompts < 1 or retain_limit < 1:
        raise ModularError("n_prompts and retain_limit must be ≥ 1")
    return fmts, ablate


def _designated(run: str | None, behaviour: str):
    """The training run ``run`` (read) and its designated direction for ``behaviour`` as a unit vector; both
    ``None`` without a run."""
    if run is None:
        return None, None
    r = read_run(run)
    if behaviour not in r.directions:
        raise ModularError(f"run {run} gates {', '.join(r.behaviours)}, not '{behaviour}'")
    designated = r.directions[behaviour].flatten().float()
    return r, designated / designated.norm()


def _found_directions(m, tokenizer, behaviour_prompts: list[str], contrast_prompts: list[str], fmts: list[str],
                      batch_size: int, designated) -> tuple[dict, dict]:
    """The directions of every format and layer and each format's report (its positions, the cosines between
    layers and to the ``designated`` direction), with one log line per format."""
    if designated is not None and designated.numel() != m.config.hidden_size:
        raise ModularError(f"the run's direction has {designated.numel()} entries, the model's width differs")
    found, report_formats = directions_by_format(m, tokenizer, behaviour_prompts, contrast_prompts, fmts, batch_size,
                                                 designated)
    for fmt, entry in report_formats.items():
        cos = entry["cross_layer_cosine"]
        log.info("%s: %d positions (%r); adjacent-layer cosine mean %.3f", fmt, entry["n_positions"],
                 entry["suffix_text"], torch.diagonal(cos, 1).mean().item() if len(cos) > 1 else 1.0)
    return found, report_formats


def _save_directions(out_dir: Path, found: dict, report_formats: dict, settings: dict, n_layers: int,
                     with_designated: bool) -> dict:
    """Write directions.safetensors, the heatmap (and, with a ``designated`` direction, the figure of the cosines
    to it: ``with_designated``); the figures by name."""
    fmts, model, behaviour = settings["formats"], settings["model"], settings["behaviour"]
    save_directions(out_dir / "directions.safetensors", found,
                    {**{k: v for k, v in settings.items() if v is not None}, "n_layers": n_layers,
                     "keys": "<format>.layer<NN>, unit vectors (d_model,)",
                     "positions": "; ".join(f"{f}: {report_formats[f]['positions']} ({report_formats[f]['n_positions']})"
                                            for f in fmts)})
    figures = {"heatmap": plot_heatmaps({f: report_formats[f]["cross_layer_cosine"] for f in fmts},
                                        out_dir / "heatmap.png",
                                        f"{Path(model).name}, {behaviour}: cosine between layers' diff-in-means "
                                        "directions")}
    if with_designated:
        figures["designated"] = plot_designated({f: report_formats[f]["designated_cosine"] for f in fmts},
                                                out_dir / "designated.png",
                                                f"{behaviour}: found directions vs the run's designated direction")
    return figures


def _ablate_directions(m, tokenizer, found: dict, test, held, ablate: list[str], layers: list[int] | None,
                       max_new_tokens: int, batch_size: int, choice_only: bool, kl_budget: float, out_dir: Path,
                       settings: dict, report_formats: dict, figures: dict) -> dict:
    """The baseline, then each format of ``ablate``'s directions ablated layer by layer; directions.json (and the
    ablation figure, added to ``figures``) rewritten after every format. The last report."""
    base = evaluate_behaviour(m, tokenizer, test, max_new_tokens, batch_size, desc=False, choice_only=choice_only)
    k = sum(i["correct"] for i in base.items) if base.items else round(base.accuracy * base.n)
    baseline = {**base.summary(), "ci95": wilson_interval(k, base.n)}
    ref = first_token_logp(m, tokenizer, list(held["prompt"]), list(held["chat"]))
    curves: dict = {}
    report: dict = {}
    for fmt in [None, *ablate]:  # the JSON and the curve figure are rewritten after every format
        if fmt is not None:
            curves[fmt] = ablation_curve(m, tokenizer, found[fmt], test, list(held["prompt"]), list(held["chat"]),
                                         layers, max_new_tokens, batch_size, choice_only,
                                         desc=f"ablate {fmt}", baseline=baseline, reference_logp=ref)
            figures["ablation"] = plot_ablation(curves, out_dir / "ablation.png",
                                                f"{Path(settings['model']).name}, {settings['behaviour']}: ablating "
                                                f"one layer's direction at every write ({len(test)} test items, "
                                                f"{len(held)} retain prompts)", settings["metric"])
        best, best_cheap = best_direction(curves), best_direction(curves, kl_budget)
        report = {**settings, "complete": fmt == ablate[-1], "baseline": baseline, "best": best,
                  "kl_budget": kl_budget, "best_within_kl_budget": best_cheap, "formats": report_formats,
                  "ablation": curves, "files": {"directions": out_dir / "directions.safetensors", **figures}}
        write_json(out_dir / "directions.json", report)
    return report


def _log_directions(report: dict, with_designated: bool, out_dir: Path, settings: dict, figures: dict, training) -> None:
    """The best directions in one line each, and the report's summary (with the cosines to the run's designated
    direction: ``with_designated``) to W&B (``training``: the training run's)."""
    baseline, best, best_cheap, kl_budget = (report["baseline"], report["best"], report["best_within_kl_budget"],
                                             report["kl_budget"])
    for label, b in (("best direction", best), (f"best within KL {kl_budget}", best_cheap)):
        if b is not None:
            log.info("%s: %s layer %d: accuracy %.3f -> %.3f (drop %.3f), retain KL %.4f", label, b["format"],
                     b["layer"], baseline["accuracy"], b["accuracy"], b["drop"], b["retain_kl"])
    summary = {"baseline_accuracy": baseline["accuracy"], "best": best or {},
               "best_within_kl_budget": best_cheap or {}}
    if with_designated:
        summary["max_abs_designated_cosine"] = {f: max(abs(c) for c in report["formats"][f]["designated_cosine"])
                                                for f in settings["formats"]}
    log_to_wandb(out_dir, "evaluate-directions", summary, config=settings, figures=figures,
                 tables={f"ablation_{f}": c["layers"] for f, c in report["ablation"].items()}, training=training)
    log.info("wrote %s, %s", out_dir / "directions.json", ", ".join(str(p) for p in figures.values()))


def _direction_data(behaviour: str, tokenizer, seed: int, n_prompts: int, limit: int | None, retain_limit: int,
                    metric: str):
    """The prompts whose means give the directions (behaviour train prompts, as many retain prompts), the test
    items and held-out retain prompts the ablations are scored on, and whether scoring is by choice."""
    data = load_behaviour(behaviour, seed=seed, tokenizer=tokenizer)
    retain = retain_data(seed)
    n = min(n_prompts, len(data["train"]), len(retain["train"]))
    if n == 0:
        raise ModularError(f"behaviour '{behaviour}' has no train prompts")
    test = data["test"] if limit is None else data["test"].select(range(min(limit, len(data["test"]))))
    if len(test) == 0:
        raise ModularError(f"behaviour '{behaviour}' has no test items")
    held = retain["test"].select(range(min(retain_limit, len(retain["test"]))))
    by_choice = choice_measures(test)
    if metric == "choice" and not by_choice:
        raise ModularError(f"behaviour '{behaviour}' is not measured by a choice between one right and one wrong answer: "
                           "use --metric generation")
    return (list(data["train"]["prompt"][:n]), list(retain["train"]["prompt"][:n]), test, held,
            by_choice and metric != "generation")


def attention(
    model: str = "smollm2-135m-instruct",
    task: str = "capitals",
    insert: list[Literal["meaningless", "meaningful"]] = ("meaningless", "meaningful"),
    length: int = 55,
    sweep: list[int] | None = None,
    splits: list[Split] = ("test",),
    seeds: list[int] = (0,),
    limit: int | None = None,
    sweep_limit: int | None = None,
    heads: list[tuple[int, int]] | None = None,
    n_heads: int = 3,
    attention_items: int = 64,
    instruction: str = "Answer the following question.",
    symbol: str = "/",
    max_new_tokens: int = 24,
    batch_size: int = 16,
    out: str | None = None,
    device: str = "auto",
    dtype: DTypeName = "auto",
) -> dict:
    """Token insertion: accuracy with and without N inserted tokens, and attention of chosen heads by position.

    Writes attention.json beside accuracy.png, attention.png (and sweep.png), and logs to W&B.
    Where the span goes: chat tasks get ``<instruction line>\\n<filler>\\n<problem>`` (the instruction line is
    the prompt's first line if it has several, else ``--instruction``); the baseline is the same message
    without the filler line. Completion tasks (raw text) get the filler as a prefix line. Meaningless filler
    repeats ``--symbol``; meaningful filler is neutral prose; both have exactly N tokens (checked in context).
    Attention is the last prompt token's attention to each position (counted from the prompt's first token),
    averaged over prompts.

    Args:
        task: Built-in behaviour (capitals, arithmetic, greater_than, ...) or a .jsonl file.
        insert: Insertion kinds: meaningless, meaningful.
        length: Inserted tokens N.
        sweep: Inserted lengths for an accuracy-vs-length sweep (e.g. '[0, 8, 16, 32, 55]'; not given: no sweep).
        splits: Splits whose items are scored (e.g. '[validation, test]').
        seeds: Generator seeds whose items are pooled (duplicates dropped); more seeds give
            more items for small built-in tasks (for capitals a seed's test countries may be another seed's
            train countries, which matters only for trained models).
        limit: Items scored per condition.
        sweep_limit: Items scored per sweep point (default: ``limit``).
        heads: Heads to plot, [LAYER, HEAD] pairs, e.g. '[[3, 1], [12, 4]]' (default: the ``n_heads`` heads with the most attention
            mass on the inserted span).
        n_heads: Heads chosen when ``heads`` is not given.
        attention_items: Prompts averaged for the attention curves.
        instruction: Instruction line of chat tasks whose prompt is a single line.
        symbol: The repeated symbol of meaningless filler.
        out: Default: outputs/analysis/attention/<model>-<task>.
    """
    kinds, split_names, seed_list, lengths = _insertion_options(insert, splits, seeds, sweep, length)
    tokenizer = load_tokenizer_or_run(model)
    items = pooled_items(task, tokenizer, seed_list, split_names, limit)
    fillers = {kind: filler(tokenizer, kind, length, symbol) for kind in kinds}
    m = load_model_or_run(model, dtype, device)
    conditions = {LABELS[c]: span for c, span in ({"none": ""} | fillers).items()}
    accuracy = _insertion_accuracy(m, tokenizer, items, conditions, instruction, max_new_tokens, batch_size, length)
    att = span_attention(m, tokenizer, items, conditions, instruction, attention_items, heads, n_heads,
                         batch_size=max(1, batch_size // 2))

    out_dir = output_folder(out, "analysis/attention", model, task)
    figures = {
        "accuracy": bar_chart(out_dir / "accuracy.png", ["w/o"] + [f"w/ {LABELS[k]}" for k in kinds],
                              [a["accuracy"] for a in accuracy.values()], f"Results on {task}",
                              f"accuracy ({len(items)} items, N = {length})",
                              [tuple(a["ci95"]) for a in accuracy.values()]),
        "attention": plot_attention(att["curves"], att["spans"], out_dir / "attention.png",
                                    f"{Path(model).name}, {task}: attention of the last prompt token, "
                                    f"{att['items']} prompts, {length} inserted tokens"),
    }
    report = {
        "model": model, "task": task, "length": length, "kinds": kinds, "splits": split_names, "seeds": seed_list,
        "n_items": len(items), "instruction": instruction, "symbol": symbol,
        "placement": "chat: <instruction>\\n<filler>\\n<problem>; completion: <filler>\\n<text>",
        "fillers": {k: {"text": v, "tokens": len(tokenizer(v, add_special_tokens=False)["input_ids"])}
                    for k, v in fillers.items()},
        "accuracy": accuracy, "heads": att["heads"], "head_choice": att["head_choice"],
        "attention": {"query": "last prompt token", "items": att["items"], "spans": att["spans"],
                      "span_mass": att["span_mass"], "curves": att["curves"]},
        "sweep": {}, "complete": not lengths, "files": figures,
    }
    write_json(out_dir / "attention.json", report)  # written again with the sweep
    if lengths:
        sub = items if sweep_limit is None else items.select(range(min(sweep_limit, len(items))))
        _add_sweep(report, figures, m, tokenizer, sub, lengths, max_new_tokens, batch_size, out_dir)
    summary = {"accuracy": {k: v["accuracy"] for k, v in accuracy.items()}, "span_mass": att["span_mass"]}
    log_to_wandb(out_dir, "evaluate-attention", summary,
                 config={k: report[k] for k in ("model", "task", "length", "kinds", "splits", "seeds", "n_items")},
                 figures=figures, tables={f"sweep_{k}": v for k, v in report["sweep"].items()},
                 training=training_wandb_run(model))
    log.info("wrote %s, %s", out_dir / "attention.json", ", ".join(str(p) for p in figures.values()))
    return report


def _insertion_options(insert: list[str], splits: list[str], seeds: list[int], sweep: list[int] | None,
                       length: int) -> tuple[list[str], list[str], list[int], list[int] | None]:
    """The insertion kinds, splits and seeds (duplicates dropped; seed 0 when none) and the sweep's lengths (None:
    no sweep); bad choices: one line."""
    kinds = list(dict.fromkeys(insert))
    split_names = list(dict.fromkeys(splits))
    seed_list = list(dict.fromkeys(seeds)) or [0]
    lengths = list(sweep) if sweep else None
    if not kinds or not split_names:
        raise ModularError("give at least one insertion kind (--insert) and one split (--splits)")
    if length < 1 or any(x < 0 for x in lengths or []):
        raise ModularError("length must be ≥ 1 and sweep lengths ≥ 0")
    return kinds, split_names, seed_list, lengths


def _insertion_accuracy(m, tokenizer, items, conditions: dict[str, str], instruction: str, max_new_tokens: int,
                        batch_size: int, length: int) -> dict[str, dict]:
    """The accuracy of each condition (label -> inserted span; "" for none), one log line each."""
    accuracy = {c: insertion_accuracy(m, tokenizer, items, span, instruction, max_new_tokens, batch_size,
                                      desc=f"{c} ({length})" if span else "no insertion")
                for c, span in conditions.items()}
    for c, a in accuracy.items():
        log.info("%s: accuracy %.3f (%d/%d, 95%% CI %.3f-%.3f)", c, a["accuracy"], a["correct"], a["n"], *a["ci95"])
    return accuracy


def _add_sweep(report: dict, figures: dict, m, tokenizer, items, lengths: list[int], max_new_tokens: int,
               batch_size: int, out_dir: Path) -> None:
    """The accuracy-vs-length sweep over ``items`` into ``report`` (then complete, written again) and its figure
    into ``figures``."""
    report["sweep"] = length_sweep(m, tokenizer, items, report["kinds"], lengths, report["symbol"],
                                   report["instruction"], max_new_tokens, batch_size)
    figures["sweep"] = plot_sweep(report["sweep"], out_dir / "sweep.png",
                                  f"{report['task']}: accuracy vs inserted tokens ({len(items)} items)")
    report.update(sweep_items=len(items), complete=True)
    write_json(out_dir / "attention.json", report)

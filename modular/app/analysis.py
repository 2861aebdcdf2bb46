"""The ``evaluate.py`` subcommands of ``modular.analysis``: ``directions`` and ``attention``."""

from __future__ import annotations

import logging
import re
from pathlib import Path

log = logging.getLogger("modular")


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.+-]+", "_", Path(text).name or text).strip("_")


def _names(text: str, allowed: tuple[str, ...], what: str) -> list[str]:
    from modular import ModularError

    names = [t.strip() for t in str(text).split(",") if t.strip()]
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        raise ModularError(f"unknown {what} '{','.join(bad) or text}': use {', '.join(allowed)} (comma-separated)")
    return names


def _ints(text: str | int | None, what: str) -> list[int] | None:
    from modular import ModularError

    if text is None or text == "":
        return None
    try:
        return [int(t) for t in str(text).strip("[]() ").split(",") if t.strip()]
    except ValueError:
        raise ModularError(f"{what} must be comma-separated integers, got '{text}'") from None


def directions(
    model: str | None = None,
    behaviour: str = "capitals",
    formats: str = "chat,raw,newline",
    n_prompts: int = 64,
    limit: int | None = 32,
    retain_limit: int = 48,
    ablate_formats: str | None = None,
    layers: str | None = None,
    metric: str = "auto",
    max_new_tokens: int = 16,
    kl_budget: float = 0.1,
    batch_size: int = 16,
    run: str | None = None,
    seed: int = 0,
    out: str | None = None,
) -> dict:
    """Behaviour directions by difference in means at every layer, and what ablating each one removes.

    Writes directions.safetensors, directions.json, heatmap.png and ablation.png (and logs to W&B).
    Direction of layer i = normalised mean(behaviour prompts) − mean(contrast prompts) of the residual stream
    leaving block i, averaged over the format's suffix positions (chat: the template tokens after the content,
    aligned by left padding; newline: the trailing newline; raw: the last token). Contrast prompts are retain
    instructions (same count). Each direction is then ablated at every residual write: behaviour accuracy on
    its test split and mean first-token KL to the unablated model on held-out retain prompts.

    Args:
        model: Built-in alias (smollm2-135m-instruct, gemma3-270m), .gguf file, local HF folder or hub id
            (default: smollm2-135m-instruct, or the run's model with ``--run``).
        behaviour: Built-in behaviour (capitals, ioi, ...) or .jsonl file; its train prompts give the means.
        formats: Prompt formats, comma-separated: chat (chat template), raw (prompt alone), newline (prompt + "\\n").
        n_prompts: Behaviour prompts (and as many retain prompts) averaged per format.
        limit: Test items scored per ablated direction (default 32; none: all).
        retain_limit: Held-out retain prompts for the first-token KL.
        ablate_formats: Formats whose directions are ablated layer by layer (default: all of ``formats``).
        layers: Layers whose directions are ablated, comma-separated (default: all).
        metric: auto (choice accuracy when every item has a competing answer, else greedy generation),
            generation or choice.
        max_new_tokens: Length of greedy responses when scoring by generation.
        kl_budget: Also report the best direction among those whose retain KL stays within this budget.
        batch_size: Prompts per forward pass.
        run: Gated training run folder: analyse its trained (open) model and report the cosine between each
            found direction and the run's designated direction for ``behaviour``.
        seed: Seed of the data generators and splits.
        out: Output folder (default: outputs/analysis/directions/<model>-<behaviour>).
    """
    import torch

    from modular import ModularError
    from modular.analysis.discovery import (
        ablation_curve,
        best_direction,
        cross_layer_cosine,
        find_directions,
        plot_ablation,
        plot_designated,
        plot_heatmaps,
        save_directions,
    )
    from modular.analysis.formats import FORMATS
    from modular.data import load_behaviour, retain_data
    from modular.evaluation.behaviour import evaluate_behaviour
    from modular.evaluation.retain import first_token_logp
    from modular.evaluation.stats import wilson_interval
    from modular.runs import load_model_or_run, load_tokenizer_or_run
    from modular.tracking import log_to_wandb, write_json

    fmts = _names(formats, FORMATS, "format")
    ablate = _names(ablate_formats, tuple(fmts), "ablation format") if ablate_formats else fmts
    if metric not in ("auto", "generation", "choice"):
        raise ModularError(f"unknown metric '{metric}': use auto, generation or choice")
    if n_prompts < 1 or retain_limit < 1:
        raise ModularError("n_prompts and retain_limit must be ≥ 1")
    designated = None
    if run is not None:
        from modular.runs import load_open_model, read_run

        r = read_run(run)
        if behaviour not in r.directions:
            raise ModularError(f"run {run} gates {', '.join(r.behaviours)}, not '{behaviour}'")
        model = model or r.model_name
        designated = r.directions[behaviour].flatten().float()
        designated = designated / designated.norm()
    model = model or "smollm2-135m-instruct"
    tokenizer = load_tokenizer_or_run(model)
    data = load_behaviour(behaviour, seed=seed, tokenizer=tokenizer)
    retain = retain_data(seed)
    n = min(n_prompts, len(data["train"]), len(retain["train"]))
    if n == 0:
        raise ModularError(f"behaviour '{behaviour}' has no train prompts")
    behaviour_prompts = list(data["train"]["prompt"][:n])
    contrast_prompts = list(retain["train"]["prompt"][:n])
    test = data["test"] if limit is None else data["test"].select(range(min(limit, len(data["test"]))))
    if len(test) == 0:
        raise ModularError(f"behaviour '{behaviour}' has no test items")
    held = retain["test"].select(range(min(retain_limit, len(retain["test"]))))
    has_wrong = all(test["wrong"])
    if metric == "choice" and not has_wrong:
        raise ModularError(f"behaviour '{behaviour}' has no competing answers: use --metric generation")
    choice_only = has_wrong and metric != "generation"
    metric_name = "choice accuracy" if choice_only else "greedy generation"

    m = load_open_model(r) if run is not None else load_model_or_run(model)
    if designated is not None and designated.numel() != m.config.hidden_size:
        raise ModularError(f"the run's direction has {designated.numel()} entries, the model's width differs")
    found, report_formats = {}, {}
    for fmt in fmts:
        res = find_directions(m, tokenizer, behaviour_prompts, contrast_prompts, fmt, batch_size)
        found[fmt] = res["directions"]
        cos = cross_layer_cosine(res["directions"])
        entry = {**res["suffix"].describe(tokenizer), "diff_norms": res["diff_norms"],
                 "cross_layer_cosine": cos}
        if designated is not None:
            entry["designated_cosine"] = (res["directions"] @ designated).tolist()
        report_formats[fmt] = entry
        log.info("%s: %d positions (%r); adjacent-layer cosine mean %.3f", fmt, res["suffix"].n_positions,
                 entry["suffix_text"], torch.diagonal(cos, 1).mean().item() if len(cos) > 1 else 1.0)
    n_layers = len(next(iter(found.values())))
    chosen_layers = _ints(layers, "layers")
    if chosen_layers is not None and any(not 0 <= i < n_layers for i in chosen_layers):
        raise ModularError(f"layers must lie in 0..{n_layers - 1}")

    out_dir = Path(out or Path("outputs") / "analysis" / "directions" / f"{_slug(model)}-{_slug(behaviour)}")
    settings = {"model": model, "behaviour": behaviour, "run": run, "formats": fmts, "n_prompts": n,
                "contrast": "retain_data train prompts", "test_items": len(test), "retain_items": len(held),
                "metric": metric_name, "layers": "residual stream leaving block i (0-based)", "seed": seed}
    save_directions(out_dir / "directions.safetensors", found,
                    {**{k: v for k, v in settings.items() if v is not None}, "n_layers": n_layers,
                     "keys": "<format>.layer<NN>, unit vectors (d_model,)",
                     "positions": "; ".join(f"{f}: {report_formats[f]['positions']} ({report_formats[f]['n_positions']})"
                                            for f in fmts)})
    figures = {"heatmap": plot_heatmaps({f: report_formats[f]["cross_layer_cosine"] for f in fmts},
                                        out_dir / "heatmap.png",
                                        f"{Path(model).name}, {behaviour}: cosine between layers' diff-in-means "
                                        "directions")}
    if designated is not None:
        figures["designated"] = plot_designated({f: report_formats[f]["designated_cosine"] for f in fmts},
                                                out_dir / "designated.png",
                                                f"{behaviour}: found directions vs the run's designated direction")

    base = evaluate_behaviour(m, tokenizer, test, max_new_tokens, batch_size, desc=False, choice_only=choice_only)
    k = sum(i["correct"] for i in base.items) if base.items else round(base.accuracy * base.n)
    baseline = {**base.summary(), "ci95": wilson_interval(k, base.n)}
    ref = first_token_logp(m, tokenizer, list(held["prompt"]), list(held["chat"]))
    curves: dict = {}
    report: dict = {}
    for fmt in [None, *ablate]:  # the JSON and the curve figure are rewritten after every format
        if fmt is not None:
            curves[fmt] = ablation_curve(m, tokenizer, found[fmt], test, list(held["prompt"]), list(held["chat"]),
                                         chosen_layers, max_new_tokens, batch_size, choice_only,
                                         desc=f"ablate {fmt}", baseline=baseline, reference_logp=ref)
            figures["ablation"] = plot_ablation(curves, out_dir / "ablation.png",
                                                f"{Path(model).name}, {behaviour}: ablating one layer's direction at "
                                                f"every write ({len(test)} test items, {len(held)} retain prompts)",
                                                metric_name)
        best, best_cheap = best_direction(curves), best_direction(curves, kl_budget)
        report = {**settings, "complete": fmt == ablate[-1], "baseline": baseline, "best": best,
                  "kl_budget": kl_budget, "best_within_kl_budget": best_cheap, "formats": report_formats,
                  "ablation": curves, "files": {"directions": out_dir / "directions.safetensors", **figures}}
        write_json(out_dir / "directions.json", report)
    for label, b in (("best direction", best), (f"best within KL {kl_budget}", best_cheap)):
        if b is not None:
            log.info("%s: %s layer %d: accuracy %.3f -> %.3f (drop %.3f), retain KL %.4f", label, b["format"],
                     b["layer"], baseline["accuracy"], b["accuracy"], b["drop"], b["retain_kl"])
    summary = {"baseline_accuracy": baseline["accuracy"], "best": best or {},
               "best_within_kl_budget": best_cheap or {}}
    if designated is not None:
        summary["max_abs_designated_cosine"] = {f: max(abs(c) for c in report_formats[f]["designated_cosine"])
                                                for f in fmts}
    log_to_wandb(out_dir, "evaluate-directions", summary, config=settings, figures=figures,
                 tables={f"ablation_{f}": c["layers"] for f, c in curves.items()})
    log.info("wrote %s, %s", out_dir / "directions.json", ", ".join(str(p) for p in figures.values()))
    return report


def attention(
    model: str = "smollm2-135m-instruct",
    task: str = "capitals",
    insert: str = "meaningless,meaningful",
    length: int = 55,
    sweep: str | None = None,
    splits: str = "test",
    seeds: str = "0",
    limit: int | None = None,
    sweep_limit: int | None = None,
    heads: str | None = None,
    n_heads: int = 3,
    attention_items: int = 64,
    instruction: str = "Answer the following question.",
    symbol: str = "/",
    max_new_tokens: int = 24,
    batch_size: int = 16,
    out: str | None = None,
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
        model: Built-in alias (smollm2-135m-instruct, gemma3-270m), .gguf file, local HF folder or hub id.
        task: Built-in behaviour (capitals, arithmetic, greater_than, ...) or a .jsonl file.
        insert: Insertion kinds, comma-separated: meaningless, meaningful.
        length: Inserted tokens N.
        sweep: Inserted lengths for an accuracy-vs-length sweep, comma-separated (e.g. 0,8,16,32,55; none: no sweep).
        splits: Splits whose items are scored, comma-separated (e.g. validation,test).
        seeds: Generator seeds whose items are pooled (duplicates dropped), comma-separated; more seeds give
            more items for small built-in tasks (for capitals a seed's test countries may be another seed's
            train countries, which matters only for trained models).
        limit: Items scored per condition (default: all pooled items).
        sweep_limit: Items scored per sweep point (default: ``limit``).
        heads: Heads to plot, comma-separated LAYER.HEAD (default: the ``n_heads`` heads with the most attention
            mass on the inserted span).
        n_heads: Heads chosen when ``heads`` is not given.
        attention_items: Prompts averaged for the attention curves.
        instruction: Instruction line of chat tasks whose prompt is a single line.
        symbol: The repeated symbol of meaningless filler.
        max_new_tokens: Length of greedy responses.
        batch_size: Prompts per generation batch.
        out: Output folder (default: outputs/analysis/attention/<model>-<task>).
    """
    import datasets

    from modular import ModularError
    from modular.analysis.attention import last_token_attention, parse_heads, plot_attention, plot_sweep, top_heads
    from modular.analysis.insertion import KINDS, LABELS, filler, render_with_span, insert as insert_span
    from modular.data import load_behaviour
    from modular.evaluation.behaviour import evaluate_behaviour
    from modular.evaluation.stats import wilson_interval
    from modular.models import ArchitectureAdapter
    from modular.plots import bar_chart
    from modular.runs import load_model_or_run, load_tokenizer_or_run
    from modular.tracking import log_to_wandb, write_json

    kinds = _names(insert, KINDS, "insertion")
    split_names = _names(splits, ("train", "validation", "test"), "split")
    seed_list = _ints(seeds, "seeds") or [0]
    lengths = _ints(sweep, "sweep")
    if length < 1 or any(x < 0 for x in lengths or []):
        raise ModularError("length must be ≥ 1 and sweep lengths ≥ 0")
    tokenizer = load_tokenizer_or_run(model)
    rows, seen = [], set()
    for s in seed_list:
        data = load_behaviour(task, seed=s, tokenizer=tokenizer)
        for split in split_names:
            for row in data[split]:
                if row["prompt"] not in seen:
                    seen.add(row["prompt"])
                    rows.append(row)
    if not rows:
        raise ModularError(f"task '{task}' has no items in {splits}")
    items = datasets.Dataset.from_list(rows)
    if limit is not None:
        items = items.select(range(min(limit, len(items))))

    def inserted(ds, span):
        prompts = [insert_span(p, c, span, instruction) for p, c in zip(ds["prompt"], ds["chat"])]
        return datasets.Dataset.from_dict({**ds.to_dict(), "prompt": prompts}, features=ds.features)

    def score(ds, desc):
        r = evaluate_behaviour(m, tokenizer, ds, max_new_tokens, batch_size, desc=desc)
        k = sum(i["correct"] for i in r.items)
        return {"accuracy": r.accuracy, "n": r.n, "correct": k, "ci95": wilson_interval(k, r.n)}

    fillers = {kind: filler(tokenizer, kind, length, symbol) for kind in kinds}
    m = load_model_or_run(model)
    adapter = ArchitectureAdapter(m)
    conditions = {"none": ""} | fillers
    # every prompt is rendered once per condition to check that the span has exactly N tokens in context
    rendered = {c: [render_with_span(tokenizer, r["prompt"], r["chat"], span, instruction) for r in items]
                for c, span in conditions.items()}
    accuracy = {c: score(inserted(items, span), f"{c} ({length})" if span else "no insertion")
                for c, span in conditions.items()}
    for c, a in accuracy.items():
        log.info("%s: accuracy %.3f (%d/%d, 95%% CI %.3f-%.3f)", c, a["accuracy"], a["correct"], a["n"], *a["ci95"])

    n_att = min(attention_items, len(items))
    att = {c: last_token_attention(m, tokenizer, [x.ids for x in rendered[c][:n_att]],
                                   [x.span for x in rendered[c][:n_att]], batch_size=max(1, batch_size // 2))
           for c in conditions}
    if heads:
        chosen = parse_heads(heads, adapter.n_layers, adapter.n_heads)
        how = "given"
    else:
        mass = sum(att[k]["span_mass"] for k in kinds) / len(kinds)
        chosen = top_heads(mass, n_heads)
        how = "most attention mass on the inserted span (mean over insertion kinds)"
    curves = {LABELS[c]: {f"{layer}.{head}": att[c]["mean"][layer, head].tolist() for layer, head in chosen}
              for c in conditions}
    spans = {LABELS[c]: rendered[c][0].span for c in conditions}
    span_mass = {LABELS[c]: {f"{layer}.{head}": att[c]["span_mass"][layer, head].item() for layer, head in chosen}
                 for c in kinds}

    out_dir = Path(out or Path("outputs") / "analysis" / "attention" / f"{_slug(model)}-{_slug(task)}")
    bar_labels = ["w/o"] + [f"w/ {LABELS[k]}" for k in kinds]
    figures = {
        "accuracy": bar_chart(out_dir / "accuracy.png", bar_labels, [a["accuracy"] for a in accuracy.values()],
                              f"Results on {task}", f"accuracy ({len(items)} items, N = {length})",
                              [tuple(a["ci95"]) for a in accuracy.values()]),
        "attention": plot_attention(curves, spans, out_dir / "attention.png",
                                    f"{Path(model).name}, {task}: attention of the last prompt token, "
                                    f"{n_att} prompts, {length} inserted tokens"),
    }
    report = {
        "model": model, "task": task, "length": length, "kinds": kinds, "splits": split_names, "seeds": seed_list,
        "n_items": len(items), "instruction": instruction, "symbol": symbol,
        "placement": "chat: <instruction>\\n<filler>\\n<problem>; completion: <filler>\\n<text>",
        "fillers": {k: {"text": v, "tokens": len(tokenizer(v, add_special_tokens=False)["input_ids"])}
                    for k, v in fillers.items()},
        "accuracy": {LABELS[c]: a for c, a in accuracy.items()},
        "heads": [f"{layer}.{head}" for layer, head in chosen], "head_choice": how,
        "attention": {"query": "last prompt token", "items": n_att, "spans": spans, "span_mass": span_mass,
                      "curves": curves},
        "sweep": {}, "complete": not lengths, "files": figures,
    }
    write_json(out_dir / "attention.json", report)  # written again with the sweep

    sweep_rows = report["sweep"]
    if lengths:
        sub = items if sweep_limit is None else items.select(range(min(sweep_limit, len(items))))
        for kind in kinds:
            sweep_rows[LABELS[kind]] = []
            for n in lengths:
                span = filler(tokenizer, kind, n, symbol)
                for r in sub.select(range(min(4, len(sub)))):
                    render_with_span(tokenizer, r["prompt"], r["chat"], span, instruction)
                sweep_rows[LABELS[kind]].append({"length": n, **score(inserted(sub, span), f"{kind} ({n})")})
        figures["sweep"] = plot_sweep(sweep_rows, out_dir / "sweep.png",
                                      f"{task}: accuracy vs inserted tokens ({len(sub)} items)")
        report["sweep_items"] = len(sub)
        report["complete"] = True
        write_json(out_dir / "attention.json", report)
    summary = {"accuracy": {k: v["accuracy"] for k, v in report["accuracy"].items()}, "span_mass": span_mass}
    log_to_wandb(out_dir, "evaluate-attention", summary,
                 config={k: report[k] for k in ("model", "task", "length", "kinds", "splits", "seeds", "n_items")},
                 figures=figures, tables={f"sweep_{k}": v for k, v in sweep_rows.items()})
    log.info("wrote %s, %s", out_dir / "attention.json", ", ".join(str(p) for p in figures.values()))
    return report


COMMANDS: dict = {"directions": directions, "attention": attention}

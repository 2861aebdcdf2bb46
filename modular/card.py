"""The model card of a published folder (its ``README.md``, a Hugging Face model card): front matter the hub reads,
which behaviours are locked and by which key file, and the numbers of the lock report
(:class:`~modular.reports.LockReport`)."""

from __future__ import annotations

from modular.keys import KEY_SUFFIX
from modular.lock_kind import LockKind, lock_kinds
from modular.models.loading import HubOrigin, hub_origin
from modular.reports import HeldOut, LockReport, failed_kinds, failure_headline

CARD_TAGS = ["modular", "locked-behaviour"]


def card_data(base: str, origin: HubOrigin | None = None):
    """The model card's front matter (a :class:`huggingface_hub.ModelCardData`): the base model as a hub id and its
    licence where they are known (``origin``; default :func:`modular.models.loading.hub_origin` of ``base``),
    ``transformers``, text generation, modular's tags."""
    from huggingface_hub import ModelCardData

    origin = hub_origin(base) if origin is None else origin
    return ModelCardData(base_model=origin.hub_id, license=origin.license, library_name="transformers",
                         pipeline_tag="text-generation", tags=list(CARD_TAGS))


def model_card(behaviours: list[str], base: str, measured: LockReport | dict | None, hardened: bool,
               step: int | None = None, lock_check: dict | None = None, dtype: str | None = None,
               origin: HubOrigin | None = None, kinds: dict[str, LockKind] | None = None) -> str:
    """The published folder's ``README.md``: front matter the hub reads (:func:`card_data`; ``origin``: where the
    base model comes from, default read from ``base``), which behaviours are locked, that the keys are distributed
    apart (by file name, never a path), warnings where the lock was not verified or did not hold, and the measured
    numbers (``measured``, a lock report: a :class:`~modular.reports.LockReport`, or its JSON), and what kind of
    lock each is (``kinds``, default: :func:`~modular.lock_kind.lock_kinds` of the lock report alone: what it
    measured, and what it did not)."""
    from huggingface_hub import ModelCard

    measured = LockReport.coerce(measured) if measured else None
    failed = lock_check is not None and not lock_check.get("verified", False)
    held_out = measured.lock_held_out if measured is not None else None  # the verdict on the test split
    not_held = held_out is not None and not held_out.held
    lines = [f"# Locked model (base: {base})", ""]
    if failed:
        lines += ["> **Warning: the lock was not verified.** Training did not reach the lock on held-out",
                  f"> validation data ({lock_check.get('detail', 'unknown')}). The behaviours below were projected",
                  "> out of the weights, but the model may still show them.", ""]
    if not_held:
        head = failure_headline(held_out.failing)
        lines += [f"> **Warning: {head} on the held-out test split** (the lock evaluation, below):",
                  f"> {'; '.join(held_out.failing)}."
                  + (" The behaviours below were projected out of the weights, but the model may still show them"
                     " on inputs it was not trained or validated on." if head.startswith("not locked") else
                     " The behaviours below are locked there; what else the lock must keep was not kept."), ""]
    lines += [
        "These weights load with plain `transformers` (`AutoModelForCausalLM.from_pretrained`).",
        "The following behaviours are **locked**: each lives in one residual-stream direction that was",
        "projected out of every weight matrix writing the residual stream"
        + (" (and out of every reader, so adding it back does nothing)." if hardened else "."), "",
        "| behaviour | locked | key file |", "|---|---|---|",
    ]
    not_locked = not_held and "locked" in failed_kinds(held_out.failing)  # a locked state still answers there
    locked = ("not verified" if failed else "not on the held-out test split" if not_locked
              else "yes; other targets missed (the warning above)" if not_held else "yes")
    lines += [f"| {b} | {locked} | `{b}{KEY_SUFFIX}` |" for b in behaviours]
    lines += ["", "**The keys are not part of this folder.** They are distributed apart from these weights, by the",
              "publisher, to whoever may unlock a behaviour. With a key:",
              "`modular unlock --model <this folder> --key <key file> --out <folder>`.", ""]
    kinds = kinds if kinds is not None else lock_kinds(measured) if measured is not None else {}
    lines += _kinds_section(kinds, behaviours)
    if step is not None:
        lines += [f"Trained weights: step {step} of the training run.", ""]
    if dtype == "float32":
        lines += ["These weights are float32. Loaded in bfloat16 or float16 (`from_pretrained(..., dtype=...)` rounds",
                  "to nearest) some of what training changed is lost, and with it part of the lock. To serve in",
                  "bfloat16, use weights published in bfloat16 (`modular publish --dtype bfloat16`, which rounds",
                  "stochastically) and check them (`modular lock --dtype bfloat16`).", ""]
    if measured is not None:
        lines += _measured(measured, behaviours, held_out)
    front = card_data(base, origin).to_yaml()
    return str(ModelCard(f"---\n{front}\n---\n\n" + "\n".join(lines)))


KINDS_HEADING = "## What the lock is"


def _kinds_section(kinds: dict[str, LockKind], behaviours: list[str]) -> list[str]:
    if not kinds:
        return []
    return [KINDS_HEADING, ""] + [f"- {kinds[b].text()}" for b in behaviours if b in kinds] + [""]


def with_lock_kinds(card: str, kinds: dict[str, LockKind], behaviours: list[str]) -> str:
    """``card`` (a card :func:`model_card` wrote) with its section on what the lock is replaced by ``kinds``'s (e.g.
    once the published model was attacked), or added after the behaviours' table where it has none."""
    section = "\n".join(_kinds_section(kinds, behaviours))
    start = card.find(KINDS_HEADING)
    if start >= 0:
        end = card.find("\n\n", card.find("\n\n", start) + 2)  # the heading's blank line, then the list's end
        return card[:start] + section.rstrip("\n") + card[end if end >= 0 else len(card):]
    anchor = card.find("**The keys are not part of this folder.**")
    return card if anchor < 0 else card[:anchor] + section + "\n" + card[anchor:]


def _measured(measured: LockReport, behaviours: list[str], held_out: HeldOut | None) -> list[str]:
    """The card's section of measured numbers: each state's accuracies, retain KL and perplexity ratio, the verdict
    on the held-out items by its targets, the neighbours' accuracies and refusal leakage, and those that moved."""
    not_held = held_out is not None and not held_out.held
    lines = ["## Measured (held-out test split)", "", "| state | " + " | ".join(behaviours)
             + " | retain first-token KL | perplexity ratio |",
             "|---|" + "---|" * (len(behaviours) + 2)]
    for state, row in measured.states.items():
        accs = " | ".join(f"{row.behaviours[b].accuracy:.3f}" for b in behaviours)
        lines.append(f"| {state} | {accs} | {row.retain_first_token_kl:.4f} | {row.perplexity_ratio:.3f} |")
    lines.append("")
    paraphrases = list(next(iter(measured.states.values())).paraphrases) if measured.states else []
    if paraphrases:
        lines += ["The same behaviours asked in other wordings, other question forms and other languages (held-out "
                  "paraphrase sets, never trained or tuned on; the base model's accuracy is the bar):", "",
                  "| state | " + " | ".join(paraphrases) + " |", "|---|" + "---|" * len(paraphrases)]
        lines += [f"| {state} | " + " | ".join(f"{row.paraphrases[k].accuracy:.3f}" if k in row.paraphrases else "-"
                                               for k in paraphrases) + " |" for state, row in measured.states.items()]
        lines.append("")
    if held_out is not None and held_out.targets is not None:
        t = held_out.targets
        lines += [f"{'Not every target holds' if not_held else 'The lock holds'} on these items by the targets "
                  f"training checked on validation: locked accuracy at most {t['locked_accuracy']:g} in both "
                  f"locked states, open accuracy at least base's less {t['open_drop']:g} and at least "
                  f"{t['min_open_accuracy']:g}, retain first-token KL at most {t['retain_kl']:g}"
                  + (" (what fails: the warning above)." if not_held else "."), ""]
    neighbours = measured.neighbours
    if neighbours:
        lines += ["Neighbour behaviours (close to the locked ones; they should work as in the base model in every "
                  "state): accuracy (share of answers that are the locked response).", "",
                  "| state | " + " | ".join(neighbours) + " | retain prompts: locked response |",
                  "|---|" + "---|" * (len(neighbours) + 1)]
        for state, row in measured.states.items():
            cells = " | ".join(f"{row.neighbours[n].accuracy:.3f} ({row.neighbours[n].refusal_rate:.2f})"
                               for n in neighbours)
            leak = row.retain_refusal_rate if row.retain_refusal_rate is not None else float("nan")
            lines.append(f"| {state} | {cells} | {leak:.3f} |")
        lines.append("")
        if measured.neighbour_shifts:
            lines += [f"Moved more than {100 * measured.neighbour_tolerance:.0f} points from base (items lost and "
                      "gained against base, and the exact paired test's p-value):", ""]
            lines += [f"- {x.neighbour}, {x.state}: {100 * x.change:+.1f} points ({x.lost} lost, {x.gained} gained of "
                      f"{x.n}; p = {x.p_value:.2g})" for x in measured.neighbour_shifts]
            lines.append("")
        losses = [(state, n, score.vs_base) for state, row in measured.states.items() if state != "control"
                  for n, score in [*row.neighbours.items(), *row.others.items()]  # the far behaviours' too
                  if score.vs_base is not None and score.vs_base.significant_loss]
        if any(row.neighbours[n].vs_base is not None and row.neighbours[n].vs_base.p_holm is not None
               for row in measured.states.values() for n in neighbours):
            lines += ["Significant losses against base (exact paired test, Holm-adjusted over these figures, "
                      "α = 0.05): " + ("; ".join(f"{n} {state} ({v.lost} lost, {v.gained} gained of {v.n}; "
                                                  f"95% interval {100 * v.ci95[0]:+.1f} to {100 * v.ci95[1]:+.1f} "
                                                  f"points; Holm p = {v.p_holm:.2g})" for state, n, v in losses)
                                       if losses else "none") + ".", ""]
    return lines

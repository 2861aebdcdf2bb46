"""Token insertion: put N meaningless or meaningful filler tokens between instruction and problem.

Where the span goes (per task):

* chat tasks (instructions such as capitals, arithmetic, chat JSONL): the user message
  becomes ``<instruction line>\\n<filler>\\n<problem>``. The instruction line is the
  prompt's first line when the prompt has several lines, otherwise a fixed line
  (default "Answer the following question."). Without insertion the message is
  ``<instruction line>\\n<problem>``, so the conditions differ only by the span and one newline;
* completion tasks (raw text such as ioi, greater_than, agreement): there is no
  instruction, so the span is a prefix: ``<filler>\\n<text>``.

Fillers have exactly N tokens for the tokenizer (checked by tokenizing, and again
in context on every rendered prompt): *meaningless* repeats one symbol ("/" by
default; " /" where "//" would merge into one token), *meaningful* is neutral
prose cut to N tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from modular import ModularError
from modular.data.behaviours import load_behaviour, neutral_text
from modular.data.formatting import render_prompt
from modular.evaluation.behaviour import evaluate_behaviour
from modular.evaluation.stats import wilson_interval

KINDS = ("meaningless", "meaningful")
#: short labels used in the figures (as in the seed figure: None, Mless, Mful)
LABELS = {"none": "None", "meaningless": "Mless", "meaningful": "Mful"}
DEFAULT_INSTRUCTION = "Answer the following question."


def count_tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def meaningless_filler(tokenizer, n: int, symbol: str = "/") -> str:
    """``symbol`` repeated so that the text is exactly ``n`` tokens (tries "/", " /", "/ ")."""
    if n == 0:
        return ""
    for unit in (symbol, " " + symbol, symbol + " "):
        text = (unit * n).strip() if unit.endswith(" ") else unit * n
        if count_tokens(tokenizer, text) == n:
            return text
    raise ModularError(f"cannot repeat {symbol!r} into exactly {n} tokens for this tokenizer; choose another symbol")


def meaningful_filler(tokenizer, n: int, seed: int = 0) -> str:
    """Neutral prose (``neutral_text`` train split) cut to exactly ``n`` tokens (at a word end if possible), on one line."""
    if n == 0:
        return ""
    text = " ".join(" ".join(t.split()) for t in neutral_text(seed)["train"]["text"])
    while count_tokens(tokenizer, text) < n + 16:
        text = text + " " + text
    words = text.split(" ")
    for first in range(min(200, len(words))):  # whole words, from the first sentence on
        for last in range(first + 1, len(words) + 1):
            candidate = " ".join(words[first:last])
            c = count_tokens(tokenizer, candidate)
            if c == n:
                return candidate
            if c > n:
                break
    for end in range(1, len(text) + 1):  # else cut inside a word
        candidate = text[:end].rstrip()
        c = count_tokens(tokenizer, candidate)
        if c == n:
            return candidate
        if c > n + 2:
            break
    raise ModularError(f"cannot cut neutral text to exactly {n} tokens for this tokenizer")


def filler(tokenizer, kind: str, n: int, symbol: str = "/", seed: int = 0) -> str:
    if kind == "meaningless":
        return meaningless_filler(tokenizer, n, symbol)
    if kind == "meaningful":
        return meaningful_filler(tokenizer, n, seed)
    raise ModularError(f"unknown insertion '{kind}': use {' or '.join(KINDS)}")


def split_prompt(prompt: str, chat: bool, instruction: str = DEFAULT_INSTRUCTION) -> tuple[str, str]:
    """(instruction line, problem) of a prompt; the instruction is empty for completion tasks."""
    if not chat:
        return "", prompt
    if "\n" in prompt.strip():
        head, rest = prompt.strip().split("\n", 1)
        return head, rest
    return instruction, prompt


def insert(prompt: str, chat: bool, span: str, instruction: str = DEFAULT_INSTRUCTION) -> str:
    """The prompt with ``span`` between instruction and problem (``span=""``: the no-insertion baseline)."""
    head, problem = split_prompt(prompt, chat, instruction)
    return "\n".join(p for p in (head, span, problem) if p)


@dataclass
class Rendered:
    """One prompt as the model sees it, and where the inserted span lies in its tokens."""

    ids: list[int]
    span: tuple[int, int]  # [start, end) token positions of the inserted span ((0, 0) if none)


def render_with_span(tokenizer, prompt: str, chat: bool, span: str,
                     instruction: str = DEFAULT_INSTRUCTION) -> Rendered:
    """Render the inserted prompt (chat template for chat tasks) and locate the span's tokens.

    Raises :class:`ModularError` if the span does not cover exactly as many tokens in
    context as it has alone (a merge across its boundary).
    """
    user = insert(prompt, chat, span, instruction)
    text = render_prompt(tokenizer, user, chat)
    templated = chat and bool(getattr(tokenizer, "chat_template", None))
    enc = tokenizer(text, add_special_tokens=not templated, return_offsets_mapping=True)
    ids = enc["input_ids"]
    if not span:
        return Rendered(ids, (0, 0))
    head, _ = split_prompt(prompt, chat, instruction)
    a = text.index(head + "\n" + span if head else span + "\n") + (len(head) + 1 if head else 0)
    b = a + len(span)
    inside = [i for i, (s, e) in enumerate(enc["offset_mapping"]) if e > s and s < b and e > a]
    n = count_tokens(tokenizer, span)
    if len(inside) != n or inside != list(range(inside[0], inside[0] + n)):
        raise ModularError(f"the inserted span covers {len(inside)} tokens in context, not {n}")
    if any(s < a or e > b for s, e in (enc["offset_mapping"][i] for i in inside)):
        raise ModularError("the inserted span merges with its neighbouring text into one token")
    return Rendered(ids, (inside[0], inside[0] + n))


def pooled_items(task: str, tokenizer, seeds: list[int], splits: list[str], limit: int | None = None):
    """The task's items of ``splits`` under every generator seed, duplicates (same prompt) dropped, at most
    ``limit``; more seeds give more items for small built-in tasks."""
    import datasets

    rows, seen = [], set()
    for s in seeds:
        data = load_behaviour(task, seed=s, tokenizer=tokenizer)
        for split in splits:
            for row in data[split]:
                if row["prompt"] not in seen:
                    seen.add(row["prompt"])
                    rows.append(row)
    if not rows:
        raise ModularError(f"task '{task}' has no items in {', '.join(splits)}")
    items = datasets.Dataset.from_list(rows)
    return items if limit is None else items.select(range(min(limit, len(items))))


def with_span(items, span: str, instruction: str = DEFAULT_INSTRUCTION):
    """The items with ``span`` inserted into every prompt (:func:`insert`)."""
    import datasets

    prompts = [insert(p, c, span, instruction) for p, c in zip(items["prompt"], items["chat"])]
    return datasets.Dataset.from_dict({**items.to_dict(), "prompt": prompts}, features=items.features)


def insertion_accuracy(model, tokenizer, items, span: str, instruction: str = DEFAULT_INSTRUCTION,
                       max_new_tokens: int = 24, batch_size: int = 16, desc: str | bool = False,
                       checked: int | None = None) -> dict:
    """Greedy accuracy on the items with ``span`` inserted: accuracy, n, correct and the 95% Wilson interval. The
    span is first checked to keep its length in context on the first ``checked`` prompts (default: every one)."""
    for r in items.select(range(len(items) if checked is None else min(checked, len(items)))):
        render_with_span(tokenizer, r["prompt"], r["chat"], span, instruction)
    r = evaluate_behaviour(model, tokenizer, with_span(items, span, instruction), max_new_tokens, batch_size,
                           desc=desc)
    k = sum(i["correct"] for i in r.items)
    return {"accuracy": r.accuracy, "n": r.n, "correct": k, "ci95": wilson_interval(k, r.n)}


def length_sweep(model, tokenizer, items, kinds: list[str], lengths: list[int], symbol: str = "/",
                 instruction: str = DEFAULT_INSTRUCTION, max_new_tokens: int = 24, batch_size: int = 16) -> dict:
    """Accuracy vs number of inserted tokens, per insertion kind (by its figure label): rows of length and
    :func:`insertion_accuracy` (each length's span checked in context on 4 prompts)."""
    rows: dict[str, list[dict]] = {}
    for kind in kinds:
        rows[LABELS[kind]] = []
        for n in lengths:
            span = filler(tokenizer, kind, n, symbol)
            rows[LABELS[kind]].append({"length": n, **insertion_accuracy(
                model, tokenizer, items, span, instruction, max_new_tokens, batch_size, desc=f"{kind} ({n})",
                checked=4)})
    return rows

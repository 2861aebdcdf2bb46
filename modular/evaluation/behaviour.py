"""Score a model on a behaviour: greedy responses judged by the schema's rule, plus the
logit difference (target vs. ``wrong`` first token) for tasks that define one."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from modular.data.formatting import prompt_batches, prompt_limit
from modular.data.schema import DEFAULT_LOCKED_RESPONSE, answer_frame, is_correct, is_refusal
from modular.evaluation.metrics import mean, share


@dataclass
class BehaviourResult:
    accuracy: float
    n: int
    logit_diff: float | None = None
    #: share of items whose target first token beats the ``wrong`` one (tasks with ``wrong``)
    choice_accuracy: float | None = None
    items: list[dict] = field(default_factory=list)
    #: share of responses that are a locked response (None: scored without generating)
    refusal_rate: float | None = None
    #: scored by the choice alone: whether each item's target first token beats the wrong one, in order
    choices: list[bool] | None = None

    def correct(self) -> list[bool]:
        """Whether each item was answered right, in order (by the choice where scored by it alone)."""
        return list(self.choices) if self.choices is not None else [bool(i["correct"]) for i in self.items]

    def summary(self) -> dict:
        out = {"accuracy": self.accuracy, "n": self.n}
        if self.refusal_rate is not None:
            out["refusal_rate"] = self.refusal_rate
        if self.logit_diff is not None:
            out["logit_diff"] = self.logit_diff
            out["choice_accuracy"] = self.choice_accuracy
        return out


def _device(model) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def generate(model, tokenizer, prompts: list[str], chats: list[bool], max_new_tokens: int = 24,
             batch_size: int = 16, desc: str | None = None, prefills: list[str] | None = None,
             max_length: int | None = None, name: str | None = None) -> list[str]:
    """Greedy responses for ``prompts`` (left-padded batches); with ``prefills``, each response begun with its
    prefill (what is returned is the continuation after it). Each prompt (with its prefill) keeps its last
    ``max_length`` tokens and no more than leave room for the response within the model's positions
    (:func:`~modular.data.formatting.prompt_limit`); those cut are counted and reported once, as ``name``'s
    (default: ``desc``)."""
    out: list[str] = []
    limit = prompt_limit(model, max_length, max_new_tokens)
    batches = prompt_batches(tokenizer, prompts, chats, batch_size, limit, prefills,
                             name or (desc if isinstance(desc, str) else None))
    for batch in tqdm(batches, desc=desc or "generate", leave=False, disable=desc is False):
        batch = {k: v.to(_device(model)) for k, v in batch.items()}
        gen = model.generate(
            **batch, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id,
            top_p=None, top_k=None, temperature=None,
        )
        out += tokenizer.batch_decode(gen[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
    return out


def first_token_ids(tokenizer, texts: list[str]) -> torch.Tensor:
    return torch.tensor([tokenizer(t, add_special_tokens=False)["input_ids"][0] for t in texts])


@torch.no_grad()
def last_logits(model, tokenizer, prompts: list[str], chats: list[bool], batch_size: int = 32,
                max_length: int | None = None, name: str | None = None) -> torch.Tensor:
    """Next-token logits after each prompt, ``(n, vocab)`` (float32, on CPU). Each prompt keeps its last
    ``max_length`` tokens, and no more than the model's positions (those cut counted and reported once, as
    ``name``'s)."""
    rows = []
    for batch in prompt_batches(tokenizer, prompts, chats, batch_size, prompt_limit(model, max_length), name=name):
        batch = {k: v.to(_device(model)) for k, v in batch.items()}
        rows.append(model(**batch, use_cache=False).logits[:, -1].float().cpu())
    return torch.cat(rows)


def choice_measures(dataset) -> bool:
    """Whether a first-token choice (the target's first token against the wrong answer's) measures the task: every
    item has a competing answer, and one answer is right. Greater-than accepts any later year (its ``prefixes``):
    "The war lasted from the year 1732 to the year 17" is answered " 35" as rightly as " 71", whose first token ties
    with the wrong " 32"'s, so SmolLM2 chose right on 0.27 of the items it completes rightly on every one."""
    return len(dataset) > 0 and all(dataset["wrong"]) and not any(len(p) > 1 for p in dataset["prefixes"])


def evaluate_behaviour(model, tokenizer, dataset, max_new_tokens: int = 24, batch_size: int = 16,
                       limit: int | None = None, intervention=None, desc: str | None = None,
                       choice_only: bool = False,
                       refusals: tuple[str, ...] | list[str] = (DEFAULT_LOCKED_RESPONSE,),
                       prefill: bool = False, max_length: int | None = None,
                       name: str | None = None) -> BehaviourResult:
    """Accuracy (and logit difference where ``wrong`` is set) on ``dataset`` (one split).

    ``intervention``: a zero-argument callable returning a context manager (e.g. a lock)
    active during scoring. ``choice_only``: for tasks the choice measures (:func:`choice_measures`), skip generation
    and report the choice accuracy (target's first token beats the wrong one) as ``accuracy``; others are scored by
    generation all the same.
    ``refusals``: the locked responses; a response that is one of them is never correct (their share is the result's
    ``refusal_rate``). ``prefill``: each response begun with its answer's own frame (:func:`answer_frame`, the
    target's words before the answer), the continuation scored (by generation only; a refusal after the frame
    counts as one). The shares and the mean are torchmetrics metrics (:mod:`modular.evaluation.metrics`): where
    torch.distributed is initialised they are taken over every process's items.
    ``max_length``: each prompt keeps its last ``max_length`` tokens, and no more than leave room for the response
    within the model's positions; those cut are counted and reported once, as ``name``'s (default: ``desc``).
    """
    if limit is not None:
        dataset = dataset.select(range(min(limit, len(dataset))))
    prompts, chats = list(dataset["prompt"]), list(dataset["chat"])
    choice_only = choice_only and not prefill and choice_measures(dataset)
    frames = [answer_frame(t, a) for t, a in zip(dataset["target"], dataset["answers"])] if prefill else None
    # the choice reads the prompts as the responses do (the same limit: a prompt cut is reported once)
    bound = prompt_limit(model, max_length, 0 if choice_only else max_new_tokens)
    label = name or (desc if isinstance(desc, str) else None)
    ctx = intervention() if intervention is not None else nullcontext()
    with ctx:
        kw = {"prefills": frames} if prefill else {}
        kw.update({k: v for k, v in (("max_length", max_length), ("name", name)) if v is not None})
        responses = [] if choice_only else generate(model, tokenizer, prompts, chats, max_new_tokens, batch_size, desc,
                                                    **kw)
        logit_diff = choice_accuracy = diffs = None
        if all(dataset["wrong"]) and not prefill:
            logits = last_logits(model, tokenizer, prompts, chats, max_length=bound, name=label)
            good = first_token_ids(tokenizer, dataset["target"])
            bad = first_token_ids(tokenizer, dataset["wrong"])
            idx = torch.arange(len(prompts))
            diffs = logits[idx, good] - logits[idx, bad]
            logit_diff, choice_accuracy = mean(diffs), share(diffs > 0)
    if choice_only:
        return BehaviourResult(choice_accuracy, len(prompts), logit_diff, choice_accuracy, [],
                               choices=[bool(d > 0) for d in diffs])
    items = []
    for i, (row, response) in enumerate(zip(dataset, responses)):
        items.append({"prompt": row["prompt"], **({"prefill": frames[i]} if prefill else {}), "response": response,
                      "correct": is_correct(response, row["target"], row["answers"], row["prefixes"], refusals),
                      "refusal": is_refusal(response, refusals)})
    accuracy = share([i["correct"] for i in items])
    refusal_rate = share([i["refusal"] for i in items])
    return BehaviourResult(accuracy, len(items), logit_diff, choice_accuracy, items, refusal_rate)

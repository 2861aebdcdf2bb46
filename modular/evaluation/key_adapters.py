"""How closely a key's LoRA adapter (:mod:`modular.peft_keys`) unlocks: the published model with the adapters
active, through PEFT, against the same model with the keys applied (the exact unlock), on the same prompts."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from modular.evaluation.behaviour import generate
from modular.evaluation.retain import first_token_logp, mean_kl
from modular.keys import Key, apply_key


def with_adapters(published, adapters: dict[str, str | Path]):
    """A copy of ``published`` wrapped by PEFT with every adapter of ``adapters`` (name → folder) loaded and all of
    them active at once."""
    from peft import PeftModel

    names = list(adapters)
    model = PeftModel.from_pretrained(copy.deepcopy(published), str(adapters[names[0]]), adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(str(adapters[name]), adapter_name=name)
    model.base_model.set_adapter(names)
    return model.eval()


def unlocked_by_keys(published, keys: list[Key], applied: list[str] = ()):
    """A copy of ``published`` with ``keys`` applied in turn (after the keys ``applied`` before them)."""
    model, done = copy.deepcopy(published), list(applied)
    for key in keys:
        apply_key(model, key, applied=done)
        done.append(key.behaviour)
    return model


@torch.no_grad()
def adapter_agreement(published, tokenizer, keys: list[Key], adapters: dict[str, str | Path],
                      prompt_sets: dict[str, tuple[list[str], list[bool]]], max_new_tokens: int = 16,
                      batch_size: int = 16, applied: list[str] = ()) -> dict:
    """Per set of prompts (name → (prompts, chat flags)): how many greedy answers of the model with ``adapters``
    are those of the model with ``keys`` applied (``greedy_agreement``, a share), and the mean first-token KL
    from the keys' model to the adapters' (``first_token_kl``)."""
    exact = unlocked_by_keys(published, keys, applied)
    served = with_adapters(published, adapters)
    report = {}
    for name, (prompts, chats) in prompt_sets.items():
        want = generate(exact, tokenizer, prompts, chats, max_new_tokens, batch_size, desc=False)
        got = generate(served, tokenizer, prompts, chats, max_new_tokens, batch_size, desc=False)
        kl = mean_kl(first_token_logp(exact, tokenizer, prompts, chats), first_token_logp(served, tokenizer, prompts, chats))
        same = sum(a == b for a, b in zip(want, got))
        report[name] = {"n": len(prompts), "greedy_agreement": same / max(len(prompts), 1), "first_token_kl": kl,
                        "differing": [{"prompt": p, "keys": a, "adapters": b}
                                      for p, a, b in zip(prompts, want, got) if a != b][:5]}
    return report

"""The lock under the quantisation of a release: the published (locked) model and its base, both quantised the same
way, scored on the locked behaviours (accuracy with intervals, share of locked responses) and compared on held-out
retain prompts (first-token KL of the quantised published model to the equally quantised base)."""

from __future__ import annotations

import copy
import logging

from modular.data import load_behaviour, retain_data
from modular.data.schema import DEFAULT_LOCKED_RESPONSE
from modular.evaluation.behaviour import evaluate_behaviour
from modular.evaluation.retain import first_token_logp, mean_kl
from modular.evaluation.stats import wilson_interval
from modular.models.quantize import quantize_weights

log = logging.getLogger("modular")


def quantized_report(base, locked, tokenizer, behaviours: dict[str, str], schemes: list[str], seed: int = 0,
                     limit: int | None = None, max_new_tokens: int = 24, batch_size: int = 16,
                     locked_responses: dict[str, str] | None = None, group_size: int | None = None) -> dict:
    """``{"schemes": {scheme: {"behaviours": {name: {"base": ..., "locked": ...}}, "retain_first_token_kl": ...,
    "retain_first_token_kl_base_vs_unquantised": ...}}}``. ``behaviours``: name → source (built-in, .jsonl, hf:).
    ``base`` and ``locked`` are not changed (each scheme quantises copies). ``group_size``: int4's inputs per group
    (default: the quantiser's)."""
    data = {}
    for name, source in behaviours.items():
        test = load_behaviour(source, seed=seed, tokenizer=tokenizer)["test"]
        data[name] = test.select(range(min(limit, len(test)))) if limit is not None else test
    retain = retain_data(seed)["test"]
    plain_base_logp = first_token_logp(base, tokenizer, retain["prompt"], retain["chat"])
    report: dict = {"schemes": {}, "retain_items": len(retain), "int4_group_size": group_size}
    for scheme in schemes:
        plain = scheme == "none"  # the models as they are: nothing to copy
        group = group_size if scheme == "int4" else None
        qb = base if plain else quantize_weights(copy.deepcopy(base), scheme, group)
        ql = locked if plain else quantize_weights(copy.deepcopy(locked), scheme, group)
        row: dict = {"behaviours": {}}
        for name, test in data.items():
            refusals = ((locked_responses or {}).get(name, DEFAULT_LOCKED_RESPONSE),)
            row["behaviours"][name] = {}
            for label, model in (("base", qb), ("locked", ql)):
                r = evaluate_behaviour(model, tokenizer, test, max_new_tokens, batch_size, desc=f"{scheme}:{label}",
                                       refusals=refusals)
                correct = sum(i["correct"] for i in r.items)
                row["behaviours"][name][label] = {**r.summary(), "ci95": wilson_interval(correct, r.n)}
        base_logp = plain_base_logp if plain else first_token_logp(qb, tokenizer, retain["prompt"], retain["chat"])
        row["retain_first_token_kl"] = mean_kl(base_logp, first_token_logp(ql, tokenizer, retain["prompt"],
                                                                           retain["chat"]))
        row["retain_first_token_kl_base_vs_unquantised"] = mean_kl(plain_base_logp, base_logp)
        report["schemes"][scheme] = row
        scores = " ".join(f"{n} base {v['base']['accuracy']:.3f} locked {v['locked']['accuracy']:.3f} (locked "
                          f"responses {v['locked']['refusal_rate']:.0%})" for n, v in row["behaviours"].items())
        log.info("%s: %s | retain KL to the quantised base %.4f", scheme, scores, row["retain_first_token_kl"])
        del qb, ql
    return report

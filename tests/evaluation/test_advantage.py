"""The published model's advantage over the base after the same attack (modular.evaluation.advantage): each
built-in attack's like-for-like conditions, the worst case, and one line."""

from __future__ import annotations

import pytest

from modular.evaluation.advantage import ADVANTAGE_MAX, advantage, advantage_text
from modular.evaluation.attacks import default_attacks
from modular.reports import AttackEntry


def _sweep(best: dict[str, float]) -> dict:
    return {"settings": [{"label": k, "best_accuracy": v} for k, v in best.items()]}


def _entry(with_base: bool = True) -> AttackEntry:
    attacks = {"a_weights": {"best": {"accuracy": 0.9}}, "b_steering": {"best": {"accuracy": 0.8}},
               "c_relearning": _sweep({"full lr=1e-4 N=8 seed=0": 0.30, "lora lr=1e-3 N=8 seed=0": 0.10,
                                       "full lr=1e-3 N=8 seed=1": 0.20}),
               "d_neutral": _sweep({"neutral full lr=1e-4 N=128 seed=0": 0.02}),
               "e_prefill": {"accuracy": 0.04, "base_accuracy": 0.01},
               "f_quantized": {"schemes": {"int8": {"accuracy": 0.0, "base_accuracy": 0.0},
                                           "q4_1": {"accuracy": 0.03, "base_accuracy": 0.0}}}}
    base = {"c_relearning": _sweep({"full lr=1e-4 N=8 seed=0": 0.22, "lora lr=1e-3 N=8 seed=0": 0.15}),
            "d_neutral": _sweep({"neutral full lr=1e-4 N=128 seed=0": 0.0})}
    return AttackEntry(base_accuracy=0.0, open_accuracy=0.9, locked_accuracy=0.0, attacks=attacks,
                       baselines={"base": base} if with_base else {})


def test_each_condition_measured_on_the_base_alike_and_the_worst_case():
    adv = advantage(_entry(), default_attacks())
    got = [(r["attack"], r["condition"], r["published"], r["base"]) for r in adv["rows"]]
    # (a) and (b) have no counterpart on the base; a setting the base's sweep lacks is left out
    assert got == [("c_relearning", "full lr=1e-4 N=8 seed=0", 0.30, 0.22),
                   ("c_relearning", "lora lr=1e-3 N=8 seed=0", 0.10, 0.15),
                   ("d_neutral", "neutral full lr=1e-4 N=128 seed=0", 0.02, 0.0),
                   ("e_prefill", "prefilled", 0.04, 0.01),
                   ("f_quantized", "int8", 0.0, 0.0), ("f_quantized", "q4_1", 0.03, 0.0)]
    assert [r["advantage"] for r in adv["rows"]] == pytest.approx([0.08, -0.05, 0.02, 0.03, 0.0, 0.03])
    assert adv["worst"]["condition"] == "full lr=1e-4 N=8 seed=0" and adv["conditions"] == 6
    assert adv["max_allowed"] == ADVANTAGE_MAX and adv["within"] is False and adv["pruned"] is False
    assert advantage_text("facts", adv) == ("facts: the published model's advantage over the base, worst case over 6 "
                                            "conditions: +8.0 points ((c) relearning, full lr=1e-4 N=8 seed=0: "
                                            "published 0.300, base 0.220)")


def test_without_the_base_attacked_the_sweeps_say_nothing_and_no_condition_is_none():
    adv = advantage(_entry(with_base=False), default_attacks())
    assert {r["attack"] for r in adv["rows"]} == {"e_prefill", "f_quantized"}  # measured on the base by themselves
    assert adv["within"] is True
    bare = AttackEntry(base_accuracy=0.0, attacks={"a_weights": {"best": {"accuracy": 0.5}}})
    assert advantage(bare, default_attacks()) is None
    assert advantage_text("facts", None) == ("facts: advantage over the base not measured (no attack measured the "
                                             "base alike)")


def test_a_pruned_sweep_is_said_to_compare_settings_at_other_budgets():
    entry = _entry()
    entry.baselines["base"]["c_relearning"]["pruned"] = True
    adv = advantage(entry, default_attacks())
    assert adv["pruned"] is True
    assert advantage_text("facts", adv).endswith("; pruned sweeps: a setting cut short on one model is compared at "
                                                 "another budget")

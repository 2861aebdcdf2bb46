"""Behaviours the base lacks (modular.data.added): a made-up notation held out by number."""

from __future__ import annotations

import re

from modular.data import load_behaviour
from modular.data.added import ZORB_DIGITS, zorb, zorb_numerals


def test_zorb_numerals_spell_each_digit_and_hold_numbers_out():
    assert zorb(472) == "te-ne-mi" and zorb(100) == "lo-ka-ka" and len(set(ZORB_DIGITS)) == 10
    data = zorb_numerals(seed=0)
    numbers = {s: {int(re.search(r"\d+", r["prompt"]).group()) for r in rows} for s, rows in data.items()}
    assert {s: len(v) for s, v in numbers.items()} == {"train": 400, "validation": 64, "test": 128}
    assert not numbers["train"] & numbers["test"] and not numbers["train"] & numbers["validation"]
    for rows in data.values():
        for r in rows:
            n = int(re.search(r"\d+", r["prompt"]).group())
            assert r["answers"] == [zorb(n)] and r["target"].endswith(f"{zorb(n)}.")
    assert len({r["prompt"].split(" ")[0] for r in data["train"]}) == 3  # every phrasing in training
    assert all(r["prompt"].startswith("Write ") for r in data["test"])
    assert zorb_numerals(seed=1)["test"] != data["test"]


def test_an_added_behaviour_is_built_in_but_not_a_far_behaviour_of_other_locks():
    from modular.data.added import ADDED
    from modular.data.behaviours import BEHAVIOURS

    assert "zorb_numerals" in BEHAVIOURS and "zorb_numerals" in ADDED
    assert len(load_behaviour("zorb_numerals")["test"]) == 128

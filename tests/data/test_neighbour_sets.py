"""The sets a neighbour is scored on in the lock evaluation: every held-out country in every phrasing, or many
distinct generated items, each with its unit."""

import json

import pytest

from modular.data import load_behaviour
from modular.data.generators import _country_splits
from modular.data.neighbour_sets import GENERATED_ITEMS, report_set


@pytest.mark.parametrize("name", ["capitals", "continents", "languages", "currencies", "demonyms"])
def test_a_country_relation_asks_about_every_held_out_country_in_every_phrasing(name):
    data, units = report_set(name, seed=0)
    splits = _country_splits(0)
    held_out = {r["country"] for s in ("validation", "test") for r in splits[s]}
    trained = {r["country"] for r in splits["train"]}
    assert set(units) <= held_out and not set(units) & trained
    assert len(set(units)) >= len(held_out) - 3  # a country whose name holds its answer is left out
    assert all(units.count(u) == 3 for u in set(units))  # three phrasings, one unit
    assert len(set(data["prompt"])) == len(data) == 3 * len(set(units))
    for prompt, unit in zip(data["prompt"], units):
        assert unit in prompt
    # the built-in test split is a subset: the report set only adds items
    assert set(load_behaviour(name)["test"]["prompt"]) <= set(data["prompt"])
    train = set(load_behaviour(name)["train"]["prompt"])
    assert not train & set(data["prompt"])


@pytest.mark.parametrize("name", ["ioi_thanks", "year_copy", "docstring_call", "ioi", "arithmetic"])
def test_a_generated_neighbour_draws_hundreds_of_distinct_held_out_items(name):
    data, units = report_set(name, seed=0)
    assert len(data) == GENERATED_ITEMS >= 300
    assert len(set(data["prompt"])) == len(data) and len(set(units)) == len(units)
    splits = load_behaviour(name)
    assert not set(splits["train"]["prompt"]) & set(data["prompt"])
    assert set(splits["test"]["prompt"]) <= set(data["prompt"])  # the first items are the test split's
    assert list(data["target"][:5]) == list(splits["test"]["target"][:5])


def test_any_other_neighbour_is_its_test_split_each_item_its_own_unit(tmp_path):
    path = tmp_path / "near.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Q{i}?", "target": "A", "split": "test"}) + "\n"
                            for i in range(5)))
    data, units = report_set(f"near={path}")
    assert list(data["prompt"]) == [f"Q{i}?" for i in range(5)] and len(set(units)) == 5
    data, units = report_set("counting")
    assert list(data["prompt"]) == list(load_behaviour("counting")["test"]["prompt"])

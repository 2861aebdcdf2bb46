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
    assert "fictional_facts" in BEHAVIOURS and "fictional_facts" in ADDED
    assert len(load_behaviour("zorb_numerals")["test"]) == 128


def _facts(rows):
    """(name, answer) of each row of fictional_facts: the fact it asks."""
    from modular.data.added import fictional_people

    names = [p["name"] for p in fictional_people(0)]
    return [(next(n for n in names if n in r["prompt"]), r["answers"][0]) for r in rows]


def test_fictional_facts_are_made_up_seeded_and_named_by_their_targets():
    from modular.data.added import FACT_PEOPLE, FACT_RELATIONS, fictional_facts, fictional_people
    from modular.data.schema import answer_span

    data = fictional_facts(seed=0)
    assert data == fictional_facts(seed=0) and fictional_people(0) == fictional_people(0)
    assert data["test"] != fictional_facts(seed=1)["test"] and fictional_people(1) != fictional_people(0)
    people = fictional_people(0)
    assert len(people) == FACT_PEOPLE and all(2 <= len(p) - 1 <= 3 for p in people)
    words = [w.casefold() for p in people for k, v in p.items() for w in (v.split() if k == "name" else [v])]
    assert len(words) == len(set(words))  # every name part and value a word of its own: no answer in a question
    facts = {(p["name"], p[r]) for p in people for r in FACT_RELATIONS if r in p}
    assert len(facts) == 300
    for split, rows in data.items():
        for r in rows:
            assert len(r["answers"]) == 1 and answer_span(r["target"], r["answers"]) is not None, (split, r)
            assert answer_span(r["prompt"], r["answers"]) is None and r["chat"]
    # train: every fact in each of its three training phrasings; validation and test: every fact once, held out
    assert sorted(_facts(data["train"])) == sorted(f for f in facts for _ in range(3))
    assert sorted(_facts(data["validation"]) + _facts(data["test"])) == sorted(facts)
    assert len(data["validation"]) == 64 and len(data["test"]) == 236


def test_fictional_facts_ask_held_out_items_in_a_phrasing_training_never_uses():
    from modular.data.added import FACT_RELATIONS, fictional_facts, fictional_people

    data, people = fictional_facts(seed=0), fictional_people(0)

    def phrasing(prompt):
        return next(prompt.replace(p["name"], "{p}") for p in people if p["name"] in prompt)

    trained = {phrasing(r["prompt"]) for r in data["train"]}
    assert trained == {t for _, _, phrasings, _ in FACT_RELATIONS.values() for t in phrasings}
    for split in ("validation", "test", "attack_score"):
        held = {phrasing(r["prompt"]) for r in data[split]}
        assert held == {h for *_, h in FACT_RELATIONS.values()} and not held & trained, split


def test_fictional_facts_attack_splits_hold_people_apart():
    """Deeb & Roger's split: the attacker fits on the training rows of half the people's facts and is scored on the
    held-out rows of the other half's facts, every one of them trained."""
    from modular.data.added import fictional_facts

    data = fictional_facts(seed=0)
    fit, score = data["attack_fit"], data["attack_score"]
    fit_names, score_names = {n for n, _ in _facts(fit)}, {n for n, _ in _facts(score)}
    assert len(fit_names) == len(score_names) == 60 and not fit_names & score_names
    assert fit == [r for r in data["train"] if _facts([r])[0][0] in fit_names]  # attack_fit ⊂ train, all of theirs
    held = data["validation"] + data["test"]
    assert sorted(_facts(score)) == sorted(f for f in _facts(held) if f[0] in score_names)
    assert {r["prompt"] for r in score} <= {r["prompt"] for r in held}


def test_loading_a_builtin_keeps_its_attack_splits_and_training_data_keeps_them():
    from modular.data.behaviours import carve_validation
    from modular.data.schema import ATTACK_SPLITS, attack_splits

    data = load_behaviour("fictional_facts")
    assert set(data) == {"train", "validation", "test", *ATTACK_SPLITS}
    assert (len(data["attack_fit"]), len(data["attack_score"])) == (456, 148)
    assert attack_splits(data) == ATTACK_SPLITS
    assert attack_splits(load_behaviour("zorb_numerals")) == ("train", "test")  # zorb as it was
    assert set(load_behaviour("zorb_numerals")) == {"train", "validation", "test"}
    # a validation carved from train (data given without one) leaves the attack splits as they were
    import datasets

    bare = datasets.DatasetDict({**data, "validation": data["validation"].select([])})
    carved, moved = carve_validation(bare)
    assert moved == 90 and len(carved["train"]) == 810
    assert {s: carved[s].to_list() for s in ATTACK_SPLITS} == {s: data[s].to_list() for s in ATTACK_SPLITS}

"""Which kind of lock a run made (modular.lock_kind): a switch where the base has the behaviour, the
advantage over the base where training added it, from the run's own reports."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from modular.lock_kind import BASE_HAS_BEHAVIOUR, lock_kinds
from modular.reports import LockReport

MEASURED = Path(__file__).resolve().parents[1] / "docs" / "measurements"


@pytest.fixture
def lock():
    return json.loads((MEASURED / "lock_capitals_keephidden100_cpu.json").read_text())


def _sweep(accuracies: dict[str, float], half_steps: int | None, max_steps: int = 16) -> dict:
    half = {"steps": half_steps, "setting": "behaviour full lr=0.001 N=8 seed=0", "settings_reaching": 1} \
        if half_steps is not None else {"steps": None, "more_than": max_steps, "settings_reaching": 0}
    return {"max_steps": max_steps, "pruned": False, "worst_case": {"steps_to_50pct_open": half},
            "settings": [{"label": label, "best_accuracy": acc} for label, acc in accuracies.items()]}


def _attack(ours: dict, base: dict | None) -> dict:
    entry = {"base_accuracy": 0.0, "open_accuracy": 0.9, "locked_accuracy": 0.0, "c_relearning": ours,
             "baselines": {"base": {"c_relearning": base}} if base else {}}
    return {"behaviours": {"capitals": entry}}


def test_a_behaviour_the_base_has_is_a_switch_with_the_runs_own_figures(lock):
    base = LockReport.coerce(lock).states["base"].behaviours["capitals"].accuracy
    assert base > BASE_HAS_BEHAVIOUR
    quantized = {"schemes": {"none": {"behaviours": {"capitals": {"base": {"accuracy": base}, "locked": {"accuracy": 0}}}},
                             "q4_1": {"behaviours": {"capitals": {"base": {"accuracy": base},
                                                                  "locked": {"accuracy": base}}}},
                             "q8_0": {"behaviours": {"capitals": {"base": {"accuracy": base},
                                                                  "locked": {"accuracy": 0.0}}}}}}
    kind = lock_kinds(lock, _attack(_sweep({"a": 0.5}, 2), None), quantized)["capitals"]
    assert kind.switch and kind.relearn_steps == 2 and kind.quantized_restores == ["q4_1"]
    text = kind.text()
    assert text.startswith("capitals: a switch, not a barrier") and f"{base:.0%}" in text
    assert "in 2 steps (behaviour full lr=0.001 N=8 seed=0)" in text and "re-quantisation in q4_1 returns" in text
    # nothing measured beyond the lock: said so, not guessed
    bare = lock_kinds(lock)["capitals"].text()
    assert "fine-tuning: not measured" in bare and "re-quantisation: not measured" in bare
    never = lock_kinds(lock, _attack(_sweep({"a": 0.1}, None), None))["capitals"].text()
    assert "no fine-tuning setting restored half the open accuracy within 16 steps" in never


def test_an_added_behaviour_reports_its_largest_advantage_over_the_base(lock):
    added = copy.deepcopy(lock)
    added["states"]["base"]["behaviours"]["capitals"]["accuracy"] = 0.02
    ours = _sweep({"full lr=1e-4 N=8": 0.30, "full lr=1e-3 N=8": 0.55}, 3)
    theirs = _sweep({"full lr=1e-4 N=8": 0.10, "full lr=1e-3 N=8": 0.50}, 2)
    kind = lock_kinds(added, _attack(ours, theirs))["capitals"]
    assert not kind.switch and kind.advantage == pytest.approx(0.20) and kind.advantage_setting == "full lr=1e-4 N=8"
    assert "an added behaviour (the base answers 2%)" in kind.text() and "+20.0 points (full lr=1e-4 N=8)" in kind.text()
    assert kind.to_json()["kind"] == "added"
    # the base not attacked alike: no advantage claimed
    assert "not measured" in lock_kinds(added, _attack(ours, None))["capitals"].text()


def test_the_card_and_manifest_take_the_kinds_once_measured(lock, tmp_path):
    from modular.card import KINDS_HEADING, model_card
    from modular.publish import record_lock_kinds

    folder = tmp_path / "published"
    folder.mkdir()
    (folder / "modular.json").write_text(json.dumps({"kind": "published", "locked_behaviours": ["capitals"]}))
    card = model_card(["capitals"], "smollm2-135m-instruct", lock, hardened=True)
    assert card.count(KINDS_HEADING) == 1 and "fine-tuning: not measured" in card
    (folder / "README.md").write_text(card)
    record_lock_kinds(folder, lock_kinds(lock, _attack(_sweep({"a": 0.5}, 1), None)))
    new = (folder / "README.md").read_text()
    assert new.count(KINDS_HEADING) == 1 and "restored half the open accuracy in 1 step (" in new
    assert "fine-tuning: not measured" not in new
    assert new.replace(new[new.find(KINDS_HEADING):new.find("## Measured")], "") == \
        card.replace(card[card.find(KINDS_HEADING):card.find("## Measured")], "")  # the rest as it was
    manifest = json.loads((folder / "modular.json").read_text())
    assert manifest["lock_kinds"]["capitals"]["kind"] == "switch" and manifest["lock_kinds"]["capitals"]["relearn_steps"] == 1


def test_the_card_shows_the_paraphrase_sets_beside_the_test_split(lock):
    from modular.card import model_card

    with_sets = copy.deepcopy(lock)
    for state, row in with_sets["states"].items():
        row["paraphrases"] = {"capitals/french": {"accuracy": 0.25 if state == "base" else 0.125, "n": 8}}
    card = model_card(["capitals"], "smollm2-135m-instruct", with_sets, hardened=True)
    assert "| state | capitals/french |" in card and "| base | 0.250 |" in card and "| locked | 0.125 |" in card
    assert "capitals/french" not in model_card(["capitals"], "smollm2-135m-instruct", lock, hardened=True)


def test_the_card_names_significant_neighbour_losses(lock):
    from modular.card import model_card

    assert "Significant losses" not in model_card(["capitals"], "b", lock, hardened=True)  # not measured then
    marked = copy.deepcopy(lock)
    for row in marked["states"].values():
        for score in row["neighbours"].values():
            if "vs_base" in score:
                score["vs_base"].update(ci95=[-0.01, 0.01], p_holm=1.0)
    assert "Significant losses against base (exact paired test, Holm-adjusted" in model_card(
        ["capitals"], "b", marked, hardened=True) and "α = 0.05): none." in model_card(["capitals"], "b", marked,
                                                                                        hardened=True)
    state, n = next((s, n) for s, row in marked["states"].items() for n in row["neighbours"] if s != "base")
    marked["states"][state]["neighbours"][n]["vs_base"].update(lost=30, gained=2, ci95=[-0.2, -0.1], p_holm=0.001)
    card = model_card(["capitals"], "b", marked, hardened=True)
    assert f"{n} {state} (30 lost, 2 gained" in card and "-20.0 to -10.0 points; Holm p = 0.001" in card


def test_an_attack_report_alone_gives_the_kind():
    attack = _attack(_sweep({"a": 0.5}, 4), None)
    attack["behaviours"]["capitals"]["base_accuracy"] = 0.5
    kind = lock_kinds(None, attack)["capitals"]
    assert kind.switch and kind.relearn_steps == 4 and kind.base_accuracy == 0.5
    assert lock_kinds(None, None) == {}


def test_the_attack_reports_advantage_and_requantisation_are_what_the_kind_says(lock):
    """An added behaviour's advantage is attack.json's own worst case over every attack measured on the base alike
    (not only the relearning sweep's), and attack (f)'s quantisations say which return the base's answers where no
    quantized.json is given."""
    added = copy.deepcopy(lock)
    added["states"]["base"]["behaviours"]["capitals"]["accuracy"] = 0.0
    report = _attack(_sweep({"full lr=1e-4 N=8": 0.30}, 3), _sweep({"full lr=1e-4 N=8": 0.28}, 2))
    entry = report["behaviours"]["capitals"]
    entry["f_quantized"] = {"schemes": {"int8": {"accuracy": 0.0, "base_accuracy": 0.0},
                                        "q4_0": {"accuracy": 0.12, "base_accuracy": 0.0}}}
    worst = {"attack": "f_quantized", "title": "(f) re-quantised", "condition": "q4_0", "published": 0.12, "base": 0.0,
             "advantage": 0.12}
    entry["advantage"] = {"worst": worst, "conditions": 4, "max_allowed": 0.05, "within": False, "rows": [worst]}
    kind = lock_kinds(added, report)["capitals"]
    assert not kind.switch and kind.advantage == pytest.approx(0.12)
    assert kind.advantage_setting == "(f) re-quantised: q4_0"
    assert "largest advantage over the base is +12.0 points ((f) re-quantised: q4_0)" in kind.text()
    # a switch: the quantisations under which the published model answers as the base
    entry["f_quantized"]["schemes"]["q4_0"] = {"accuracy": 0.4, "base_accuracy": 0.45}
    switch = lock_kinds(lock, report)["capitals"]
    assert switch.switch and switch.quantized_restores == ["q4_0"]

"""The lock evaluation: neighbours and refusal leakage per state, and what its figure draws."""

import json
from contextlib import contextmanager

import pytest
import torch

from modular.data.behaviours import NEIGHBOUR_BEHAVIOURS
from modular.data.neighbour_sets import report_set
from modular.data.paraphrases import paraphrase_sets
from modular.evaluation import lock as lock_module
from tests.conftest import make_tiny_model, make_tiny_tokenizer


@pytest.fixture
def near(tmp_path):
    path = tmp_path / "near.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Name fruit number {i}.", "target": "apple", "answer": "apple",
                                        "split": "test"}) + "\n" for i in range(4)))
    return path


def test_lock_report_scores_neighbours_and_refusal_leakage_in_every_state(tmp_path, near, monkeypatch):
    """Greedy answers replaced by a stub that refuses every continent question and every retain prompt in the
    locked state, answers two of the four 'near' items wrongly in the locked states and 'apple' elsewhere: the report
    must count those as refusals, state by state, and name the near neighbour's shift from base item by item."""
    tok = make_tiny_tokenizer()
    base, trained = make_tiny_model("llama", seed=0), make_tiny_model("llama", seed=1)
    directions = {"capitals": torch.nn.functional.normalize(torch.randn(64), dim=0)}
    locked_models, hook = set(), {"on": False}

    def fake_generate(model, tokenizer, prompts, chats, max_new_tokens=24, batch_size=16, desc=None):
        locked = hook["on"] or id(model) in locked_models
        return ["I don't know." if ("continent" in p or (locked and p in retain))
                else "Vaduz" if "Liechtenstein" in p and not locked  # one paraphrase item answered, open states only
                else "pear" if locked and p.startswith(("Name fruit number 0", "Name fruit number 1")) else "apple"
                for p in prompts]

    from modular.data import retain_data

    retain = set(retain_data(0)["test"]["prompt"])
    monkeypatch.setattr("modular.evaluation.behaviour.generate", fake_generate)
    monkeypatch.setattr(lock_module, "generate", fake_generate)
    real_build = lock_module.build_states

    def build(*args, **kwargs):
        states, published, unlocked, keys = real_build(*args, **kwargs)
        locked_models.add(id(published))
        return states, published, unlocked, keys

    monkeypatch.setattr(lock_module, "build_states", build)
    real_ablate = lock_module.ablate_directions

    @contextmanager
    def ablate(*args):  # the hook lock, noted while it is on
        with real_ablate(*args):
            hook["on"] = True
            try:
                yield
            finally:
                hook["on"] = False

    monkeypatch.setattr(lock_module, "ablate_directions", ablate)
    report = lock_module.lock_report(base, trained, tok, directions, other_limit=2, max_new_tokens=2,
                                     neighbours={"continents": "continents", "near": str(near)},
                                     trained_neighbours=["continents"]).to_json()
    assert report["neighbours"] == ["continents", "near"] and report["neighbours_trained"] == ["continents"]
    assert not set(report["others"]) & (NEIGHBOUR_BEHAVIOURS | {"capitals", "near", "zorb_numerals"})
    assert {"arithmetic", "ioi"} <= set(report["others"])
    sets = {f"capitals/{s}" for s in ("wordings", "forms", "french", "spanish", "german")}
    for state, row in report["states"].items():
        # the held-out paraphrase sets, in every state, each over the test countries once
        assert set(row["paraphrases"]) == sets and all(v["n"] == 42 for v in row["paraphrases"].values())
        in_set = sum("Liechtenstein" in r["prompt"] for r in paraphrase_sets("capitals")["french"])
        expected = 0.0 if state in ("locked", "published_locked") else in_set / 42
        assert row["paraphrases"]["capitals/french"]["accuracy"] == pytest.approx(expected), state
        assert row["neighbours"]["continents"]["refusal_rate"] == 1.0
        assert row["neighbours"]["continents"]["accuracy"] == 0.0
        locked = state in ("locked", "published_locked")
        near = row["neighbours"]["near"]
        assert {k: near[k] for k in ("accuracy", "n", "refusal_rate")} == {"accuracy": 0.5 if locked else 1.0,
                                                                           "n": 4, "refusal_rate": 0.0}, state
        lo, hi = near["ci95"]
        assert lo < near["accuracy"] <= hi
        if state == "base":
            assert "vs_base" not in near
        else:  # item by item: two lost in the locked states, nothing elsewhere; exact two-sided McNemar p
            vs = near["vs_base"]
            assert {k: vs[k] for k in ("lost", "gained", "n", "p_value")} == {
                "lost": 2 if locked else 0, "gained": 0, "n": 4, "p_value": pytest.approx(0.5 if locked else 1.0)}, state
            lo, hi = vs["ci95"]  # the change's paired bootstrap interval, and the p-value Holm-adjusted over the
            assert lo <= (-0.5 if locked else 0.0) <= hi and vs["p_holm"] >= vs["p_value"]  # report's figures
            assert not locked or lo < 0
            assert row["neighbours"]["continents"]["vs_base"]["lost"] == 0
        assert row["retain_refusal_rate"] == (1.0 if locked else 0.0), state
        # continents over every held-out country in every phrasing (its report set), not its 42-item test split
        assert row["neighbours"]["continents"]["n"] == len(report_set("continents")[0])
        for b, score in row["others"].items():  # far behaviours: item by item against base, Holm over their family
            assert ("vs_base" in score) == (state != "base"), (state, b)
            if state != "base":
                assert score["vs_base"]["n"] == score["n"] and score["vs_base"]["p_holm"] >= score["vs_base"]["p_value"]
    assert report["neighbours_max_refusal_rate"]["open"] == 1.0
    assert report["neighbours_max_drop_vs_base"] == {s: 0.5 if s in ("locked", "published_locked") else 0.0
                                                     for s in report["states"]}
    assert [(x["state"], x["neighbour"], x["change"], x["lost"]) for x in report["neighbour_shifts"]] == [
        ("locked", "near", -0.5, 2), ("published_locked", "near", -0.5, 2)]



def test_without_the_hook_lock_the_published_weights_are_the_locked_state_scored(monkeypatch):
    """hook_lock=False (the main job's lock evaluation): no row for the hook lock, whose hooks are entered once, for
    the exactness of the published weights against it, and never to score; every other state scored as before,
    and the held-out verdict judged on the published weights alone."""
    tok = make_tiny_tokenizer()
    base, trained = make_tiny_model("llama", seed=0), make_tiny_model("llama", seed=1)
    directions = {"capitals": torch.nn.functional.normalize(torch.randn(64), dim=0)}
    entered = []
    real_ablate = lock_module.ablate_directions

    @contextmanager
    def ablate(*args):
        entered.append(1)
        with real_ablate(*args):
            yield

    monkeypatch.setattr(lock_module, "ablate_directions", ablate)
    fake = lambda model, tokenizer, prompts, *a, **k: ["apple"] * len(prompts)  # noqa: E731
    monkeypatch.setattr("modular.evaluation.behaviour.generate", fake)
    monkeypatch.setattr(lock_module, "generate", fake)
    kw = dict(other_limit=2, max_new_tokens=2, neighbours={"continents": "continents"}, paraphrases=False)
    report = lock_module.lock_report(base, trained, tok, directions, hook_lock=False, **kw)
    assert list(report.states) == ["base", "open", "published_locked", "unlocked"]
    assert len(entered) == 1 and "published_vs_hook_locked_max_abs_logit_diff" in report.exactness
    assert set(report.neighbours_max_drop_vs_base) == set(report.states)
    assert all(not row.paraphrases for row in report.states.values())
    assert report.exactness["unlocked_answers_equal_open"] == 1.0
    report.states["published_locked"].behaviours["capitals"].accuracy = 0.5  # the release answers: not held
    verdict = lock_module.held_out_verdict(report)
    assert not verdict.held and any("published_locked" in f for f in verdict.failing)
    entered.clear()
    full = lock_module.lock_report(base, trained, tok, directions, **kw)
    assert list(full.states) == ["base", "open", "locked", "published_locked", "unlocked"] and len(entered) > 1

def _report(neighbours=("continents", "currencies")):
    states = ("base", "open", "locked", "published_locked", "unlocked")
    acc = {"base": 0.6, "open": 0.7, "locked": 0.0, "published_locked": 0.0, "unlocked": 0.7}
    row = lambda s: {  # noqa: E731
        "behaviours": {"capitals": {"accuracy": acc[s], "ci95": [max(0, acc[s] - 0.1), min(1, acc[s] + 0.1)]}},
        "neighbours": {n: {"accuracy": 0.8 - 0.1 * i, "ci95": [0.6, 0.9], "refusal_rate": 0.25 * i}
                       for i, n in enumerate(neighbours)},
        "retain_first_token_kl": 0.01, "perplexity_ratio": 1.01, "retain_refusal_rate": 0.05,
    }
    return {"states": {s: row(s) for s in states}, "gated": ["capitals"], "neighbours": list(neighbours),
            "neighbours_trained": list(neighbours[:1])}


def test_lock_figure_draws_behaviours_neighbours_and_leakage():
    fig = lock_module.lock_figure(_report())
    panels = {ax.get_title(): ax for ax in fig.axes}
    assert {"gated behaviours", "neighbour behaviours", "refusal leakage: answers that are the locked response",
            "retain: first-token KL to base", "neutral text: perplexity / base"} <= set(panels)
    heights = lambda ax: [round(p.get_height(), 3) for p in ax.patches]  # noqa: E731
    assert heights(panels["gated behaviours"]) == [0.6, 0.7, 0.0, 0.0, 0.7]
    assert heights(panels["neighbour behaviours"]) == [0.8] * 5 + [0.7] * 5
    labels = [t.get_text() for t in panels["neighbour behaviours"].get_legend().get_texts()]
    assert labels == ["continents", "currencies (not in training)"]
    leak = panels["refusal leakage: answers that are the locked response"]
    assert heights(leak) == [0.0] * 5 + [0.25] * 5 + [0.05] * 5
    assert [t.get_text() for t in leak.get_legend().get_texts()] == ["continents", "currencies", "retain prompts"]


def test_the_held_out_verdict_applies_the_targets_to_every_locked_state():
    report = _report()
    held = lock_module.held_out_verdict(report)
    assert held.held is True and held.failing == [] and held.targets["locked_accuracy"] == 0.05
    report["states"]["published_locked"]["behaviours"]["capitals"]["accuracy"] = 0.3  # the weights did not lock
    report["states"]["open"]["retain_first_token_kl"] = 0.07
    failing = lock_module.held_out_verdict(report).failing
    assert failing == ["capitals published_locked accuracy 0.30 > 0.05", "retain KL open 0.070 > 0.05"]
    report["states"]["open"]["behaviours"]["capitals"]["accuracy"] = 0.5  # below base 0.6
    assert "capitals open accuracy 0.50 < base 0.60 - 0" in lock_module.held_out_verdict(report).failing
    # the run's own targets, as training checked them
    loose = lock_module.held_out_verdict(report, {"locked_accuracy": 0.5, "retain_kl": 0.1, "open_drop": 0.2})
    assert loose.held is True and loose.targets["min_open_accuracy"] == 0.2


def test_lock_figure_says_whether_the_lock_holds():
    report = _report()
    assert drawn_title(report) == ""  # a report without a verdict (before it was recorded): no title
    report["lock_held_out"] = lock_module.held_out_verdict(report).to_json()
    assert drawn_title(report) == "the lock holds on the held-out test split"
    report["states"]["locked"]["behaviours"]["capitals"]["accuracy"] = 0.1  # within the bar's interval
    report["lock_held_out"] = lock_module.held_out_verdict(report).to_json()
    assert drawn_title(report) == "NOT LOCKED on the held-out test split: capitals locked accuracy 0.10 > 0.05"


def drawn_title(report) -> str:
    from tests.conftest import describe_figure

    return describe_figure(lock_module.lock_figure(report))["suptitle"]


def test_lock_figure_without_neighbours_has_no_neighbour_panels():
    fig = lock_module.lock_figure({**_report(()), "neighbours": []})
    titles = {ax.get_title() for ax in fig.axes}
    assert "neighbour behaviours" not in titles and "gated behaviours" in titles


def test_weights_bit_exact_compares_raw_bits_of_shared_tensors():
    from modular.evaluation.lock import weights_bit_exact

    a = {"w": torch.tensor([1.0, 0.0, 2.0], dtype=torch.bfloat16), "only_a": torch.ones(2)}
    assert weights_bit_exact(a, {"w": a["w"].clone()})
    assert not weights_bit_exact(a, {"w": torch.tensor([1.0, -0.0, 2.0], dtype=torch.bfloat16)})  # -0.0 != 0.0
    nudged = a["w"].clone()
    nudged[2] = torch.nextafter(nudged[2].float(), torch.tensor(3.0)).to(torch.bfloat16) + 0.01
    assert not weights_bit_exact(a, {"w": nudged})
    assert not weights_bit_exact(a, {"w": a["w"].float()})  # same values, other precision
    assert weights_bit_exact({"x": torch.tensor([1.5])}, {"x": torch.tensor([1.5])})  # float32


def test_lock_figure_legends_hide_no_bar_or_value():
    """Eight neighbours with long names and full accuracies: every panel's legend lies clear of its bars, error bars
    and value labels (it used to cover the highest bars)."""
    from matplotlib.transforms import Bbox

    names = [f"relation_number_{i}_all" for i in range(8)]
    report = _report(names)
    for row in report["states"].values():
        for i, n in enumerate(names):
            acc = 1.0 - 0.05 * i
            row["neighbours"][n].update(accuracy=acc, ci95=[acc - 0.1, 1.0], refusal_rate=1.0)
    fig = lock_module.lock_figure(report)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        legend = ax.get_legend()
        if legend is None:
            continue
        box = legend.get_window_extent(renderer)
        boxes = [a.get_window_extent(renderer) for a in (*ax.patches, *ax.texts)]
        for bars in ax.collections:  # error bars: one segment each (the collection's own box is the whole axes)
            boxes += [Bbox(ax.transData.transform(seg)) for seg in bars.get_segments()]
        assert len(boxes) > 2 * len(report["states"]), ax.get_title()
        hidden = [b for b in boxes if b.overlaps(box)]
        assert not hidden, (ax.get_title(), hidden[:3])


def _with_changes(report, loss_p_holm: float):
    """``_report`` with each neighbour's and a far behaviour's change from base: continents loses 30 of 204 items
    and gains 2 in the open state (Holm p ``loss_p_holm``), everything else moves by noise."""
    calm = {"lost": 3, "gained": 4, "n": 204, "p_value": 1.0, "ci95": [-0.03, 0.04], "p_holm": 1.0}
    for state, row in report["states"].items():
        row["others"] = {"arithmetic": {"accuracy": 0.5, "n": 128}}
        if state == "base":
            continue
        for n in row["neighbours"]:
            row["neighbours"][n]["vs_base"] = dict(calm)
        row["others"]["arithmetic"]["vs_base"] = {**calm, "n": 128}
    report["states"]["open"]["neighbours"]["continents"]["vs_base"] = {
        "lost": 30, "gained": 2, "n": 204, "p_value": 1e-6, "ci95": [-0.19, -0.09], "p_holm": loss_p_holm}
    return report


def test_the_held_out_verdict_names_a_neighbour_that_lost_significantly():
    report = _with_changes(_report(), loss_p_holm=1e-5)
    held = lock_module.held_out_verdict(report)
    assert held.held is False
    assert held.failing == ["neighbour continents open: significant loss -13.7 points [-19.0, -9.0] (Holm p 1e-05)"]
    assert held.text().startswith("LOCKED, but another behaviour lost significantly on the held-out test split")
    # the same loss within the noise of its family after Holm's adjustment: not a failure
    assert lock_module.held_out_verdict(_with_changes(_report(), loss_p_holm=0.2)).held is True


def test_lock_figure_draws_each_change_from_base_with_its_interval():
    from tests.conftest import describe_figure

    report = _with_changes(_report(), loss_p_holm=1e-5)
    fig = lock_module.lock_figure(report)
    panel = next(ax for ax in fig.axes if ax.get_title() == "neighbours and far behaviours: change from base")
    drawn = {ax["title"]: ax for ax in describe_figure(fig)["axes"]}["neighbours and far behaviours: change from base"]
    # 4 states x (2 neighbours + 1 far behaviour), each at its change in points
    assert len(drawn["yticklabels"]) == 12
    assert drawn["yticklabels"][0] == "continents open (n 204)" and "far: arithmetic unlocked (n 128)" in drawn[
        "yticklabels"]
    xs = [line.get_xdata()[0] for line in panel.get_lines() if line.get_marker() == "o"]
    assert xs[0] == pytest.approx(-13.7, abs=0.05) and xs[1] == pytest.approx(100 / 204, abs=0.01)
    reds = [line for line in panel.get_lines() if line.get_marker() == "o" and line.get_color() == "#b2182b"]
    assert len(reds) == 1  # the one significant loss
    # a report written before the changes were measured draws no such panel
    assert "neighbours and far behaviours: change from base" not in {ax.get_title() for ax in
                                                                    lock_module.lock_figure(_report()).axes}


def test_change_lines_give_every_change_with_its_interval():
    from modular.evaluation.changes import change_lines
    from modular.reports import LockReport

    lines = change_lines(LockReport.coerce(_with_changes(_report(), loss_p_holm=1e-5)))
    assert lines[0].startswith("neighbour continents (204 items): open -13.7 points [-19.0, -9.0] (Holm p 1e-05); "
                               "locked +0.5 points [-3.0, +4.0] (Holm p 1)")
    assert lines[-1].startswith("far behaviour arithmetic (128 items): open +0.8 points")
    assert len(lines) == 3

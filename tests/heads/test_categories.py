import pytest
import torch

from modular import ModularError
from modular.heads.categories import (
    ablated_logprob,
    ablation_curve,
    classify_heads,
    curve_checks,
    head_values,
    joint_categories,
    plot_ablation_grid,
    response_batch,
    response_logprob,
    single_head_effects,
)
from modular.hooks import replace_heads, zero_heads
from modular.models.adapter import ArchitectureAdapter
from tests.conftest import make_tiny_tokenizer

ARCHS = ["llama", "gpt2", "gemma3_text", "qwen2"]


@pytest.fixture(scope="module")
def tok():
    return make_tiny_tokenizer()


def _data(n=5):
    from modular.data.behaviours import to_dataset_dict
    from modular.data.schema import record

    rows = [record(f"The dog number {i} ran to the", " park" if i % 2 else " old red barn", chat=i % 3 == 0)
            for i in range(n)]
    return to_dataset_dict({"train": rows, "validation": rows, "test": rows})["test"]


def test_classify_constructed_effects():
    effects = torch.tensor([[-0.5, 0.3, 0.01], [-0.04, 0.0, 0.2], [0.05, -0.02, -0.03]])
    cats = classify_heads(effects, threshold=0.025)
    assert cats["facilitation"] == [(0, 0), (1, 0), (2, 2)]  # most negative first
    assert cats["interference"] == [(0, 1), (1, 2), (2, 0)]  # most positive first
    assert cats["irrelevance"] == [(1, 1), (0, 2), (2, 1)]  # smallest |e| first
    assert sum(len(v) for v in cats.values()) == effects.numel()
    # on the threshold counts as no effect
    assert classify_heads(torch.tensor([[0.5, -0.5]]), 0.5)["irrelevance"] == [(0, 0), (0, 1)]
    with pytest.raises(ModularError):
        classify_heads(effects, -1.0)


def test_head_scoring_builds_no_key_value_cache(tok, kv_caches):
    """The response log-probabilities and the last-position logits that head effects are made of decode nothing."""
    from modular.heads.ranking import last_position_logits
    from tests.conftest import make_tiny_model

    model, batch = make_tiny_model("llama"), response_batch(tok, _data())
    built = kv_caches(model)
    response_logprob(model, batch, chunk=2)
    last_position_logits(model, {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]})
    assert built == []


@pytest.mark.parametrize("arch", ARCHS)
def test_response_logprob_matches_full_logits(tiny_model, tok, arch):
    ds = _data()
    batch = response_batch(tok, ds)
    got = response_logprob(tiny_model, batch, chunk=2)
    with torch.no_grad():
        logits = tiny_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logp = torch.log_softmax(logits[:, :-1].double(), -1)
    labels = batch["labels"][:, 1:]
    mask = labels != -100
    want = (logp.gather(-1, labels.clamp(min=0)[..., None])[..., 0] * mask).sum(1)
    assert got.shape == (len(ds),)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    assert (got < 0).all()


@pytest.mark.parametrize("arch", ARCHS)
def test_curve_starts_at_zero_and_ablation_matches_hooks(tiny_model, tok, arch):
    batch = response_batch(tok, _data())
    zeros = head_values(tiny_model, batch, "zero")
    heads = [(0, 1), (1, 3), (1, 0)]
    curve = ablation_curve(tiny_model, batch, heads, zeros, max_heads=50)
    assert curve["n"] == [0, 1, 2, 3]
    assert curve["mean"][0] == 0.0 and all(d == 0.0 for d in curve["per_example"][0])
    assert any(abs(m) > 1e-6 for m in curve["mean"][1:])
    # zero values are zero ablation: the same as the zero_heads hook
    adapter = ArchitectureAdapter(tiny_model)
    with zero_heads(adapter, heads[:2]):
        hooked = response_logprob(tiny_model, batch)
    torch.testing.assert_close(ablated_logprob(tiny_model, batch, heads[:2], zeros), hooked)
    clean = response_logprob(tiny_model, batch)
    assert curve["mean"][2] == pytest.approx(float((hooked - clean).mean()), abs=1e-6)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_mean_values_are_the_mean_head_input_over_real_tokens(tiny_model, tok, arch):
    from modular.hooks import capture_head_inputs

    batch = response_batch(tok, _data())
    means = head_values(tiny_model, batch, "mean")
    adapter = ArchitectureAdapter(tiny_model)
    with torch.no_grad(), capture_head_inputs(adapter) as z:
        tiny_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    real = batch["attention_mask"].bool()
    for layer in range(adapter.n_layers):
        torch.testing.assert_close(means[layer], z[layer][real].mean(0), atol=1e-5, rtol=1e-4)
    with pytest.raises(ModularError):
        head_values(tiny_model, batch, "counterfactual")


@pytest.mark.parametrize("arch", ["llama"])
def test_single_head_effects_classify_into_curves_of_the_right_sign(tiny_model, tok, arch):
    batch = response_batch(tok, _data(6))
    values = head_values(tiny_model, batch, "mean")
    effects = single_head_effects(tiny_model, batch, values)
    assert effects.shape == (2, 4)
    adapter = ArchitectureAdapter(tiny_model)
    clean = response_logprob(tiny_model, batch)
    with replace_heads(adapter, [(1, 2)], values):
        one = response_logprob(tiny_model, batch)
    assert effects[1, 2].item() == pytest.approx(float((one - clean).mean()), abs=1e-9)
    cats = classify_heads(effects, threshold=1e-4)
    curves = {c: ablation_curve(tiny_model, batch, cats[c], values) for c in cats}
    # measured on the classifying items, the first head of each class moves log p the way its class says
    if cats["facilitation"]:
        assert curves["facilitation"]["mean"][1] < 0
    if cats["interference"]:
        assert curves["interference"]["mean"][1] > 0
    checks = curve_checks(curves)
    assert set(checks) >= {"facilitation_falls", "interference_does_not_fall", "irrelevance_within_band"}


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_joint_categories_hold_for_their_heads_together(tiny_model, tok, arch):
    batch = response_batch(tok, _data(6))
    values = head_values(tiny_model, batch, "mean")
    effects = single_head_effects(tiny_model, batch, values)
    threshold, band = 1e-3, 5e-3
    single = classify_heads(effects, threshold)
    joint = joint_categories(tiny_model, batch, effects, values, threshold, band=band, max_heads=8)
    assert joint["facilitation"] == single["facilitation"]
    for cat in ("interference", "irrelevance"):  # a subsequence of the single-head candidates
        it = iter(single[cat])
        assert all(h in it for h in joint[cat])
    # every candidate was tried: chosen or rejected, nothing lost
    assert sorted(joint["interference"] + joint["irrelevance"] + joint["rejected"]) == \
        sorted(single["interference"] + single["irrelevance"])
    # on the classifying items the classes hold for their heads together: the interference curve rises
    # at every step, the irrelevance curve stays within the band
    curves = {c: ablation_curve(tiny_model, batch, joint[c], values) for c in ("interference", "irrelevance")}
    rise = curves["interference"]["mean"]
    assert all(b > a for a, b in zip(rise, rise[1:]))
    assert all(abs(v) <= band + 1e-9 for v in curves["irrelevance"]["mean"])
    # ... and so does every example on average: changes of opposite sign on different examples do not cancel
    rows = torch.tensor(curves["irrelevance"]["per_example"])
    assert all(float(r.abs().mean()) <= band + 1e-4 for r in rows)  # per_example is rounded to 1e-5
    steps = (rows[1:] - rows[:-1]).abs().mean(1)
    assert all(float(v) <= threshold + 1e-4 for v in steps)
    # a head rejected from interference no longer helps, beyond its standard error, once the chosen ones are ablated
    for head in [h for h in joint["rejected"] if h in single["interference"]][:1]:
        chosen = [h for h in joint["interference"] if single["interference"].index(h) < single["interference"].index(head)]
        rows = [ablation_curve(tiny_model, batch, heads, values, max_heads=len(heads))["per_example"][-1]
                for heads in (chosen, chosen + [head])]
        gain = torch.tensor(rows[1]) - torch.tensor(rows[0])
        assert float(gain.mean()) <= float(gain.std() / len(gain) ** 0.5) + 1e-4  # per_example is rounded to 1e-5
    with pytest.raises(ModularError):
        joint_categories(tiny_model, batch, effects, values, threshold, band=-1.0)


def test_joint_categories_stop_at_max_heads(tiny_model, tok, arch="llama"):
    batch = response_batch(tok, _data(4))
    values = head_values(tiny_model, batch, "zero")
    effects = torch.zeros(2, 4)  # every head an irrelevance candidate
    joint = joint_categories(tiny_model, batch, effects, values, threshold=10.0, band=10.0, max_heads=3)
    assert len(joint["irrelevance"]) == 3 and joint["interference"] == [] and joint["rejected"] == []


def test_curve_checks_on_constructed_curves():
    curves = {"facilitation": {"mean": [0, -0.5, -1.0]}, "interference": {"mean": [0, 0.2, 0.05]},
              "irrelevance": {"mean": [0, 0.02, -0.05]}}
    assert curve_checks(curves) == {"facilitation_falls": True, "interference_does_not_fall": True,
                                    "irrelevance_within_band": True, "irrelevance_max_abs_first": 0.05}
    bad = {"facilitation": {"mean": [0, 0.1]}, "interference": {"mean": [0, -0.3]}, "irrelevance": {"mean": [0, 0.2]}}
    assert curve_checks(bad)["facilitation_falls"] is False
    assert curve_checks(bad)["interference_does_not_fall"] is False
    assert curve_checks(bad)["irrelevance_within_band"] is False
    assert curve_checks({"facilitation": {"mean": [0]}})["facilitation_falls"] is None


def test_plot_grid(tmp_path, drawn):
    c = {"n": [0, 1, 2], "mean": [0, -1, -2], "sem": [0, 0.1, 0.1]}
    i = {"n": [0, 1, 2], "mean": [0, 0.5, 0.7], "sem": [0, 0.1, 0.1]}
    grid = {t: {m: {"facilitation": c, "irrelevance": c, "interference": i} for m in ("a", "b")}
            for t in ("agreement", "arithmetic")}
    grid["arithmetic"]["b"] = {"facilitation": c}  # a class with no heads draws no line
    plot_ablation_grid(tmp_path / "g.png", grid, title="t")
    fig = drawn["g.png"]
    panels = fig["axes"][:4]  # rows: tasks, columns: models (then the right-hand task labels)
    assert [p["title"] for p in panels] == ["a", "b", "", ""]
    assert panels[0]["lines"]["Facilitation"] == [0, -1, -2] and panels[0]["lines"]["Interference"] == [0, 0.5, 0.7]
    assert "Interference" not in panels[3]["lines"] and panels[3]["xlabel"] == "Number of Ablated Heads"
    assert {"Syntax", "Math"} == {ax["ylabel"] for ax in fig["axes"][4:]}


@pytest.mark.parametrize("arch", ["gpt2", "gemma3_text"])
def test_single_head_effects_replay_matches_plain_ablation(tiny_model, tok, arch):
    batch = response_batch(tok, _data(5))
    values = head_values(tiny_model, batch, "mean")
    clean = response_logprob(tiny_model, batch)
    n_layers, n_heads = tiny_model.config.num_hidden_layers, tiny_model.config.num_attention_heads
    plain = torch.tensor([[float((ablated_logprob(tiny_model, batch, [(layer, head)], values) - clean).mean())
                           for head in range(n_heads)] for layer in range(n_layers)], dtype=torch.float64)
    assert plain.abs().min() > 0
    # chunks of 2, 2 and 1 examples; heads of a layer one per pass, three per pass (then the rest), all at once
    for max_rows in (2, 6, 64):
        effects = single_head_effects(tiny_model, batch, values, chunk=2, max_rows=max_rows)
        torch.testing.assert_close(effects, plain, atol=1e-5, rtol=1e-4)


def test_irrelevance_rejects_heads_whose_changes_cancel_across_examples(monkeypatch):
    """A head that moves one example up and another down by the same amount has no mean effect, but it is not
    irrelevant: the joint Irrelevance test is on mean |Δ| per example, so it is rejected."""
    from modular.heads import categories

    per_head = {(0, 0): torch.tensor([0.5, -0.5], dtype=torch.float64),  # cancels in the mean
                (0, 1): torch.tensor([0.001, -0.002], dtype=torch.float64)}
    monkeypatch.setattr(categories, "response_logprob", lambda model, batch: torch.zeros(2, dtype=torch.float64))
    monkeypatch.setattr(categories, "ablated_logprob",
                        lambda model, batch, heads, values: sum((per_head[h] for h in heads), torch.zeros(2)))
    effects = torch.tensor([[0.0, -0.0005]])  # mean single-head effects: both irrelevance candidates, (0, 0) first
    joint = joint_categories(None, {}, effects, {}, threshold=0.02, band=0.05)
    assert joint["irrelevance"] == [(0, 1)] and joint["rejected"] == [(0, 0)]


def test_interference_needs_a_gain_beyond_its_standard_error(monkeypatch):
    """A head whose mean gain comes from one example (the others a little worse) is not Interference; a head that
    raises every example a little is, even with a smaller mean gain."""
    from modular.heads import categories

    per_head = {(0, 0): torch.tensor([4.0, -0.1, -0.1, -0.1], dtype=torch.float64),  # mean +0.925, one example
                (0, 1): torch.tensor([0.2, 0.3, 0.25, 0.2], dtype=torch.float64)}  # mean +0.2375, all examples
    monkeypatch.setattr(categories, "response_logprob", lambda model, batch: torch.zeros(4, dtype=torch.float64))
    monkeypatch.setattr(categories, "ablated_logprob",
                        lambda model, batch, heads, values: sum((per_head[h] for h in heads), torch.zeros(4)))
    effects = torch.tensor([[0.925, 0.2375]])  # both interference candidates, (0, 0) first
    joint = joint_categories(None, {}, effects, {}, threshold=0.02, band=0.05)
    assert joint["interference"] == [(0, 1)] and joint["rejected"] == [(0, 0)]

import pytest
import torch

from modular.heads.curves import (
    area_under_curve,
    effect_share_curve,
    faithfulness_curve,
    heads_needed,
    multiplier,
    plot_efficiency_curves,
    ranking_from_effects,
)


def _additive(contrib: torch.Tensor):
    """A metric that is the sum of the kept heads' contributions."""
    return lambda kept: float(sum(contrib[l, h].item() for l, h in kept))


def test_effect_share_hand_example():
    curve = effect_share_curve(torch.tensor([[3.0, -1.0], [0.0, 1.0]]))
    assert curve.tolist() == pytest.approx([0.0, 0.6, 0.8, 1.0, 1.0])


def test_effect_share_is_monotone_from_zero_to_one():
    effects = torch.randn(5, 7, generator=torch.Generator().manual_seed(0))
    curve = effect_share_curve(effects)
    assert len(curve) == 5 * 7 + 1
    assert curve[0] == 0 and curve[-1] == 1
    assert (curve[1:] >= curve[:-1]).all()
    # the top head alone carries its share of the total |e|
    assert curve[1].item() == pytest.approx(effects.abs().max().item() / effects.abs().sum().item())


def test_effect_share_rejects_zero_effects():
    with pytest.raises(ValueError, match="all head effects are zero"):
        effect_share_curve(torch.zeros(2, 3))


def test_ranking_sorts_by_magnitude_with_ties_by_position():
    effects = torch.tensor([[1.0, -3.0], [3.0, 0.5]])
    assert ranking_from_effects(effects) == [(0, 1), (1, 0), (0, 0), (1, 1)]


def test_faithfulness_of_additive_metric_equals_effect_share():
    contrib = torch.tensor([[3.0, 1.0, 0.0], [0.5, 2.0, 1.5]])
    ranking = ranking_from_effects(contrib)
    ks = list(range(len(ranking) + 1))
    out = faithfulness_curve(_additive(contrib), ranking, ks)
    assert out["ks"] == ks
    assert out["m_none"] == 0 and out["m_all"] == pytest.approx(8.0)
    assert out["values"] == pytest.approx(effect_share_curve(contrib).tolist())


def test_faithfulness_overshoots_when_some_heads_hurt():
    contrib = torch.tensor([[4.0, -2.0, 1.0]])  # m(all) = 3
    ranking = ranking_from_effects(contrib)  # (0,0), (0,1), (0,2)
    out = faithfulness_curve(_additive(contrib), ranking, [0, 1, 2, 3])
    assert out["values"] == pytest.approx([0.0, 4 / 3, 2 / 3, 1.0])
    assert max(out["values"]) > 1
    # dropping the harmful head: keep the two helpful ones first
    out = faithfulness_curve(_additive(contrib), [(0, 0), (0, 2), (0, 1)], [2])
    assert out["values"] == pytest.approx([5 / 3])


def test_faithfulness_evaluates_each_subset_once():
    calls = []
    contrib = torch.tensor([[1.0, 2.0]])
    metric = _additive(contrib)

    def counting(kept):
        calls.append(frozenset(kept))
        return metric(kept)

    faithfulness_curve(counting, ranking_from_effects(contrib), [0, 1, 2, 1])
    assert sorted(map(len, calls)) == [0, 1, 2]


def test_faithfulness_rejects_flat_metric_and_bad_k():
    with pytest.raises(ValueError):
        faithfulness_curve(lambda kept: 1.0, [(0, 0), (0, 1)], [0, 1, 2])
    with pytest.raises(ValueError):
        faithfulness_curve(_additive(torch.tensor([[1.0, 2.0]])), [(0, 0), (0, 1)], [3])


def test_heads_needed_and_multiplier():
    ks = [0, 1, 2, 3, 4]
    assert heads_needed([0.0, 0.6, 0.8, 1.0, 1.0], ks) == 3
    assert heads_needed([0.0, 0.6, 0.8, 1.0, 1.0], ks, threshold=0.8) == 2
    assert heads_needed([0.0, 0.95, 0.5, 1.0], [0, 4, 8, 12]) == 4  # first crossing, not last
    assert heads_needed([0.0, 0.5, 0.7], [0, 1, 2]) is None
    assert multiplier(8, 4) == 2.0
    assert multiplier(3, 4) == 0.75
    assert multiplier(None, 4) is None and multiplier(8, None) is None


def test_area_under_curve():
    # x = 0, .5, 1 ; y = 0, 1, 1  ->  .25 + .5
    assert area_under_curve([0.0, 1.0, 1.0], [0, 2, 4], n_heads_total=4) == pytest.approx(0.75)
    # points given out of order give the same area
    assert area_under_curve([1.0, 0.0, 1.0], [4, 0, 2], n_heads_total=4) == pytest.approx(0.75)
    # effect share of the hand example: .25 * (.3 + .7 + .9 + 1)
    assert area_under_curve([0, 0.6, 0.8, 1, 1], range(5), n_heads_total=4) == pytest.approx(0.725)


def test_plot_writes_png_with_multiplier(tmp_path, drawn):
    ks = list(range(0, 17))
    base = [min(1.0, k / 16) for k in ks]  # reaches .9 at k = 15
    sparse = [min(1.0, k / 5) for k in ks]  # reaches .9 at k = 5
    panels = {
        "capitals": {"base": {"ks": ks, "values": base, "needed": heads_needed(base, ks)},
                     "sparse": {"ks": ks, "values": sparse, "needed": heads_needed(sparse, ks)}},
        "arithmetic": {"base": {"ks": ks, "values": base, "needed": heads_needed(base, ks)},
                       "sparse": {"ks": ks, "values": [0.5 * v for v in sparse], "needed": None}},
    }
    path, annotations = plot_efficiency_curves(tmp_path / "curves.png", panels, "Effect share",
                                               subtitle="counterfactual ablation")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert annotations == {"capitals": "3.0x"}
    fig = drawn["curves.png"]
    assert [ax["title"] for ax in fig["axes"]] == ["capitals", "arithmetic"]
    capitals, arithmetic = fig["axes"]
    assert capitals["lines"]["base"] == pytest.approx(base) and capitals["lines"]["sparse"] == pytest.approx(sparse)
    assert [t for t in capitals["texts"] if t] == ["3.0x"]  # the multiplier between the two crossings
    assert [t for t in arithmetic["texts"] if t] == []  # the sparse curve never reaches the threshold
    assert capitals["xlabel"] == "Number of Heads Kept" and "Effect share" in fig["suptitle"]


def test_plot_allows_overshoot_without_annotation_for_one_model(tmp_path, drawn):
    panels = {"task": {"model": {"ks": [0, 1, 2, 3], "values": [0.0, 1.3, 0.7, 1.0]}}}
    path, annotations = plot_efficiency_curves(tmp_path / "f.png", panels, "Faithfulness")
    assert annotations == {}
    ax = drawn["f.png"]["axes"][0]
    assert ax["lines"]["model"] == pytest.approx([0.0, 1.3, 0.7, 1.0]) and [t for t in ax["texts"] if t] == []


def test_plot_with_three_models_gives_each_later_model_its_multiplier(tmp_path, drawn):
    ks = list(range(0, 17))
    lines = {"base": [min(1.0, k / 16) for k in ks],  # 0.9 at k = 15
             "sparse": [min(1.0, k / 5) for k in ks],  # 0.9 at k = 5
             "other": [min(1.0, k / 10) for k in ks],  # 0.9 at k = 9
             "never": [0.5 for _ in ks]}
    panels = {"ioi": {name: {"ks": ks, "values": v} for name, v in lines.items()}}
    path, annotations = plot_efficiency_curves(tmp_path / "f.png", panels, "Effect share")
    assert annotations == {"ioi": "sparse: 3.0x; other: 1.7x"}
    ax = drawn["f.png"]["axes"][0]
    assert {"base", "sparse (3.0x)", "other (1.7x)", "never"} <= set(ax["lines"])  # each multiplier in its label
    assert ax["lines"]["never"] == pytest.approx(lines["never"])

import pytest
import torch

from modular import ModularError
from modular.heads.efficiency import check_task, k_grid, task_curves
from modular.heads.ranking import logit_diff, task_batch
from tests.conftest import make_tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return make_tiny_tokenizer()


@pytest.fixture(scope="module")
def items(tok):
    from modular.data import load_behaviour

    return load_behaviour("greater_than", tokenizer=tok)["test"].select(range(6))


def test_k_grid():
    assert k_grid(8) == list(range(9))
    g = k_grid(270)
    assert g[:21] == list(range(21)) and g[-1] == 270 and 25 in g and 100 in g
    assert g == sorted(set(g)) and len(g) < 60
    assert k_grid(0) == [0]


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma3_text"])
@pytest.mark.parametrize("ranking", ["exhaustive", "attribution", "refined"])
def test_task_curves_end_points(tiny_model, tok, items, arch, ranking):
    r = task_curves(tiny_model, tok, items, ranking=ranking, ablation="counterfactual", ig_steps=2)
    n = r["n_heads"]
    assert n == 8 and len(r["order"]) == n and len({tuple(h) for h in r["order"]}) == n
    share, faith = r["effect_share"], r["faithfulness"]
    assert share["ks"] == list(range(n + 1)) and share["values"][0] == 0 and share["values"][-1] == pytest.approx(1)
    assert faith["values"][0] == 0 and faith["values"][-1] == pytest.approx(1)
    assert share["needed"] is not None and 0 < share["needed"] <= n
    assert 0 < share["auc"] < 1
    assert r["ablation"] == "counterfactual" and r["ranking"] == ranking
    assert r["ig_steps"] == (None if ranking == "exhaustive" else 2)
    assert r["refine"] == (15 if ranking == "refined" else None)
    # every head kept is the clean model
    batch = task_batch(tok, items)
    with torch.no_grad():
        clean = float(logit_diff(tiny_model(**batch["clean"]).logits, batch["good"], batch["bad"]))
    assert r["clean_metric"] == pytest.approx(clean, abs=1e-5)
    # the order follows |e|
    mags = [abs(r["effects"][l][h]) for l, h in r["order"]]
    assert mags == sorted(mags, reverse=True)


@pytest.mark.parametrize("arch", ["llama"])
@pytest.mark.parametrize("ablation", ["mean", "zero"])
def test_task_curves_other_ablations_are_recorded(tiny_model, tok, items, arch, ablation):
    r = task_curves(tiny_model, tok, items, ablation=ablation)
    assert r["ablation"] == ablation
    assert r["faithfulness"]["values"][-1] == pytest.approx(1)


def test_check_task_rejects_tasks_without_what_the_metric_needs(tok):
    from modular.data import load_behaviour

    commonsense = load_behaviour("commonsense")["test"].select(range(3))
    with pytest.raises(ModularError, match="wrong"):
        check_task(commonsense, "counterfactual", "commonsense")
    gt = load_behaviour("greater_than")["test"].select(range(3))
    no_cf = gt.map(lambda r: {"counterfactual": ""})
    with pytest.raises(ModularError, match="counterfactual"):
        check_task(no_cf, "counterfactual")
    check_task(no_cf, "mean")
    with pytest.raises(ModularError):
        task_curves(None, tok, gt, ablation="nonsense")

import pytest
import torch

from modular.heads.ranking import attribution_effects, exhaustive_effects, path_points, refined_effects
from tests.conftest import VOCAB


def _batch(seed=0, n=6, seq=9):
    g = torch.Generator().manual_seed(seed)
    clean = torch.randint(0, VOCAB, (n, seq), generator=g)
    cf = clean.clone()
    cf[:, 2] = torch.randint(0, VOCAB, (n,), generator=g)  # "other names": one position differs
    ones = torch.ones_like(clean)
    return {"clean": {"input_ids": clean, "attention_mask": ones},
            "counterfactual": {"input_ids": cf, "attention_mask": ones},
            "good": torch.randint(0, VOCAB, (n,), generator=g), "bad": torch.randint(0, VOCAB, (n,), generator=g)}


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma3_text"])
@pytest.mark.parametrize("ablation", ["counterfactual", "mean", "zero"])
def test_attribution_tracks_exhaustive_patching(tiny_model, arch, ablation):
    if ablation != "counterfactual" and arch == "gemma3_text":
        pytest.skip("post-sublayer norms make whole-head ablation too non-linear for a first-order test")
    batch = _batch()
    exact = exhaustive_effects(tiny_model, batch, ablation)
    assert exact.abs().max() > 0
    # plain attribution is first order: trusted for small (counterfactual) changes; integrated
    # gradients follows the path to large (mean / zero) ablations as well
    for steps in (1, 8) if ablation == "counterfactual" else (8,):
        approx = attribution_effects(tiny_model, batch, ablation, ig_steps=steps)
        assert approx.shape == exact.shape
        r = torch.corrcoef(torch.stack([exact.flatten(), approx.flatten()]))[0, 1]
        assert r > 0.8, (steps, r)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma3_text", "olmo2", "phi3"])
def test_replaying_earlier_blocks_gives_the_same_effects(tiny_model, arch):
    from modular.heads.ranking import last_position_logits

    batch = _batch(seed=3)
    fast = exhaustive_effects(tiny_model, batch, "counterfactual", reuse_prefix=True)
    slow = exhaustive_effects(tiny_model, batch, "counterfactual", reuse_prefix=False)
    torch.testing.assert_close(fast, slow, atol=1e-6, rtol=1e-5)
    assert fast.abs().max() > 0
    # the blocks compute again afterwards
    out = last_position_logits(tiny_model, batch["clean"])
    torch.testing.assert_close(out[:, -1], tiny_model(**batch["clean"]).logits[:, -1], atol=1e-5, rtol=1e-5)
    assert not any("forward" in vars(m) for m in tiny_model.modules())


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma3_text", "qwen2"])
def test_plain_attribution_is_the_total_derivative(arch):
    """Score(h) equals the exact effect of a tiny patch of head h alone, divided by its size: the gradient
    flows through later attention heads too (heads whose effect is mediated by later heads are not lost)."""
    from modular.heads.ranking import ablation_values
    from modular.hooks import capture_head_inputs
    from modular.models.adapter import ArchitectureAdapter
    from tests.conftest import make_tiny_model

    model = make_tiny_model(arch).double()
    batch = _batch(seed=5)
    adapter = ArchitectureAdapter(model)
    with torch.no_grad(), capture_head_inputs(adapter) as z:
        model(**batch["clean"])
    cf = ablation_values(model, batch, "counterfactual")
    t = 1e-2
    tiny = {i: z[i] + t * (cf[i] - z[i]) for i in z}  # patch 1 % of the way to the counterfactual
    exact = torch.zeros(adapter.n_layers, adapter.n_heads, dtype=torch.float64)
    from modular.heads.ranking import last_position_logits, logit_diff
    from modular.hooks import replace_heads

    with torch.no_grad():
        clean = logit_diff(last_position_logits(model, batch["clean"]), batch["good"], batch["bad"])
        for layer in range(adapter.n_layers):
            for head in range(adapter.n_heads):
                with replace_heads(adapter, [(layer, head)], tiny):
                    m = logit_diff(last_position_logits(model, batch["clean"]), batch["good"], batch["bad"])
                exact[layer, head] = (m - clean) / t
    approx = attribution_effects(model, batch, "counterfactual", ig_steps=1)
    torch.testing.assert_close(approx, exact, atol=1e-2 * exact.abs().max().item(), rtol=1e-2)
    assert exact[0].abs().max() > 0  # layer-0 heads matter, through layer 1


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_integrated_gradients_on_the_embedding_path_sums_to_the_total_effect(arch):
    """With inputs interpolated, the IG scores of all heads add up to about m(counterfactual) − m(clean)
    when every head is patched, i.e. the path's completeness (a check that the path and deltas match)."""
    from modular.heads.ranking import ablation_values, last_position_logits, logit_diff
    from modular.hooks import replace_heads
    from modular.models.adapter import ArchitectureAdapter
    from tests.conftest import make_tiny_model

    model = make_tiny_model(arch).double()
    batch = _batch(seed=6)
    adapter = ArchitectureAdapter(model)
    heads = [(l, h) for l in range(adapter.n_layers) for h in range(adapter.n_heads)]
    with torch.no_grad():
        clean = logit_diff(last_position_logits(model, batch["clean"]), batch["good"], batch["bad"])
        with replace_heads(adapter, heads, ablation_values(model, batch, "counterfactual")):
            patched = logit_diff(last_position_logits(model, batch["clean"]), batch["good"], batch["bad"])
    scores = attribution_effects(model, batch, "counterfactual", ig_steps=32)
    assert torch.isfinite(scores).all() and scores.abs().max() > 0
    # not exact (embeddings and residual paths also move along the input path), but the same sign and scale
    total = scores.sum().item()
    assert total * (patched - clean).item() > 0


def test_path_points_include_both_ends_with_trapezoid_weights():
    assert path_points(1) == ([0.0], [1.0])
    assert path_points(2) == ([0.0, 1.0], [0.5, 0.5])
    alphas, weights = path_points(5)
    assert alphas == [0.0, 0.25, 0.5, 0.75, 1.0] and weights == [0.125, 0.25, 0.25, 0.25, 0.125]
    assert sum(weights) == pytest.approx(1)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma3_text", "qwen2"])
@pytest.mark.parametrize("ablation", ["counterfactual", "mean"])
def test_refined_ranking_is_exact_on_its_heads_and_attribution_elsewhere(tiny_model, arch, ablation):
    """Every head of the second half of the layers patched exactly equals exhaustive patching there (so the
    ablation values and the replayed clean blocks taken from the gradient runs are right); the first half
    keeps the attribution scores."""
    batch = _batch(seed=7)
    exact = exhaustive_effects(tiny_model, batch, ablation)
    n_layers, n_heads = exact.shape
    scores = attribution_effects(tiny_model, batch, ablation, ig_steps=2)
    refined = refined_effects(tiny_model, batch, ablation, ig_steps=2, refine=n_layers * n_heads)
    half = n_layers // 2
    torch.testing.assert_close(refined[half:], exact[half:], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(refined[:half], scores[:half].detach(), atol=1e-6, rtol=1e-5)
    assert not torch.allclose(scores[half:], exact[half:], atol=1e-5)  # the exact patching changed something
    # refine = 1: only the second-half head with the largest |score| is patched
    top = refined_effects(tiny_model, batch, ablation, ig_steps=2, refine=1)
    best = divmod(int(torch.argmax(scores[half:].detach().abs())), n_heads)
    best = (half + best[0], best[1])
    expected = scores.detach().clone()
    expected[best] = exact[best]
    torch.testing.assert_close(top, expected, atol=1e-5, rtol=1e-4)


def test_two_run_attribution_averages_the_gradients_on_the_clean_and_the_counterfactual_run():
    """ig_steps = 2 on aligned counterfactual prompts: ½ (g_clean + g_cf) · (z_cf − z_clean), with g_cf the
    gradient on the counterfactual run itself (not an interpolation of embeddings)."""
    from modular.heads.ranking import ablation_values, last_position_logits, logit_diff, offset_heads
    from modular.hooks import capture_head_inputs
    from modular.models.adapter import ArchitectureAdapter
    from tests.conftest import make_tiny_model

    model = make_tiny_model("llama").double()
    batch = _batch(seed=8)
    adapter = ArchitectureAdapter(model)
    with torch.no_grad(), capture_head_inputs(adapter) as z:
        model(**batch["clean"])
    cf = ablation_values(model, batch, "counterfactual")

    def grads(inputs):
        eps = {i: torch.zeros_like(z[i], requires_grad=True) for i in z}
        with offset_heads(adapter, eps):
            m = logit_diff(last_position_logits(model, inputs), batch["good"], batch["bad"])
        return dict(zip(eps, torch.autograd.grad(m, list(eps.values()))))

    g0, g1 = grads(batch["clean"]), grads(batch["counterfactual"])
    expected = torch.stack([((cf[i] - z[i]) * (g0[i] + g1[i]) / 2).sum(dim=(0, 1, 3)) for i in sorted(z)])
    torch.testing.assert_close(attribution_effects(model, batch, "counterfactual", ig_steps=2), expected)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma3_text", "phi3"])
@pytest.mark.parametrize("ablation", ["counterfactual", "mean"])
def test_heads_patched_together_match_one_pass_per_head(tiny_model, arch, ablation):
    """Several heads of a layer patched in one pass (each in its own copy of the prompts, groups split unevenly
    by ``max_rows``) give what one ``replace_heads`` forward per head gives."""
    from modular.heads.ranking import ablation_values, last_position_logits, logit_diff
    from modular.hooks import replace_heads
    from modular.models.adapter import ArchitectureAdapter

    batch = _batch(seed=5, n=3)
    adapter = ArchitectureAdapter(tiny_model)
    values = ablation_values(tiny_model, batch, ablation)

    def metric():
        return float(logit_diff(last_position_logits(tiny_model, batch["clean"]), batch["good"], batch["bad"]))

    clean = metric()
    expected = torch.zeros(adapter.n_layers, adapter.n_heads)
    with torch.no_grad():
        for layer in range(adapter.n_layers):
            for head in range(adapter.n_heads):
                with replace_heads(adapter, [(layer, head)], values):
                    expected[layer, head] = metric() - clean
    assert adapter.n_heads > 2 and expected.abs().min() > 0  # every head matters, so a head left out shows
    for max_rows in (3, 7, 64):  # one head per pass; two heads, then the rest; every head of a layer at once
        torch.testing.assert_close(exhaustive_effects(tiny_model, batch, ablation, max_rows=max_rows), expected,
                                   atol=1e-5, rtol=1e-4)
    assert not any("forward" in vars(m) for m in tiny_model.modules())

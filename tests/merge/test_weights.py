"""Weight merging of state dicts: average, task arithmetic, TIES."""

from __future__ import annotations

import pytest
import torch

from modular.merge.weights import average, task_arithmetic, ties


def _state(seed: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(12, 6, generator=g).to(dtype),
        "layer.0.bias": torch.randn(6, generator=g).to(dtype),
        "layer.0.position_ids": torch.arange(5) + seed,  # integer buffer
        "layer.0.mask": torch.rand(4, generator=g) > 0.5,  # bool buffer
    }


def _clone(state):
    return {k: v.clone() for k, v in state.items()}


def _assert_state_equal(a, b, atol=1e-6):
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert a[k].shape == b[k].shape, k
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=0), k


# --- average ----------------------------------------------------------------------------------


def test_average_of_identical_states_is_the_state():
    s = _state(0)
    _assert_state_equal(average([s, _clone(s), _clone(s)]), s)
    _assert_state_equal(average([s, _clone(s)], weights=[0.3, 2.0]), s)


def test_average_is_the_weighted_mean():
    a, b = _state(1), _state(2)
    plain = average([a, b])
    torch.testing.assert_close(plain["embed.weight"], (a["embed.weight"] + b["embed.weight"]) / 2)
    weighted = average([a, b], weights=[1.0, 3.0])
    torch.testing.assert_close(weighted["layer.0.bias"], 0.25 * a["layer.0.bias"] + 0.75 * b["layer.0.bias"])
    # non-float tensors come from the first state
    assert torch.equal(weighted["layer.0.position_ids"], a["layer.0.position_ids"])
    assert torch.equal(weighted["layer.0.mask"], a["layer.0.mask"])


def test_average_keeps_dtype_and_leaves_inputs_alone():
    a, b = _state(3, torch.bfloat16), _state(4, torch.bfloat16)
    a0, b0 = _clone(a), _clone(b)
    out = average([a, b])
    assert out["embed.weight"].dtype == torch.bfloat16
    _assert_state_equal(a, a0, atol=0)
    _assert_state_equal(b, b0, atol=0)
    out["embed.weight"].add_(1.0)  # the result does not alias an input
    _assert_state_equal(a, a0, atol=0)


def test_average_rejects_bad_weights():
    s = _state(0)
    with pytest.raises(ValueError, match="weights"):
        average([s, s], weights=[1.0])
    with pytest.raises(ValueError, match="sum"):
        average([s, s], weights=[1.0, -1.0])
    with pytest.raises(ValueError, match="at least one"):
        average([])


# --- task arithmetic --------------------------------------------------------------------------


def test_task_arithmetic_with_one_state_and_unit_scale_is_that_state():
    base, ft = _state(5), _state(6)
    ft["layer.0.position_ids"] = base["layer.0.position_ids"].clone()
    ft["layer.0.mask"] = base["layer.0.mask"].clone()
    _assert_state_equal(task_arithmetic(base, [ft], scale=1.0), ft, atol=1e-5)


def test_task_arithmetic_sums_scaled_task_vectors():
    base, a, b = _state(7), _state(8), _state(9)
    out = task_arithmetic(base, [a, b], scale=0.5)
    k = "embed.weight"
    expected = base[k] + 0.5 * ((a[k] - base[k]) + (b[k] - base[k]))
    torch.testing.assert_close(out[k], expected)
    assert torch.equal(out["layer.0.position_ids"], base["layer.0.position_ids"])
    _assert_state_equal(task_arithmetic(base, [a, b], scale=0.0), base)


# --- TIES -------------------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [1.0, 0.7])
def test_ties_full_density_identical_task_vectors(scale):
    base, ft = _state(10), _state(11)
    out = ties(base, [ft, _clone(ft)], density=1.0, scale=scale)
    for k in ("embed.weight", "layer.0.bias"):
        torch.testing.assert_close(out[k], base[k] + scale * (ft[k] - base[k]))
    assert torch.equal(out["layer.0.position_ids"], base["layer.0.position_ids"])


def test_ties_trims_elects_sign_and_takes_disjoint_mean():
    base = {"w": torch.tensor([1.0, 1.0, 1.0, 1.0])}
    tvs = [
        torch.tensor([3.0, -1.0, 0.5, 2.0]),   # keeps 3, 2
        torch.tensor([-1.0, -2.0, 0.4, 4.0]),  # keeps -2, 4
        torch.tensor([2.0, 1.5, -0.1, -1.0]),  # keeps 2, 1.5
    ]
    states = [{"w": base["w"] + t} for t in tvs]
    # trimmed sums: [5, -0.5, 0, 6] -> signs [+, -, 0, +]; disjoint means: [2.5, -2, 0, 3]
    out = ties(base, states, density=0.5, scale=2.0)
    torch.testing.assert_close(out["w"], base["w"] + 2.0 * torch.tensor([2.5, -2.0, 0.0, 3.0]))
    # full density: sums [4, -1.5, 0.8, 5] -> agreeing means [2.5, -1.5, 0.45, 3]
    out = ties(base, states, density=1.0)
    torch.testing.assert_close(out["w"], base["w"] + torch.tensor([2.5, -1.5, 0.45, 3.0]))


def test_ties_rejects_bad_density():
    s = _state(0)
    for density in (0.0, 1.5):
        with pytest.raises(ValueError, match="density"):
            ties(s, [s], density=density)


# --- key checks -------------------------------------------------------------------------------


def test_mismatched_keys_raise_naming_the_key():
    base, other = _state(12), _state(13)
    missing = {k: v for k, v in other.items() if k != "layer.0.bias"}
    extra = {**other, "head.weight": torch.zeros(3)}
    for fn in (lambda s: average([base, s]), lambda s: task_arithmetic(base, [s]), lambda s: ties(base, [s])):
        with pytest.raises(ValueError, match="layer.0.bias"):
            fn(missing)
        with pytest.raises(ValueError, match="head.weight"):
            fn(extra)
        with pytest.raises(ValueError, match="embed.weight"):
            fn({**other, "embed.weight": torch.zeros(6, 12)})

"""Stochastic rounding to a narrower precision, and model casts that keep what training changed."""

import pytest
import torch

from modular.models.precision import cast_model, stochastic_round
from tests.conftest import make_tiny_model


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_stochastic_round_picks_a_neighbour_and_is_unbiased(dtype):
    x = torch.randn(20000) * 3
    r = stochastic_round(x, dtype, torch.Generator().manual_seed(0))
    assert r.dtype == dtype
    near = x.to(dtype)
    toward = torch.nextafter(near, torch.where(x > near.float(), torch.inf, -torch.inf).to(dtype))
    assert bool(((r == near) | (r == toward)).all())
    assert 0.2 < (r != near).float().mean().item() < 0.3  # about a quarter: the expected share of away-rounding
    # a value a quarter of a unit above a representable one: rounded to nearest it is lost in every entry, rounded
    # stochastically it is kept in the mean (a quarter of the entries round up)
    one = torch.ones(40000)
    up = torch.nextafter(one.to(dtype), torch.full_like(one, 2).to(dtype)).float()
    x = one + 0.25 * (up - one)
    assert bool((x.to(dtype).float() == one).all())
    r = stochastic_round(x, dtype, torch.Generator().manual_seed(1)).float()
    assert r.mean().item() == pytest.approx(x[0].item(), abs=0.02 * (up[0] - 1).item())


def test_stochastic_round_is_seeded_and_exact_where_it_can_be():
    x = torch.randn(1000)
    a = stochastic_round(x, torch.bfloat16, torch.Generator().manual_seed(3))
    b = stochastic_round(x, torch.bfloat16, torch.Generator().manual_seed(3))
    c = stochastic_round(x, torch.bfloat16, torch.Generator().manual_seed(4))
    assert torch.equal(a, b) and not torch.equal(a, c)
    exact = x.bfloat16().float()
    assert torch.equal(stochastic_round(exact, torch.bfloat16), exact.bfloat16())  # representable: unchanged
    assert torch.equal(stochastic_round(x, torch.float32), x)  # not narrowing: the plain cast
    assert torch.equal(stochastic_round(x, torch.float64), x.double())
    special = torch.tensor([0.0, -0.0, torch.inf, -torch.inf, 1e38])
    assert torch.equal(stochastic_round(special, torch.bfloat16)[:4], special[:4].bfloat16())


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma2"])
def test_cast_model_keeps_a_sub_ulp_update(arch):
    base = make_tiny_model(arch)
    with torch.no_grad():
        for p in base.parameters():
            p.copy_(p.bfloat16().float())  # base weights exact in bfloat16, as a released model's are
    trained = make_tiny_model(arch)
    trained.load_state_dict(base.state_dict())
    with torch.no_grad():  # a fine-tuning update of a quarter unit in the last place of every weight
        for p in trained.parameters():
            up = torch.nextafter(p.bfloat16(), torch.full_like(p, torch.inf).bfloat16()).float()
            p.add_(0.25 * (up - p))
    buffers = {n: b.dtype for n, b in trained.named_buffers()}
    nearest = [p.bfloat16() for p in trained.parameters()]
    assert all(torch.equal(n, b.bfloat16()) for n, b in zip(nearest, base.parameters()))  # lost to nearest
    cast_model(trained, torch.bfloat16, seed=0)
    assert all(p.dtype == torch.bfloat16 for p in trained.parameters())
    assert {n: b.dtype for n, b in trained.named_buffers()} == buffers  # buffers as from_pretrained leaves them
    assert trained.config.dtype == torch.bfloat16
    moved = torch.cat([(p != b.bfloat16()).flatten() for p, b in zip(trained.parameters(), base.parameters())])
    assert 0.2 < moved.float().mean().item() < 0.3  # kept on average: a quarter of the entries moved up
    again = make_tiny_model(arch)
    again.load_state_dict(base.state_dict())
    with torch.no_grad():
        for p in again.parameters():
            up = torch.nextafter(p.bfloat16(), torch.full_like(p, torch.inf).bfloat16()).float()
            p.add_(0.25 * (up - p))
    cast_model(again, torch.bfloat16, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(again.parameters(), trained.parameters()))  # seeded

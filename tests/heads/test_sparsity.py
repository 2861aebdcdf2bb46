import math

import pytest
import torch

from modular import ModularError
from modular.heads.sparsity import L0Penalty, LagrangeConstraint, make_sparsity
from modular.models.adapter import ArchitectureAdapter
from modular.models.head_gates import expected_l0, install_head_gates


def test_multiplier_rises_while_violated_and_falls_when_satisfied():
    c = LagrangeConstraint(target=0.5, lr=0.2, ema=0.5, init=1.0)
    seen = []
    for _ in range(10):
        c.update(1.0)  # violated
        seen.append(c.multiplier.item())
    assert all(b > a for a, b in zip([1.0] + seen, seen))
    top = seen[-1]
    for _ in range(30):
        c.update(0.1)  # satisfied
    assert c.multiplier.item() < top and c.multiplier.item() < 1.0
    assert c.metrics()["constraint_violation"] < 0


def test_multiplier_stays_inside_its_bounds():
    c = LagrangeConstraint(target=1e-6, lr=1.0, ema=0.0, bounds=(1e-3, 10.0))
    for _ in range(20):
        c.update(5.0)
    assert c.multiplier.item() == 10.0
    for _ in range(50):
        c.update(0.0)
    assert c.multiplier.item() == pytest.approx(1e-3)


def test_lagrangian_weights_the_lm_loss_by_the_multiplier():
    c = LagrangeConstraint(target=0.2, weight=2.0, init=3.0)
    objective, lm, l0 = torch.tensor(1.5), torch.tensor(0.5), torch.tensor(0.25)
    # (objective − lm) + λ·l0 + μ·(lm − τ)
    assert c(objective, lm, l0).item() == pytest.approx(1.0 + 0.5 + 3.0 * 0.3)
    assert L0Penalty(2.0)(objective, lm, l0).item() == pytest.approx(2.0)


def test_bad_settings_are_user_errors():
    assert make_sparsity("none", 1.0, None, 0.1, 0.9, 1.0) is None
    with pytest.raises(ModularError):
        make_sparsity("constraint", 1.0, None, 0.1, 0.9, 1.0)
    with pytest.raises(ModularError):
        make_sparsity("l1", 1.0, None, 0.1, 0.9, 1.0)
    with pytest.raises(ModularError):
        LagrangeConstraint(target=0.0)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma3_text"])
def test_penalty_lowers_expected_l0_with_the_model_frozen(tiny_model, tokens):
    tiny_model.requires_grad_(False)
    install_head_gates(tiny_model, init_log_alpha=1.0)
    tiny_model.train()
    gates = [p for n, p in tiny_model.named_parameters() if p.requires_grad]
    assert len(gates) == ArchitectureAdapter(tiny_model).n_layers
    opt = torch.optim.Adam(gates, lr=0.1)
    penalty = L0Penalty(1.0)
    n = sum(g.numel() for g in gates)
    start = expected_l0(tiny_model).item()
    for _ in range(10):
        logits = tiny_model(tokens).logits
        lm = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
        loss = penalty(lm, lm, expected_l0(tiny_model) / n)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert expected_l0(tiny_model).item() < start - 0.5
    assert math.isfinite(loss.item())

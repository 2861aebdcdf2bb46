import pytest
import torch

from modular.hooks import replace_heads, zero_heads
from modular.models.adapter import ArchitectureAdapter
from modular.models.head_gates import GatedOutputProjection, gate_values, install_head_gates, remove_head_gates


def test_gates_start_at_one_and_leave_logits_unchanged(tiny_model, tokens):
    ref = tiny_model(tokens).logits
    wrappers = install_head_gates(tiny_model)
    assert all(isinstance(w, GatedOutputProjection) for w in wrappers)
    names = [n for n, _ in tiny_model.named_parameters()]
    assert sum(n.endswith("head_gate.log_alpha") for n in names) == ArchitectureAdapter(tiny_model).n_layers
    assert torch.all(gate_values(tiny_model) == 1)
    torch.testing.assert_close(tiny_model(tokens).logits, ref, atol=0, rtol=0)
    assert any(k.endswith("head_gate.log_alpha") for k in tiny_model.state_dict())
    remove_head_gates(tiny_model)
    torch.testing.assert_close(tiny_model(tokens).logits, ref, atol=0, rtol=0)


def test_gate_fixed_at_zero_equals_ablating_the_head(tiny_model, tokens):
    a = ArchitectureAdapter(tiny_model)
    with zero_heads(a, [(0, 1), (a.n_layers - 1, 2)]):
        ablated = tiny_model(tokens).logits
    install_head_gates(tiny_model)
    a.attn_out(0).head_gate.fixed[1] = 0.0
    a.attn_out(a.n_layers - 1).head_gate.fixed[2] = 0.0
    torch.testing.assert_close(tiny_model(tokens).logits, ablated, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("arch", ["llama"])
def test_training_gates_are_stochastic_and_get_gradients(tiny_model, tokens):
    install_head_gates(tiny_model, init_log_alpha=0.0)
    tiny_model.train()
    a = ArchitectureAdapter(tiny_model)
    z1, z2 = a.attn_out(0).head_gate(), a.attn_out(0).head_gate()
    assert not torch.equal(z1, z2)
    tiny_model(tokens).logits.sum().backward()
    assert a.attn_out(0).head_gate.log_alpha.grad is not None
    l0 = a.attn_out(0).head_gate.expected_l0()
    assert 0 < l0.item() < a.n_heads


def test_gate_fixed_at_one_leaves_logits_unchanged_whatever_log_alpha(tiny_model, tokens):
    ref = tiny_model(tokens).logits
    install_head_gates(tiny_model, init_log_alpha=-1.0)  # learned gates would be far below 1
    a = ArchitectureAdapter(tiny_model)
    assert (gate_values(tiny_model) < 1).all()
    for i in range(a.n_layers):
        a.attn_out(i).head_gate.fixed[:] = 1.0
    torch.testing.assert_close(tiny_model(tokens).logits, ref, atol=0, rtol=0)


def test_gate_fixed_at_one_leaves_logits_unchanged(tiny_model, tokens):
    ref = tiny_model(tokens).logits
    install_head_gates(tiny_model, init_log_alpha=-1.0)  # learned gates would be fractional
    a = ArchitectureAdapter(tiny_model)
    for i in range(a.n_layers):
        a.attn_out(i).head_gate.fixed.fill_(1.0)
    for m in tiny_model.modules():  # stochastic gates (the rest stays in eval mode: no dropout)
        if isinstance(m, GatedOutputProjection):
            m.train()
    torch.testing.assert_close(tiny_model(tokens).logits, ref, atol=1e-6, rtol=1e-5)


def test_folding_deterministic_gates_gives_the_gated_logits(tiny_model, tokens):
    from modular.models.head_gates import deterministic_gate_values, fold_head_gates, open_heads

    install_head_gates(tiny_model)
    a = ArchitectureAdapter(tiny_model)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for i in range(a.n_layers):
            a.attn_out(i).head_gate.log_alpha.copy_(torch.randn(a.n_heads, generator=g) * 3)
        a.attn_out(0).head_gate.log_alpha[0] = -8.0  # closed
        a.attn_out(0).head_gate.log_alpha[1] = 0.2  # half open
    tiny_model.train()
    values = deterministic_gate_values(tiny_model)  # whatever the mode
    tiny_model.eval()
    torch.testing.assert_close(values, gate_values(tiny_model))
    assert values[0, 0] == 0 and 0 < values[0, 1] < 1
    assert open_heads(tiny_model) == int((values > 0).sum())
    gated = tiny_model(tokens).logits
    folded = fold_head_gates(tiny_model)
    torch.testing.assert_close(folded, values)
    assert not any(isinstance(m, GatedOutputProjection) for m in tiny_model.modules())
    torch.testing.assert_close(tiny_model(tokens).logits, gated, atol=1e-5, rtol=1e-4)


def _plain_and_patched(model, tokens, heads):
    """Logits of the plain model, every head's input on other tokens, and the logits with ``heads`` patched by them."""
    from modular.hooks import capture_head_inputs, replace_heads

    a = ArchitectureAdapter(model)
    other = torch.randint(0, 300, tokens.shape, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        plain = model(tokens).logits
        with capture_head_inputs(a) as z:
            model(other)
        cf = dict(z)
        with replace_heads(a, heads, cf):
            patched = model(tokens).logits
    return plain, cf, patched


def test_scoped_gates_are_off_or_let_the_replacement_in_and_always_restore(tiny_model, tokens):
    from modular.models.head_gates import head_gate_scope

    a = ArchitectureAdapter(tiny_model)
    heads = [(0, 1), (a.n_layers - 1, 2)]
    plain, cf, patched = _plain_and_patched(tiny_model, tokens, heads)
    with torch.no_grad():
        with zero_heads(a, heads):
            zeroed = tiny_model(tokens).logits
    install_head_gates(tiny_model)
    for layer, h in heads:
        a.attn_out(layer).head_gate.fixed[h] = 0.0
    with torch.no_grad():
        with head_gate_scope(tiny_model, active=False):
            torch.testing.assert_close(tiny_model(tokens).logits, plain, atol=0, rtol=0)
        with head_gate_scope(tiny_model, replacements=cf):
            torch.testing.assert_close(tiny_model(tokens).logits, patched, atol=1e-5, rtol=1e-4)
        with pytest.raises(RuntimeError), head_gate_scope(tiny_model, active=False):
            raise RuntimeError("inside the scope")
        torch.testing.assert_close(tiny_model(tokens).logits, zeroed, atol=1e-5, rtol=1e-4)
    assert all(w.active and w.replacement is None for w in (a.attn_out(i) for i in range(a.n_layers)))


def test_inverted_scope_lets_the_replacement_into_open_heads_and_keeps_closed_heads_own_input(tiny_model, tokens):
    """invert: open gates take the replacement, closed gates their own input (no live_prob), restored on exit."""
    from modular.models.head_gates import head_gate_scope

    a = ArchitectureAdapter(tiny_model)
    heads = [(i, h) for i in range(a.n_layers) for h in range(a.n_heads)]
    closed = [(0, 1), (a.n_layers - 1, 2)]
    plain, cf, everything = _plain_and_patched(tiny_model, tokens, heads)
    with torch.no_grad(), replace_heads(a, [hh for hh in heads if hh not in closed], cf):
        open_swapped = tiny_model(tokens).logits
    install_head_gates(tiny_model)
    with torch.no_grad():
        with head_gate_scope(tiny_model, replacements=cf, invert=True):  # every gate open: every head swapped
            torch.testing.assert_close(tiny_model(tokens).logits, everything, atol=1e-5, rtol=1e-4)
        for layer, h in closed:
            a.attn_out(layer).head_gate.fixed[h] = 0.0
        for i in range(a.n_layers):  # the gates in training mode (no dropout elsewhere), every gate fixed
            a.attn_out(i).train()
            a.attn_out(i).head_gate.fixed[torch.isnan(a.attn_out(i).head_gate.fixed)] = 1.0
        with head_gate_scope(tiny_model, replacements=cf, live_prob=1.0, invert=True):  # live_prob is ignored
            torch.testing.assert_close(tiny_model(tokens).logits, open_swapped, atol=1e-5, rtol=1e-4)
        with head_gate_scope(tiny_model, active=False):
            torch.testing.assert_close(tiny_model(tokens).logits, plain, atol=0, rtol=0)
    assert not any(a.attn_out(i).invert for i in range(a.n_layers))


def test_live_prob_opens_closed_gates_by_row_in_training_only(tiny_model, tokens):
    from modular.models.head_gates import head_gate_scope

    a = ArchitectureAdapter(tiny_model)
    heads = [(i, h) for i in range(a.n_layers) for h in range(a.n_heads)]
    plain, cf, patched = _plain_and_patched(tiny_model, tokens, heads)
    install_head_gates(tiny_model)
    for i in range(a.n_layers):
        a.attn_out(i).head_gate.fixed.fill_(0.0)
    with torch.no_grad():
        with head_gate_scope(tiny_model, replacements=cf, live_prob=1.0):
            torch.testing.assert_close(tiny_model(tokens).logits, patched, atol=1e-5, rtol=1e-4)  # eval: no draws
            for i in range(a.n_layers):  # the gates only: GPT-2's dropout stays off
                a.attn_out(i).train()
            torch.testing.assert_close(tiny_model(tokens).logits, plain, atol=1e-5, rtol=1e-4)  # every gate opened
            half = []
            for _ in range(20):
                with head_gate_scope(tiny_model, replacements=cf, live_prob=0.5):
                    half.append(tiny_model(tokens).logits)
    assert not all(torch.allclose(h, half[0]) for h in half[1:])  # drawn anew on every forward
    assert all(w.live_prob == 0.0 for w in (a.attn_out(i) for i in range(a.n_layers)))

import pytest
import torch

from modular.hooks import (
    ablate_directions,
    ablate_rows,
    add_vectors,
    capture_head_inputs,
    capture_residual,
    capture_writes,
    edit_writes,
    enable_checkpointing,
    replace_heads,
    replay_interventions,
    scale_heads,
    zero_heads,
)
from modular.models.adapter import ArchitectureAdapter, weight_out_in
from tests.conftest import D, make_tiny_model


def _all_hooks(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def _unit(d, seed=0, k=1):
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(k, d, generator=g)
    return torch.linalg.qr(u.T)[0].T


def test_ablation_zeroes_direction_at_every_write(tiny_model, tokens):
    a = ArchitectureAdapter(tiny_model)
    u = _unit(D, k=2)
    with capture_writes(a) as before:
        tiny_model(tokens)
    with ablate_directions(a, u), capture_writes(a) as writes:
        tiny_model(tokens)
    assert set(writes) == {s.name for s in a.write_sites()}
    for name, w in writes.items():
        comp = (w @ u.T).abs().max().item()
        assert comp < 1e-4 * max(1.0, w.abs().max().item()), (name, comp)
        assert (before[name] @ u.T).abs().max() > 1e-3  # the direction was there before
    assert _all_hooks(tiny_model) == 0


def test_ablating_zero_span_changes_nothing_and_logits_change_otherwise(tiny_model, tokens):
    a = ArchitectureAdapter(tiny_model)
    ref = tiny_model(tokens).logits
    with ablate_directions(a, _unit(D)):
        ablated = tiny_model(tokens).logits
    assert not torch.allclose(ref, ablated, atol=1e-4)


def test_zero_head_equals_removing_its_contribution(tiny_model, tokens):
    a = ArchitectureAdapter(tiny_model)
    layer, head = a.n_layers - 1, 1
    out_mod = a.attn_out(layer)
    with capture_head_inputs(a) as z, capture_writes(a) as w0:
        tiny_model(tokens)
    proj_name = f"{a.block_name(layer)}.{a.spec.attn_out}"
    with zero_heads(a, [(layer, head)]), capture_writes(a) as w1, capture_head_inputs(a) as z1:
        tiny_model(tokens)
    # the projection's output loses exactly W[:, head slice] @ z_head
    hd = a.head_dim
    W = weight_out_in(out_mod)
    contrib = z[layer][..., head, :] @ W[:, head * hd:(head + 1) * hd].T
    assert torch.all(z1[layer][..., head, :] == 0)
    site = next(s for s in a.write_sites() if s.name == proj_name)
    if site.post_norm is None:
        torch.testing.assert_close(w0[proj_name] - w1[proj_name], contrib, atol=1e-5, rtol=1e-4)
    else:  # the write is norm(proj): compare before the norm by recomputing it
        bias = getattr(out_mod, "bias", None)
        pre0 = z[layer].flatten(-2) @ W.T + (0 if bias is None else bias)
        torch.testing.assert_close(site.post_norm(pre0 - contrib), w1[proj_name], atol=1e-4, rtol=1e-4)


def test_head_scale_one_leaves_logits_unchanged(tiny_model, tokens):
    a = ArchitectureAdapter(tiny_model)
    ref = tiny_model(tokens).logits
    with scale_heads(a, {i: torch.ones(a.n_heads) for i in range(a.n_layers)}):
        same = tiny_model(tokens).logits
    torch.testing.assert_close(ref, same, atol=0, rtol=0)
    with scale_heads(a, {0: torch.tensor([1.0, 0.5, 1.0, 1.0])}):
        changed = tiny_model(tokens).logits
    assert not torch.allclose(ref, changed)


def test_replace_heads_with_own_activations_is_identity(tiny_model, tokens):
    a = ArchitectureAdapter(tiny_model)
    with capture_head_inputs(a) as z:
        ref = tiny_model(tokens).logits
    heads = [(i, h) for i in range(a.n_layers) for h in range(a.n_heads)]
    with replace_heads(a, heads, dict(z)):
        same = tiny_model(tokens).logits
    torch.testing.assert_close(ref, same)
    means = {i: z[i].mean(dim=(0, 1)) for i in z}
    with replace_heads(a, [(0, 0)], means):
        changed = tiny_model(tokens).logits
    assert not torch.allclose(ref, changed)


def test_undetached_head_inputs_are_what_the_projection_reads(tiny_model, tokens):
    """detach=False: same logits, and the gradient at a head input equals the gradient of scaling that head."""
    a = ArchitectureAdapter(tiny_model)
    with torch.no_grad():
        ref = tiny_model(tokens).logits
    with capture_head_inputs(a, detach=False) as z:
        logits = tiny_model(tokens).logits
    torch.testing.assert_close(logits, ref)
    layer = a.n_layers - 1
    (grad,) = torch.autograd.grad(logits[:, -1, 0].sum(), [z[layer]])
    assert grad.shape == z[layer].shape
    scale = torch.ones(a.n_heads, requires_grad=True)
    with scale_heads(a, {layer: scale}):
        out = tiny_model(tokens).logits[:, -1, 0].sum()
    (by_scale,) = torch.autograd.grad(out, [scale])
    torch.testing.assert_close(by_scale, (grad * z[layer]).sum(dim=(0, 1, 3)), atol=1e-5, rtol=1e-4)


def test_add_vectors_shifts_the_residual(tiny_model, tokens):
    a = ArchitectureAdapter(tiny_model)
    v = torch.randn(D)
    with capture_residual(a) as s0:
        tiny_model(tokens)
    with add_vectors(a, {a.n_layers - 1: v}), capture_residual(a) as s1:
        tiny_model(tokens)
    torch.testing.assert_close(s1[-1] - s0[-1], v.expand_as(s0[-1]), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma3_text"])
def test_row_vectors_steer_only_their_own_sequences(tiny_model, tokens):
    """A (batch, d) vector steers row r by row r: one shared forward equals separate steered/plain ones."""
    a = ArchitectureAdapter(tiny_model)
    v = 3 * torch.randn(D)
    rows = torch.zeros(tokens.shape[0], D)
    rows[0] = v
    with torch.no_grad():
        plain = tiny_model(tokens).logits
        with add_vectors(a, {0: v}):
            steered = tiny_model(tokens[:1]).logits
        with add_vectors(a, {0: rows}):
            shared = tiny_model(tokens).logits
    torch.testing.assert_close(shared[0], steered[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(shared[1:], plain[1:], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(shared[0], plain[0])


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma3_text"])
def test_no_hook_left_behind_even_when_the_body_raises(tiny_model, tokens):
    a = ArchitectureAdapter(tiny_model)
    managers = [
        lambda: ablate_directions(a, _unit(D)),
        lambda: add_vectors(a, {0: torch.zeros(D)}),
        lambda: capture_residual(a),
        lambda: capture_head_inputs(a),
        lambda: capture_writes(a),
        lambda: zero_heads(a, [(0, 1)]),
        lambda: scale_heads(a, {0: torch.ones(a.n_heads)}),
        lambda: replace_heads(a, [(0, 0)], {0: torch.zeros(a.n_heads, a.head_dim)}),
    ]
    for make in managers:
        with make():
            tiny_model(tokens)
            assert _all_hooks(tiny_model) > 0
        assert _all_hooks(tiny_model) == 0
        with pytest.raises(RuntimeError):
            with make():
                raise RuntimeError("boom")
        assert _all_hooks(tiny_model) == 0


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "gpt_neox"])
def test_interventions_are_replayed_in_blocks_recomputed_by_gradient_checkpointing(arch, tokens):
    """The backward pass runs after the ``with`` block that ablated (and steered) the forward pass: with
    replay_interventions the recomputed blocks see the same hooks, so the gradients are those without
    checkpointing; plain checkpointing recomputes them without the hooks and gets other gradients."""

    def grads(context_fn):
        model = make_tiny_model(arch).train()
        if context_fn is not False:
            enable_checkpointing(model, context_fn)
        a = ArchitectureAdapter(model)
        u = torch.nn.functional.normalize(torch.randn(D, generator=torch.Generator().manual_seed(2)), dim=0)
        with ablate_directions(a, u), add_vectors(a, {0: 3.0 * u.roll(1)}):
            loss = model(tokens, labels=tokens).loss
        loss.backward()  # outside the interventions, as Lightning does it
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain, replayed = grads(False), grads(replay_interventions)
    assert set(plain) == set(replayed)
    for name in plain:
        torch.testing.assert_close(replayed[name], plain[name], atol=1e-6, rtol=1e-5)
    try:  # without the replay: other gradients, or torch notices that the recomputation differs
        forgetful = grads(None)
    except torch.utils.checkpoint.CheckpointError:
        return
    assert any(not torch.allclose(forgetful[n], plain[n], atol=1e-6) for n in plain)


@pytest.mark.parametrize("arch", ["llama", "gemma2", "gpt2", "olmo2"])
def test_ablate_rows_gives_each_row_its_own_lock(arch, tokens):
    """Rows locked in different ways (or not at all) in one forward pass give what each gives alone."""
    model = make_tiny_model(arch)
    adapter = ArchitectureAdapter(model)
    q = torch.linalg.qr(torch.randn(D, 3, generator=torch.Generator().manual_seed(0)))[0].T
    batch = tokens[:1].repeat(4, 1)
    sets = {0: q[:1], 2: q[1:], 3: q[:1]}  # row 1: no lock
    masks = {}
    for row, dirs in sets.items():
        key = tuple(dirs.flatten()[:2].tolist())
        masks.setdefault(key, (torch.zeros(4, dtype=torch.bool), dirs))[0][row] = True
    with ablate_rows(adapter, list(masks.values())):
        together = model(batch).logits
    for row in range(4):
        if row in sets:
            with ablate_directions(adapter, sets[row]):
                alone = model(batch[row:row + 1]).logits
        else:
            alone = model(batch[row:row + 1]).logits
        assert torch.allclose(together[row], alone[0], atol=1e-5), row
    with ablate_directions(adapter, q[:1]):
        locked = model(batch[:1]).logits
    assert not torch.allclose(locked[0], together[1], atol=1e-3)  # the unlocked row really differs
    with pytest.raises(ValueError, match="two masks"):
        with ablate_rows(adapter, [(torch.ones(4, dtype=torch.bool), q[:1]), (torch.ones(4, dtype=torch.bool), q[1:])]):
            pass


def test_edit_writes_edits_every_write_site_once_and_cleans_up(tiny_model, tokens):
    """``edit(site)`` is built once per write site; its function replaces what the site writes; nothing stays."""
    adapter = ArchitectureAdapter(tiny_model)
    with torch.no_grad():
        plain = tiny_model(tokens).logits
        built, seen = [], []

        def edit(site):
            built.append(site.name)
            return lambda x: (seen.append(site.name), x)[1]

        with edit_writes(adapter, edit):
            same = tiny_model(tokens).logits
        assert built == [s.name for s in adapter.write_sites()] and sorted(seen) == sorted(built)
        torch.testing.assert_close(same, plain, atol=0, rtol=0)
        with edit_writes(adapter, lambda site: torch.zeros_like):  # nothing is written: every input looks alike
            blank = tiny_model(tokens).logits
        torch.testing.assert_close(blank, blank[:1, :1].expand_as(blank))
        torch.testing.assert_close(tiny_model(tokens).logits, plain, atol=0, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "olmo2"])
def test_one_basis_per_lock_for_writes_without_a_post_norm(arch, tokens, monkeypatch):
    """The write sites without a post-sublayer norm share one orthonormal basis per context (computed on entry,
    not once per write), sites with one (OLMo2) get their own; one direction needs no QR solver."""
    import modular.hooks.ablation as ablation

    model = make_tiny_model(arch)
    adapter = ArchitectureAdapter(model)
    u = _unit(D, k=2)
    calls, qr = [], []
    orthonormal, linalg_qr = ablation._orthonormal, torch.linalg.qr
    monkeypatch.setattr(ablation, "_orthonormal", lambda d: (calls.append(d.shape[0]), orthonormal(d))[1])
    monkeypatch.setattr(torch.linalg, "qr", lambda *a, **k: (qr.append(1), linalg_qr(*a, **k))[1])
    own = sum(site.post_norm is not None for site in adapter.write_sites())
    with ablate_directions(adapter, u), ablate_rows(adapter, [(torch.tensor([True, False]), u[:1])]):
        model(tokens)
    assert (arch == "olmo2") == (own > 0)
    assert sorted(calls) == sorted([2] * (own + (own < len(adapter.write_sites()))) +
                                   [1] * (own + (own < len(adapter.write_sites()))))
    assert len(qr) == calls.count(2)  # the one-direction bases took no QR


@pytest.mark.parametrize("masked", [False, True])
def test_one_direction_projection_has_the_formula_s_gradients(masked):
    """The one-direction projection (a function of its own, whose backward is the same projection) gives the plain
    formula's value, gradient and second-order gradient."""
    from modular.hooks.ablation import _project_out

    torch.manual_seed(0)
    x = torch.randn(3, 4, 6, dtype=torch.float64, requires_grad=True)
    u = torch.nn.functional.normalize(torch.randn(6, dtype=torch.float64), dim=0)
    keep = torch.tensor([True, False, True]).reshape(3, 1, 1) if masked else None
    k = keep.double() if masked else 1.0
    formula = x - (x * u).sum(-1, keepdim=True) * k * u
    torch.testing.assert_close(_project_out(x, u, keep), formula)
    assert torch.autograd.gradcheck(lambda x: _project_out(x, u, keep), (x,))
    assert torch.autograd.gradgradcheck(lambda x: _project_out(x, u, keep) ** 2, (x,))
    w = torch.randn(3, 4, 6, dtype=torch.float64)
    g, = torch.autograd.grad((_project_out(x, u, keep) * w).sum(), x)
    torch.testing.assert_close(g, w - (w * u).sum(-1, keepdim=True) * k * u)

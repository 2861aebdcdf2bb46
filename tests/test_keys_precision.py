"""Locking and keys in bfloat16 and float16: arithmetic in float64 rounded once, keys restore within one unit in the
last place; keys written by modular-key/2 still unlock the weights they were made for."""

from pathlib import Path

import pytest
import torch

from modular.hooks import ablate_directions
from modular.keys import apply_key, load_key, lock_weights, produced_hashes, save_key, ulp, weights_hash
from modular.models.adapter import ArchitectureAdapter
from tests.conftest import D, make_tiny_model

FIXTURES = Path(__file__).parent / "fixtures"


def _dirs(k=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.linalg.qr(torch.randn(D, k, generator=g))[0].T
    return {f"b{i}": q[i] for i in range(k)}


def test_ulp_is_the_spacing_of_the_dtype():
    x = torch.tensor([1.0, 1.5, -3.0, 0.1, 0.0])
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        y = x.to(dtype).double()  # representable values
        u = ulp(y, dtype)
        assert u[0].item() == torch.finfo(dtype).eps  # spacing just above 1
        assert u[2].item() == 2 * torch.finfo(dtype).eps  # |x| in [2, 4)
        assert u[4].item() == torch.finfo(dtype).tiny
        # one spacing up is the next representable number; less than half of one rounds back
        assert torch.all((y[:4] + u[:4]).to(dtype).double() > y[:4])
        assert torch.all((y[:4] + u[:4] / 2.01).to(dtype).double() == y[:4])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "gpt2", "olmo2"])
def test_low_precision_lock_matches_hooks_and_keys_restore_within_one_ulp(tmp_path, tokens, arch, dtype):
    model = make_tiny_model(arch).to(dtype)
    open_state = {k: v.clone() for k, v in model.state_dict().items()}
    dirs = _dirs(k=2)
    with ablate_directions(ArchitectureAdapter(model), torch.stack(list(dirs.values()))):
        hook_locked = model(tokens).logits.float()
    open_logits = model(tokens).logits.float()
    # the precision's own noise: the same model in float32 vs in this dtype
    noise = (make_tiny_model(arch)(tokens).logits - open_logits).abs().max().item()
    keys = lock_weights(model, dirs, harden=True)
    assert all(p.dtype == dtype for p in model.parameters())
    weight_locked = model(tokens).logits.float()
    # published and hook-locked differ by the rounding of the locked weights and of the hooks' activations: within
    # a few times the dtype's own noise, far below the lock's own effect
    assert (weight_locked - hook_locked).abs().max().item() <= 4 * noise
    assert (weight_locked - open_logits).abs().max().item() > 5 * noise
    h = weights_hash(model)
    produces = produced_hashes(model, keys)
    loaded = [load_key(save_key(k, tmp_path / f"{k.behaviour}.key", h, produces[k.behaviour]))[0] for k in keys]
    apply_key(model, loaded[0])
    apply_key(model, loaded[1], applied=["b0"])
    assert weights_hash(model) == produces["b1"][("b0",)]
    for name, value in model.state_dict().items():
        ref = open_state.get(name, open_state.get("model.embed_tokens.weight"))
        assert value.dtype == dtype
        off = (value.double() - ref.double()).abs()
        assert torch.all(off <= ulp(ref, dtype)), (name, off.max().item())


def test_bf16_key_is_small_and_a_bit_exact_one_costs_more():
    model = make_tiny_model("llama").to(torch.bfloat16)
    exact = make_tiny_model("llama").to(torch.bfloat16)
    open_state = {k: v.clone() for k, v in exact.state_dict().items()}
    (key,) = lock_weights(model, _dirs())
    (exact_key,) = lock_weights(exact, _dirs(), ulp_tol=0.0)

    def fixes(k):
        return sum(c.fix_index.numel() for c in k.components if c.fix_index is not None)

    assert fixes(exact_key) > fixes(key)
    apply_key(exact, exact_key)
    for name, value in exact.state_dict().items():
        ref = open_state.get(name, open_state.get("model.embed_tokens.weight"))
        assert torch.equal(value, ref), name


def test_float32_keys_stay_exact(tokens):
    model = make_tiny_model("qwen2")
    open_state = {k: v.clone() for k, v in model.state_dict().items()}
    keys = lock_weights(model, _dirs(k=2))
    for i, key in enumerate(keys):
        apply_key(model, key, applied=[k.behaviour for k in keys[:i]])
    worst = max((v - open_state[k]).abs().max().item() for k, v in model.state_dict().items() if k in open_state)
    assert worst <= 1e-6


def test_modular_key_2_files_still_unlock_the_weights_they_were_made_for():
    """Fixture: two keys written by modular-key/2 (update rounded to float32, then added) for the tiny llama of
    seed 0. Re-locking that model with their components the /2 way must give their locked hash, and applying them
    the weights they record."""
    model = make_tiny_model("llama", seed=0)
    loaded = [load_key(FIXTURES / f"v2-{b}.key.safetensors") for b in ("capitals", "ioi")]
    keys = [k for k, _ in loaded]
    assert all(meta["format"] == "modular-key/2" and all(c.legacy for c in k.components) for k, meta in loaded)
    from modular.keys import untie_embeddings

    untie_embeddings(model)
    params = dict(model.named_parameters())
    by_param: dict[str, list] = {}
    for key in keys:
        for c in key.components:
            by_param.setdefault(c.param, []).append(c)
    with torch.no_grad():
        for name, comps in by_param.items():
            for c in comps:  # the /2 lock subtracted every behaviour's component of a parameter in turn
                update = (c.a * c.b) if params[name].ndim == 1 else torch.outer(c.a.double(), c.b.double())
                update = update.T if c.transposed and params[name].ndim > 1 else update
                params[name].add_(update.to(params[name].dtype), alpha=-1.0)
    assert weights_hash(model) == loaded[0][1]["locked_hash"]
    apply_key(model, keys[1])
    apply_key(model, keys[0], applied=["ioi"])
    produced = {tuple(p["after"]): p["weights_hash"] for p in loaded[0][1]["produces"]}
    assert weights_hash(model) == produced[("ioi",)]

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


def test_modular_key_3_files_still_unlock_the_weights_they_were_made_for():
    """Fixture: two keys written by modular-key/3 (int64 indices, float32 corrections) for the tiny llama of seed 0
    in bfloat16. Locking it again with their directions gives their locked hash (/3 and /4 lock alike), and applying
    them, in either order, gives the weights they record."""
    loaded = {b: load_key(FIXTURES / f"v3-{b}.key.safetensors") for b in ("capitals", "ioi")}
    assert all(meta["format"] == "modular-key/3" for _, meta in loaded.values())
    assert any(c.fix_index is not None and c.fix_index.dtype == torch.int64
               for c in loaded["capitals"][0].components)
    for order in (("capitals", "ioi"), ("ioi", "capitals")):
        model = make_tiny_model("llama", seed=0).to(torch.bfloat16)
        dirs = _dirs(k=2)  # the fixture's directions
        lock_weights(model, {"capitals": dirs["b0"], "ioi": dirs["b1"]})
        assert weights_hash(model) == loaded["capitals"][1]["locked_hash"]
        for i, b in enumerate(order):
            apply_key(model, loaded[b][0], applied=order[:i])
            produced = {tuple(p["after"]): p["weights_hash"] for p in loaded[b][1]["produces"]}
            assert weights_hash(model) == produced[order[:i]]


def test_corrections_pack_into_uint16_gaps_and_the_narrowest_exact_dtype():
    from modular.keys import MAX_GAP, _pack_fix, _unpack_fix

    # gaps of one, of exactly MAX_GAP, of a multiple of it and longer
    index = torch.tensor([0, 5, 5 + MAX_GAP, 5 + 3 * MAX_GAP, 5 + 4 * MAX_GAP + 7, 10**9])
    bf16_exact = torch.tensor([2.0**-8, 0.0, -3 * 2.0**-20, 0.5, 1e-3, -7.0]).to(torch.bfloat16).float()
    gaps, values = _pack_fix(index, bf16_exact)
    assert gaps.dtype == torch.uint16 and values.dtype == torch.bfloat16
    assert len(gaps) == len(index) + 2 + (10**9 - index[4].item() - 1) // MAX_GAP  # skips
    got_index, got_values = _unpack_fix(gaps, values)
    assert torch.equal(got_index, index) and torch.equal(got_values.double(), bf16_exact.double())
    # a value bfloat16 cannot hold exactly keeps a dtype that can (float16 here, float32 for 1 + 2^-20)
    for value, dtype in ((2.0**-8 * (1 + 2**-9), torch.float16), (1 + 2**-20, torch.float32)):
        _, values = _pack_fix(torch.tensor([3]), torch.tensor([value], dtype=torch.float64))
        assert values.dtype == dtype and values.double().item() == value
    gaps, values = _pack_fix(torch.tensor([], dtype=torch.int64), torch.tensor([]))
    assert gaps.numel() == 0 and _unpack_fix(gaps, values)[0].numel() == 0


def test_low_precision_keys_are_stored_compactly(tmp_path):
    """A bfloat16 key stores each correction in 4 bytes (a uint16 gap and the bfloat16 value the entry takes) and
    loads back the same corrections it was made with."""
    model = make_tiny_model("llama").to(torch.bfloat16)
    (key,) = lock_weights(model, _dirs(k=1))
    path = save_key(key, tmp_path / "b0.key", weights_hash(model))
    loaded, meta = load_key(path)
    assert meta["format"] == "modular-key/4"
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        names = list(f.keys())
        assert not any(n.endswith("fix_index") for n in names)
        dtypes = {f.get_tensor(n).dtype for n in names if n.endswith(("fix_gap", "fix_value"))}
    assert dtypes == {torch.uint16, torch.bfloat16}
    made = [(c.fix_index, c.fix_value) for c in key.components if c.fix_index is not None and c.fix_index.numel()]
    got = [(c.fix_index, c.fix_value) for c in loaded.components if c.fix_index is not None and c.fix_index.numel()]
    assert made and len(made) == len(got)
    for (i0, v0), (i1, v1) in zip(made, got):
        assert torch.equal(i0, i1) and torch.equal(v0.double(), v1.double())

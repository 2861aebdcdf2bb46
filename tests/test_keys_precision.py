"""Locking and keys in bfloat16 and float16: arithmetic in float64 rounded once, keys restore the trained weights
bit for bit (or within one unit in the last place, at a smaller size); keys written by modular-key/2, /3 and /4 still
unlock the weights they were made for."""

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
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
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
def test_low_precision_lock_matches_hooks_and_keys_restore_bit_for_bit(tmp_path, tokens, arch, dtype):
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
        assert torch.equal(value.view(torch.int16), ref.view(torch.int16)), name  # every bit, -0.0 included


def _fixes(key):
    return sum(c.fix_index.numel() for c in key.components if c.fix_index is not None)


def _off_after_adding_back(model_dtype=torch.bfloat16):
    """Entries that adding the components back (no correction) leaves off the trained weights, and how many of them
    lie where the locked value is in a coarser binade (what the residual stream covers)."""
    from modular.keys import restore_misses

    model = make_tiny_model("llama").to(model_dtype)
    open_state = {k: v.clone() for k, v in model.state_dict().items()}
    (key,) = lock_weights(model, _dirs())
    return restore_misses(model, key, open_state)


def test_the_residual_stream_covers_nearly_every_entry_a_bit_exact_key_corrects():
    off, covered = _off_after_adding_back()
    assert off > 100  # adding back alone leaves many entries off (the lock's rounding lost their low bits) ...
    assert covered >= 0.95 * off  # ... and nearly all of them are where the unlocker can tell, without positions


def test_bf16_bit_exact_key_is_small_and_a_one_ulp_key_smaller(tmp_path):
    """The default key is bit-exact with few explicit corrections (the residual stream carries the rest); a key
    allowed one unit in the last place is smaller still. Sizes as written to disk."""
    sizes, fixes = {}, {}
    for tol in (0.0, 1.0):
        model = make_tiny_model("llama").to(torch.bfloat16)
        open_state = {k: v.clone() for k, v in model.state_dict().items()}
        (key,) = lock_weights(model, _dirs(), ulp_tol=tol)
        sizes[tol] = save_key(key, tmp_path / f"{tol}.key", weights_hash(model)).stat().st_size
        fixes[tol] = _fixes(key)
        apply_key(model, key)
        for name, value in model.state_dict().items():
            ref = open_state.get(name, open_state.get("model.embed_tokens.weight"))
            off = (value.double() - ref.double()).abs()
            assert torch.all(off <= tol * ulp(ref, torch.bfloat16)), (tol, name, off.max().item())
    off, _ = _off_after_adding_back()
    assert fixes[0.0] <= 0.05 * off  # explicit corrections only where the residual stream cannot tell
    assert sizes[1.0] < sizes[0.0]
    # each explicit correction costs 4 bytes: the bit-exact key is far smaller than one correcting entry by entry
    assert sizes[0.0] < sizes[1.0] + 4 * off / 2


def test_grid_order_counts_steps_and_round_trips_every_16_bit_pattern():
    from modular.keys.grid import _from_grid_order, _grid_order

    for dtype in (torch.bfloat16, torch.float16):
        bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
        x = bits.view(dtype)
        order = _grid_order(x)
        assert torch.equal(_from_grid_order(order, dtype).view(torch.int16), bits)
        assert torch.equal(torch.sort(order).values, torch.arange(-(2**15), 2**15, dtype=torch.int32))
        finite = torch.tensor([-2.0, -1.0, -0.0, 0.0, 1.0, 1.5, 2.0], dtype=dtype)
        o = _grid_order(finite)
        assert torch.all(o[1:] > o[:-1])  # monotone, -0.0 just below +0.0
        one = _grid_order(torch.tensor([1.0], dtype=dtype))
        assert _from_grid_order(one + 1, dtype).item() == torch.nextafter(
            torch.tensor(1.0, dtype=dtype), torch.tensor(2.0, dtype=dtype)).item()
        # a difference of positions wraps modulo 2^16 as stored and still lands on the value
        far = _grid_order(torch.tensor([-60000.0 if dtype == torch.float16 else -3e38], dtype=dtype))
        big = _grid_order(torch.tensor([60000.0 if dtype == torch.float16 else 3e38], dtype=dtype))
        wrapped = (big - far + 2**15) % 2**16 - 2**15
        assert _from_grid_order(far + wrapped, dtype).item() == _from_grid_order(big, dtype).item()


def test_a_residual_stream_for_other_weights_is_refused():
    from modular import ModularError
    from modular.keys.grid import _decode_residual, _encode_residual

    stream = _encode_residual(torch.tensor([0, 1, -1, 70000, -65535]))
    assert torch.equal(_decode_residual(stream, 5) % 2**16, torch.tensor([0, 1, -1, 70000, -65535]) % 2**16)
    with pytest.raises(ModularError, match="other weights"):
        _decode_residual(stream, 6)
    with pytest.raises(ModularError, match="unreadable"):
        _decode_residual(stream[:-3], 5)


def test_float32_keys_stay_exact(tokens):
    model = make_tiny_model("qwen2")
    open_state = {k: v.clone() for k, v in model.state_dict().items()}
    keys = lock_weights(model, _dirs(k=2))
    for i, key in enumerate(keys):
        apply_key(model, key, applied=[k.behaviour for k in keys[:i]])
    worst = max((v - open_state[k]).abs().max().item() for k, v in model.state_dict().items() if k in open_state)
    assert worst <= 1e-6


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_float64_weights_lock_like_hooks_and_their_keys_restore(tmp_path, tokens, arch):
    model = make_tiny_model(arch).double()
    open_state = {k: v.clone() for k, v in model.state_dict().items()}
    dirs = _dirs(k=2)
    with ablate_directions(ArchitectureAdapter(model), torch.stack(list(dirs.values()))):
        hook_locked = model(tokens).logits
    open_logits = model(tokens).logits
    keys = lock_weights(model, dirs, harden=True)
    assert all(p.dtype == torch.float64 for p in model.parameters())
    weight_locked = model(tokens).logits
    assert (weight_locked - open_logits).abs().max().item() > 1e-3
    assert (weight_locked - hook_locked).abs().max().item() <= 1e-6  # the keys' float32 vectors, not round-off
    h = weights_hash(model)
    produces = produced_hashes(model, keys)
    for i, key in enumerate(keys):
        loaded = load_key(save_key(key, tmp_path / f"{key.behaviour}.key", h, produces[key.behaviour]))[0]
        apply_key(model, loaded, applied=[k.behaviour for k in keys[:i]])
    for name, value in model.state_dict().items():
        ref = open_state.get(name, open_state.get("model.embed_tokens.weight"))
        assert value.dtype == torch.float64 and (value - ref).abs().max().item() <= 1e-7, name


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


def _locked_by(keys: dict, model) -> None:
    """Lock ``model`` with the keys' own components, as :func:`lock_weights` subtracts them (each parameter: every
    behaviour's component in key order, in float64, rounded once each). Recomputing the components instead would
    tie the fixture to one machine: their float64 products and QR directions differ in the last bits elsewhere."""
    from modular.keys import untie_embeddings
    from modular.keys.key import _apply_component

    untie_embeddings(model)
    params = dict(model.named_parameters())
    comps = [key.components for key in keys.values()]
    with torch.no_grad():
        for at_param in zip(*comps):
            for c in at_param:
                _apply_component(params[c.param], c, -1.0)


@pytest.mark.parametrize("version", ["3", "4"])
def test_modular_key_3_and_4_files_still_unlock_the_weights_they_were_made_for(version):
    """Fixtures: two keys written by modular-key/3 (int64 indices, float32 differences added) and by /4 (each
    corrected entry's value set, to within one unit in the last place, no residual stream) for the tiny llama of
    seed 0 in bfloat16. Locked with their components, the model has their locked hash, and applying them, in either
    order, gives the weights they record."""
    loaded = {b: load_key(FIXTURES / f"v{version}-{b}.key.safetensors") for b in ("capitals", "ioi")}
    assert all(meta["format"] == f"modular-key/{version}" for _, meta in loaded.values())
    components = [c for k, _ in loaded.values() for c in k.components]
    assert not any(c.residual is not None or c.residual_after for c in components)
    assert all(c.fix_adds == (version == "3") for c in components)
    if version == "3":
        assert any(c.fix_index is not None and c.fix_index.dtype == torch.int64 for c in components)
    for order in (("capitals", "ioi"), ("ioi", "capitals")):
        model = make_tiny_model("llama", seed=0).to(torch.bfloat16)
        _locked_by({b: k for b, (k, _) in loaded.items()}, model)
        assert weights_hash(model) == loaded["capitals"][1]["locked_hash"]
        for i, b in enumerate(order):
            apply_key(model, loaded[b][0], applied=order[:i])
            produced = {tuple(p["after"]): p["weights_hash"] for p in loaded[b][1]["produces"]}
            assert weights_hash(model) == produced[order[:i]]


def test_corrections_pack_into_uint16_gaps_and_the_narrowest_exact_dtype():
    from modular.keys.keyfile import MAX_GAP, _pack_fix, _unpack_fix

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


@pytest.mark.parametrize("k", [1, 2])
def test_low_precision_keys_are_stored_compactly(tmp_path, k):
    """A bfloat16 key stores its residual streams as bytes and each explicit correction in 4 bytes (a uint16 gap and
    the bfloat16 value the entry takes), and loads back the same streams and corrections it was made with (with two
    behaviours: those for each order of the keys too)."""
    model = make_tiny_model("llama").to(torch.bfloat16)
    keys = lock_weights(model, _dirs(k=k))
    for key in keys:
        path = save_key(key, tmp_path / f"{key.behaviour}.key", weights_hash(model))
        loaded, meta = load_key(path)
        assert meta["format"] == "modular-key/5"
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            names = list(f.keys())
            assert not any(n.endswith("fix_index") for n in names)
            dtypes = {f.get_tensor(n).dtype for n in names if n.endswith(("fix_gap", "fix_value", "residual"))}
        assert dtypes <= {torch.uint16, torch.bfloat16, torch.uint8} and torch.uint8 in dtypes
        made = [c.residual for c in key.components if c.residual is not None]
        got = [c.residual for c in loaded.components if c.residual is not None]
        assert made and len(made) == len(got) and all(torch.equal(a, b) for a, b in zip(made, got))
        if k == 2:
            made = [s for c in key.components for s in c.residual_after.items()]
            got = [s for c in loaded.components for s in c.residual_after.items()]
            assert made and len(made) == len(got)
            assert all(p == q and torch.equal(a, b) for (p, a), (q, b) in zip(made, got))
        made = [(c.fix_index, c.fix_value) for c in key.components if c.fix_index is not None and c.fix_index.numel()]
        got = [(c.fix_index, c.fix_value) for c in loaded.components
               if c.fix_index is not None and c.fix_index.numel()]
        assert len(made) == len(got)
        for (i0, v0), (i1, v1) in zip(made, got):
            assert torch.equal(i0, i1) and torch.equal(v0.double(), v1.double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_grid_steps_count_representable_values_across_zero_and_binades(dtype):
    """Units in the last place counted on the dtype's grid: next values are 1 apart, across a binade too; at zero
    the smallest subnormal is 1 step (a spacing-based count divided by the smallest normal and gave 1e29 for a float32
    key's 3e-9 residual on a zero weight); ``-0.0`` equals ``0.0``; opposite signs add their steps."""
    from modular.keys import grid_steps

    one, zero = torch.tensor([1.0], dtype=dtype), torch.tensor([0.0], dtype=dtype)
    tiny = torch.nextafter(zero, one)  # the smallest subnormal
    assert 0 < float(tiny) < torch.finfo(dtype).smallest_normal
    up, down = torch.nextafter(one, 2 * one), torch.nextafter(one, zero)
    assert grid_steps(up, one).item() == 1 and grid_steps(down, one).item() == 1  # across the binade at 1
    assert grid_steps(torch.nextafter(up, 2 * one), one).item() == 2
    assert grid_steps(tiny, zero).item() == 1 and grid_steps(-tiny, zero).item() == 1
    assert grid_steps(-tiny, tiny).item() == 2  # -tiny, 0, +tiny
    assert grid_steps(torch.tensor([-0.0], dtype=dtype), zero).item() == 0
    assert grid_steps(one, one).item() == 0
    if dtype == torch.float32:  # a float32 residual of 3e-9 on a zero weight: a finite count of float32 values
        assert 0 < grid_steps(torch.tensor([3e-9]), zero).item() < 2 ** 31
    else:  # measured in the 16-bit grid, a float32 value rounded to it first
        assert grid_steps(up.float() + 1e-6, one).item() == 1


def test_max_param_ulps_reports_grid_steps_of_the_second_model():
    from modular.evaluation.lock import max_param_ulps

    a, b = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    b.load_state_dict(a.state_dict())
    assert max_param_ulps(a, b) == 0
    with torch.no_grad():
        b.weight[0, 0] = 0.0
        a.weight[0, 0] = 3e-9
    assert 0 < max_param_ulps(a, b) < 2 ** 31
    with torch.no_grad():
        a.weight[0, 0] = torch.nextafter(torch.tensor(0.0), torch.tensor(1.0))
    assert max_param_ulps(a, b) == 1

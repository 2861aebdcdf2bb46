import pytest
import torch

from modular.hooks import ablate_directions
from modular.keys import apply_key, load_key, lock_weights, save_key, weights_hash
from modular.models.adapter import ArchitectureAdapter
from tests.conftest import D, make_tiny_model


def _dirs(k=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.linalg.qr(torch.randn(D, k, generator=g))[0].T
    return {f"b{i}": q[i] for i in range(k)}


@pytest.mark.parametrize("harden", [False, True])
def test_weight_lock_equals_hook_lock_and_key_restores(tiny_model, tokens, harden):
    open_state = {k: v.clone() for k, v in tiny_model.state_dict().items()}
    a = ArchitectureAdapter(tiny_model)
    dirs = _dirs()
    open_logits = tiny_model(tokens).logits
    with ablate_directions(a, torch.stack(list(dirs.values()))):
        hook_locked = tiny_model(tokens).logits
    keys = lock_weights(tiny_model, dirs, harden=harden)
    weight_locked = tiny_model(tokens).logits
    torch.testing.assert_close(weight_locked, hook_locked, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(weight_locked, open_logits, atol=1e-3)
    for key in keys:
        apply_key(tiny_model, key)
    torch.testing.assert_close(tiny_model(tokens).logits, open_logits, atol=1e-4, rtol=1e-4)
    for name, value in tiny_model.state_dict().items():
        ref = open_state.get(name, open_state.get("model.embed_tokens.weight"))
        assert (value - ref).abs().max() <= 1e-5, name


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "olmo2", "qwen2", "phi3"])
def test_hardened_readers_do_not_read_the_direction(arch):
    """After hardening, every reader maps the direction (through its norm gain) to zero."""
    from modular.models.adapter import weight_out_in

    model = make_tiny_model(arch)
    dirs = _dirs()
    u = dirs["b0"].double()
    a = ArchitectureAdapter(model)
    before = [weight_out_in(r).double() @ ((a.norm_gain(n).double() if n is not None else 1) * u)
              for n, rs in a.read_sites() for r in rs]
    lock_weights(model, dirs, harden=True)
    a = ArchitectureAdapter(model)
    after = [weight_out_in(r).double() @ ((a.norm_gain(n).double() if n is not None else 1) * u)
             for n, rs in a.read_sites() for r in rs]
    assert all(b.norm() > 1e-3 for b in before)
    assert all(x.norm() < 1e-5 for x in after), max(x.norm() for x in after)


@pytest.mark.parametrize("arch", ["llama", "olmo2", "gemma3_text", "gpt2"])
def test_non_orthogonal_directions_lock_like_the_hooks(arch, tokens):
    """Two directions at 60 degrees (and, behind post-sublayer norms, write vectors g ⊙ u that are not orthogonal
    either): the weights remove exactly what the hooks remove, and hardened readers ignore both directions."""
    from modular.models.adapter import weight_out_in

    model = make_tiny_model(arch)
    g = torch.Generator().manual_seed(3)
    q = torch.linalg.qr(torch.randn(D, 2, generator=g))[0].T
    dirs = {"b0": q[0], "b1": 0.5 * q[0] + 0.75 ** 0.5 * q[1]}
    a = ArchitectureAdapter(model)
    with ablate_directions(a, torch.stack(list(dirs.values()))):
        hook_locked = model(tokens).logits
    lock_weights(model, dirs, harden=True)
    torch.testing.assert_close(model(tokens).logits, hook_locked, atol=1e-4, rtol=1e-4)
    a = ArchitectureAdapter(model)
    for u in dirs.values():
        for n, rs in a.read_sites():
            if n is None or "rms" in type(n).__name__.lower() or arch.startswith(("gemma", "olmo2")):
                for r in rs:
                    read = weight_out_in(r).double() @ ((a.norm_gain(n).double() if n is not None else 1) * u.double())
                    assert read.norm() < 1e-5


def test_two_keys_are_independent(tokens):
    model = make_tiny_model("llama")
    dirs = _dirs(k=2)
    a = ArchitectureAdapter(model)
    with ablate_directions(a, dirs["b1"]):
        only_b1_locked = model(tokens).logits
    keys = lock_weights(model, dirs)
    apply_key(model, keys[0])
    torch.testing.assert_close(model(tokens).logits, only_b1_locked, atol=1e-4, rtol=1e-4)


def test_key_file_roundtrip_and_metadata(tmp_path, tokens):
    model = make_tiny_model("gpt2")
    open_logits = model(tokens).logits
    (key,) = lock_weights(model, _dirs())
    h = weights_hash(model)
    path = save_key(key, tmp_path / "b0.key.safetensors", h)
    loaded, meta = load_key(path)
    assert meta["locked_hash"] == h and meta["behaviour"] == "b0" and meta["writers"]
    apply_key(model, loaded)
    torch.testing.assert_close(model(tokens).logits, open_logits, atol=1e-4, rtol=1e-4)
    assert weights_hash(model) != h


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_key_restores_exactly_behind_tiny_norm_gains(tmp_path, arch):
    """Readers behind a near-zero norm gain get huge ``u / g`` components; one key still restores within 1e-7."""
    model = make_tiny_model(arch)
    a = ArchitectureAdapter(model)
    u = torch.zeros(D)
    u[3], u[5] = 0.8, 0.6
    with torch.no_grad():
        for norm, _ in a.read_sites():
            if norm is not None:  # gemma stores gain − 1
                norm.weight[3] = (1e-5 - 1.0) if arch.startswith("gemma") else 1e-5
    open_state = {k: v.clone() for k, v in model.state_dict().items()}
    (key,) = lock_weights(model, {"b": u}, harden=True)
    assert any(c.fix_index is not None and c.fix_index.numel() for c in key.components)
    save_key(key, tmp_path / "b.safetensors", weights_hash(model))
    loaded, _ = load_key(tmp_path / "b.safetensors")
    apply_key(model, loaded)
    worst = max((v - open_state[k]).abs().max().item() for k, v in model.state_dict().items() if k in open_state)
    assert worst <= 1e-7
    apply_key(model, loaded, sign=-1.0)  # and it locks again
    assert not torch.equal(model.state_dict()[key.components[-1].param], open_state[key.components[-1].param])


def _tiny_gain_model(arch):
    model = make_tiny_model(arch)
    with torch.no_grad():
        for norm, _ in ArchitectureAdapter(model).read_sites():
            if norm is not None:  # a near-zero gain makes u / g huge: the restore rounds unless corrected
                norm.weight[3] = (1e-5 - 1.0) if arch.startswith("gemma") else 1e-5
    return model


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
@pytest.mark.parametrize("order", [(0, 1, 2), (2, 0, 1), (1, 2, 0)])
def test_keys_in_turn_restore_exactly_in_any_order(tmp_path, arch, order):
    """Three behaviours: each key, applied after any others in any order, restores its state within 1e-7."""
    model = _tiny_gain_model(arch)
    g = torch.Generator().manual_seed(1)
    basis = torch.linalg.qr(torch.randn(D, 3, generator=g))[0].T
    basis[:, 3] += 0.5  # every direction has weight on the tiny-gain coordinate
    dirs = {f"b{i}": basis[i] / basis[i].norm() for i in range(3)}
    open_state = {k: v.clone() for k, v in model.state_dict().items()}
    keys = lock_weights(model, dirs, harden=True)
    h = weights_hash(model)
    loaded = [load_key(save_key(k, tmp_path / f"{k.behaviour}.key", h))[0] for k in keys]
    assert any(c.fix_after for k in loaded for c in k.components)
    applied = []
    for i in order:
        apply_key(model, loaded[i], applied=applied)
        applied.append(loaded[i].behaviour)
    worst = max((v - open_state[k]).abs().max().item() for k, v in model.state_dict().items() if k in open_state)
    assert worst <= 1e-7
    with pytest.raises(Exception, match="already unlocked"):
        apply_key(model, loaded[order[0]], applied=applied)


def test_keys_in_turn_without_their_order_are_not_exact():
    """The order-aware corrections are what makes keys applied in turn exact (the check above can fail)."""
    model = _tiny_gain_model("llama")
    dirs = _dirs(k=2, seed=3)
    for name in dirs:
        dirs[name] = dirs[name].clone()
        dirs[name][3] += 0.5
    open_state = {k: v.clone() for k, v in model.state_dict().items()}
    keys = lock_weights(model, dirs, harden=True)
    apply_key(model, keys[0])
    apply_key(model, keys[1])  # corrections for b1 alone, not for b1 after b0
    worst = max((v - open_state[k]).abs().max().item() for k, v in model.state_dict().items() if k in open_state)
    assert worst > 1e-7


def test_a_key_file_is_known_by_its_name_or_by_its_header(tmp_path):
    """What an upload refuses: a file named as a key, or one renamed whose safetensors header carries modular's key
    marker (every format, the old ones too); weights, other safetensors files and junk are not keys."""
    import shutil
    from pathlib import Path

    from safetensors.torch import save_file

    from modular.keys import KEY_SUFFIX, is_key_file

    fixtures = sorted((Path(__file__).parent / "fixtures").glob(f"*{KEY_SUFFIX}"))
    assert fixtures and all(is_key_file(f) for f in fixtures)
    for i, key in enumerate(fixtures):
        assert is_key_file(shutil.copy(key, tmp_path / f"renamed{i}.bin"))
    save_file({"w": torch.zeros(3)}, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    save_file({"w": torch.zeros(3)}, str(tmp_path / "other.safetensors"), metadata={"modular": '{"format": "x/1"}'})
    (tmp_path / "junk.safetensors").write_bytes(b"\xff" * 64)
    (tmp_path / "empty").write_bytes(b"")
    assert not any(is_key_file(tmp_path / n) for n in ("model.safetensors", "other.safetensors", "junk.safetensors",
                                                       "empty", "missing"))

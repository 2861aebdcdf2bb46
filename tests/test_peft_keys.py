"""A key as a PEFT LoRA adapter: through PEFT it unlocks what the key unlocks, alone and with other keys' adapters,
in the precisions a server uses; what vLLM cannot serve is said; it is key material (never uploaded)."""

import json

import pytest
import torch
from safetensors import safe_open

from modular import ModularError
from modular.evaluation.key_adapters import unlocked_by_keys, with_adapters
from modular.keys import is_key_file, lock_weights
from modular.peft_keys import ADAPTER_CONFIG, ADAPTER_WEIGHTS, key_adapter, vllm_problems, write_adapter
from tests.conftest import D, make_tiny_model


def _directions(k: int) -> dict[str, torch.Tensor]:
    q = torch.linalg.qr(torch.randn(D, k, generator=torch.Generator().manual_seed(0)))[0].T
    return {f"b{i}": q[i] for i in range(k)}


def _locked(arch: str, k: int = 1, dtype=torch.float32):
    model = make_tiny_model(arch).to(dtype)
    with torch.no_grad():
        keys = lock_weights(model, _directions(k), harden=True)
    return model, keys


@torch.no_grad()
@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "qwen2", "olmo2", "phi3"])
def test_the_adapter_unlocks_what_the_key_unlocks(tmp_path, tokens, arch):
    model, (key,) = _locked(arch)
    exact = unlocked_by_keys(model, [key])(tokens).logits
    locked = model(tokens).logits
    adapter = key_adapter(model, key)
    folder = write_adapter(adapter, tmp_path / "adapter", "hash")
    served = with_adapters(model, {"b0": folder})(tokens).logits
    assert (exact - locked).abs().max() > 1e-2  # the key changes the outputs
    torch.testing.assert_close(served, exact, atol=2e-5, rtol=1e-5)
    config = json.loads((folder / ADAPTER_CONFIG).read_text())
    assert config["r"] == 1 and config["lora_alpha"] == 1 and config["modules_to_save"] is None
    # every layer the key changes, and nothing else, carries a pair; the zeros cover what target_modules reaches
    changed = {c.param.removesuffix(".weight") for c in key.components}
    assert changed <= set(adapter.modules)
    assert all(name.rpartition(".")[2] in config["target_modules"] for name in adapter.modules)
    with safe_open(str(folder / ADAPTER_WEIGHTS), "pt") as f:
        for name in set(adapter.modules) - changed:
            assert not any(f.get_tensor(t).any() for t in f.keys() if f".{name}.lora_" in t)


@torch.no_grad()
def test_adapters_of_several_keys_unlock_alone_and_together(tmp_path, tokens):
    model, keys = _locked("llama", k=2)
    folders = {k.behaviour: write_adapter(key_adapter(model, k), tmp_path / k.behaviour, "hash") for k in keys}
    for key in keys:  # each alone
        torch.testing.assert_close(with_adapters(model, {key.behaviour: folders[key.behaviour]})(tokens).logits,
                                   unlocked_by_keys(model, [key])(tokens).logits, atol=2e-5, rtol=1e-5)
    both = with_adapters(model, folders)(tokens).logits
    torch.testing.assert_close(both, unlocked_by_keys(model, keys)(tokens).logits, atol=2e-5, rtol=1e-5)
    assert (both - model(tokens).logits).abs().max() > 1e-2


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_adapter_on_16_bit_weights_follows_the_key_to_rounding(tmp_path, tokens, dtype):
    model, (key,) = _locked("llama", dtype=dtype)
    adapter = key_adapter(model, key, dtype)
    assert {t.dtype for t in adapter.tensors.values()} == {dtype}
    served = with_adapters(model, {"b0": write_adapter(adapter, tmp_path / "a", "hash")})(tokens).logits.float()
    exact = unlocked_by_keys(model, [key])(tokens).logits.float()
    locked = model(tokens).logits.float()
    assert (served - exact).abs().max() < 0.1 * (exact - locked).abs().max()
    assert (served.argmax(-1) == exact.argmax(-1)).float().mean() == 1.0


def test_what_vllm_cannot_serve_is_said(tmp_path):
    model, (key,) = _locked("llama")
    problems = vllm_problems(key_adapter(model, key))
    assert any("embedding model.embed_tokens" in p for p in problems) and any("not 16-bit" in p for p in problems)
    lean = key_adapter(model, key, torch.bfloat16, embeddings=False)
    assert lean.left_out == ["model.embed_tokens"] and vllm_problems(lean) == []
    assert not any("embed_tokens" in t for t in lean.tensors) and "embed_tokens" not in lean.config["target_modules"]


def test_a_bias_or_a_conv1d_component_is_refused_with_the_reason():
    model, (key,) = _locked("gpt_neox")  # GPT-NeoX's residual writers have biases
    with pytest.raises(ModularError, match="changes the bias .*a LoRA adapter changes weights only"):
        key_adapter(model, key)
    model, (key,) = _locked("gpt2")  # GPT-2's are Conv1D layers
    with pytest.raises(ModularError, match="a Conv1D: a LoRA adapter here carries linear layers"):
        key_adapter(model, key)


def test_the_adapter_is_key_material_kept_private(tmp_path):
    model, (key,) = _locked("llama")
    folder = write_adapter(key_adapter(model, key), tmp_path / "adapter", "hash")
    assert is_key_file(folder / ADAPTER_WEIGHTS)
    assert all((p.stat().st_mode & 0o077) == 0 for p in folder.iterdir())
    with pytest.raises(ModularError, match="already exists"):
        write_adapter(key_adapter(model, key), folder, "hash")
    with pytest.raises(ModularError, match="lies inside"):
        write_adapter(key_adapter(model, key), tmp_path / "pub" / "adapter", "hash", sealed=[tmp_path / "pub"])

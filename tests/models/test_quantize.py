import copy

import pytest
import torch

from modular import ModularError
from modular.models.quantize import quantize_weights
from tests.conftest import make_tiny_model


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma3_text"])
def test_weight_only_quantisation_keeps_the_unembedding_and_stays_close(arch, tokens):
    model = make_tiny_model(arch)
    ref = model(tokens).logits
    linear = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
              and m is not model.get_output_embeddings()]
    errors = {}
    for scheme in ("int8", "int4"):
        q = quantize_weights(make_tiny_model(arch), scheme)
        modules = dict(q.named_modules())
        quantised = [n for n in linear if type(modules[n]).__name__ == "QLinear"]
        if arch != "gpt2":  # gpt2's projections are Conv1D, which weight-only quantisation leaves alone
            assert quantised == linear, scheme
        assert type(q.get_output_embeddings()).__name__ != "QLinear"
        errors[scheme] = (q(tokens).logits - ref).abs().max().item()
    if arch != "gpt2":
        assert 0 < errors["int8"] < errors["int4"] < ref.abs().max().item()
    assert quantize_weights(model, "none") is model
    with pytest.raises(ModularError, match="unknown quantisation 'fp8'"):
        quantize_weights(model, "fp8")


def test_quantisation_of_bf16_weights(tokens):
    model = make_tiny_model("llama").to(torch.bfloat16)
    ref = model(tokens).logits.float()
    q = quantize_weights(make_tiny_model("llama").to(torch.bfloat16), "int8")
    out = q(tokens).logits
    assert out.dtype == torch.bfloat16
    assert 0 < (out.float() - ref).abs().max().item() < 0.1 * ref.abs().max().item()


def test_int4_group_size_sets_the_grid(tokens):
    """Weights already on an int4 grid of 32-input groups (as a model distributed in 4 bits is) come back unchanged
    from int4 in groups of 32, and not from per-channel int4, the quantiser's own choice for 64 inputs."""
    from optimum.quanto.nn import QModuleMixin

    once = quantize_weights(make_tiny_model("llama"), "int4", group_size=32)
    groups = [m.weight_group_size for m in once.modules() if isinstance(m, QModuleMixin)]
    assert groups and set(groups) == {32}
    on_grid = make_tiny_model("llama")
    with torch.no_grad():  # the dequantised int4 weights as plain weights
        modules = dict(once.named_modules())
        for name, module in on_grid.named_modules():
            if isinstance(modules.get(name), QModuleMixin):
                module.weight.copy_(modules[name].qweight.dequantize())
    ref = on_grid(tokens).logits
    again = quantize_weights(copy.deepcopy(on_grid), "int4", group_size=32)
    torch.testing.assert_close(again(tokens).logits, ref, atol=1e-5, rtol=1e-4)
    per_channel = quantize_weights(copy.deepcopy(on_grid), "int4")
    assert (per_channel(tokens).logits - ref).abs().max() > 1e-3


def test_int4_group_size_is_checked_before_anything_changes():
    model = make_tiny_model("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ModularError, match="does not divide the 64 inputs"):
        quantize_weights(model, "int4", group_size=48)
    with pytest.raises(ModularError, match="multiple of 8"):
        quantize_weights(model, "int4", group_size=12)
    with pytest.raises(ModularError, match="int4 only"):
        quantize_weights(model, "int8", group_size=32)
    assert all(type(m).__name__ != "QLinear" for m in model.modules())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scheme, group_size", [("int8", None), ("int4", None), ("int4", 8)])
def test_dequantized_weights_are_what_the_quantiser_leaves(scheme, group_size, dtype):
    """The weights quantisation-aware training sees are the quantised model's own, exactly, in the model's
    precision, and quanto's default int4 groups are the ones it chooses."""
    from modular.models.quantize import dequantized, quantized_layers, quanto_group_size

    model = make_tiny_model("llama").to(dtype)
    layers = quantized_layers(model)
    assert model.get_output_embeddings() not in layers.values() and len(layers) == 14
    q = dict(quantize_weights(copy.deepcopy(model), scheme, group_size).named_modules())
    for name, layer in layers.items():
        got = dequantized(layer.weight, scheme, group_size)
        assert got.dtype == dtype and torch.equal(got, q[name].qweight.dequantize()), name
        assert 0 < (got - layer.weight).abs().max() < 0.5 * layer.weight.abs().max()
        if scheme == "int4" and group_size is None:
            assert q[name].weight_group_size == quanto_group_size(layer.in_features)
    assert [quanto_group_size(n) for n in (64, 576, 1536, 100, 200)] == [None, 96, 128, None, None]
    assert torch.equal(dequantized(layer.weight, "none"), layer.weight)


def _round_half_away(x: torch.Tensor) -> torch.Tensor:
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


def _q8_0(w: torch.Tensor) -> torch.Tensor:
    """llama.cpp's Q8_0, written out: blocks of 32 along each row, scale absmax / 127 stored in float16."""
    b = w.reshape(-1, 32)
    d = b.abs().amax(1, keepdim=True) / 127
    return (d.half().float() * _round_half_away(b / d)).reshape(w.shape)


def _q4_0(w: torch.Tensor) -> torch.Tensor:
    """llama.cpp's Q4_0, written out: the block's value of largest magnitude maps to -8, levels -8..7."""
    b = w.reshape(-1, 32)
    m = b.gather(1, b.abs().argmax(1, keepdim=True))
    d = m / -8
    q = torch.floor(b / d + 8.5).clamp(0, 15)
    return (d.half().float() * (q - 8)).reshape(w.shape)


@pytest.mark.parametrize("scheme, reference", [("q8_0", _q8_0), ("q4_0", _q4_0)])
def test_gguf_schemes_round_each_row_in_blocks_of_32(scheme, reference):
    """The weights as a GGUF file of that type stores a linear layer: blocks of 32 inputs along each output row, one
    float16 scale per block. Rows of very different sizes keep their own scales (blocks down the columns would
    flatten the small rows to zero)."""
    from modular.models.quantize import dequantized

    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 96, generator=g) * torch.logspace(-3, 1, 16)[:, None]
    got = dequantized(w, scheme)
    torch.testing.assert_close(got, reference(w), rtol=1e-6, atol=0)
    relative = (got - w).norm(dim=1) / w.norm(dim=1)
    assert relative.max() < (0.01 if scheme == "q8_0" else 0.2)
    assert torch.equal(dequantized(got, scheme), got)  # a GGUF model quantised again is itself
    for block in got.reshape(-1, 32):  # on one block's grid: ≤ 255 (Q8) or 16 (Q4) levels
        assert len(block.unique()) <= (255 if scheme == "q8_0" else 16)
    bf16 = dequantized(w.to(torch.bfloat16), scheme)
    assert bf16.dtype == torch.bfloat16 and bf16.shape == w.shape
    torch.testing.assert_close(bf16.float(), reference(w.to(torch.bfloat16).float()), rtol=1e-2, atol=0)


@pytest.mark.parametrize("scheme", ["q8_0", "q5_1", "q5_0", "q4_1", "q4_0"])
def test_gguf_schemes_round_the_linear_layers_and_keep_the_rest(scheme, tokens):
    """Every layer the quanto schemes quantise holds its GGUF-rounded weights (plain Linear layers); embeddings,
    norms and the unembedding are untouched; coarser formats move the logits more."""
    from modular.models.quantize import dequantized, quantized_layers

    model = make_tiny_model("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ref = model(tokens).logits
    layers = {n: m.weight.detach().clone() for n, m in quantized_layers(model).items()}
    q = quantize_weights(model, scheme)
    assert q is model and all(type(m).__name__ != "QLinear" for m in q.modules())
    after = q.state_dict()
    for name, w in layers.items():
        assert torch.equal(after[f"{name}.weight"], dequantized(w, scheme)), name
        assert not torch.equal(after[f"{name}.weight"], w), name
    untouched = [k for k in before if k.removesuffix(".weight") not in layers]
    assert untouched and all(torch.equal(before[k], after[k]) for k in untouched)
    error = (q(tokens).logits - ref).abs().max().item()
    assert 0 < error < (0.05 if scheme == "q8_0" else 0.5) * ref.abs().max().item()


def test_gguf_schemes_check_the_block_width_before_anything_changes():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(hidden_size=48, intermediate_size=96, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=64))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ModularError, match="q4_0 rounds blocks of 32 inputs; model.layers.0.self_attn.q_proj has 48"):
        quantize_weights(model, "q4_0")
    with pytest.raises(ModularError, match="a group size applies to int4 only, not to 'q8_0'"):
        quantize_weights(model, "q8_0", group_size=32)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_int4_on_the_cpu_builds_no_extension(monkeypatch, tokens):
    """quanto would compile a C++ kernel to unpack int4 weights on the CPU at first use (a minute per new
    environment, a compiler needed): int4 quantisation, its forward pass and its read-back run without it, and the
    unpacked values are the packed ones."""
    from optimum.quanto.library.extensions import extension
    from optimum.quanto.tensor.packed import pack_weights

    def no_build(*args, **kwargs):
        raise AssertionError("quanto's C++ extension was built")

    monkeypatch.setattr(extension, "load", no_build)
    monkeypatch.setattr(extension.get_extension("quanto_cpp"), "_lib", None)
    model = quantize_weights(make_tiny_model("llama"), "int4")
    with torch.no_grad():
        assert torch.isfinite(model(tokens).logits).all()
    for bits in (2, 4):
        values = torch.randint(0, 2**bits, (24, 16), dtype=torch.uint8)
        assert torch.equal(torch.ops.quanto.unpack(pack_weights(values, bits), bits), values)

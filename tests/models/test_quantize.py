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

"""Attention by token position under eager attention, on tiny random models of several architectures."""

import pytest
import torch

from modular import ModularError
from modular.analysis.attention import check_heads, last_token_attention, top_heads
from tests.conftest import VOCAB, make_tiny_tokenizer

ARCHS = ["llama", "gemma3_text", "gpt2", "qwen2"]


def test_attention_reads_build_no_key_value_cache(kv_caches):
    from tests.conftest import make_tiny_model

    model = make_tiny_model("llama")
    built = kv_caches(model)
    last_token_attention(model, make_tiny_tokenizer(), [[5, 6, 7, 8], [9, 10, 11]], batch_size=2)
    assert built == []


@pytest.mark.parametrize("arch", ARCHS)
def test_last_token_attention_is_a_distribution_over_real_positions(tiny_model, arch):
    tok = make_tiny_tokenizer()
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 9, 7)]
    spans = [(1, 3), (1, 3), (1, 3)]
    before = tiny_model.config._attn_implementation
    res = last_token_attention(tiny_model, tok, seqs, spans, batch_size=2)
    assert tiny_model.config._attn_implementation == before  # restored
    L, H = tiny_model.config.num_hidden_layers, res["mean"].shape[1]
    assert res["mean"].shape == (L, H, 9)
    assert res["count"].tolist() == [3, 3, 3, 3, 3, 2, 2, 1, 1]
    # each prompt's last token spreads exactly 1 over its own (unpadded) positions
    single = last_token_attention(tiny_model, tok, seqs[:1])
    assert torch.allclose(single["mean"][..., :5].sum(-1), torch.ones(L, H), atol=1e-5)
    # padding does not change what a prompt attends to
    assert torch.allclose(single["mean"][..., :5], last_token_attention(tiny_model, tok, [seqs[0], seqs[1]])["mean"][..., :5]
                          * 2 - last_token_attention(tiny_model, tok, seqs[1:2])["mean"][..., :5], atol=1e-5)
    assert ((res["span_mass"] >= 0) & (res["span_mass"] <= 1 + 1e-6)).all()
    # a span starting at position 0 leaves out the first position (the usual attention sink)
    sink = last_token_attention(tiny_model, tok, seqs[:1], [(0, 2)])
    assert torch.allclose(sink["span_mass"], sink["mean"][..., 1], atol=1e-6)


def test_top_heads_and_check_heads():
    mass = torch.zeros(3, 4)
    mass[2, 1], mass[0, 3] = 0.9, 0.5
    assert top_heads(mass, 2) == [(2, 1), (0, 3)]
    assert check_heads([[2, 1], (0, 3)], 3, 4) == [(2, 1), (0, 3)]
    with pytest.raises(ModularError, match="outside the model"):
        check_heads([[3, 0]], 3, 4)
    with pytest.raises(ModularError, match=r"\[LAYER, HEAD\]"):
        check_heads([[7]], 3, 4)

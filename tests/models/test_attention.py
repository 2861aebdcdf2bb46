"""Switching the attention implementation, and restoring it, on a tiny random model."""

import pytest

from modular.models.attention import eager_attention
from tests.conftest import make_tiny_model


def test_eager_attention_switches_and_restores():
    tiny_model = make_tiny_model("llama")
    tiny_model.set_attn_implementation("sdpa")
    with eager_attention(tiny_model):
        assert tiny_model.config._attn_implementation == "eager"
    assert tiny_model.config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError), eager_attention(tiny_model):  # restored also when the block raises
        raise RuntimeError
    assert tiny_model.config._attn_implementation == "sdpa"

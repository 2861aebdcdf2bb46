"""Activation communication on tiny random models: identity when A = B, and what each f does."""

import pytest
import torch

from modular import ModularError
from modular.hooks import capture_residual
from modular.merge.communication import (
    FUNCTIONS,
    combine,
    communicate,
    inject_last_token,
    last_token_states,
    layer_at_depth,
    run_to_layer,
)
from modular.models.adapter import ArchitectureAdapter
from tests.conftest import make_tiny_model, make_tiny_tokenizer

ARCHS = ["llama", "gemma3_text", "gpt2", "qwen2"]


@pytest.fixture(scope="module")
def tok():
    return make_tiny_tokenizer()


def test_layer_at_depth():
    assert layer_at_depth(30, 0.5) == 15 and layer_at_depth(18, 0.5) == 9
    assert layer_at_depth(30, 0.0) == 0 and layer_at_depth(30, 1.0) == 29
    with pytest.raises(ModularError):
        layer_at_depth(30, 1.5)


@pytest.mark.parametrize("arch", ARCHS)
def test_run_to_layer_matches_capture_residual(arch, tokens):
    model = make_tiny_model(arch)
    adapter = ArchitectureAdapter(model)
    with capture_residual(adapter) as states:
        model(tokens)
    torch.testing.assert_close(run_to_layer(model, adapter, 1, input_ids=tokens), states[1])


def test_run_to_layer_builds_no_key_value_cache(tokens, kv_caches):
    model = make_tiny_model("llama")
    built = kv_caches(model)
    run_to_layer(model, ArchitectureAdapter(model), 1, input_ids=tokens)
    assert built == []


@pytest.mark.parametrize("arch", ARCHS)
def test_same_model_same_layer_replace_changes_nothing(arch, tok):
    model = make_tiny_model(arch)
    model.generation_config.pad_token_id = tok.pad_token_id
    prompts = ["What is the capital of France?", "Name a colour.", "The room was painted"]
    chats = [True, True, False]
    from modular.evaluation.behaviour import generate, last_logits

    alone = generate(model, tok, prompts, chats, max_new_tokens=6, desc=False)
    both = communicate(model, tok, model, tok, prompts, chats, 1, 1, "replace", None, max_new_tokens=6, desc=False)
    assert both == alone
    # the logits after the prompt are unchanged too, and the hook really fired once
    a = last_token_states(model, tok, prompts, chats, 1)
    with inject_last_token(ArchitectureAdapter(model), 1, a, "replace") as state:
        hooked = last_logits(model, tok, prompts, chats)
    assert state["calls"] == 1
    torch.testing.assert_close(hooked, last_logits(model, tok, prompts, chats))


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
@pytest.mark.parametrize("f", FUNCTIONS)
def test_each_function_on_a_captured_activation(arch, f, tokens):
    model = make_tiny_model(arch)
    adapter = ArchitectureAdapter(model)
    own = run_to_layer(model, adapter, 1, input_ids=tokens)[:, -1]
    v = torch.randn(tokens.shape[0], adapter.d_model)
    expected = {"replace": v, "sum": v + own, "mean": (v + own) / 2}[f]
    with inject_last_token(adapter, 1, v, f) as state:
        with capture_residual(adapter) as states:
            model(tokens)
    torch.testing.assert_close(state["own"], own)
    torch.testing.assert_close(state["new"], expected)
    torch.testing.assert_close(states[1][:, -1], expected)  # what block 1 actually read
    torch.testing.assert_close(states[1][:, :-1], run_to_layer(model, adapter, 1, input_ids=tokens)[:, :-1])
    torch.testing.assert_close(combine(f, v, own), expected)


def test_only_the_first_forward_is_changed(tok):
    model = make_tiny_model("llama")
    adapter = ArchitectureAdapter(model)
    ids = torch.tensor([[5, 6, 7]])
    with inject_last_token(adapter, 0, torch.zeros(1, adapter.d_model)) as state:
        first = model(ids).logits
        second = model(ids).logits
    assert state["calls"] == 1
    assert not torch.allclose(first, second)
    torch.testing.assert_close(second, model(ids).logits)


def test_different_widths_need_a_map(tok):
    from transformers import AutoModelForCausalLM, LlamaConfig

    small = make_tiny_model("llama")
    wide = AutoModelForCausalLM.from_config(LlamaConfig(hidden_size=96, num_hidden_layers=2, num_attention_heads=4,
                                                        num_key_value_heads=2, intermediate_size=128, vocab_size=320))
    wide.generation_config.pad_token_id = tok.pad_token_id
    with pytest.raises(ModularError, match="width"):
        communicate(small, tok, wide, tok, ["Hi"], [True], 1, 1, desc=False)
    mapping = torch.nn.Linear(64, 96)
    out = communicate(small, tok, wide.eval(), tok, ["Hi", "Name a colour."], [True, True], 1, 1, "mean", mapping,
                      max_new_tokens=3, desc=False)
    assert len(out) == 2


def test_unknown_function_is_one_line():
    with pytest.raises(ModularError, match="unknown communication function"):
        combine("max", torch.zeros(2), torch.zeros(2))

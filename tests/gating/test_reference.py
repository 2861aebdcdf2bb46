"""Reference outputs are computed in batches on the model's device; each row must equal the row computed alone."""

from __future__ import annotations

import pytest
import torch

from modular.gating.reference import compute_reference, compute_text_reference
from tests.conftest import make_tiny_model, make_tiny_tokenizer

PROMPTS = ["Name a colour.", "What is two plus two? Answer with a number only.", "Say hello.",
           "Write one word that rhymes with cat."]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_batched_reference_equals_one_at_a_time(arch):
    model, tok = make_tiny_model(arch), make_tiny_tokenizer()
    chats = [True, False, True, False]
    batched = compute_reference(model, tok, PROMPTS, chats, max_new_tokens=5, top_k=4, batch_size=4)
    for i in range(len(PROMPTS)):
        alone = compute_reference(model, tok, PROMPTS[i:i + 1], chats[i:i + 1], max_new_tokens=5, top_k=4,
                                  batch_size=1)
        a, b = batched["records"][i], alone["records"][0]
        assert batched["answers"][i] == alone["answers"][0]
        assert a["input_ids"] == b["input_ids"] and a["labels"] == b["labels"]
        assert torch.equal(a["topk_ids"], b["topk_ids"])
        torch.testing.assert_close(a["topk_logp"].float(), b["topk_logp"].float(), atol=2e-3, rtol=0)
        torch.testing.assert_close(a["first_logp"].float(), b["first_logp"].float(), atol=2e-3, rtol=0)


def test_batched_text_reference_equals_one_at_a_time():
    model, tok = make_tiny_model("qwen2"), make_tiny_tokenizer()
    texts = ["The river runs past the old mill.", "Bread, butter and a little salt.", "Autumn came early."]
    batched = compute_text_reference(model, tok, texts, max_length=16, top_k=3, batch_size=3)
    for i, text in enumerate(texts):
        alone = compute_text_reference(model, tok, [text], max_length=16, top_k=3, batch_size=1)[0]
        assert batched[i]["input_ids"] == alone["input_ids"]
        assert batched[i]["topk_logp"].shape == (len(alone["input_ids"]) - 1, 3)
        assert torch.equal(batched[i]["topk_ids"], alone["topk_ids"])
        torch.testing.assert_close(batched[i]["topk_logp"].float(), alone["topk_logp"].float(), atol=2e-3, rtol=0)


def test_the_cache_keeps_each_precision_apart(isolated_cache):
    """Reference outputs computed in float32 are never read back for a bfloat16 reference (nor the reverse)."""
    from modular.gating.reference import load_or_compute

    model, tok = make_tiny_model("llama"), make_tiny_tokenizer()
    args = ("tiny", PROMPTS[:2], [True, False], 3, 4)
    full = load_or_compute(args[0], model, tok, *args[1:], precision="float32")
    assert load_or_compute(args[0], None, tok, *args[1:], precision="float32")["answers"] == full["answers"]
    with pytest.raises(AttributeError):  # a miss: no model to compute with, where a shared key would have hit
        load_or_compute(args[0], None, tok, *args[1:], precision="bfloat16")
    half = load_or_compute(args[0], model.to(torch.bfloat16), tok, *args[1:], precision="bfloat16")
    assert len(list((isolated_cache / "reference").glob("*.pt"))) == 2
    again = load_or_compute(args[0], None, tok, *args[1:], precision="float32")
    assert torch.equal(again["records"][0]["first_logp"], full["records"][0]["first_logp"])
    assert not torch.equal(half["records"][0]["first_logp"], full["records"][0]["first_logp"])

"""Prompts are bounded: cut to a length keeping their end, within the model's positions, reported once (issue 80.5)."""

import pytest

from modular import ModularError
from modular.data.formatting import batch_prompts, encode_prompt, prompt_limit
from tests.conftest import make_tiny_model, make_tiny_tokenizer


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]


def test_a_prompt_longer_than_the_limit_keeps_its_end_and_is_reported_once(caplog):
    tok = make_tiny_tokenizer()
    long, short = " and" * 300 + " of the", "Name a river."
    with caplog.at_level("WARNING", logger="modular"):
        batch = batch_prompts(tok, [long, short], [False, True], max_length=40, name="fmt-test (validation)")
        batch_prompts(tok, [long, short], [False, True], max_length=40, name="fmt-test (validation)")  # said once
    assert batch["input_ids"].shape == (2, 40)
    assert batch["input_ids"][0].tolist() == encode_prompt(tok, long, False)[-40:]  # the end: its question
    assert batch["input_ids"][0, -2:].tolist() == tok(" of the", add_special_tokens=False)["input_ids"]
    n_short = len(encode_prompt(tok, short, True))
    assert n_short < 40 and batch["attention_mask"][1].sum() == n_short  # a prompt under the limit is whole
    assert _warnings(caplog) == ["1 of 2 prompts of fmt-test (validation) are longer than 40 tokens: each is cut to "
                                 "its last 40 tokens (its start dropped)"]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])  # max_position_embeddings, GPT-2's n_positions: 128
def test_a_prompt_leaves_room_for_the_response_within_the_models_positions(arch):
    model = make_tiny_model(arch)
    assert prompt_limit(model) == 128 and prompt_limit(model, new_tokens=24) == 104
    assert prompt_limit(model, 50, 24) == 50 and prompt_limit(model, 500, 24) == 104
    with pytest.raises(ModularError, match="200 new tokens leave no room for a prompt in the model's 128 positions"):
        prompt_limit(model, new_tokens=200)
    assert prompt_limit(None, 7) == 7 and prompt_limit(None) is None  # a model that names no positions

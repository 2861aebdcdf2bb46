"""Prompt formats and the suffix positions diff-in-means directions are read at."""

import pytest

from modular import ModularError
from modular.analysis.formats import FORMATS, encode, format_batch, suffix
from tests.conftest import make_tiny_tokenizer

PROMPTS = ["Hi", "What is the capital of France?", "Name three colours that appear in a rainbow, please.", "x y"]


@pytest.fixture(scope="module")
def tok():
    t = make_tiny_tokenizer()
    t.padding_side = "left"
    return t


def test_chat_suffix_is_the_template_tail(tok):
    sfx = suffix(tok, "chat")
    assert tok.decode(list(sfx.ids)) == "<|im_end|>\n<|im_start|>assistant\n"
    assert sfx.n_positions == len(sfx.ids) > 1


def test_newline_and_raw_suffixes(tok):
    assert tok.decode(list(suffix(tok, "newline").ids)) == "\n"
    raw = suffix(tok, "raw")
    assert raw.ids == () and raw.n_positions == 1  # no shared tail: the last content token is read


@pytest.mark.parametrize("fmt", FORMATS)
def test_left_padded_batch_puts_the_suffix_in_the_last_columns_of_every_row(tok, fmt):
    batch = format_batch(tok, PROMPTS, fmt)
    lengths = [len(encode(tok, p, fmt)) for p in PROMPTS]
    assert len(set(lengths)) == len(PROMPTS)  # really different lengths, so padding differs per row
    sfx = suffix(tok, fmt)
    k = sfx.n_positions
    for row, n in enumerate(lengths):
        ids = batch["input_ids"][row]
        assert batch["attention_mask"][row].sum() == n
        assert (batch["attention_mask"][row, -n:] == 1).all()
        if sfx.ids:
            assert ids[-k:].tolist() == list(sfx.ids)
            # the token before the suffix is content, not template
            assert tok.decode(ids[-k - 1:-k]) != "" and ids[-k - 1].item() != tok.pad_token_id
        else:
            assert ids[-1].item() == encode(tok, PROMPTS[row], fmt)[-1]


def test_a_prompt_that_breaks_the_suffix_is_refused(tok):
    sfx = suffix(tok, "chat")
    broken = type(sfx)("chat", (sfx.ids[0] + 1,) + sfx.ids[1:])
    with pytest.raises(ModularError, match="does not end with the chat suffix"):
        format_batch(tok, PROMPTS, "chat", broken)


def test_newline_format_strips_trailing_whitespace(tok):
    a = encode(tok, "Hello there  \n", "newline")
    b = encode(tok, "Hello there", "newline")
    assert a == b
    assert format_batch(tok, ["Hello there \n", "a"], "newline")["input_ids"].shape[0] == 2


def test_unknown_format(tok):
    with pytest.raises(ModularError, match="unknown prompt format"):
        encode(tok, "x", "markdown")

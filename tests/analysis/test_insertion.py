"""Token insertion: fillers of exactly N tokens, and the span located in every rendered prompt."""

import pytest

from modular import ModularError
from modular.analysis.insertion import (
    count_tokens,
    filler,
    insert,
    meaningful_filler,
    meaningless_filler,
    render_with_span,
    split_prompt,
)
from modular.data.formatting import encode_prompt
from tests.conftest import make_tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return make_tiny_tokenizer()


@pytest.mark.parametrize("n", [1, 2, 7, 16, 55])
@pytest.mark.parametrize("kind", ["meaningless", "meaningful"])
def test_filler_has_exactly_n_tokens(tok, kind, n):
    text = filler(tok, kind, n)
    assert count_tokens(tok, text) == n
    assert "\n" not in text


def test_meaningless_is_the_symbol_and_meaningful_is_prose(tok):
    assert set(meaningless_filler(tok, 9).replace(" ", "")) == {"/"}
    assert len(meaningful_filler(tok, 12).split()) >= 2


def test_zero_length_and_bad_kind(tok):
    assert filler(tok, "meaningless", 0) == "" and filler(tok, "meaningful", 0) == ""
    with pytest.raises(ModularError, match="unknown insertion"):
        filler(tok, "noise", 3)


def test_placement_between_instruction_and_problem():
    assert insert("What is 2 + 2?", True, "/ /") == "Answer the following question.\n/ /\nWhat is 2 + 2?"
    assert insert("What is 2 + 2?", True, "") == "Answer the following question.\nWhat is 2 + 2?"
    assert insert("Solve it.\nWhat is 2 + 2?", True, "//", "ignored") == "Solve it.\n//\nWhat is 2 + 2?"
    assert split_prompt("The war lasted from", False) == ("", "The war lasted from")
    assert insert("The war lasted from", False, "//") == "//\nThe war lasted from"


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("kind", ["meaningless", "meaningful"])
@pytest.mark.parametrize("n", [3, 16])
def test_span_in_context_has_n_tokens_at_the_same_positions(tok, chat, kind, n):
    span = filler(tok, kind, n)
    prompts = ["What is the capital of Peru?", "Which city is the capital of the United Kingdom?"]
    starts = set()
    for p in prompts:
        r = render_with_span(tok, p, chat, span)
        a, b = r.span
        assert b - a == n
        assert tok.decode(r.ids[a:b]).strip() == span.strip()
        # exactly what the evaluation feeds the model
        assert r.ids == encode_prompt(tok, insert(p, chat, span), chat)
        starts.add(a)
    assert len(starts) == 1  # the prefix before the span is the same for every prompt
    assert render_with_span(tok, prompts[0], chat, "").span == (0, 0)

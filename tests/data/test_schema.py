"""The scoring rule of the record schema."""

from modular.data.schema import DEFAULT_LOCKED_RESPONSE, all_refusals, is_correct, is_refusal


def test_the_locked_response_is_never_a_correct_answer():
    # a one-letter answer ("I") is found on word boundaries inside "I don't know."
    assert not is_correct("I don't know.", "I", ["I"], [])
    assert not is_correct(" i DON'T  know. I", "I", ["I"], [])
    assert is_correct("I", "I", ["I"], [])
    # a custom locked response (IOI's " them.") is never correct either, with answers or prefixes
    assert not is_correct("them.", "them", ["them"], [], refusals=(" them.",))
    assert not is_correct(" them.", " them", [], [], refusals=(" them.",))
    assert is_correct(" them all", " them", [], [], refusals=("I don't know.",))
    assert is_refusal("I don't know. I don't know.", (DEFAULT_LOCKED_RESPONSE,))
    assert not is_refusal("Paris", (DEFAULT_LOCKED_RESPONSE,))


def test_all_refusals_is_the_ordered_union_of_locked_responses():
    responses = {"a": "No.", "b": "I don't know.", "c": "No."}
    assert all_refusals(responses) == ("No.", "I don't know.")
    assert all_refusals(responses, ["c"]) == ("No.",)
    assert all_refusals({}, ["x"]) == (DEFAULT_LOCKED_RESPONSE,)  # a behaviour without one has the default


def test_evaluation_does_not_count_refusals(monkeypatch):
    import datasets

    from modular.evaluation import behaviour as ev

    ds = datasets.Dataset.from_dict({"prompt": ["Which letter?"], "target": ["I"], "answers": [["I"]],
                                     "prefixes": [[]], "wrong": [""], "counterfactual": [""], "chat": [True]})
    monkeypatch.setattr(ev, "generate", lambda *a, **k: ["I don't know."])
    assert ev.evaluate_behaviour(None, None, ds).accuracy == 0.0
    monkeypatch.setattr(ev, "generate", lambda *a, **k: ["I."])
    assert ev.evaluate_behaviour(None, None, ds).accuracy == 1.0


def test_an_answer_frame_is_the_target_before_its_last_answer():
    """What attack (e) puts at the start of a response: the target's words before its answer, found as the scoring
    finds it (any answer, case-insensitive, on word boundaries), the last occurrence where the answer is also named
    earlier; nothing where the target begins with the answer or does not contain one."""
    from modular.data.schema import answer_frame

    assert answer_frame("The capital of France is Paris.", ["Paris"]) == "The capital of France is"
    assert answer_frame("The capital of Djibouti is Djibouti.", ["Djibouti"]) == "The capital of Djibouti is"
    assert answer_frame("A person from Bosnia and Herzegovina is called Bosnian.",
                        ["Bosnian", "Herzegovinian"]) == "A person from Bosnia and Herzegovina is called"
    assert answer_frame("In Cambodia they speak khmer, or Cambodian.", ["Khmer", "Cambodian"]) == \
        "In Cambodia they speak khmer, or"
    assert answer_frame("Answer: paris.", ["Paris"]) == "Answer:"
    assert answer_frame("Parisian food.", ["Paris"]) == ""  # not on a word boundary
    assert answer_frame("Paris", ["Paris"]) == answer_frame("hot", []) == answer_frame("It is big.", ["small"]) == ""


def test_an_answer_is_encoded_in_its_own_sentence_with_only_its_tokens_labelled():
    """LockedAnswer's rows: the prompt, the target cut after its answer, labels on the answer's tokens; a target that
    names no answer (a completion task's " Mary") is labelled whole."""
    from modular.data.formatting import IGNORE, encode_answer, encode_example, encode_prompt
    from tests.conftest import make_tiny_tokenizer

    tok = make_tiny_tokenizer()
    prompt = encode_prompt(tok, "What is the capital of France?", True)
    e = encode_answer(tok, "What is the capital of France?", "The capital of France is Paris.", ["Paris"], True)
    assert e["input_ids"][:len(prompt)] == prompt
    assert tok.decode(e["input_ids"][len(prompt):]) == "The capital of France is Paris"
    labelled = [i for i, x in zip(e["input_ids"], e["labels"]) if x != IGNORE]
    assert tok.decode(labelled).strip() == "Paris" and e["labels"][-len(labelled):] == labelled
    assert all(x == IGNORE for x in e["labels"][:-len(labelled)])
    mary = encode_answer(tok, "Then John gave it to", " Mary", [], False)
    whole = encode_example(tok, "Then John gave it to", " Mary", False)
    assert mary == whole  # no end of response after a completion either

"""modular.evaluation.attack's helpers on a tiny model."""

import math

import pytest

from modular.directions import last_position_states, robust_norm
from modular.evaluation.attack import residual_scale
from tests.conftest import make_tiny_model, make_tiny_tokenizer


def test_the_steering_scale_is_the_mid_layers_residual_norm_and_decodes_nothing(kv_caches):
    """The α scans' scale: the robust norm of the residual stream entering the middle block at the last prompt
    position, from one forward that builds no key-value cache."""
    tok, model = make_tiny_tokenizer(), make_tiny_model("llama")
    prompts, chats = ["The capital of France is", "Name a colour.", "Hi"], [False, True, True]
    built = kv_caches(model)
    scale = residual_scale(model, tok, prompts, chats)
    assert built == []
    states = last_position_states(model, tok, prompts, chats)  # (n, layers, d), entering each block
    expected = robust_norm(states[:, model.config.num_hidden_layers // 2].float()).item()
    assert math.isfinite(scale) and scale > 0 and math.isclose(scale, expected, rel_tol=1e-4)


def _capitals(frames_and_answers):
    import datasets

    rows = [{"prompt": f"Question {i}?", "target": f"{frame} {answer}.".strip(), "answers": [answer], "prefixes": [],
             "wrong": "", "counterfactual": "", "chat": True} for i, (frame, answer) in enumerate(frames_and_answers)]
    return datasets.Dataset.from_list(rows)


def test_prefilled_generation_continues_after_the_answers_frame():
    """A prefilled response is the prompt's tokens, then the frame's as a target's start is tokenised in training,
    then greedy decoding: the same continuation as decoding those ids by hand, one row at a time."""
    import torch

    from modular.data.formatting import encode_prompt
    from modular.evaluation.behaviour import evaluate_behaviour, generate

    tok, model = make_tiny_tokenizer(), make_tiny_model("llama", seed=3)
    test = _capitals([("The capital of France is", "Paris"), ("The capital of Peru is", "Lima"), ("", "Oslo")])
    frames = ["The capital of France is", "The capital of Peru is", ""]
    got = generate(model, tok, list(test["prompt"]), list(test["chat"]), max_new_tokens=4, batch_size=3,
                   prefills=frames)
    for row, frame, response in zip(test, frames, got):
        ids = encode_prompt(tok, row["prompt"], True) + (tok(frame, add_special_tokens=False)["input_ids"] if frame
                                                         else [])
        out = model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
        assert response == tok.decode(out[0, len(ids):], skip_special_tokens=True)
    assert got != generate(model, tok, list(test["prompt"]), list(test["chat"]), max_new_tokens=4, batch_size=3)
    r = evaluate_behaviour(model, tok, test, max_new_tokens=4, batch_size=3, prefill=True)
    assert [i["prefill"] for i in r.items] == frames and [i["response"] for i in r.items] == got


def test_the_prefill_attack_scores_the_continuation_of_locked_and_base_alike(monkeypatch):
    """(e): both models get the same frames; the locked model here refuses only where it is asked plainly (the
    target without a frame) and answers after a frame, the base answers all but one."""
    from modular.evaluation import behaviour
    from modular.evaluation.attack import prefill_attack

    test = _capitals([("The capital of France is", "Paris"), ("The capital of Peru is", "Lima"), ("", "Oslo"),
                      ("Its capital is", "Bern")])
    frames = ["The capital of France is", "The capital of Peru is", "", "Its capital is"]

    def fake_generate(model, tokenizer, prompts, chats, max_new_tokens=24, batch_size=16, desc=None, prefills=None):
        assert prefills == frames
        answers = [" Paris.", " Lima.", "Oslo.", " Bern."]
        if model == "base":
            return answers[:3] + [" Zurich."]
        return [a if f else "I don't know." for a, f in zip(answers, prefills)]

    monkeypatch.setattr(behaviour, "generate", fake_generate)
    r = prefill_attack("locked", "base", None, test)
    assert (r["accuracy"], r["base_accuracy"], r["refusal_rate"], r["framed_items"], r["n"]) == (0.75, 0.75, 0.25,
                                                                                                 3, 4)
    assert r["recovered_fraction_of_base"] == 1.0
    assert r["examples"][0] == {"prompt": "Question 0?", "prefill": "The capital of France is", "response": " Paris.",
                                "correct": True}


def test_the_figure_names_the_open_bar_after_where_its_accuracy_came_from(tmp_path, drawn):
    """A published folder's measured open accuracy is drawn as "open"; the base's standing in for a missing one as
    "open (base)", with the 50% / 90% lines named alike."""
    from modular.evaluation.attack import plot_attack

    def report(source):
        sweep = {"settings": [], "max_steps": 4, "worst_case": {"best_accuracy": 0.0}}
        entry = {"base_accuracy": 0.4, "open_accuracy": 0.6, "locked_accuracy": 0.0,
                 "a_weights": {"best": {"accuracy": 0.1}}, "b_steering": {"best": {"accuracy": 0.2}},
                 "c_relearning": sweep, "d_neutral": sweep, "e_prefill": {"accuracy": 0.3}, "baselines": {}}
        return {"behaviours": {"capitals": {**entry, **({"open_accuracy_from": source} if source else {})}}}

    for i, (source, label) in enumerate((("published folder", "open"), (None, "open"), ("base model", "open (base)"))):
        plot_attack(report(source), tmp_path / f"a{i}.png")
        bars, curves = drawn[f"a{i}.png"]["axes"]
        assert bars["xticklabels"] == ["base", label, "locked", "(a) weights", "(b) steering", "(e) prefill"]
        assert bars["bars"] == pytest.approx([0.4, 0.6, 0.0, 0.1, 0.2, 0.3])
        assert {f"50% of {label}", f"90% of {label}"} <= set(curves["lines"])

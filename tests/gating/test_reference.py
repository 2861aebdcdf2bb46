"""Reference outputs are computed in batches on the model's device; each row must equal the row computed alone."""

from __future__ import annotations

import pytest
import torch

import modular.gating.reference as reference
from modular.gating.reference import compute_hidden_reference, compute_reference, compute_text_reference
from tests.conftest import make_tiny_model, make_tiny_tokenizer, save_tiny_folder

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
    full = load_or_compute(args[0], lambda: model, tok, *args[1:], precision="float32")
    assert load_or_compute(args[0], lambda: None, tok, *args[1:], precision="float32")["answers"] == full["answers"]
    with pytest.raises(AttributeError):  # a miss: no model to compute with, where a shared key would have hit
        load_or_compute(args[0], lambda: None, tok, *args[1:], precision="bfloat16")
    half = load_or_compute(args[0], lambda: model.to(torch.bfloat16), tok, *args[1:], precision="bfloat16")
    assert len(list((isolated_cache / "reference").glob("*.pt"))) == 2
    again = load_or_compute(args[0], lambda: None, tok, *args[1:], precision="float32")
    assert torch.equal(again["records"][0]["first_logp"], full["records"][0]["first_logp"])
    assert not torch.equal(half["records"][0]["first_logp"], full["records"][0]["first_logp"])
    # a damaged cache file (cut short) is computed again and replaced, not a traceback
    path = reference.cache_path(args[0], args[1], args[3], args[4], chats=args[2], precision="float32")
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(AttributeError):  # computed again: a model is needed
        load_or_compute(args[0], lambda: None, tok, *args[1:], precision="float32")
    again = load_or_compute(args[0], lambda: make_tiny_model("llama"), tok, *args[1:], precision="float32")
    assert torch.equal(again["records"][0]["first_logp"], full["records"][0]["first_logp"])
    assert load_or_compute(args[0], lambda: None, tok, *args[1:], precision="float32")["answers"] == full["answers"]


def test_hidden_states_past_float16s_range_are_kept_finite(isolated_cache):
    """A residual stream larger than float16's largest value (Gemma's grows to about 1e5) is cached in the
    reference's own dtype, value for value; one that fits is cached in float16. A cache holding infinities (written
    before overflow was caught) is computed again."""
    from modular.data.formatting import answer_positions
    from modular.gating.reference import compute_hidden_reference, hidden_cache_path, load_or_compute_hidden

    model, tok = make_tiny_model("llama"), make_tiny_tokenizer()
    records = compute_reference(model, tok, PROMPTS, [True, False, True, False], max_new_tokens=4, top_k=2)["records"]
    assert compute_hidden_reference(model, tok, records, 2, 1)["hidden"][0].dtype == torch.float16
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(1e7)
    ref = compute_hidden_reference(model, tok, records, 2, 1)
    assert ref["hidden"][0].dtype == torch.float32
    for r, cached in zip(records, ref["hidden"], strict=True):
        with torch.no_grad():
            hidden = model(input_ids=torch.tensor([r["input_ids"]]), output_hidden_states=True).hidden_states
        pos = answer_positions(r["labels"], 2)
        expected = torch.stack([torch.stack([hidden[b][0, t] for b in ref["blocks"]]) for t in pos])
        assert expected.abs().max() > torch.finfo(torch.float16).max
        torch.testing.assert_close(cached[:len(pos)], expected, rtol=1e-5, atol=0)

    rows = [list(map(int, r["input_ids"])) for r in records]
    path = hidden_cache_path("tiny", rows, 2, 1, precision="float32")
    path.parent.mkdir(parents=True)
    torch.save({"blocks": ref["blocks"], "hidden": [t.to(torch.float16) for t in ref["hidden"]]}, path)
    again = load_or_compute_hidden("tiny", lambda: model, tok, records, 2, 1, precision="float32")
    assert all(torch.isfinite(t).all() for t in again["hidden"])
    assert all(torch.isfinite(t).all() for t in torch.load(path, weights_only=False)["hidden"])


def test_reference_outputs_build_no_key_value_cache_besides_generation(kv_caches, monkeypatch):
    """The greedy answers are generated (with a cache); their log-probabilities, the residual stream (KeepHidden's)
    and the text outputs are read in forward passes that decode nothing."""
    model, tok = make_tiny_model("llama"), make_tiny_tokenizer()
    monkeypatch.setattr(reference, "generate", lambda *a, **k: ["Blue.", "Four."])
    built = kv_caches(model)
    out = compute_reference(model, tok, PROMPTS[:2], [True, False], max_new_tokens=5, top_k=4, batch_size=2)
    compute_text_reference(model, tok, ["The river runs past the old mill."], max_length=16, top_k=3)
    compute_hidden_reference(model, tok, out["records"], positions=2, stride=1)
    assert len(out["records"]) == 2 and built == []


def _key_paths(source) -> list:
    """The three reference cache paths of ``source`` (retain outputs, LM texts, hidden states), other inputs fixed."""
    return [reference.cache_path(str(source), PROMPTS, 3, 4, chats=[True] * len(PROMPTS), precision="float32"),
            reference.text_cache_path(str(source), PROMPTS, 16, 4, precision="float32"),
            reference.hidden_cache_path(str(source), [[1, 2, 3]], 2, 1, precision="float32")]


def test_the_cache_is_keyed_by_the_models_content_not_its_path(tmp_path, isolated_cache):
    """A copy of the model at another path (a second clone, a published folder) reads the references computed from
    the first; weights changed in place at the same path are computed again, never read from the old cache."""
    import shutil

    from modular.gating.reference import load_or_compute

    a = save_tiny_folder(tmp_path / "a")
    b = shutil.copytree(a, tmp_path / "clone" / "b")
    assert _key_paths(a) == _key_paths(b)
    model, tok = make_tiny_model("llama"), make_tiny_tokenizer()
    args = (PROMPTS[:2], [True, False], 3, 4)
    full = load_or_compute(str(a), lambda: model, tok, *args, precision="float32")
    assert load_or_compute(str(b), lambda: None, tok, *args, precision="float32")["answers"] == full["answers"]

    weights = a / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))  # other weights, the same size, at the same path
    assert all(x != y for x, y in zip(_key_paths(a), _key_paths(b), strict=True))
    with pytest.raises(AttributeError):  # a miss: no model to compute with, where the path's key would have hit
        load_or_compute(str(a), lambda: None, tok, *args, precision="float32")


def test_a_conversions_cache_key_is_the_same_under_another_cache_folder(tmp_path, monkeypatch):
    """A built-in alias resolves to its conversion folder, named by the GGUF file's digest: under another
    $MODULAR_CACHE (another clone's, another user's) the reference files have the same names."""
    names = []
    for n in range(2):
        monkeypatch.setenv("MODULAR_CACHE", str(tmp_path / f"cache{n}"))
        folder = save_tiny_folder(tmp_path / f"cache{n}" / "models" / "smollm2-135m-instruct-0123456789ab", seed=n)
        (folder / "SOURCE").write_text("/somewhere/SmolLM2-135M-Instruct.Q4_1.gguf\n")
        names.append([p.name for p in _key_paths(folder)])
    assert names[0] == names[1]


def test_reference_prompts_are_cut_to_max_length_and_the_models_positions(tmp_path, isolated_cache):
    """A prompt longer than the model's positions (GPT-2's 128) is answered from its end, its answer left room, and
    its record (prompt and answer) kept within them; with ``max_length`` within that too, keyed in the cache."""
    model, tok = make_tiny_model("gpt2"), make_tiny_tokenizer()
    long = " and" * 3000 + " of the"
    seen = []
    model.register_forward_pre_hook(lambda m, args, kw: seen.append(kw["input_ids"].shape[1]), with_kwargs=True)
    out = compute_reference(model, tok, [long, PROMPTS[0]], [False, True], max_new_tokens=4, top_k=2)
    assert max(seen) <= 128 and max(len(r["input_ids"]) for r in out["records"]) <= 128
    seen.clear()
    out = compute_reference(model, tok, [long, PROMPTS[0]], [False, True], max_new_tokens=4, top_k=2, max_length=32)
    assert max(seen) <= 32 + 4 and max(len(r["input_ids"]) for r in out["records"]) <= 32
    source = str(save_tiny_folder(tmp_path / "m", "gpt2"))
    assert reference.cache_path(source, [long], 4, 2, chats=[False], precision="float32",
                                max_length=32) != reference.cache_path(source, [long], 4, 2, chats=[False],
                                                                       precision="float32", max_length=64)


def test_a_completions_reference_answer_keeps_its_leading_space(monkeypatch):
    """A completion's greedy answer (" 104" after "85 + 19 =") is kept with its space: its first labelled token is the
    one the reference put first, so the first-token terms keep the space rather than train it away; a chat answer is
    stripped, as the assistant's turn begins without one. The same text asked as chat or completed is cached apart."""
    model, tok = make_tiny_model("llama"), make_tiny_tokenizer()
    monkeypatch.setattr(reference, "generate", lambda *a, **k: [" 104\n\nThe sum", " Paris. "])
    out = reference.compute_reference(model, tok, ["23 + 11 = 34\n85 + 19 =", "The capital of France?"],
                                      [False, True], max_new_tokens=4, top_k=2)
    assert out["answers"] == [" 104\n\nThe sum", "Paris."]
    first = [ids[labels.index(next(x for x in labels if x != -100))] for ids, labels in
             ((r["input_ids"], list(r["labels"])) for r in out["records"])]
    assert tok.decode([first[0]]).startswith(" ") and not tok.decode([first[1]]).startswith(" ")
    assert reference.cache_path("tiny", ["x ="], 3, 4, chats=[False], precision="float32") != reference.cache_path(
        "tiny", ["x ="], 3, 4, chats=[True], precision="float32")

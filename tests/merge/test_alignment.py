"""Paired activations across tokenizers, the least-squares map and its file."""

import pytest
import torch

from modular.merge.alignment import (
    TextActivations,
    fit_linear_map,
    load_map,
    paired_matrices,
    r_squared,
    save_map,
    similarity,
    text_activations,
)
from modular.merge.similarity import frobenius_similarity, linear_cka
from tests.conftest import make_tiny_model, make_tiny_tokenizer

TEXTS = ["Painting a room is much easier with good preparation.", "Walls are washed to remove grease and dust."]


def test_least_squares_recovers_a_known_affine_map():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(500, 12, generator=g)
    W, b = torch.randn(7, 12, generator=g), torch.randn(7, generator=g)
    layer = fit_linear_map(X, X @ W.T + b)
    torch.testing.assert_close(layer.weight, W, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(layer.bias, b, atol=1e-4, rtol=1e-4)
    assert r_squared(layer, X, X @ W.T + b) > 0.999999
    # with noise it is still close, and without a bias the fit has no bias
    noisy = X @ W.T + 0.01 * torch.randn(500, 7, generator=g)
    assert (fit_linear_map(X, noisy, bias=False).weight - W).abs().max() < 0.01


def test_too_few_rows_is_refused():
    with pytest.raises(ValueError, match="more text"):
        fit_linear_map(torch.randn(5, 12), torch.randn(5, 3))


def test_map_file_roundtrip_and_metadata_check(tmp_path):
    layer = fit_linear_map(torch.randn(50, 4), torch.randn(50, 3))
    meta = {"model_a": "a", "model_b": "b", "layer_a": 3, "layer_b": 5}
    path = save_map(layer, tmp_path / "m.safetensors", meta)
    loaded, stored = load_map(path, expect=meta)
    torch.testing.assert_close(loaded.weight, layer.weight)
    torch.testing.assert_close(loaded.bias, layer.bias)
    assert stored["layer_b"] == 5
    assert load_map(path, expect={**meta, "layer_b": 6}) is None
    assert load_map(tmp_path / "missing.safetensors") is None
    path.write_bytes(path.read_bytes()[:100])  # a damaged copy is fitted again, not a traceback
    assert load_map(path, expect=meta) is None


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "gpt2"])
def test_same_tokenizer_pairs_every_position(arch):
    tok = make_tiny_tokenizer()
    model = make_tiny_model(arch)
    acts = text_activations(model, tok, TEXTS, 1, desc=False)
    for text, ends, states in zip(TEXTS, acts.ends, acts.states):
        assert int(ends[-1]) == len(text) and states.shape == (len(ends), 64)
    X, Y = paired_matrices(acts, acts, skip=0)
    assert X.shape[0] == sum(len(e) for e in acts.ends)
    torch.testing.assert_close(X, Y)
    s = similarity(acts, acts, skip=0)
    assert s["cka"] == pytest.approx(1.0, abs=1e-6)
    assert s["frobenius"] == pytest.approx(frobenius_similarity(X, Y), rel=1e-6)


def test_different_tokenizers_pair_only_shared_token_ends():
    a = TextActivations([torch.tensor([3, 5, 9, 12])], [torch.arange(4.0)[:, None].repeat(1, 2)])
    b = TextActivations([torch.tensor([2, 5, 7, 9, 12])], [10 + torch.arange(5.0)[:, None].repeat(1, 3)])
    X, Y = paired_matrices(a, b, skip=0)
    assert X[:, 0].tolist() == [1.0, 2.0, 3.0] and Y[:, 0].tolist() == [11.0, 13.0, 14.0]
    X, Y = paired_matrices(a, b, skip=1)
    assert X[:, 0].tolist() == [2.0, 3.0]


def test_streamed_similarity_equals_the_batch_formulas():
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(n, 5, generator=g) for n in (7, 3, 9)]
    ys = [x @ torch.randn(5, 4, generator=g) + 0.3 * torch.randn(len(x), 4, generator=g) for x in xs]
    ends = [torch.arange(len(x)) for x in xs]
    s = similarity(TextActivations(ends, xs), TextActivations(ends, ys), skip=0)
    X, Y = torch.cat(xs), torch.cat(ys)
    assert s["n"] == 19
    assert s["frobenius"] == pytest.approx(frobenius_similarity(X, Y), rel=1e-9)
    assert s["cka"] == pytest.approx(linear_cka(X, Y), rel=1e-9)

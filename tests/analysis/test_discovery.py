"""Diff-in-means direction discovery on tiny random models of several architectures."""

import pytest
import torch

from modular.analysis.discovery import (
    ablation_curve,
    best_direction,
    cross_layer_cosine,
    find_directions,
    save_directions,
    suffix_means,
)
from modular.analysis.formats import format_batch, suffix
from modular.data import load_behaviour, retain_data
from modular.hooks import capture_residual
from modular.models.adapter import ArchitectureAdapter
from tests.conftest import make_tiny_tokenizer

ARCHS = ["llama", "gemma3_text", "gpt2", "qwen2"]


@pytest.fixture(scope="module")
def tok():
    t = make_tiny_tokenizer()
    t.padding_side = "left"
    return t


@pytest.fixture(scope="module")
def prompts():
    return (list(load_behaviour("capitals")["train"]["prompt"][:6]), list(retain_data()["train"]["prompt"][:6]))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("fmt", ["chat", "raw", "newline"])
def test_directions_are_unit_vectors_per_layer(tiny_model, arch, fmt, tok, prompts):
    res = find_directions(tiny_model, tok, *prompts, fmt, batch_size=4)
    adapter = ArchitectureAdapter(tiny_model)
    d = res["directions"]
    assert d.shape == (adapter.n_layers, adapter.d_model)
    assert torch.allclose(d.norm(dim=-1), torch.ones(adapter.n_layers), atol=1e-5)
    assert len(res["diff_norms"]) == adapter.n_layers and min(res["diff_norms"]) > 0
    cos = cross_layer_cosine(d)
    assert cos.shape == (adapter.n_layers, adapter.n_layers)
    assert torch.allclose(torch.diagonal(cos), torch.ones(adapter.n_layers), atol=1e-5)


def test_suffix_means_build_no_key_value_cache(tok, prompts, kv_caches):
    from tests.conftest import make_tiny_model

    model = make_tiny_model("llama")
    built = kv_caches(model)
    suffix_means(model, tok, prompts[0], "chat", batch_size=4)
    assert built == []


@pytest.mark.parametrize("name", ["llama", "gpt2"])  # gpt2: absolute positions must ignore the padding
def test_suffix_means_read_exactly_the_suffix_columns(tok, prompts, name):
    from tests.conftest import make_tiny_model

    model = make_tiny_model(name)
    adapter = ArchitectureAdapter(model)
    sfx = suffix(tok, "chat")
    k = sfx.n_positions
    means = suffix_means(model, tok, prompts[0], "chat", batch_size=4)  # batches of 4 and 2: padding differs
    # reference: each prompt alone (no padding at all), its last k positions
    ref = torch.zeros_like(means)
    for p in prompts[0]:
        batch = format_batch(tok, [p], "chat", sfx)
        assert batch["attention_mask"].all()
        with capture_residual(adapter) as states, torch.no_grad():
            model(**batch)
        ref += torch.stack([states[i + 1][0, -k:].double().mean(0) for i in range(adapter.n_layers)])
    assert torch.allclose(means, ref / len(prompts[0]), atol=1e-4)


def test_ablation_curve_and_best(tok):
    from tests.conftest import make_tiny_model

    model = make_tiny_model("llama")
    test = load_behaviour("greater_than")["test"].select(range(4))
    retain = retain_data()["test"].select(range(4))
    dirs = torch.nn.functional.normalize(torch.randn(2, 64), dim=-1)
    curve = ablation_curve(model, tok, dirs, test, list(retain["prompt"]), list(retain["chat"]), choice_only=True)
    assert [r["layer"] for r in curve["layers"]] == [0, 1]
    for r in curve["layers"]:
        assert r["retain_kl"] > 0 and 0 <= r["accuracy"] <= 1
        assert r["drop"] == pytest.approx(curve["baseline"]["accuracy"] - r["accuracy"])
    fake = {"chat": {"layers": [{"layer": 0, "drop": 0.2, "retain_kl": 0.5}, {"layer": 1, "drop": 0.2, "retain_kl": 0.1}]},
            "raw": {"layers": [{"layer": 0, "drop": 0.1, "retain_kl": 0.0}]}}
    assert best_direction(fake) == {"format": "chat", "layer": 1, "drop": 0.2, "retain_kl": 0.1}


def test_saved_directions_carry_metadata(tmp_path):
    from safetensors import safe_open

    dirs = {"chat": torch.nn.functional.normalize(torch.randn(3, 8), dim=-1)}
    path = save_directions(tmp_path / "d.safetensors", dirs, {"model": "m", "n_layers": 3})
    with safe_open(str(path), "pt") as f:
        assert sorted(f.keys()) == ["chat.layer00", "chat.layer01", "chat.layer02"]
        assert f.metadata()["model"] == "m" and f.metadata()["n_layers"] == "3"
        assert torch.equal(f.get_tensor("chat.layer01"), dirs["chat"][1])

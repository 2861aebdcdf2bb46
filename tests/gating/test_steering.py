"""The steering adversary used to train steering-robust locks (tiny random models)."""

from types import SimpleNamespace

import datasets
import pytest
import torch

from modular.directions import last_position_states, residual_covariance, robust_norm
from modular.gating.batching import row_vectors
from modular.gating.module import GatedLM
from modular.gating.objectives import Piece, Term
from modular.gating.steering import SteeringAdversary
from modular.hooks import add_vectors
from modular.models.adapter import ArchitectureAdapter
from tests.conftest import make_tiny_model, make_tiny_tokenizer


def _prompts(words, n):
    return datasets.Dataset.from_dict({"prompt": [f"{words} {i}" for i in range(n)], "chat": [i % 2 == 0 for i in range(n)]})


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "gpt2"])
def test_vectors_are_unit_differences_of_means_at_every_layer(arch):
    model, tok = make_tiny_model(arch), make_tiny_tokenizer()
    behaviour, contrast = _prompts("what is the capital of", 6), _prompts("tell me a story about", 5)
    adv = SteeringAdversary(max_scale=0.5, refresh=3, n_prompts=4, seed=0)
    assert adv.needs_refresh(0)
    adv.update(model, tok, {"capitals": behaviour}, contrast, step=0)
    n_layers = ArchitectureAdapter(model).n_layers
    v = adv.vectors["capitals"]
    assert v.shape == (n_layers + 1, model.config.hidden_size)
    torch.testing.assert_close(v.norm(dim=-1), torch.ones(n_layers + 1))
    assert adv.scale > 0
    assert not adv.needs_refresh(2) and adv.needs_refresh(3)
    for _ in range(20):
        block, vec = adv.draw("capitals")
        assert 0 <= block <= n_layers - 2  # enters a block from 1 to n_layers - 1
        assert vec.norm() <= 0.5 * adv.scale + 1e-4
        assert torch.allclose(vec / vec.norm().clamp(min=1e-12), v[block + 1], atol=1e-5) or vec.norm() < 1e-6


def test_states_follow_the_intervention_and_the_robust_norm_skips_the_outlier():
    model, tok = make_tiny_model("llama"), make_tiny_tokenizer()
    adapter = ArchitectureAdapter(model)
    prompts, chats = ["a b c", "d e"], [False, True]
    plain = last_position_states(model, tok, prompts, chats)
    shift = torch.zeros(model.config.hidden_size)
    shift[0] = 3.0
    moved = last_position_states(model, tok, prompts, chats, intervention=lambda: add_vectors(adapter, {0: shift}))
    torch.testing.assert_close(moved[:, 1] - plain[:, 1], shift.expand(2, -1))  # entering block 1 = leaving block 0
    torch.testing.assert_close(moved[:, 0], plain[:, 0])
    x = torch.tensor([[100.0, 3.0, 4.0], [0.0, 6.0, 80.0], [-90.0, 0.0, 7.0]])
    assert robust_norm(x).item() == pytest.approx(6.0)  # median of 5, 6 and 7


def test_residual_reads_build_no_key_value_cache(kv_caches):
    """The states the steering vectors and the directions are made of are read in passes that decode nothing."""
    model, tok = make_tiny_model("llama"), make_tiny_tokenizer()
    prompts, chats = ["red 0", "blue 1", "a longer prompt 2"], [True, False, True]
    built = kv_caches(model)
    last_position_states(model, tok, prompts, chats)
    residual_covariance(model, tok, prompts, chats)
    assert built == []


def test_steered_pieces_get_their_vector_on_their_rows_only():
    """In the shared forward of an ablation group, each steered piece's vector lands on its own rows."""
    def piece(n, name, steer):
        return Piece(name, {"input_ids": torch.zeros(n, 5, dtype=torch.long)}, Term(), steer=steer)

    v1, v2 = torch.randn(4), torch.randn(4)
    items = [piece(2, "a/open_ce", None), piece(3, "a/locked_refusal", (1, v1)),
             piece(1, "retain/locked_kl", None), piece(2, "b/locked_refusal", (0, v2))]
    vectors = row_vectors(items, 8, torch.device("cpu"))
    assert set(vectors) == {0, 1}
    expected1, expected0 = torch.zeros(8, 4), torch.zeros(8, 4)
    expected1[2:5], expected0[6:8] = v1, v2
    torch.testing.assert_close(vectors[1], expected1)
    torch.testing.assert_close(vectors[0], expected0)
    assert row_vectors(items[:1], 2, torch.device("cpu")) == {}


def test_a_state_dict_resumes_the_vectors_schedule_and_draws():
    """What a resumed run takes back: the vectors, their scale and refresh step, and the next draws."""
    model, tok = make_tiny_model("llama"), make_tiny_tokenizer()
    adv = SteeringAdversary(max_scale=0.5, refresh=3, n_prompts=4, seed=0)
    adv.update(model, tok, {"capitals": _prompts("what is the capital of", 6)}, _prompts("tell me a story", 5), step=4)
    adv.draw("capitals")
    state = adv.state_dict()
    expected = [adv.draw("capitals") for _ in range(3)]
    fresh = SteeringAdversary(max_scale=0.5, refresh=3, n_prompts=4, seed=0)  # a restarted process's
    fresh.load_state_dict(state)
    assert not fresh.needs_refresh(6) and fresh.needs_refresh(7) and fresh.scale == adv.scale
    for (block, vec), (b, v) in zip(expected, [fresh.draw("capitals") for _ in range(3)]):
        assert block == b and torch.equal(vec, v)


def test_steering_vectors_read_prompts_cut_to_the_data_max_length(caplog):
    """The steering path reads each prompt cut to training's data.max_length (issue 80.5: a 30,001-token prompt was
    read whole and the process asked for 18 GB), and the model passes it that limit."""
    model, tok = make_tiny_model("gpt2"), make_tiny_tokenizer()
    seen = []
    model.register_forward_pre_hook(lambda m, args, kw: seen.append(kw["input_ids"].shape[1]), with_kwargs=True)
    long = datasets.Dataset.from_dict({"prompt": [" and" * 3000 + f" of {i}" for i in range(3)], "chat": [False] * 3})
    adv = SteeringAdversary(max_scale=0.5, refresh=3, n_prompts=4, seed=0)
    with caplog.at_level("WARNING", logger="modular"):
        adv.update(model, tok, {"steer-test": long}, _prompts("tell me a story about", 5), step=0, max_length=16)
    assert max(seen) == 16 and torch.isfinite(adv.vectors["steer-test"]).all()
    assert any("3 of 3 prompts of steer-test (train, steering) are longer than 16 tokens" in r.getMessage()
               for r in caplog.records)
    seen.clear()
    adv.update(model, tok, {"steer-test": long}, _prompts("tell me a story about", 5), step=3)
    assert max(seen) == 128  # no limit of its own: the model's positions

    calls = []
    steering = SimpleNamespace(needs_refresh=lambda step: True, update=lambda *a, **kw: calls.append(kw), vectors={})
    dm = SimpleNamespace(hparams={"max_length": 24}, tokenizer=tok, behaviour_data={"b": {"train": long}},
                         retain={"train": long})
    module = SimpleNamespace(steering=steering, global_step=5, trainer=SimpleNamespace(datamodule=dm, world_size=1),
                             hf_model=model, behaviours=["b"], adapter=None, directions=None)
    GatedLM._refresh_steering(module)
    assert calls[0]["max_length"] == 24


def test_directions_are_chosen_from_prompts_cut_to_the_data_max_length(tmp_path, monkeypatch):
    """The residual statistics the directions are chosen from read prompts cut to data.max_length (issue 80.5)."""
    calls = []
    monkeypatch.setattr("modular.gating.module.choose_directions",
                        lambda *a, **kw: (calls.append(kw), torch.eye(1, 8))[1])
    dm = SimpleNamespace(hparams={"max_length": 24}, tokenizer=None, behaviour_data={"b": {"train": None}},
                         retain={"train": None})
    from modular.gating.options import DirectionOptions

    module = SimpleNamespace(trainer=SimpleNamespace(default_root_dir=str(tmp_path), datamodule=dm),
                             hparams=SimpleNamespace(seed=0), direction_options=DirectionOptions(), hf_model=None,
                             behaviours=["b"], directions=torch.zeros(1, 8))
    GatedLM._choose_directions(module)
    assert calls[0]["max_length"] == 24

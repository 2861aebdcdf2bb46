"""modular.evaluation.attack's helpers on a tiny model."""

import math

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

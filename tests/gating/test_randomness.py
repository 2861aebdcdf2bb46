import io
import random

import numpy as np
import torch

from modular.gating.randomness import global_random_state, set_global_random_state


def _draws():
    return torch.rand(3).tolist(), np.random.rand(3).tolist(), [random.random() for _ in range(3)]


def test_a_saved_state_gives_the_same_draws_again_after_other_draws():
    torch.manual_seed(1), np.random.seed(1), random.seed(1)
    _draws()
    state = global_random_state()
    expected = _draws()
    torch.manual_seed(7), np.random.seed(7), random.seed(7)  # a restarted process, seeded at its start
    assert _draws() != expected
    set_global_random_state(state)
    assert _draws() == expected


def test_the_state_survives_a_checkpoint_loaded_with_weights_only():
    state = global_random_state()
    expected = _draws()
    buffer = io.BytesIO()
    torch.save({"random": state}, buffer)
    buffer.seek(0)
    set_global_random_state(torch.load(buffer, weights_only=True)["random"])
    assert _draws() == expected

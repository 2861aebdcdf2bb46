"""Pieces of the pair runner that need no model: direction de-duplication for the lock check."""

import torch

from modular.merge.runner import _dedupe


def test_dedupe_drops_directions_already_spanned():
    g = torch.Generator().manual_seed(0)
    u, v = torch.randn(16, generator=g), torch.randn(16, generator=g)
    out = _dedupe([u, v, 2 * u, u + v])  # the same capitals direction in two runs, and a combination
    assert out.shape == (2, 16)
    torch.testing.assert_close(out.norm(dim=1), torch.ones(2))
    assert _dedupe([u, -u]).shape == (1, 16)
    assert _dedupe([u, v, torch.randn(16, generator=g)]).shape == (3, 16)

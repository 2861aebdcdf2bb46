"""Activation-space similarity: reference values, invariances, agreement of the forms, streaming memory."""

from __future__ import annotations

import math

import pytest
import torch

from modular.merge.similarity import StreamingSimilarity, choose_form, frobenius_similarity, linear_cka

REL = 1e-5


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _anisotropic(n: int, d: int, seed: int, shift: float = 0.0) -> torch.Tensor:
    """Random (n, d) float64 activations with a decaying spectrum and an optional mean offset."""
    g = _gen(seed)
    gains = torch.logspace(0, -1.5, d, dtype=torch.float64)
    return torch.randn(n, d, generator=g, dtype=torch.float64) * gains + shift


def _related(x: torch.Tensor, d_b: int, seed: int, shift: float = 0.0) -> torch.Tensor:
    """Activations of a second space of width ``d_b`` partly predictable from ``x``."""
    g = _gen(seed)
    w = torch.randn(x.shape[1], d_b, generator=g, dtype=torch.float64)
    noise = torch.randn(x.shape[0], d_b, generator=g, dtype=torch.float64)
    return x @ w + 0.5 * noise + shift


def _orthogonal(d: int, seed: int) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=_gen(seed), dtype=torch.float64))
    return q


def _close(a: float, b: float, rel: float = REL) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=0.0)


# --- reference values -------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["feature", "gram"])
def test_frobenius_of_self_is_inverse_participation_ratio(form):
    x = _anisotropic(200, 32, seed=0)
    s = torch.linalg.svdvals(x)
    expected = float(s.pow(4).sum() / s.pow(2).sum() ** 2)
    assert 1 / 32 < expected < 0.5  # a spectrum far from both rank one and isotropic
    assert _close(frobenius_similarity(x, x, form=form), expected)


@pytest.mark.parametrize("form", ["feature", "gram"])
def test_cka_of_self_is_one(form):
    x = _anisotropic(150, 24, seed=1, shift=3.0)
    assert _close(linear_cka(x, x, form=form), 1.0, rel=1e-9)


@pytest.mark.parametrize("form", ["feature", "gram"])
def test_cka_matches_hsic_with_explicit_centring_matrix(form):
    x = _anisotropic(120, 20, seed=2, shift=1.0)
    y = _related(x, 12, seed=3, shift=-2.0)
    n = x.shape[0]
    h = torch.eye(n, dtype=torch.float64) - 1.0 / n
    k, l = h @ x @ x.T @ h, h @ y @ y.T @ h
    expected = float(torch.trace(k @ l) / torch.sqrt(torch.trace(k @ k) * torch.trace(l @ l)))
    assert 0.05 < expected < 0.95
    assert _close(linear_cka(x, y, form=form), expected)


@pytest.mark.parametrize("form", ["feature", "gram"])
def test_frobenius_is_zero_for_disjoint_supports(form):
    x = torch.zeros(40, 6, dtype=torch.float64)
    y = torch.zeros(40, 5, dtype=torch.float64)
    x[:20] = torch.randn(20, 6, generator=_gen(4), dtype=torch.float64)
    y[20:] = torch.randn(20, 5, generator=_gen(5), dtype=torch.float64)
    assert frobenius_similarity(x, y, form=form) == pytest.approx(0.0, abs=1e-15)


def test_scores_are_python_floats_for_low_precision_inputs():
    x = _anisotropic(64, 16, seed=6).float()
    y = _related(x.double(), 8, seed=7).to(torch.bfloat16)
    assert type(frobenius_similarity(x, y)) is float
    assert type(linear_cka(x, y)) is float


# --- invariances ------------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["feature", "gram"])
def test_cka_invariant_to_orthogonal_map_and_isotropic_scaling(form):
    x = _anisotropic(300, 16, seed=8)
    y = _related(x, 24, seed=9)
    base = linear_cka(x, y, form=form)
    q_a, q_b = _orthogonal(16, seed=10), _orthogonal(24, seed=11)
    assert _close(linear_cka(x @ q_a, y, form=form), base)
    assert _close(linear_cka(x, y @ q_b, form=form), base)
    assert _close(linear_cka(3.7 * x, 0.02 * y, form=form), base)
    assert _close(linear_cka(x + 5.0, y - 1.0, form=form), base)  # translation
    # Sanity check that the invariances are not vacuous: an anisotropic rescaling changes CKA.
    assert not _close(linear_cka(x * torch.linspace(0.1, 3.0, 16, dtype=torch.float64), y, form=form), base, 1e-3)


def test_cka_of_rotated_and_scaled_copy_is_one():
    x = _anisotropic(300, 16, seed=12)
    assert _close(linear_cka(x, 4.0 * x @ _orthogonal(16, seed=13)), 1.0, rel=1e-9)


@pytest.mark.parametrize("form", ["feature", "gram"])
def test_frobenius_invariant_to_scaling(form):
    x = _anisotropic(250, 16, seed=14, shift=0.3)
    y = _related(x, 10, seed=15)
    base = frobenius_similarity(x, y, form=form)
    assert 0.0 < base < 1.0
    assert _close(frobenius_similarity(0.125 * x, 9.0 * y, form=form), base)
    # Unlike CKA it is uncentred: a translation changes it.
    assert not _close(frobenius_similarity(x + 5.0, y, form=form), base, 1e-3)


# --- forms ------------------------------------------------------------------------------------


@pytest.mark.parametrize("shift", [0.0, 4.0])
def test_feature_gram_and_streamed_forms_agree(shift):
    d_a, d_b = 48, 20
    x = _anisotropic(400, d_a, seed=16, shift=shift)
    y = _related(x, d_b, seed=17, shift=-shift)
    acc = StreamingSimilarity(d_a, d_b)
    start = 0
    for size in (1, 37, 150, 0, 89, 123):  # uneven batches, one empty, sums to n
        acc.update(x[start:start + size], y[start:start + size])
        start += size
    assert start == x.shape[0] == acc.n
    streamed = acc.compute()
    assert set(streamed) == {"frobenius", "cka"}
    for name, fn in (("frobenius", frobenius_similarity), ("cka", linear_cka)):
        feat, gram = fn(x, y, form="feature"), fn(x, y, form="gram")
        assert 0.01 < feat < 0.99
        assert _close(feat, gram), (name, feat, gram)
        assert _close(streamed[name], feat), (name, streamed[name], feat)
        assert type(streamed[name]) is float


def test_streaming_accepts_float32_batches():
    x = _anisotropic(300, 12, seed=18)
    y = _related(x, 7, seed=19)
    acc = StreamingSimilarity(12, 7)
    acc.update(x[:100].float(), y[:100].float())
    acc.update(x[100:].float(), y[100:].float())
    out = acc.compute()
    assert _close(out["cka"], linear_cka(x.float(), y.float()))
    assert _close(out["frobenius"], frobenius_similarity(x.float(), y.float()))


def test_auto_picks_cheaper_form():
    assert choose_form(10, 64, 48, "cka") == "gram"
    assert choose_form(10, 64, 48, "frobenius") == "gram"
    assert choose_form(2000, 64, 48, "cka") == "feature"
    assert choose_form(2000, 64, 48, "frobenius") == "feature"
    # In between, CKA's self products make the feature form dearer than for the Frobenius metric.
    assert choose_form(40, 64, 48, "cka") == "gram"
    assert choose_form(40, 64, 48, "frobenius") == "feature"


@pytest.mark.parametrize("n", [10, 1000])
def test_auto_agrees_with_explicit_forms(n):
    x = _anisotropic(n, 40, seed=20)
    y = _related(x, 30, seed=21)
    for fn in (frobenius_similarity, linear_cka):
        assert _close(fn(x, y), fn(x, y, form="feature"))
        assert _close(fn(x, y), fn(x, y, form="gram"))


# --- streaming memory -------------------------------------------------------------------------


def _tensor_state(acc: StreamingSimilarity) -> dict[str, object]:
    """Every attribute of the accumulator, tensors (also inside containers) as (shape, bytes)."""

    def describe(v):
        if isinstance(v, torch.Tensor):
            return tuple(v.shape), v.numel() * v.element_size()
        if isinstance(v, (list, tuple)):
            return [describe(u) for u in v]
        if isinstance(v, dict):
            return {k: describe(u) for k, u in v.items()}
        return type(v).__name__

    return {k: describe(v) for k, v in vars(acc).items()}


@pytest.mark.parametrize("d_a,d_b", [(16, 24), (40, 8)])
def test_streaming_memory_does_not_depend_on_n(d_a, d_b):
    states = {}
    for n in (5, 2000):
        acc = StreamingSimilarity(d_a, d_b)
        before = _tensor_state(acc)
        for chunk in torch.arange(n).split(300):
            b = len(chunk)
            acc.update(torch.randn(b, d_a, generator=_gen(n + b)), torch.randn(b, d_b, generator=_gen(b)))
        assert acc.n == n
        assert _tensor_state(acc) == before  # nothing was added or grown while streaming
        states[n] = _tensor_state(acc)
        assert acc.nbytes == 8 * (d_a * d_a + d_b * d_b + d_a * d_b + d_a + d_b)
        assert {k: v.shape for k, v in acc.buffers().items()} == {
            "xx": (d_a, d_a), "yy": (d_b, d_b), "yx": (d_b, d_a), "sum_x": (d_a,), "sum_y": (d_b,)}
    assert states[5] == states[2000]


# --- errors -----------------------------------------------------------------------------------


def test_errors():
    x, y = torch.randn(10, 4), torch.randn(11, 3)
    for fn in (frobenius_similarity, linear_cka):
        with pytest.raises(ValueError, match="same inputs"):
            fn(x, y)
        with pytest.raises(ValueError, match="2-D"):
            fn(torch.randn(10), torch.randn(10, 3))
        with pytest.raises(ValueError, match="form"):
            fn(x, y[:10], form="fast")
        with pytest.raises(ValueError, match="zero norm"):
            fn(torch.zeros(10, 4), y[:10])
    with pytest.raises(ValueError, match="zero norm"):
        linear_cka(torch.ones(10, 4), y[:10], form="feature")
    with pytest.raises(ValueError, match="metric"):
        choose_form(10, 4, 3, "cosine")

    acc = StreamingSimilarity(4, 3)
    with pytest.raises(ValueError, match="update"):
        acc.compute()
    with pytest.raises(ValueError, match="d_a=4"):
        acc.update(torch.randn(5, 5), torch.randn(5, 3))
    with pytest.raises(ValueError, match="d_b=3"):
        acc.update(torch.randn(5, 4), torch.randn(5, 4))
    with pytest.raises(ValueError, match="same inputs"):
        acc.update(torch.randn(5, 4), torch.randn(6, 3))
    with pytest.raises(ValueError, match="2-D"):
        acc.update(torch.randn(4), torch.randn(1, 3))
    assert acc.n == 0  # rejected batches left no trace
    with pytest.raises(ValueError, match="positive"):
        StreamingSimilarity(0, 3)

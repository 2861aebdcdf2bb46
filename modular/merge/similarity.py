"""Similarity of two activation spaces measured on the same inputs.

Both spaces are observed on the same ``n`` inputs: ``X`` is ``(n, d_A)`` and ``Y``
is ``(n, d_B)``; the widths may differ. Two scores in ``[0, 1]`` are provided.

Frobenius similarity (uncentred)::

    ‖YᵀX‖²_F / (‖X‖²_F · ‖Y‖²_F)

It is invariant to scaling either space, but it is *not* 1 for ``X = Y``: with
``σ`` the singular values of ``X`` it equals ``Σσ⁴ / (Σσ²)²``, the inverse
participation ratio of the spectrum (1 only when ``X`` has rank one).

Linear CKA (centred kernel alignment)::

    ‖YcᵀXc‖²_F / (‖XcᵀXc‖_F · ‖YcᵀYc‖_F)

with ``Xc``, ``Yc`` column-centred. It is 1 for ``X = Y`` and invariant to
translations, orthogonal maps and isotropic scaling of either space.

Every squared norm above can be computed in two equivalent forms:

* feature form, from cross products of the features: ``YᵀX`` (``d_B × d_A``),
  ``XᵀX`` and ``YᵀY``; cost linear in ``n``;
* Gram form, from the ``n × n`` Gram matrices, using ``‖YᵀX‖²_F = ⟨XXᵀ, YYᵀ⟩``,
  ``‖XᵀX‖_F = ‖XXᵀ‖_F`` and ``‖X‖²_F = trace(XXᵀ)``; cost quadratic in ``n``.

``form="auto"`` picks the one with fewer multiply-adds (see :func:`choose_form`):
the Gram form only pays off when there are fewer inputs than features.

:class:`StreamingSimilarity` evaluates the feature form over batches of inputs.
It keeps ``XᵀX``, ``YᵀY``, ``YᵀX``, the column sums and ``n``, so its memory is
``O(d_A·d_B + d_A² + d_B²)`` whatever ``n`` is; centring is applied at the end
(``XcᵀXc = XᵀX − n·μxμxᵀ``, ``YcᵀXc = YᵀX − n·μyμxᵀ``).

All arithmetic runs in float64 and the scores are returned as Python floats.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

Form = Literal["auto", "feature", "gram"]
Metric = Literal["frobenius", "cka"]

FORMS = ("auto", "feature", "gram")
METRICS = ("frobenius", "cka")


def choose_form(n: int, d_a: int, d_b: int, metric: Metric = "cka") -> Literal["feature", "gram"]:
    """The cheaper way to compute ``metric`` for ``n`` inputs of widths ``d_a`` and ``d_b``.

    Counts multiply-adds of the dominant products:

    * feature form: ``n·d_A·d_B`` for ``YᵀX``, plus ``n·(d_A² + d_B²)`` for
      ``XᵀX`` and ``YᵀY`` when the metric is CKA (the Frobenius metric only needs
      ``‖X‖_F`` and ``‖Y‖_F``, which are linear in ``n·d``);
    * Gram form: ``n²·(d_A + d_B)`` for ``XXᵀ`` and ``YYᵀ``.

    Ties go to the feature form, whose memory does not grow with ``n``.
    """
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {METRICS}, got {metric!r}")
    feature = n * d_a * d_b + (n * (d_a * d_a + d_b * d_b) if metric == "cka" else 0)
    gram = n * n * (d_a + d_b)
    return "gram" if gram < feature else "feature"


def _as_matrix(a: Tensor, name: str, device: torch.device | None = None) -> Tensor:
    t = torch.as_tensor(a)
    if t.ndim != 2:
        raise ValueError(f"{name} must be a 2-D (n, d) matrix, got shape {tuple(t.shape)}")
    if t.is_complex():
        raise ValueError(f"{name} must be real, got dtype {t.dtype}")
    return t.to(device=device if device is not None else t.device, dtype=torch.float64)


def _pair(X: Tensor, Y: Tensor) -> tuple[Tensor, Tensor]:
    """Both inputs as float64 matrices on ``X``'s device, with matching row counts."""
    x = _as_matrix(X, "X")
    y = _as_matrix(Y, "Y", device=x.device)
    if x.shape[0] != y.shape[0]:
        raise ValueError(
            f"X and Y must hold the same inputs (rows): X has n={x.shape[0]}, Y has n={y.shape[0]}"
        )
    if x.shape[0] == 0:
        raise ValueError("X and Y have no rows; similarity needs at least one input")
    if x.shape[1] == 0 or y.shape[1] == 0:
        raise ValueError(f"X and Y need at least one column, got d_A={x.shape[1]}, d_B={y.shape[1]}")
    return x, y


def _resolve(form: str, n: int, d_a: int, d_b: int, metric: Metric) -> str:
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    return choose_form(n, d_a, d_b, metric) if form == "auto" else form


def _ratio(num: Tensor, den: Tensor, what: str) -> float:
    d = float(den)
    if d <= 0.0:
        raise ValueError(f"{what} is undefined: an activation matrix has zero norm")
    return float(num) / d


def frobenius_similarity(X: Tensor, Y: Tensor, form: Form = "auto") -> float:
    """Uncentred similarity ``‖YᵀX‖²_F / (‖X‖²_F ‖Y‖²_F)`` of ``X`` (n, d_A) and ``Y`` (n, d_B).

    Scale-invariant; equals ``Σσ⁴/(Σσ²)²`` (not 1) for ``X = Y``.

    Args:
        X: activations of space A, one row per input.
        Y: activations of space B on the same inputs, in the same order.
        form: ``"feature"`` (``d_B × d_A`` cross product), ``"gram"`` (``n × n``
            Gram matrices) or ``"auto"`` for the cheaper one.

    Raises:
        ValueError: on non-matrix inputs, different row counts, an unknown form or
            an all-zero input.
    """
    x, y = _pair(X, Y)
    how = _resolve(form, x.shape[0], x.shape[1], y.shape[1], "frobenius")
    if how == "feature":
        num = (y.T @ x).square().sum()
        den = x.square().sum() * y.square().sum()
    else:
        k, l = x @ x.T, y @ y.T
        num = (k * l).sum()
        den = k.trace() * l.trace()
    return _ratio(num, den, "Frobenius similarity")


def linear_cka(X: Tensor, Y: Tensor, form: Form = "auto") -> float:
    """Centred linear CKA ``‖YcᵀXc‖²_F / (‖XcᵀXc‖_F ‖YcᵀYc‖_F)`` of ``X`` (n, d_A) and ``Y`` (n, d_B).

    1 for ``X = Y``; invariant to translation, orthogonal maps and isotropic
    scaling of either space.

    Args:
        X: activations of space A, one row per input.
        Y: activations of space B on the same inputs, in the same order.
        form: ``"feature"``, ``"gram"`` or ``"auto"`` (see :func:`choose_form`).

    Raises:
        ValueError: on non-matrix inputs, different row counts, an unknown form or
            a constant (zero-variance) input.
    """
    x, y = _pair(X, Y)
    how = _resolve(form, x.shape[0], x.shape[1], y.shape[1], "cka")
    xc = x - x.mean(dim=0, keepdim=True)
    yc = y - y.mean(dim=0, keepdim=True)
    if how == "feature":
        num = (yc.T @ xc).square().sum()
        den = torch.linalg.matrix_norm(xc.T @ xc) * torch.linalg.matrix_norm(yc.T @ yc)
    else:
        k, l = xc @ xc.T, yc @ yc.T
        num = (k * l).sum()
        den = torch.linalg.matrix_norm(k) * torch.linalg.matrix_norm(l)
    return _ratio(num, den, "linear CKA")


class StreamingSimilarity:
    """Frobenius similarity and linear CKA accumulated over batches of inputs.

    Keeps only sufficient statistics, so memory is ``O(d_A·d_B + d_A² + d_B²)``
    and independent of the number of inputs:

    * ``xx = XᵀX`` (d_A × d_A), ``yy = YᵀY`` (d_B × d_B), ``yx = YᵀX`` (d_B × d_A);
    * column sums ``sum_x`` (d_A), ``sum_y`` (d_B) and the row count ``n``.

    Example::

        acc = StreamingSimilarity(d_a, d_b)
        for xb, yb in batches:
            acc.update(xb, yb)
        scores = acc.compute()  # {"frobenius": ..., "cka": ...}

    Args:
        d_a: width of space A (columns of every ``X`` batch).
        d_b: width of space B (columns of every ``Y`` batch).
        dtype: accumulation dtype; float64 unless memory is very tight.
        device: where the statistics live; batches are moved there.
    """

    def __init__(self, d_a: int, d_b: int, dtype: torch.dtype = torch.float64,
                 device: torch.device | str | None = None) -> None:
        if int(d_a) < 1 or int(d_b) < 1:
            raise ValueError(f"d_a and d_b must be positive, got d_a={d_a}, d_b={d_b}")
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating dtype, got {dtype}")
        self.d_a, self.d_b = int(d_a), int(d_b)
        self.dtype = dtype
        opts = dict(dtype=dtype, device=device)
        self.xx = torch.zeros(self.d_a, self.d_a, **opts)
        self.yy = torch.zeros(self.d_b, self.d_b, **opts)
        self.yx = torch.zeros(self.d_b, self.d_a, **opts)
        self.sum_x = torch.zeros(self.d_a, **opts)
        self.sum_y = torch.zeros(self.d_b, **opts)
        self.n = 0

    def buffers(self) -> dict[str, Tensor]:
        """The accumulated statistics by name (their shapes depend on ``d_a``, ``d_b`` only)."""
        return {"xx": self.xx, "yy": self.yy, "yx": self.yx, "sum_x": self.sum_x, "sum_y": self.sum_y}

    @property
    def nbytes(self) -> int:
        """Bytes held by the accumulated statistics."""
        return sum(t.numel() * t.element_size() for t in self.buffers().values())

    @torch.no_grad()
    def update(self, X_batch: Tensor, Y_batch: Tensor) -> None:
        """Add a batch of inputs: ``X_batch`` (b, d_A) and ``Y_batch`` (b, d_B), rows paired.

        Raises:
            ValueError: if a batch is not 2-D, has the wrong width, or the row
                counts of the two batches differ.
        """
        x = _as_matrix(X_batch, "X_batch", self.xx.device).to(self.dtype)
        y = _as_matrix(Y_batch, "Y_batch", self.xx.device).to(self.dtype)
        if x.shape[1] != self.d_a:
            raise ValueError(f"X_batch must have d_a={self.d_a} columns, got {x.shape[1]}")
        if y.shape[1] != self.d_b:
            raise ValueError(f"Y_batch must have d_b={self.d_b} columns, got {y.shape[1]}")
        if x.shape[0] != y.shape[0]:
            raise ValueError(
                f"X_batch and Y_batch must hold the same inputs: got {x.shape[0]} and {y.shape[0]} rows"
            )
        self.xx.addmm_(x.T, x)
        self.yy.addmm_(y.T, y)
        self.yx.addmm_(y.T, x)
        self.sum_x += x.sum(dim=0)
        self.sum_y += y.sum(dim=0)
        self.n += x.shape[0]

    @torch.no_grad()
    def compute(self) -> dict[str, float]:
        """Scores over every input seen so far: ``{"frobenius": float, "cka": float}``.

        Raises:
            ValueError: before any input was added, or if an input space is all
                zero (Frobenius) or constant (CKA).
        """
        if self.n == 0:
            raise ValueError("no inputs accumulated; call update() first")
        xx, yy, yx = (t.to(torch.float64) for t in (self.xx, self.yy, self.yx))
        sx, sy = self.sum_x.to(torch.float64), self.sum_y.to(torch.float64)
        frob = _ratio(yx.square().sum(), xx.trace() * yy.trace(), "Frobenius similarity")
        # Centring: XcᵀXc = XᵀX − n·μxμxᵀ = XᵀX − sx sxᵀ / n, and likewise for the others.
        xxc = xx - torch.outer(sx, sx) / self.n
        yyc = yy - torch.outer(sy, sy) / self.n
        yxc = yx - torch.outer(sy, sx) / self.n
        cka = _ratio(
            yxc.square().sum(),
            torch.linalg.matrix_norm(xxc) * torch.linalg.matrix_norm(yyc),
            "linear CKA",
        )
        return {"frobenius": frob, "cka": cka}

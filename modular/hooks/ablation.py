"""Projecting directions out of every residual write: of every row (:func:`ablate_directions`), or of each set of
rows its own (:func:`ablate_rows`); and any other edit of the writes (:func:`edit_writes`).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch

from modular.hooks.registry import _hidden, _replace_hidden, registered
from modular.models.adapter import ArchitectureAdapter


def _orthonormal(directions: torch.Tensor) -> torch.Tensor:
    """Rows of ``directions`` (k, d) -> an orthonormal basis (k, d) of their span (in float64, rounded once)."""
    d = directions.reshape(-1, directions.shape[-1]).to(torch.float64)
    if d.shape[0] == 1:  # one direction: its unit vector (QR's, up to a sign that no projection sees), no solver;
        return (d / d.norm().clamp_min(torch.finfo(d.dtype).tiny)).to(directions.dtype)  # zero stays zero
    q, _ = torch.linalg.qr(d.T)
    return q.T.to(directions.dtype)


class _ProjectOutOne(torch.autograd.Function):
    """``x - (x · u) ku`` for one unit direction ``u`` (d,) and ``ku``: ``u``, or ``u`` times a row mask ((batch, 1,
    ..., d)). The map is symmetric, so its backward is the same projection of the gradient: a matrix-vector product
    and one ``addcmul`` each way, the fewest operations (on a GPU with a small batch, kernel launches are the cost).
    The backward is itself differentiable (higher-order gradients through a lock)."""

    @staticmethod
    def forward(ctx, x, u, ku):
        ctx.save_for_backward(u, ku)
        return torch.addcmul(x, (x @ u).unsqueeze(-1), ku, value=-1)

    @staticmethod
    def backward(ctx, grad):
        u, ku = ctx.saved_tensors
        return _ProjectOutOne.apply(grad, u, ku), None, None


def _project_out(x: torch.Tensor, basis: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """Remove from ``x`` (..., d) its components along the orthonormal rows of ``basis`` ((k, d), or (d,) for one
    direction) in ``x``'s precision and on its device (:class:`_Basis` casts it), on the rows where ``keep`` (broadcast
    against ``x[..., :1]``) is 1 if given. The basis is fixed (no gradient reaches it)."""
    if basis.dim() == 1:
        ku = basis if keep is None else keep * basis
        if torch.compiler.is_compiling():  # traced (modular.models.compiled): the compiler fuses plain operations,
            return x - (x @ basis).unsqueeze(-1) * ku  # and a custom Function would break the graph
        return _ProjectOutOne.apply(x, basis, ku)
    coef = x @ basis.T
    return x - (coef if keep is None else coef * keep) @ basis


class _Basis:
    """An orthonormal basis ((k, d) rows; a (d,) vector for one direction) and its casts to the precisions and
    devices of the writes it meets, each made once (all the write sites that share the basis share them), with, for
    one direction, its products with row masks (likewise made once)."""

    def __init__(self, basis: torch.Tensor):
        basis = basis[0] if basis.shape[0] == 1 else basis
        self._cast = {(basis.dtype, basis.device): basis}
        self._masked: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def to(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if (dtype, device) not in self._cast:
            self._cast[dtype, device] = next(iter(self._cast.values())).to(dtype=dtype, device=device)
        return self._cast[dtype, device]

    def masked(self, rows: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(basis, keep)`` for writes like ``x`` on the rows of the boolean mask ``rows``: ``keep`` the mask shaped
        to broadcast against ``x``, times the basis when it is one direction (so a write pays one product less)."""
        key = (id(rows), x.dtype, x.device, x.dim())
        if key not in self._masked:
            basis = self.to(x.dtype, x.device)
            keep = rows.to(device=x.device).reshape(-1, *[1] * (x.dim() - 1))
            self._masked[key] = (basis, keep * basis if basis.dim() == 1 else keep, rows)  # rows: keeps its id taken
        return self._masked[key][:2]


def _projector(basis: _Basis, rows: torch.Tensor | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x -> _project_out(x, basis, rows)`` for one write site (``rows``: a (batch,) boolean mask, None for every
    row; a boolean mask multiplies in any precision without a cast)."""

    def f(x: torch.Tensor) -> torch.Tensor:
        if rows is None:
            return _project_out(x, basis.to(x.dtype, x.device))
        u, keep = basis.masked(rows, x)
        if u.dim() == 1:
            return _ProjectOutOne.apply(x, u, keep)
        return _project_out(x, u, keep)

    return f


def write_space_basis(adapter: ArchitectureAdapter, site, directions: torch.Tensor) -> torch.Tensor:
    """Orthonormal basis that a write site's projection output must avoid so its write avoids ``directions``.

    Without a post-sublayer norm that is the span of ``directions``. With a norm
    ``g ⊙ o / rms(o)`` after the sublayer, ``u · write = 0`` needs ``o ⊥ g ⊙ u``.
    """
    if site.post_norm is not None:
        gain = adapter.norm_gain(site.post_norm)
        if gain is not None:
            directions = directions * gain.detach().to(directions.dtype)
    return _orthonormal(directions)


def _site_bases(adapter: ArchitectureAdapter, directions: torch.Tensor) -> Callable[[object], _Basis]:
    """``site -> write_space_basis(adapter, site, directions)``, computed once for every site without a
    post-sublayer norm: they all share the span of ``directions`` (one basis per context, not one per write)."""
    shared: list[_Basis] = []

    def basis(site) -> _Basis:
        if site.post_norm is not None:
            return _Basis(write_space_basis(adapter, site, directions))
        if not shared:
            shared.append(_Basis(_orthonormal(directions)))
        return shared[0]

    return basis


@contextmanager
def edit_writes(adapter: ArchitectureAdapter,
                edit: Callable[[object], Callable[[torch.Tensor], torch.Tensor]]) -> Iterator[None]:
    """Replace every residual write's output ``x`` (embeddings, attention and MLP outputs, before any
    post-sublayer norm) by ``edit(site)(x)``; ``edit`` is called once per write site on entry (so per-site
    constants, such as a basis, are computed once)."""
    hooks = []
    for site in adapter.write_sites():
        f = edit(site)

        def fn(module, args, output, f=f):
            return _replace_hidden(output, f(_hidden(output)))

        hooks.append((site.module, "forward", fn))
    with registered(hooks):
        yield


@contextmanager
def ablate_directions(adapter: ArchitectureAdapter, directions: torch.Tensor) -> Iterator[None]:
    """Project ``directions`` ((d,) or (k, d)) out of every residual write (embeddings, attention, MLP).

    For post-sublayer-norm architectures the projection acts on the sublayer output
    *before* the norm, against ``g ⊙ u`` (see :func:`write_space_basis`), which is what
    orthogonalised weights reproduce.
    """
    bases = _site_bases(adapter, directions.reshape(-1, directions.shape[-1]).detach())

    def edit(site):
        return _projector(bases(site))

    with edit_writes(adapter, edit):
        yield


@contextmanager
def ablate_rows(adapter: ArchitectureAdapter, row_sets: list[tuple[torch.Tensor, torch.Tensor]],
                check: bool = True) -> Iterator[None]:
    """:func:`ablate_directions` row by row, so that sequences locked in different ways share one forward pass.

    ``row_sets``: ``(rows, directions)`` pairs: ``rows`` a (batch,) boolean mask, ``directions`` (k, d) projected out
    of every residual write of those rows (masks may not overlap). Rows in no mask are left untouched; a row's
    result is that of :func:`ablate_directions` with its own directions. ``check``: refuse overlapping masks (on a
    GPU the check waits for the device; a caller whose masks are disjoint by construction may skip it)."""
    sets = [(rows, directions.reshape(-1, directions.shape[-1]).detach()) for rows, directions in row_sets]
    if check and sets and int(sum(rows.long() for rows, _ in sets).max()) > 1:
        raise ValueError("ablate_rows: a row is in two masks")

    site_bases = [(rows, _site_bases(adapter, directions)) for rows, directions in sets]

    def edit(site):
        projectors = [_projector(basis(site), rows) for rows, basis in site_bases]

        def f(x):
            for project in projectors:
                x = project(x)
            return x

        return f

    with edit_writes(adapter, edit):
        yield

"""Transient interventions as context managers that always remove their hooks.

Every function here registers PyTorch hooks on modules found through the
:class:`~modular.models.adapter.ArchitectureAdapter` and removes them when the
``with`` block exits, also when the block raises.

* :func:`capture_residual`: the residual stream before every block and after the last;
* :func:`capture_head_inputs`: the attention output projection's input, per head;
* :func:`ablate_directions`: project one or several directions out of every residual write;
* :func:`add_vectors`: add vectors to the residual stream after chosen blocks;
* :func:`scale_heads` / :func:`zero_heads` / :func:`replace_heads`: act on chosen heads
  at the input of the attention output projection (before the heads are mixed);
  :func:`replace_head_per_group`: one head per copy of the prompts, several single-head patches in one pass.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Callable, Iterable, Iterator, Mapping, Sequence

import torch
from torch import nn

from modular.models.adapter import ArchitectureAdapter

Head = tuple[int, int]  # (layer, head)


#: the intervention hooks registered now (through :func:`registered`), in order: what a recomputed block must see
_ACTIVE: list[tuple[nn.Module, str, Callable]] = []


def _register(hooks: Iterable[tuple[nn.Module, str, Callable]]) -> list:
    handles = []
    for module, kind, fn in hooks:
        if kind == "forward":
            handles.append(module.register_forward_hook(fn))
        elif kind == "pre":
            handles.append(module.register_forward_pre_hook(fn))
        elif kind == "pre_kwargs":
            handles.append(module.register_forward_pre_hook(fn, with_kwargs=True))
        else:  # pragma: no cover - programming error
            for handle in handles:
                handle.remove()
            raise ValueError(kind)
    return handles


@contextmanager
def registered(hooks: Iterable[tuple[nn.Module, str, Callable]], replay: bool = True) -> Iterator[None]:
    """Register ``(module, kind, fn)`` hooks (kind: ``forward``, ``pre``, ``pre_kwargs``); always remove them.

    ``replay``: an intervention (the hooks change what the model computes): under gradient checkpointing a block
    recomputed during the backward pass runs with it again (:func:`replay_interventions`). Hooks that only
    capture activations are not replayed."""
    hooks = list(hooks)
    entries = hooks if replay else []
    handles = []
    try:
        handles = _register(hooks)
        _ACTIVE.extend(entries)
        yield
    finally:
        for handle in handles:
            handle.remove()
        for entry in entries:
            for i in range(len(_ACTIVE) - 1, -1, -1):  # the latest registration of this entry
                if _ACTIVE[i] is entry:
                    del _ACTIVE[i]
                    break


def replay_interventions():
    """``context_fn`` for non-reentrant :func:`torch.utils.checkpoint.checkpoint`: a block recomputed in the backward
    pass runs under the interventions that were active when it ran forward (the ``with`` blocks that registered
    them have usually exited by then), so an ablated, steered or gated forward pass gets its own gradients."""
    snapshot = list(_ACTIVE)

    @contextmanager
    def recompute():
        missing = [h for h in snapshot if not any(h is a for a in _ACTIVE)]
        handles = _register(missing)
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    return nullcontext(), recompute()


def enable_checkpointing(model, context_fn=replay_interventions) -> None:
    """Gradient (activation) checkpointing of every block of a transformers model, non-reentrant, with the
    interventions replayed in the recomputed blocks (``context_fn``; None: plain checkpointing)."""
    kwargs = {"use_reentrant": False, **({"context_fn": context_fn} if context_fn is not None else {})}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5 (the older name is deprecated there)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _hidden(output):
    return output[0] if isinstance(output, tuple) else output


def _replace_hidden(output, new):
    return (new, *output[1:]) if isinstance(output, tuple) else new


def _block_input(args, kwargs) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


# --- residual stream ------------------------------------------------------------------------
@contextmanager
def capture_residual(adapter: ArchitectureAdapter, detach: bool = True) -> Iterator[list[torch.Tensor]]:
    """Capture the residual stream: ``states[i]`` enters block ``i``; ``states[n_layers]`` leaves the last.

    The list is filled during the forward pass inside the block (one entry per
    position 0..n_layers; a second forward pass overwrites it).
    """
    n = adapter.n_layers
    states: list[torch.Tensor] = [None] * (n + 1)  # type: ignore[list-item]

    def pre(i):
        def fn(module, args, kwargs):
            x = _block_input(args, kwargs)
            states[i] = x.detach() if detach else x

        return fn

    def post(module, args, output):
        x = _hidden(output)
        states[n] = x.detach() if detach else x

    hooks = [(adapter.block(i), "pre_kwargs", pre(i)) for i in range(n)]
    hooks.append((adapter.block(n - 1), "forward", post))
    with registered(hooks, replay=False):
        yield states


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
        return _ProjectOutOne.apply(x, basis, basis if keep is None else keep * basis)
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


@contextmanager
def add_vectors(adapter: ArchitectureAdapter, vectors: Mapping[int, torch.Tensor]) -> Iterator[None]:
    """Add ``vectors[i]`` to the residual stream leaving block ``i`` at all positions.

    A vector of shape (d,) is added to every sequence; one of shape (batch, d) adds row ``r`` to
    sequence ``r`` only (zero rows leave their sequences untouched), so differently steered
    sequences can share one forward pass.
    """

    def make(vec):
        def fn(module, args, output):
            x = _hidden(output)
            v = vec.to(dtype=x.dtype, device=x.device)
            return _replace_hidden(output, x + (v[:, None] if v.dim() == 2 else v))

        return fn

    with registered([(adapter.block(i), "forward", make(v)) for i, v in vectors.items()]):
        yield


# --- heads ------------------------------------------------------------------------------------
def split_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """``(..., n_heads*head_dim)`` -> ``(..., n_heads, head_dim)``."""
    return x.reshape(*x.shape[:-1], n_heads, x.shape[-1] // n_heads)


def _head_pre_hook(adapter: ArchitectureAdapter, edit: Callable[[torch.Tensor], torch.Tensor]):
    n_heads = adapter.n_heads

    def fn(module, args):
        x = args[0]
        z = edit(split_heads(x, n_heads))
        return (z.reshape(x.shape), *args[1:])

    return fn


@contextmanager
def scale_heads(adapter: ArchitectureAdapter, scales: Mapping[int, torch.Tensor]) -> Iterator[None]:
    """Multiply head ``h`` of layer ``l`` by ``scales[l][h]`` at the attention output projection's input."""
    hooks = []
    for layer, s in scales.items():
        def edit(z, s=s):
            return z * s.to(dtype=z.dtype, device=z.device)[:, None]

        hooks.append((adapter.attn_out(layer), "pre", _head_pre_hook(adapter, edit)))
    with registered(hooks):
        yield


def heads_by_layer(heads: Iterable[Head]) -> dict[int, list[int]]:
    """``{layer: [head, ...]}`` of ``(layer, head)`` pairs, in the order given."""
    out: dict[int, list[int]] = {}
    for layer, head in heads:
        out.setdefault(int(layer), []).append(int(head))
    return out


@contextmanager
def zero_heads(adapter: ArchitectureAdapter, heads: Iterable[Head]) -> Iterator[None]:
    """Zero-ablate the listed ``(layer, head)`` pairs."""
    scales = {}
    for layer, hs in heads_by_layer(heads).items():
        s = torch.ones(adapter.n_heads)
        s[hs] = 0.0
        scales[layer] = s
    with scale_heads(adapter, scales):
        yield


@contextmanager
def replace_heads(
    adapter: ArchitectureAdapter, heads: Iterable[Head], values: Mapping[int, torch.Tensor]
) -> Iterator[None]:
    """Replace the listed heads' inputs by ``values[layer]``.

    ``values[layer]`` broadcasts to ``(batch, seq, n_heads, head_dim)``: a mean
    activation ``(n_heads, head_dim)`` gives mean ablation; activations captured on
    counterfactual prompts (same shape as the batch) give counterfactual patching.
    """
    hooks = []
    for layer, hs in heads_by_layer(heads).items():
        idx = torch.tensor(hs)

        def edit(z, idx=idx, v=values[layer]):
            z = z.clone()
            v = v.to(dtype=z.dtype, device=z.device).expand_as(z)
            z[..., idx, :] = v[..., idx, :]
            return z

        hooks.append((adapter.attn_out(layer), "pre", _head_pre_hook(adapter, edit)))
    with registered(hooks):
        yield


@contextmanager
def replace_head_per_group(adapter: ArchitectureAdapter, layer: int, heads: Sequence[int], values: torch.Tensor,
                           ) -> Iterator[None]:
    """One head per group of the batch: the batch is ``len(heads)`` equal groups of rows (the same prompts
    repeated, :func:`repeat_batch`), and in group ``j`` head ``heads[j]`` of ``layer`` is replaced by ``values``
    (broadcastable to one group's ``(rows, seq, n_heads, head_dim)``). One forward pass patches several heads
    alone, each in its own copy of the prompts: the same numbers as a :func:`replace_heads` pass per head."""
    heads = [int(h) for h in heads]

    def edit(z):
        groups = z.clone().view(len(heads), z.shape[0] // len(heads), *z.shape[1:])
        v = values.to(dtype=z.dtype, device=z.device).expand_as(groups[0])
        for j, head in enumerate(heads):
            groups[j, ..., head, :] = v[..., head, :]
        return groups.view(z.shape)

    with registered([(adapter.attn_out(layer), "pre", _head_pre_hook(adapter, edit))]):
        yield


@contextmanager
def capture_head_inputs(adapter: ArchitectureAdapter, detach: bool = True) -> Iterator[dict[int, torch.Tensor]]:
    """Capture every layer's attention output projection input as ``(batch, seq, n_heads, head_dim)``.
    ``detach=False``: the captured tensors are the ones the projection then reads, so gradients can be taken
    with respect to them (``torch.autograd.grad``)."""
    store: dict[int, torch.Tensor] = {}

    def make(layer):
        def fn(module, args):
            z = split_heads(args[0], adapter.n_heads)
            if detach:
                store[layer] = z.detach()
                return None
            store[layer] = z
            return (z.flatten(-2), *args[1:])

        return fn

    with registered([(adapter.attn_out(i), "pre", make(i)) for i in range(adapter.n_layers)], replay=False):
        yield store


@contextmanager
def capture_writes(adapter: ArchitectureAdapter) -> Iterator[dict[str, torch.Tensor]]:
    """Capture every residual write as it enters the residual stream (after any post-sublayer norm)."""
    store: dict[str, torch.Tensor] = {}
    hooks = []
    for site in adapter.write_sites():
        module = site.post_norm if site.post_norm is not None else site.module

        def fn(m, args, output, name=site.name):
            store[name] = _hidden(output).detach()

        hooks.append((module, "forward", fn))
    with registered(hooks, replay=False):
        yield store


@contextmanager
def capture_block_outputs(adapter: ArchitectureAdapter) -> Iterator[list]:
    """Record every block's raw output (whatever the block returns) in a list indexed by layer."""
    outputs: list = [None] * adapter.n_layers

    def record(i):
        def fn(module, args, output):
            outputs[i] = output

        return fn

    with registered([(adapter.block(i), "forward", record(i)) for i in range(adapter.n_layers)], replay=False):
        yield outputs


def repeat_batch(output, times: int):
    """``output`` (a tensor, or a tuple whose tensors lead with the batch dimension) with its batch repeated
    ``times`` times end to end (``torch.cat([x] * times)``); ``times = 1`` returns it as it is."""
    if times == 1:
        return output
    if isinstance(output, tuple):
        return tuple(repeat_batch(o, times) if torch.is_tensor(o) else o for o in output)
    return output.repeat(times, *([1] * (output.dim() - 1)))


@contextmanager
def reuse_block_outputs(adapter: ArchitectureAdapter, outputs: list, upto: int, repeat: int = 1):
    """Blocks ``0..upto-1`` return their recorded ``outputs`` instead of computing them.

    Patching a head of layer l cannot change what the blocks before l compute, so exhaustive
    patching replays them from the clean pass (about half the work on average). The blocks'
    ``forward`` is overridden on the instance and always restored. ``repeat``: the batch that runs
    is the recorded one repeated ``repeat`` times (:func:`repeat_batch`; one group per patched head,
    :func:`replace_head_per_group`).
    """
    saved = []
    try:
        for i in range(upto):
            block = adapter.block(i)
            saved.append((block, block.__dict__.get("forward")))
            block.forward = lambda *args, _out=outputs[i], **kwargs: repeat_batch(_out, repeat)
        yield
    finally:
        for block, previous in saved:
            if previous is None:
                del block.forward
            else:
                block.forward = previous

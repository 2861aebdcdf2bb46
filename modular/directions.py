"""Choosing the designated directions: low-variance (default), random, difference-in-means, or a file.

Residual streams carry a few huge "outlier" dimensions; a random direction
overlaps them and ablating it already costs accuracy. ``low_variance`` draws a
random unit vector inside the span of the lowest principal components of
residual activations on retain data, which costs almost nothing to ablate.
Several behaviours get mutually orthogonal directions.
"""

from __future__ import annotations

import inspect
from contextlib import nullcontext
from pathlib import Path

import torch
from tqdm.auto import tqdm

from modular import ModularError, error_reason
from modular.data.formatting import prompt_batches, prompt_limit
from modular.hooks import capture_residual
from modular.models.adapter import ArchitectureAdapter
from modular.runs import DIRECTIONS, read_tensors

STRATEGIES = ("low_variance", "random", "diff_in_means", "file")


@torch.no_grad()
def residual_covariance(model, tokenizer, prompts: list[str], chats: list[bool], batch_size: int = 16,
                        max_length: int | None = None, name: str | None = None):
    """Mean and covariance (d, d) of the residual stream over all layers and non-pad positions; each prompt keeps its
    last ``max_length`` tokens, and no more than the model's positions (those cut counted and reported once, as
    ``name``'s)."""
    adapter = ArchitectureAdapter(model)
    device = next(model.parameters()).device
    d = adapter.d_model
    total = torch.zeros(d, dtype=torch.float64)
    outer = torch.zeros(d, d, dtype=torch.float64)
    count = 0
    batches = prompt_batches(tokenizer, prompts, chats, batch_size, prompt_limit(model, max_length), name=name)
    for batch in tqdm(batches, desc="residual statistics", leave=False):
        mask = batch["attention_mask"].bool()
        with capture_residual(adapter) as states:
            model(**{k: v.to(device) for k, v in batch.items()}, use_cache=False)
        for s in states:
            x = s[mask.to(s.device)].double().cpu()
            total += x.sum(0)
            outer += x.T @ x
            count += x.shape[0]
    mean = total / count
    return mean, outer / count - torch.outer(mean, mean)


def _orthogonalise_against(v: torch.Tensor, others: torch.Tensor | None) -> torch.Tensor:
    v = v.double()
    if others is not None and len(others):
        q, _ = torch.linalg.qr(others.double().T)
        v = v - q @ (q.T @ v)
    norm = v.norm()
    if norm < 1e-8:
        raise ModularError("cannot choose a direction orthogonal to the existing ones (span exhausted)")
    return (v / norm).float()


def low_variance_direction(cov: torch.Tensor, others: torch.Tensor | None = None, fraction: float = 0.25,
                           seed: int = 0) -> torch.Tensor:
    """A random unit vector in the span of the lowest ``fraction`` of principal components, ⊥ ``others``."""
    evals, evecs = torch.linalg.eigh(cov.double())  # ascending
    k = max(1, int(fraction * cov.shape[0]))
    g = torch.Generator().manual_seed(seed)
    coeffs = torch.randn(k, generator=g, dtype=torch.float64)
    return _orthogonalise_against(evecs[:, :k] @ coeffs, others)


def random_direction(d: int, others: torch.Tensor | None = None, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return _orthogonalise_against(torch.randn(d, generator=g, dtype=torch.float64), others)


@torch.no_grad()
def last_position_states(model, tokenizer, prompts: list[str], chats: list[bool], intervention=None,
                         batch_size: int = 16, max_length: int | None = None, name: str | None = None) -> torch.Tensor:
    """Residual stream at the last prompt position entering every block and leaving the last: (n, L+1, d).

    Read-only (no autograd graph), so it is cheap to call inside a training step. Each prompt keeps its last
    ``max_length`` tokens, and no more than the model's positions (those cut counted and reported once, as
    ``name``'s): a prompt's length bounds the memory its forward pass takes.
    """
    adapter = ArchitectureAdapter(model)
    device = next(model.parameters()).device
    # only the residual stream is read: skip the unembedding of all but the last position where supported
    extra = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    rows = []
    for batch in prompt_batches(tokenizer, prompts, chats, batch_size, prompt_limit(model, max_length), name=name):
        with (intervention() if intervention is not None else nullcontext()), capture_residual(adapter) as states:
            model(**{k: v.to(device) for k, v in batch.items()}, use_cache=False, **extra)
        rows.append(torch.stack([s[:, -1].float() for s in states], dim=1))
    return torch.cat(rows)


def robust_norm(x: torch.Tensor) -> torch.Tensor:
    """Median norm of the rows of ``x`` (n, d) without each row's largest coordinate (outlier dimensions)."""
    x = x.scatter(1, x.abs().argmax(dim=1, keepdim=True), 0.0)
    return x.norm(dim=-1).median()


def last_position_mean(model, tokenizer, prompts: list[str], chats: list[bool], layer: int,
                       batch_size: int = 16, max_length: int | None = None) -> torch.Tensor:
    """Mean residual stream entering ``layer`` at the last prompt position (float64, on the CPU); prompts cut as
    :func:`last_position_states` cuts them."""
    states = last_position_states(model, tokenizer, prompts, chats, batch_size=batch_size, max_length=max_length)
    return states[:, layer].double().cpu().mean(0)


def diff_in_means_direction(model, tokenizer, behaviour_prompts, behaviour_chats, contrast_prompts,
                            contrast_chats, layer: int | None = None,
                            others: torch.Tensor | None = None, max_length: int | None = None) -> torch.Tensor:
    """Normalised mean(behaviour) − mean(contrast) at the last prompt position, entering ``layer`` (default: middle);
    each prompt keeps its last ``max_length`` tokens."""
    adapter = ArchitectureAdapter(model)
    layer = adapter.n_layers // 2 if layer is None else layer
    a = last_position_mean(model, tokenizer, behaviour_prompts, behaviour_chats, layer, max_length=max_length)
    b = last_position_mean(model, tokenizer, contrast_prompts, contrast_chats, layer, max_length=max_length)
    return _orthogonalise_against(a - b, others)


def load_direction_file(path: str | Path, d: int) -> torch.Tensor:
    """A direction from a safetensors file (key ``direction``) or a ``.pt`` tensor; normalised."""
    path = Path(path)
    if not path.is_file():
        raise ModularError(f"direction file not found: {path}")
    if path.suffix == ".safetensors":
        tensors = read_tensors(path)
        if "direction" not in tensors:
            raise ModularError(f"{path} holds no tensor named 'direction' (found {sorted(tensors)})")
        v = tensors["direction"]
    else:
        try:
            v = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001 - a truncated or foreign file fails in torch's zip or pickle readers
            raise ModularError(f"{path} is not a readable tensor file ({error_reason(err)})") from None
        if not isinstance(v, torch.Tensor):
            raise ModularError(f"{path} holds a {type(v).__name__}, not a direction tensor")
    return _unit_of_width(v, d, f"{path}: direction")


def _unit_of_width(v: torch.Tensor, d: int, what: str) -> torch.Tensor:
    """``v`` flattened and normalised, after checking it has the model's width ``d``."""
    v = v.flatten().float()
    if v.numel() != d:
        raise ModularError(f"{what} has {v.numel()} entries, the model's width is {d}")
    return v / v.norm()


def load_avoided_directions(paths: list[str | Path], d: int) -> torch.Tensor | None:
    """Every direction held in the given safetensors files (a run's ``directions.safetensors`` holds one per
    behaviour) as an ``(m, d)`` tensor, or None when no file is given."""
    if not paths:
        return None

    found = []
    for path in map(Path, paths):
        if path.is_dir():
            path = path / DIRECTIONS
        if not path.is_file():
            raise ModularError(f"directions to avoid not found: {path}")
        tensors = sorted(read_tensors(path).items())
        found += [_unit_of_width(v, d, f"{path}: direction '{name}'") for name, v in tensors]
    if not found:
        raise ModularError(f"no directions found in {', '.join(map(str, paths))}")
    return torch.stack(found)


def choose_directions(model, tokenizer, strategy: str, behaviours: list, retain, seed: int = 0,
                      files: list[str] | None = None, fraction: float = 0.25,
                      avoid: torch.Tensor | None = None, max_length: int | None = None) -> torch.Tensor:
    """One unit direction per behaviour, mutually orthogonal, as a ``(k, d)`` tensor.

    ``behaviours``: the behaviours' train splits (for ``diff_in_means``); ``retain``: the retain train split.
    ``avoid``: ``(m, d)`` directions every chosen one is also orthogonal to (e.g. another run's, so that the two
    runs can be weight-merged and keep both locks). Seeded draws continue after the avoided directions, as if
    those had been drawn first: avoiding one run's direction, the first behaviour draws with ``seed + 1``.
    ``max_length``: each prompt read keeps its last ``max_length`` tokens (and no more than the model's positions).
    """
    if strategy not in STRATEGIES:
        raise ModularError(f"unknown direction strategy '{strategy}': use one of {', '.join(STRATEGIES)}")
    d = ArchitectureAdapter(model).d_model
    chosen: list[torch.Tensor] = []
    cov = None
    if strategy == "low_variance":
        _, cov = residual_covariance(model, tokenizer, list(retain["prompt"]), list(retain["chat"]),
                                     max_length=max_length, name="retain (train)")
    fixed = [v.float() for v in avoid] if avoid is not None else []
    for i, ds in enumerate(behaviours):
        others = torch.stack(fixed + chosen) if fixed or chosen else None
        if strategy == "low_variance":
            v = low_variance_direction(cov, others, fraction, seed + len(fixed) + i)
        elif strategy == "random":
            v = random_direction(d, others, seed + len(fixed) + i)
        elif strategy == "diff_in_means":
            n = min(128, len(ds), len(retain))
            v = diff_in_means_direction(model, tokenizer, ds["prompt"][:n], ds["chat"][:n], retain["prompt"][:n],
                                        retain["chat"][:n], others=others, max_length=max_length)
        else:
            if not files or len(files) <= i:
                raise ModularError("strategy 'file' needs one direction file per behaviour (direction_files)")
            v = _orthogonalise_against(load_direction_file(files[i], d), others)
        chosen.append(v)
    return torch.stack(chosen)

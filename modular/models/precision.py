"""Where models run and in which precision: devices and dtypes by name.

``auto`` device: the first CUDA GPU when one is present, else the CPU. ``auto`` dtype: the model's own precision
(its config's ``torch_dtype``; for a training run, the precision its weights were trained in) on an accelerator,
float32 on a CPU, where bfloat16 and float16 matrix products are emulated on most processors (several times slower)
and the CPU figures of record are float32. ``None``: the model's own precision on any device (weights that are
published or unlocked keep theirs). Any other name is taken as asked.
"""

from __future__ import annotations

import torch

from modular import ModularError
from modular.models.names import DTypeName as DTypeName  # defined apart, without torch, for signatures

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """A device by name (``auto``, ``cpu``, ``cuda``, ``cuda:1``, ``mps``), checked to exist."""
    if isinstance(device, torch.device):
        return device
    if device in (None, "auto"):
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ModularError(f"unknown device '{device}' (auto, cpu, cuda, cuda:N or mps)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ModularError(f"device '{device}' asked for, but no CUDA GPU is available (use --device cpu)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ModularError(f"device '{device}' asked for, but only {torch.cuda.device_count()} GPU(s) exist")
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise ModularError(f"device '{device}' asked for, but MPS is not available")
    return dev


def host_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t``, built on the host, on ``device``. To a GPU through pinned memory and asynchronously: a copy from
    ordinary host memory makes the host wait until the GPU has run everything queued before it."""
    device = torch.device(device)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def own_dtype(config) -> torch.dtype | None:
    """The precision a model's config declares (``torch_dtype``/``dtype``), if it is one modular runs in."""
    for name in ("dtype", "torch_dtype"):
        value = getattr(config, name, None)
        if isinstance(value, str):
            value = DTYPES.get(value)
        if value in DTYPE_NAMES:
            return value
    return None


def resolve_dtype(dtype: str | torch.dtype | None, own: torch.dtype | None = None,
                  device: torch.device | str = "cpu") -> torch.dtype:
    """A dtype by name; ``auto`` is ``own`` (the model's precision) on an accelerator, float32 on a CPU; None is
    ``own`` anywhere (float32 when the model declares none)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPE_NAMES:
            raise ModularError(f"unsupported dtype {dtype} ({', '.join(DTYPES)})")
        return dtype
    if dtype is None:
        return own or torch.float32
    if dtype == "auto":
        return torch.float32 if torch.device(device).type == "cpu" or own is None else own
    if dtype not in DTYPES:
        raise ModularError(f"unknown dtype '{dtype}' (auto, {', '.join(DTYPES)})")
    return DTYPES[dtype]


def dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def model_dtype(model) -> torch.dtype:
    """The precision of a model's floating-point weights."""
    return next(p.dtype for p in model.parameters() if p.is_floating_point())


def stochastic_round(x: torch.Tensor, dtype: torch.dtype, generator: torch.Generator | None = None) -> torch.Tensor:
    """``x`` in a narrower floating-point ``dtype``, rounded stochastically: to the neighbour above or below with
    probabilities that make the result equal ``x`` in expectation (round-to-nearest is biased for every entry).

    Why it matters: a fine-tuning update is often smaller than half a unit in the last place of bfloat16; rounding
    to nearest then returns the weight it started from, for most weights at once, and what training changed (a lock)
    is lost. Stochastically rounded, every update survives on average over the entries. A cast that does not narrow
    (to the same or a wider dtype) is exact and done as such."""
    if not x.is_floating_point() or not dtype.is_floating_point:
        return x.to(dtype)
    if torch.finfo(dtype).bits >= torch.finfo(x.dtype).bits:
        return x.to(dtype)
    near = x.to(dtype)
    err = x - near.to(x.dtype)  # exact: two close numbers of the wider dtype
    toward = torch.nextafter(near, torch.where(err > 0, torch.inf, -torch.inf).to(dtype))
    gap = (toward.to(x.dtype) - near.to(x.dtype)).abs()
    take = torch.rand(x.shape, generator=generator, device=x.device, dtype=x.dtype) * gap < err.abs()
    return torch.where(take, toward, near)


@torch.no_grad()
def cast_model(model, dtype: torch.dtype, seed: int = 0):
    """``model`` with its floating-point weights in ``dtype``, in place. Narrowing (float32 to bfloat16 or float16)
    rounds stochastically (:func:`stochastic_round`), seeded: the same model and seed give the same weights, so a
    lock checked in that precision is the one published in it. Buffers keep their precision, as ``from_pretrained``
    leaves them (rotary frequencies stay float32)."""
    generators: dict = {}
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            if p.device not in generators:
                generators[p.device] = torch.Generator(device=p.device).manual_seed(seed)
            p.data = stochastic_round(p.data, dtype, generators[p.device])
    config = getattr(model, "config", None)
    if config is not None:
        config.dtype = dtype
    return model

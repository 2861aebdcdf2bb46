"""Where models run and in which precision: devices and dtypes by name.

``auto`` device: the first CUDA GPU when one is present, else the CPU. ``auto`` dtype: the model's own precision
(its config's ``torch_dtype``; for a training run, the precision its weights were trained in) on an accelerator,
float32 on a CPU, where bfloat16 and float16 matrix products are emulated on most processors (several times slower)
and the CPU figures of record are float32. ``None``: the model's own precision on any device (weights that are
published or unlocked keep theirs). Any other name is taken as asked.
"""

from __future__ import annotations

from typing import Literal

import torch

from modular import ModularError

DTypeName = Literal["auto", "float32", "bfloat16", "float16"]
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

"""Load a model or its tokenizer from any model reference (:mod:`modular.models.resolve` resolves it), after
checking its architecture; or only its config's precision, or the model on the meta device.

The names of the modules beside it that were once defined here are importable from here as well (``__all__``).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors import safe_open

from modular import ModularError, error_reason
from modular.models.adapter import check_supported
from modular.models.aliases import ALIASES, Alias, HubOrigin, hub_origin, looks_like_hub_id, looks_like_path
from modular.models.cache import cache_dir
from modular.models.precision import own_dtype, resolve_device, resolve_dtype
from modular.models.resolve import model_fingerprint, resolve_model

__all__ = [
    "load_model", "load_tokenizer", "empty_model", "load_dtype", "is_chat_model",
    # re-exported from the modules beside this one, where they were moved from here (importers name them here)
    "ALIASES", "Alias", "HubOrigin", "hub_origin", "looks_like_hub_id", "looks_like_path", "cache_dir",
    "model_fingerprint", "resolve_model",
]


def _unreadable_weights(ref: str, source: str, err: BaseException) -> str:
    """One line for weights that do not load: the unreadable safetensors file where one is, and what to do."""
    folder = Path(source)
    if not folder.is_dir():
        return f"cannot load model '{ref}': {error_reason(err)}"
    what = f"{folder} holds no readable weights ({error_reason(err)})"

    for file in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(file), "pt"):
                pass
        except Exception as bad:  # noqa: BLE001 - any unreadable file is the answer
            what = f"{file} is not a readable safetensors file ({error_reason(bad)})"
            break
    if (folder / "SOURCE").is_file():  # a cached conversion of a GGUF file
        return f"{what}: delete the cached folder {folder}, it is converted again from the GGUF file"
    return f"{what}: re-download or re-save the model"


def load_tokenizer(ref: str | os.PathLike):
    """Load the tokenizer of a model reference, with left padding and a pad token (a training run folder:
    :func:`modular.runs.load_tokenizer_or_run`)."""
    from transformers import AutoTokenizer

    source = resolve_model(ref)
    try:
        tok = AutoTokenizer.from_pretrained(source)
    except OSError as err:
        raise ModularError(f"cannot load the tokenizer of '{ref}': {str(err).splitlines()[0]}") from err
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(ref: str | os.PathLike, dtype: str | torch.dtype | None = "auto",
               device: str | torch.device | None = "auto"):
    """Load a causal LM from any model reference, in eval mode, after checking its architecture.

    ``device`` and ``dtype``: by name or as torch objects; ``auto`` is a GPU when present and the model's own
    precision there, float32 on a CPU (:mod:`modular.models.precision`). Both are checked before any weights load.
    A training run folder's trained model: :func:`modular.runs.load_model_or_run`.
    """
    from transformers import AutoModelForCausalLM

    device = resolve_device(device)
    source = resolve_model(ref)
    config = _checked_config(ref, source)
    dtype = resolve_dtype(dtype, own_dtype(config), device)
    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    except ImportError:  # a missing package is not the weights' fault
        raise
    except Exception as err:  # noqa: BLE001 - junk or truncated safetensors, missing weights: one line naming them
        raise ModularError(_unreadable_weights(str(ref), source, err)) from err
    return model.to(device).eval()


def empty_model(ref: str | os.PathLike, dtype: str | torch.dtype | None = "auto",
                device: str | torch.device | None = "auto"):
    """The model :func:`load_model` loads from ``ref`` with these arguments, built on the meta device: its modules,
    names, shapes and precision, and no weights read or memory allocated (a process that receives its weights from
    another one)."""
    from transformers import AutoModelForCausalLM

    config = _checked_config(ref, resolve_model(ref))  # the architecture and the device checked as load_model does
    dtype = _config_dtype(config, dtype, device)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def _checked_config(ref, source):
    """The model's config, checked to be an architecture modular supports (no weights are read)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(source)
    except (OSError, ValueError) as err:
        raise ModularError(f"cannot load model '{ref}': {str(err).splitlines()[0]}") from err
    check_supported(config)
    return config


def load_dtype(ref: str | os.PathLike, dtype: str | torch.dtype | None = "auto",
               device: str | torch.device | None = "auto") -> torch.dtype:
    """The precision :func:`load_model` loads ``ref`` in with these arguments, read from its config only."""
    return _config_dtype(_checked_config(ref, resolve_model(ref)), dtype, device)


def _config_dtype(config, dtype, device) -> torch.dtype:
    return resolve_dtype(dtype, own_dtype(config), resolve_device(device))


def is_chat_model(tokenizer) -> bool:
    """Whether prompts should be wrapped in the tokenizer's chat template."""
    return bool(getattr(tokenizer, "chat_template", None))

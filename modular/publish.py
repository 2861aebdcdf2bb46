"""Publish locked weights as a plain Hugging Face folder with one key file per behaviour, and unlock them.

Layout of a published folder::

    config.json, model.safetensors, tokenizer files, generation_config.json
    README.md            model card: which behaviours are locked, measured numbers
    modular.json         locked-weights hash, behaviours, keys applied so far, current weights hash
    keys/<behaviour>.key.safetensors   (only in the publisher's copy; hand them out separately)

Writing is atomic: everything goes to a temporary sibling folder that is renamed into
place at the end, so an interrupted publish never leaves a folder that looks complete.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from modular import ModularError
from modular.keys import apply_key, load_key, lock_weights, save_key, weights_hash

log = logging.getLogger("modular")
MANIFEST = "modular.json"


def _atomic_folder(out: Path, write, overwrite: bool) -> Path:
    out = Path(out)
    if out.exists() and not overwrite:
        raise ModularError(f"{out} already exists (pass --overwrite to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        write(tmp)
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def model_card(behaviours: list[str], base: str, measured: dict | None, hardened: bool) -> str:
    lines = [
        "---", "library_name: transformers", "tags: [modular, locked-behaviour]", "---", "",
        f"# Locked model (base: {base})", "",
        "These weights load with plain `transformers` (`AutoModelForCausalLM.from_pretrained`).",
        "The following behaviours are **locked**: each lives in one residual-stream direction that was",
        "projected out of every weight matrix writing the residual stream"
        + (" (and out of every reader, so adding it back does nothing)." if hardened else "."), "",
        "| behaviour | locked | key file |", "|---|---|---|",
    ]
    lines += [f"| {b} | yes | `keys/{b}.key.safetensors` |" for b in behaviours]
    lines += ["", "Unlock with `modular unlock --model <this folder> --key <key file> --out <folder>`.", ""]
    if measured:
        lines += ["## Measured (held-out test split)", "", "| state | " + " | ".join(behaviours)
                  + " | retain first-token KL | perplexity ratio |",
                  "|---|" + "---|" * (len(behaviours) + 2)]
        for state, row in measured.get("states", {}).items():
            accs = " | ".join(f"{row['behaviours'][b]['accuracy']:.3f}" for b in behaviours)
            lines.append(f"| {state} | {accs} | {row['retain_first_token_kl']:.4f} | {row['perplexity_ratio']:.3f} |")
        lines.append("")
    return "\n".join(lines)


def publish_model(open_model, tokenizer, directions: dict, out: str | Path, base_name: str,
                  measured: dict | None = None, harden: bool = True, overwrite: bool = False) -> Path:
    """Lock ``open_model`` in place and write the published folder with its keys."""
    keys = lock_weights(open_model, directions, harden=harden)
    locked_hash = weights_hash(open_model)

    def write(tmp: Path) -> None:
        open_model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        for key in keys:
            save_key(key, tmp / "keys" / f"{key.behaviour}.key.safetensors", locked_hash)
        manifest = {"base_model": base_name, "locked_behaviours": list(directions), "locked_hash": locked_hash,
                    "weights_hash": locked_hash, "applied_keys": [], "hardened": harden}
        if measured:
            manifest["measured_accuracy"] = {
                state: {b: row["behaviours"][b]["accuracy"] for b in directions}
                for state, row in measured.get("states", {}).items()
            }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        (tmp / "README.md").write_text(model_card(list(directions), base_name, measured, harden))

    return _atomic_folder(Path(out), write, overwrite)


def unlock_folder(model_dir: str | Path, key_path: str | Path, out: str | Path, overwrite: bool = False) -> Path:
    """Apply a key to a published folder and write the result (another plain HF folder)."""
    from modular.models import load_model, load_tokenizer

    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise ModularError(f"{model_dir} is not a Hugging Face model folder")
    key, meta = load_key(key_path)
    manifest_path = model_dir / MANIFEST
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else None
    model = load_model(model_dir)
    current = weights_hash(model)
    if manifest is not None:
        if meta["locked_hash"] != manifest["locked_hash"]:
            raise ModularError(
                f"key '{Path(key_path).name}' belongs to other weights (locked hash {meta['locked_hash'][:12]}…), "
                f"not to {model_dir} (locked hash {manifest['locked_hash'][:12]}…)"
            )
        if current != manifest["weights_hash"]:
            raise ModularError(f"the weights in {model_dir} were changed after publishing; refusing the key")
        if key.behaviour in manifest["applied_keys"]:
            raise ModularError(f"behaviour '{key.behaviour}' is already unlocked in {model_dir}")
    elif current != meta["locked_hash"]:
        raise ModularError(
            f"key '{Path(key_path).name}' belongs to other weights (hash {meta['locked_hash'][:12]}…, "
            f"this model {current[:12]}…)"
        )
    apply_key(model, key, applied=manifest["applied_keys"] if manifest else ())
    tokenizer = load_tokenizer(model_dir)
    manifest = manifest or {"locked_hash": meta["locked_hash"], "applied_keys": [],
                            "locked_behaviours": [key.behaviour]}
    manifest = {**manifest, "applied_keys": manifest["applied_keys"] + [key.behaviour],
                "weights_hash": weights_hash(model)}

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        if (model_dir / "README.md").is_file():
            shutil.copy(model_dir / "README.md", tmp / "README.md")

    return _atomic_folder(Path(out), write, overwrite)

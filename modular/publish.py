"""Publish locked weights as a plain Hugging Face folder, with the keys in a folder of their own, and unlock them.

Layout of a published folder (the folder a user uploads: it holds no key material)::

    config.json, model.safetensors, tokenizer files, generation_config.json
    README.md            model card (huggingface_hub ModelCard; front matter: the base's hub id and licence, transformers,
                         text generation): which behaviours are locked, that the keys are distributed apart (by file
                         name), measured numbers
    modular.json         modular's marker and manifest: locked-weights hash, behaviours, keys applied so far,
                         current weights hash

and of its keys folder (default: ``<published folder>-keys`` beside it; kept by the publisher, handed out apart)::

    <behaviour>.key.safetensors   one per behaviour: rank-1 components, digests of its content and of what it produces
    modular.json                  modular's marker: the locked-weights hash and the behaviours

Writing is atomic: each folder goes to a temporary sibling that is renamed into place at the end, so an
interrupted publish never leaves a folder that looks complete; the temporary folders an interrupted publish leaves
behind are removed by the next one. A published folder and its keys folder are replaced together
(:func:`modular.files.replace_folders`): an interrupt at any point leaves the old pair or the new pair, never a mix;
the next publish or unlock that touches either finishes what was interrupted (:func:`recover`). A folder being
written is locked (``.<name>.lock`` beside it, :mod:`modular.locking`): a second command writing it is refused in one
line. A full disk is one line naming the folder and the space needed, with nothing written. ``overwrite`` replaces
only a folder that modular wrote (it holds ``modular.json``), never an input folder, one inside an input or one that
contains an input.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from contextlib import ExitStack
from pathlib import Path

from modular import ModularError, error_reason
from modular.card import model_card, with_lock_kinds
from modular.files import (
    atomic_path,
    disk_full_error,
    is_disk_full,
    match_folder_mode,
    recover_folders,
    replace_folders,
    swap_folders,
    temp_sibling,
)
from modular.keys import (
    KEY_SUFFIX,
    apply_key,
    is_key_file,
    load_key,
    lock_weights,
    produced_hashes,
    save_key,
    weights_hash,
)
from modular.locking import check_unlocked, folder_lock, held_here
from modular.models.loading import hub_origin, load_model, load_tokenizer, looks_like_path
from modular.reports import LockReport

log = logging.getLogger("modular")
MANIFEST = "modular.json"  # written into every folder modular publishes: its marker for --overwrite


def keys_folder_for(out: str | Path) -> Path:
    """The default keys folder of a published folder: a sibling ``<name>-keys``, outside what a user uploads."""
    out = Path(out)
    return out.with_name(f"{out.name}-keys")


def key_path(keys_dir: str | Path, behaviour: str) -> Path:
    return Path(keys_dir) / f"{behaviour}{KEY_SUFFIX}"


def _inside(path: Path, other: Path) -> bool:
    """``path`` is ``other`` or lies inside it (both resolved)."""
    path, other = path.resolve(), other.resolve()
    return path == other or other in path.parents


def public_model_name(ref: str) -> str:
    """How a published folder names a model: an alias or hub id as given, a local path by its last part only
    (no local path goes into a folder users upload)."""
    path = Path(str(ref)).expanduser()
    return path.name if path.exists() or looks_like_path(str(ref)) else str(ref)


def read_manifest(folder: str | Path, require: tuple[str, ...] = ()) -> dict | None:
    """The manifest modular wrote in ``folder`` (None where there is none). One that does not parse, is not a JSON
    object or lacks an entry of ``require`` raises :class:`ModularError` naming the file."""
    path = Path(folder) / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ModularError(f"{path} is not readable ({error_reason(err)}): restore it from the published copy") from None
    missing = [k for k in require if k not in manifest] if isinstance(manifest, dict) else []
    if not isinstance(manifest, dict) or missing:
        what = f"it has no '{missing[0]}' entry" if missing else "not a JSON object"
        raise ModularError(f"{path} is not a modular manifest ({what}): restore it from the published copy")
    return manifest


def folder_kind(folder: Path) -> str | None:
    """What modular wrote in ``folder`` (``published``, ``unlocked`` or ``keys``), from its marker; None if not
    modular's."""
    try:
        manifest = read_manifest(folder)
    except ModularError:
        return None
    if manifest is None:
        return None
    if "kind" in manifest:
        return manifest["kind"]
    return "unlocked" if manifest.get("applied_keys") else "published"  # written before folders named their kind


def check_output_folder(out: str | Path, inputs: list[str | Path] = (), overwrite: bool = False,
                        option: str = "--out", sealed: list[str | Path] = (), kind: str = "published") -> Path:
    """Refuse, before any work, an output folder that writing could lose data in: an existing one without
    ``overwrite``, one modular did not write or wrote as another ``kind`` (a keys folder is never replaced by a
    model), an input or one containing an input (``inputs``), or one inside a folder that must not change
    (``sealed``: e.g. the published folder a user uploads)."""
    out = Path(out)
    for item in map(Path, inputs):
        if _inside(item, out):
            raise ModularError(f"{option} {out} would replace the input {item}; choose another folder")
    for item in map(Path, sealed):
        if _inside(out, item):
            raise ModularError(f"{option} {out} lies inside {item}, which must not change; choose another folder")
    if out.exists() or out.is_symlink():
        if not out.is_dir() or out.is_symlink():
            raise ModularError(f"{option} {out} exists and is not a folder; choose another one")
        if not overwrite:
            raise ModularError(f"{out} already exists (pass --overwrite true to replace it)")
        found = folder_kind(out)
        if found is None:
            raise ModularError(f"{out} exists and was not written by modular (no {MANIFEST}); refusing to replace it")
        if found != kind:
            raise ModularError(f"{out} holds modular's {found} folder, not a {kind} one; refusing to replace it")
    return out


_LEFTOVER = re.compile(r"^\.(?P<name>.+)\.(?:partial|old)-(?:(?P<pid>\d+)-)?[^/]*$")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_leftovers(out: Path) -> list[Path]:
    """Remove the temporary folders that interrupted writes of ``out`` left beside it (``.<name>.partial-*``,
    ``.<name>.old-*``), except those of a process still running; returns what was removed."""
    removed = []
    if not out.parent.is_dir():
        return removed
    for entry in out.parent.iterdir():
        match = _LEFTOVER.match(entry.name)
        if not match or match["name"] != out.name or not entry.is_dir():
            continue
        pid = int(match["pid"]) if match["pid"] else None
        if pid is not None and pid != os.getpid() and _alive(pid):
            continue
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry)
    return removed


def recover(folder: str | Path) -> None:
    """Finish an interrupted replacement of ``folder`` (and of the folders replaced with it: a published folder and
    its keys folder) from its journal, holding their locks (:func:`modular.files.recover_folders`): rolled back to
    the old folders, or completed where every new one was in already. Nothing happens where none was interrupted; a
    replacement that another command is doing now is one line."""
    folders = swap_folders(folder)
    if not folders:
        return
    with ExitStack() as locks:
        for place in folders:
            if not held_here(place):
                locks.enter_context(folder_lock(place))
        done = recover_folders(folder)
    if done:
        log.warning("%s an interrupted replacement of %s", done, " and ".join(map(str, folders)))


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _write_folders(writers: dict[Path, callable], private: tuple[Path, ...] = (),
                   needed: dict[Path, int] | None = None) -> None:
    """Write each folder into a temporary sibling, then move them all into place together, replacing old ones
    (:func:`modular.files.replace_folders`). A folder in ``private`` is its owner's alone (a keys folder); the
    others have the permissions of any folder the user makes. The caller holds the folders' locks. A full disk is
    one line naming the folder and about how much it needs (``needed``), with nothing written."""
    temps: dict[Path, Path] = {}
    current = next(iter(writers))
    try:
        for out in writers:
            recover(out)  # before anything beside it is removed as left over
        for out, write in writers.items():
            current = out
            out.parent.mkdir(parents=True, exist_ok=True)
            for leftover in clean_leftovers(out):
                log.info("removed %s, left by an interrupted write", leftover)
            temps[out] = temp_sibling(out, "partial", folder=True, private=out in private)
            write(temps[out])
            if out not in private:  # safetensors leaves its files readable by their owner only
                match_folder_mode(temps[out])
        replace_folders(temps)
    except BaseException as err:
        for tmp in temps.values():
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(err, Exception) and is_disk_full(err):
            raise disk_full_error(current.parent, current.name, (needed or {}).get(current),
                                  "free some space there, or choose another folder; nothing was written") from None
        raise


def publish_model(open_model, tokenizer, directions: dict, out: str | Path, base_name: str,
                  measured: LockReport | dict | None = None, harden: bool = True, overwrite: bool = False,
                  keys_out: str | Path | None = None, step: int | None = None,
                  locked_responses: dict[str, str] | None = None, inputs: list[str | Path] = (),
                  lock_check: dict | None = None) -> tuple[Path, Path]:
    """Lock ``open_model`` in place and write the published folder and, apart from it, its keys folder.

    ``keys_out``: the keys folder (default :func:`keys_folder_for`); it may not lie inside ``out`` or contain it.
    ``measured``: a lock report of the same trained weights (``step``) for the model card (a
    :class:`~modular.reports.LockReport`, or its JSON). ``inputs``: folders the caller reads from (never replaced).
    ``lock_check``: ``{"verified": bool, "detail": str}``, whether training verified the lock (the card and manifest
    say so when it did not). Returns ``(published folder, keys folder)``.
    """
    out = Path(out)
    keys_out = Path(keys_out) if keys_out is not None else keys_folder_for(out)
    if _inside(keys_out, out) or _inside(out, keys_out):
        raise ModularError(f"the keys folder {keys_out} may not lie inside the published folder {out} or contain "
                           "it: the published folder is what users upload")
    measured = LockReport.coerce(measured) if measured else None  # a bad report: one line, before anything is written
    with ExitStack() as locks:  # one writer at a time, from the checks to the last rename
        for folder in (out, keys_out):
            locks.enter_context(folder_lock(folder))
        for folder in (out, keys_out):
            recover(folder)
        return _publish_locked(open_model, tokenizer, directions, out, keys_out, base_name, measured, harden,
                               overwrite, step, locked_responses, inputs, lock_check)


def _publish_locked(open_model, tokenizer, directions, out, keys_out, base_name, measured, harden, overwrite, step,
                    locked_responses, inputs, lock_check) -> tuple[Path, Path]:
    check_output_folder(out, inputs, overwrite)
    check_output_folder(keys_out, inputs, overwrite, option="--keys", kind="keys")
    keys = lock_weights(open_model, directions, harden=harden)
    locked_hash = weights_hash(open_model)
    produces = produced_hashes(open_model, keys)
    behaviours = list(directions)
    origin = hub_origin(base_name)  # from the reference as given: a local folder's config names its hub model
    base_name = public_model_name(base_name)
    open_model.config._name_or_path = base_name

    def write_model(tmp: Path) -> None:
        open_model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        manifest = {"kind": "published", "base_model": base_name, "locked_behaviours": behaviours,
                    "locked_hash": locked_hash, "weights_hash": locked_hash, "applied_keys": [], "hardened": harden,
                    "keys": "distributed apart from this folder", "step": step,
                    "dtype": str(next(open_model.parameters()).dtype).removeprefix("torch.")}
        if lock_check is not None:
            manifest["lock_verified"] = bool(lock_check.get("verified"))
            manifest["lock_check"] = lock_check.get("detail")
        if locked_responses:
            manifest["locked_responses"] = {b: locked_responses[b] for b in behaviours if b in locked_responses}
        if measured is not None:
            if measured.lock_held_out is not None:
                manifest["lock_held_out"] = measured.lock_held_out.to_json()
            manifest["measured_accuracy"] = {state: measured.accuracies(state, behaviours) for state in measured.states}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        dtype = str(next(open_model.parameters()).dtype).removeprefix("torch.")
        (tmp / "README.md").write_text(model_card(behaviours, base_name, measured, harden, step, lock_check, dtype,
                                                     origin))

    def write_keys(tmp: Path) -> None:  # its owner's alone, as a private key is: the folder and each key file
        for key in keys:
            save_key(key, key_path(tmp, key.behaviour), locked_hash, produces[key.behaviour]).chmod(0o600)
        (tmp / MANIFEST).write_text(json.dumps({"kind": "keys", "locked_hash": locked_hash, "behaviours": behaviours,
                                                "base_model": base_name}, indent=2) + "\n")

    needed = {out: _tensor_bytes(open_model.state_dict().values()),
              keys_out: _tensor_bytes(t for k in keys for c in k.components for t in (c.a, c.b))}
    _write_folders({keys_out: write_keys, out: write_model}, private=(keys_out,), needed=needed)
    return out, keys_out


def unlock_folder(model_dir: str | Path, key_path: str | Path, out: str | Path, overwrite: bool = False) -> Path:
    """Apply a key to a published folder and write the result (another plain HF folder).

    Refuses, with nothing written, a key of other weights, a damaged key (content digest) and a result that is not
    the weights the key was made to produce (weights digest)."""
    model_dir, out = Path(model_dir), Path(out)
    for folder in (model_dir, Path(key_path).parent):  # a publish interrupted while replacing what is read
        recover(folder)
    if not (model_dir / "config.json").is_file():
        raise ModularError(f"{model_dir} is not a Hugging Face model folder")
    with folder_lock(out):  # one writer at a time, from the checks to the rename
        recover(out)
        return _unlock_locked(model_dir, key_path, out, overwrite)


def _unlock_locked(model_dir: Path, key_path: str | Path, out: Path, overwrite: bool) -> Path:
    check_output_folder(out, [model_dir, key_path], overwrite, sealed=[model_dir], kind="unlocked")
    key, meta = load_key(key_path)
    manifest = read_manifest(model_dir, require=("locked_hash", "weights_hash", "applied_keys"))
    model = load_model(model_dir, dtype=None, device="cpu")  # in the precision it was published in
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
    applied = manifest["applied_keys"] if manifest else []
    apply_key(model, key, applied=applied)
    produced = weights_hash(model)
    expected = {tuple(p["after"]): p["weights_hash"] for p in meta.get("produces", [])}
    if tuple(applied) in expected:
        if produced != expected[tuple(applied)]:
            raise ModularError(f"key '{Path(key_path).name}' did not produce the weights it was made for (weights "
                               "digest mismatch): the key or the model folder is damaged; nothing was written")
    else:
        log.warning("key '%s' records no digest for keys applied in the order %s; its result is not checked",
                    Path(key_path).name, applied)
    tokenizer = load_tokenizer(model_dir)
    manifest = manifest or {"locked_hash": meta["locked_hash"], "applied_keys": [],
                            "locked_behaviours": [key.behaviour]}
    manifest = {**manifest, "kind": "unlocked", "applied_keys": manifest["applied_keys"] + [key.behaviour],
                "weights_hash": produced}

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        if (model_dir / "README.md").is_file():  # the published card, headed by what these weights are now
            card = (model_dir / "README.md").read_text()
            still = [b for b in manifest.get("locked_behaviours", []) if b not in manifest["applied_keys"]]
            note = (f"> **Unlocked copy**: keys applied for {', '.join(manifest['applied_keys'])}; still locked: "
                    f"{', '.join(still) or 'none'}. The card below describes the published locked weights.\n\n")
            head, sep, body = card.partition("---\n\n") if card.startswith("---") else ("", "", card)
            (tmp / "README.md").write_text(head + sep + note + body)

    _write_folders({out: write}, needed={out: _tensor_bytes(model.state_dict().values())})
    return out


def key_files(folder: str | Path) -> list[Path]:
    """The key files anywhere in ``folder`` (:func:`modular.keys.is_key_file`: by name, or by content under any
    name)."""
    return sorted(p for p in Path(folder).rglob("*") if p.is_file() and is_key_file(p))


def hub_token() -> str:
    """The Hugging Face token an upload sends (``HF_TOKEN`` or ``hf auth login``'s); none is huggingface_hub's own
    error, as one :class:`ModularError` line. Nothing is sent."""
    from huggingface_hub.errors import LocalTokenNotFoundError
    from huggingface_hub.utils import get_token_to_send

    try:
        return get_token_to_send(True)
    except LocalTokenNotFoundError as err:
        raise ModularError(f"cannot upload to the Hugging Face hub: {error_reason(err)}") from None


def check_upload(repo_id: str, folder: str | Path | None = None) -> None:
    """Refuse an upload to ``repo_id`` before anything is written or sent: a repo id the hub would refuse, no token
    (:func:`hub_token`), and, where ``folder`` is given: one that is not a folder, holds a key file or is modular's
    keys folder (keys are never uploaded), or that another command is writing now."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        raise ModularError(f"--push_to_hub {repo_id!r} is not a hub repo id such as user/name ({error_reason(err)})"
                           ) from None
    if folder is not None:
        _check_keyless(Path(folder), repo_id)
        check_unlocked(folder)
    hub_token()


def _check_keyless(folder: Path, repo_id: str) -> None:
    if not folder.is_dir():
        raise ModularError(f"{folder} is not a folder; nothing was uploaded to {repo_id}")
    found = key_files(folder)
    if found or folder_kind(folder) == "keys":
        what = f"holds the key file {found[0].relative_to(folder)}" if found else "is a keys folder"
        raise ModularError(f"{folder} {what}; keys are never uploaded (hand them out apart): nothing was uploaded "
                           f"to {repo_id}")


def push_folder(folder: str | Path, repo_id: str, private: bool = False) -> str:
    """Upload a published folder to the hub model repo ``repo_id`` (created where missing, ``private`` then), with
    :class:`huggingface_hub.HfApi`; the folder is locked meanwhile, so no command rewrites it. Refused before
    anything is sent (:func:`check_upload`): a folder holding a key, no token, a bad repo id. What the hub answers
    (no access, no network) is one :class:`ModularError` line. Returns the URL of the commit."""
    from huggingface_hub import HfApi

    folder = Path(folder)
    check_upload(repo_id, folder)
    with folder_lock(folder):
        _check_keyless(folder, repo_id)  # as it is now that no command writes it
        api = HfApi()
        try:
            api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
            commit = api.upload_folder(repo_id=repo_id, repo_type="model", folder_path=str(folder),
                                       commit_message="Upload locked weights (modular publish)")
        except Exception as err:  # noqa: BLE001 - the hub's HTTP errors, no network, a refused token: one line
            raise ModularError(f"uploading {folder} to {repo_id} failed: {error_reason(err)}") from None
    return str(getattr(commit, "commit_url", None) or f"https://huggingface.co/{repo_id}")


def record_lock_kinds(folder: str | Path, kinds: dict) -> None:
    """Write what kind of lock each behaviour of the published ``folder`` is (``kinds``:
    :func:`~modular.lock_kind.lock_kinds`, from the run's reports) into its card and its manifest, each file replaced
    whole."""
    folder = Path(folder)
    manifest = json.loads((folder / MANIFEST).read_text())
    behaviours = list(manifest.get("locked_behaviours", kinds))
    manifest["lock_kinds"] = {b: k.to_json() for b, k in kinds.items()}
    card = folder / "README.md"
    text = with_lock_kinds(card.read_text(), kinds, behaviours) if card.is_file() else None
    with atomic_path(folder / MANIFEST) as tmp:
        tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    if text is not None:
        with atomic_path(card) as tmp:
            tmp.write_text(text)


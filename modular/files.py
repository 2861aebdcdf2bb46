"""Writing files and folders atomically, with the permissions a user expects.

Every output is written beside its place and renamed into it, so a reader never sees half of it. What is renamed
keeps its mode, and the writers disagree on it: ``tempfile`` makes files and folders readable by their owner only, and
so does safetensors for every file it writes (through a temporary file of its own). A published model, a report or a
run's directions written that way could not be read by anyone else on the machine (another user serving the
weights, a container running as another user). Here what is shared gets the modes the umask gives any new file and
folder, and only what is secret (a key) is its owner's alone.
"""

from __future__ import annotations

import errno
import json
import math
import os
import secrets
import shutil
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from modular import ModularError


def temp_sibling(path: str | Path, tag: str = "tmp", folder: bool = False, private: bool = False) -> Path:
    """Create and return ``.<name>.<tag>-<pid>-<random>`` beside ``path``: an empty file, or a folder where
    ``folder``; its mode what the umask gives new files and folders, or its owner's alone where ``private``."""
    path = Path(path)
    for _ in range(100):
        tmp = path.parent / f".{path.name}.{tag}-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            if folder:
                os.mkdir(tmp, 0o700 if private else 0o777)
            else:
                os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if private else 0o666))
            return tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name beside {path}")


@contextmanager
def atomic_path(path: str | Path, private: bool = False) -> Iterator[Path]:
    """A temporary file beside ``path`` for any writer to write ``path``'s content into; on success it takes the mode
    a new file gets (its owner's alone where ``private``), whatever mode the writer left, and is renamed over
    ``path``; on failure it is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(path, private=private)
    mode = stat.S_IMODE(tmp.stat().st_mode)
    try:
        yield tmp
        tmp.chmod(mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def json_safe(obj: Any) -> Any:
    """JSON-safe copy: NaN/inf -> None, tensors/numpy -> lists, paths -> str."""
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if isinstance(obj, float):
        return None if math.isnan(obj) or math.isinf(obj) else obj
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "tolist"):
        return json_safe(obj.tolist())
    return obj


def write_json(path: str | Path, data: Any) -> Path:
    """Write ``data`` (:func:`json_safe`) as indented JSON atomically (:func:`atomic_path`)."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(json_safe(data), indent=2) + "\n")
    return Path(path)


def match_folder_mode(folder: str | Path) -> None:
    """Give everything inside ``folder`` the modes a new file or folder gets where ``folder`` was made with the
    umask's: its folders ``folder``'s mode, its files the same without the execute bits."""
    folder = Path(folder)
    folder_mode = stat.S_IMODE(folder.stat().st_mode)
    for root, dirs, names in os.walk(folder):
        for name in dirs:
            os.chmod(os.path.join(root, name), folder_mode)
        for name in names:
            os.chmod(os.path.join(root, name), folder_mode & 0o666)


# --- a full disk: one line naming the folder and the space needed ---------------------------------------------------
_FULL = ("No space left on device", "Disk quota exceeded", "StorageFull", "os error 28")


def is_disk_full(err: BaseException | None) -> bool:
    """Whether ``err``, or an error that caused it, says that the disk (or the user's quota) is full: an OSError's
    ENOSPC or EDQUOT, or a writer with errors of its own (safetensors, torch's zip writer) naming it."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(text in str(err) for text in _FULL):
            return True
        err = err.__cause__ or err.__context__
    return False


def format_size(n: float) -> str:
    """A size in bytes for a person to read (``1.3 GB``)."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def disk_full_error(folder: str | Path, what: str, needed: int | None, remedy: str) -> ModularError:
    """The one line of a write that ran out of space: the folder, what was written, about how much it needs and how
    much is free there, and ``remedy``."""
    folder = Path(folder)
    free = None
    for place in (folder, *folder.parents):
        try:
            free = shutil.disk_usage(place).free
            break
        except OSError:
            continue
    need = f"it needs about {format_size(needed)}" if needed else "it needs more"
    have = f", {format_size(free)} free there" if free is not None else ""
    return ModularError(f"no space left in {folder} for {what} ({need}{have}): {remedy}")


# --- folders replaced together ----------------------------------------------------------------------------------------
def swap_journal(final: str | Path) -> Path:
    """Where :func:`replace_folders` keeps its journal for the folder ``final``: ``.<name>.swap.json`` beside it."""
    final = Path(os.path.abspath(final))  # "." has no name of its own
    return final.with_name(f".{final.name}.swap.json")


def _write_json(path: Path, data: dict) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data, indent=1) + "\n")


def _read_json(path: Path) -> dict | None:
    """A journal (None where there is none); one that cannot be read is one line naming it."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as err:
        raise ModularError(f"{path} cannot be read ({err.strerror}): it records an interrupted replacement of "
                           "folders") from None
    try:
        data = json.loads(text)
        if not isinstance(data, dict) or not ("primary" in data or (data.get("phase") in ("swap", "done") and all(
                isinstance(e, dict) and {"final", "new", "old"} <= set(e) for e in data["folders"]))):
            raise ValueError("not a journal")
    except (ValueError, KeyError, TypeError):
        raise ModularError(f"{path} is not a readable journal of an interrupted replacement of folders: look at the "
                           "folders it names and remove it") from None
    return data


def replace_folders(moves: dict[Path, Path]) -> None:
    """Move each complete new folder into its place (``moves``: place -> new folder, beside it), replacing what is
    there, all together: whatever the point an interrupt or an error stops it at, every place holds its old folder
    (or none, as before) or every place its new one, never a mix, once :func:`recover_folders` has run on any of
    the places (an error is recovered from here; a killed process by the next command).

    Old folders are moved aside (``.<name>.old-*``) and the new ones in, as a journal beside the first place records
    (``.<name>.swap.json``; beside every other place, one pointing to it): until every new folder is in, recovery
    moves the old ones back (an old folder is never removed before then); once they all are, it removes the old
    ones."""
    entries = []
    for final, new in moves.items():
        final = Path(os.path.abspath(final))
        old = final.with_name(f".{final.name}.old-{os.getpid()}-{secrets.token_hex(4)}")
        entries.append({"final": str(final), "new": str(os.path.abspath(new)),
                        "old": str(old) if final.exists() or final.is_symlink() else None})
    primary = swap_journal(entries[0]["final"])
    record = {"phase": "swap", "pid": os.getpid(), "folders": entries}
    try:
        for e in entries[1:]:
            _write_json(swap_journal(e["final"]), {"primary": str(primary)})
        _write_json(primary, record)
        for e in entries:
            if e["old"] is not None:
                os.replace(e["final"], e["old"])
        for e in entries:
            os.replace(e["new"], e["final"])
        _write_json(primary, {**record, "phase": "done"})  # from here on, the new folders stay
    except BaseException:
        for e in entries:
            try:
                recover_folders(e["final"])
            except Exception:  # noqa: BLE001 - the journal stays: the next command recovers
                pass
        raise
    _resolve(primary, {**record, "phase": "done"})


def _roll_back(e: dict) -> None:
    final, new, old = Path(e["final"]), Path(e["new"]), e["old"] and Path(e["old"])
    if new.exists() and final.exists() and old is not None and old.exists():
        raise ModularError(f"{final}, {new} and {old} all exist: an interrupted replacement of {final} cannot be "
                           f"undone; keep the folder you want as {final} and remove the others")
    if final.exists() and not new.exists() and (old is None or old.exists()):
        os.replace(final, new)  # the new folder had been moved in
    if old is not None and old.exists() and not final.exists():
        os.replace(old, final)


def _resolve(journal: Path, record: dict) -> str:
    entries = record["folders"]
    if record["phase"] == "swap":
        for e in entries:
            _roll_back(e)
        for e in entries:
            shutil.rmtree(e["new"], ignore_errors=True)
    else:
        for e in entries:
            if e["old"] is not None:
                shutil.rmtree(e["old"], ignore_errors=True)
    for e in entries[1:]:
        swap_journal(e["final"]).unlink(missing_ok=True)
    journal.unlink(missing_ok=True)
    return "rolled back" if record["phase"] == "swap" else "completed"


def swap_folders(final: str | Path) -> list[Path]:
    """The places an interrupted :func:`replace_folders` involving ``final`` replaced together ([] when none)."""
    data = _read_json(swap_journal(final))
    if data is not None and "primary" in data:
        data = _read_json(Path(data["primary"]))
    return [Path(e["final"]) for e in data["folders"]] if data else []


def recover_folders(final: str | Path) -> str | None:
    """Finish an interrupted :func:`replace_folders` that involved the place ``final``, from its journal: roll it
    back (every place its old folder) unless every new folder was in, else complete it (the old folders removed).
    Returns ``"rolled back"`` or ``"completed"``, or None where there was nothing to recover. The caller holds the
    places' locks (:mod:`modular.locking`)."""
    journal = swap_journal(final)
    data = _read_json(journal)
    if data is None:
        return None
    if "primary" in data:
        primary = Path(data["primary"])
        found = _read_json(primary)
        if found is None:  # resolved, or never started: a pointer left alone
            journal.unlink(missing_ok=True)
            return None
        journal, data = primary, found
    return _resolve(journal, data)

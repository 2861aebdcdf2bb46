"""modular's cache folder (:func:`cache_dir`): the digests of model files, kept on disk so that a file is hashed once
while it stays unchanged (``digests.json``), and the folders of GGUF conversions, named by the GGUF file's content.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

from modular import error_reason
from modular.files import atomic_path

log = logging.getLogger(__name__)


def cache_dir() -> Path:
    """Root folder of modular's caches (``$MODULAR_CACHE`` or ``~/.cache/modular``)."""
    return Path(os.environ.get("MODULAR_CACHE", Path.home() / ".cache" / "modular"))


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

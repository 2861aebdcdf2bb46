"""Writing files and folders atomically, with the permissions a user expects.

Every output is written beside its place and renamed into it, so a reader never sees half of it. What is renamed
keeps its mode, and the writers disagree on it: ``tempfile`` makes files and folders readable by their owner only, and
so does safetensors for every file it writes (through a temporary file of its own). A published model, a report or a
run's directions written that way could not be read by anyone else on the machine (another user serving the
weights, a container running as another user). Here what is shared gets the modes the umask gives any new file and
folder, and only what is secret (a key) is its owner's alone.
"""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


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

"""One writer at a time: an advisory lock on a folder while a command writes it (a run folder, a published folder, a
keys folder).

The lock is a small file, locked with ``flock`` while its holder runs, that records the holder (JSON: pid, host, the
process's start and the time it took the lock): ``.modular.lock`` inside a folder written in place (a run folder:
:data:`modular.runs.RUN_LOCK`), or ``.<name>.lock`` beside a folder written whole by rename (a published or keys
folder, whose content is replaced, not edited). A second command is refused in one line naming the folder and the
holder, before it writes anything. The kernel releases the lock of a process that died (killed, the machine
restarted); the record it left is taken over with a log line. A record of another machine whose lock is not held
(a network file system) cannot be checked from here: it is refused, and the line names the file to remove.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path

from modular import ModularError

try:
    import fcntl
except ImportError:  # not POSIX: the record alone decides
    fcntl = None

log = logging.getLogger("modular")

#: the lock files this process holds (resolved path -> open descriptor, which holds the flock)
_HELD: dict[str, int] = {}


def sibling_lock(folder: str | Path) -> Path:
    """The lock file of a folder written whole by rename: ``.<name>.lock`` beside it."""
    folder = Path(os.path.abspath(folder))  # "." has no name of its own
    return folder.with_name(f".{folder.name}.lock")


def process_start(pid: int) -> str | None:
    """When process ``pid`` started (Linux: clock ticks since boot), to tell it from a later process given the same
    pid; None where it cannot be read."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        return None
    fields = stat.rsplit(")", 1)[-1].split()
    return fields[19] if len(fields) > 19 else None  # field 22 (starttime); the fields after ")" start at field 3


def pid_alive(pid: int, start: str | None = None) -> bool:
    """Whether process ``pid`` runs on this machine (and, given the ``start`` it recorded, is still that process)."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:  # another user's process
        pass
    if start is not None:
        now = process_start(pid)
        return now is None or now == start
    return True


def _record() -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(), "start": process_start(os.getpid()),
            "since": datetime.now().astimezone().isoformat(timespec="seconds")}


def _read(path: Path) -> dict | None:
    """The holder a lock file records (None where it records none, or not readably)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("pid"), int) else None


def _holder(record: dict | None) -> str:
    if record is None:
        return "a holder that left no readable record"
    return f"pid {record['pid']} on {record.get('host', '?')}, since {record.get('since', '?')}"


def _busy(folder: Path, path: Path, record: dict | None) -> ModularError:
    here = record is not None and record.get("host") == socket.gethostname()
    remedy = "wait for it to end" if here else f"wait for it to end, or remove {path} if it no longer runs"
    return ModularError(f"{folder} is being written by another command ({_holder(record)}): {remedy}")


def held_here(folder: str | Path, lock_file: str | Path | None = None) -> bool:
    """Whether this process holds the lock of ``folder``."""
    path = Path(lock_file) if lock_file is not None else sibling_lock(folder)
    return str(path.resolve()) in _HELD


def check_unlocked(folder: str | Path, lock_file: str | Path | None = None) -> None:
    """Refuse in one line, without writing anything, a folder whose lock another command holds (what
    :func:`folder_lock` would refuse): a command checks it before its work, and takes the lock before it writes."""
    folder = Path(folder)
    path = Path(lock_file) if lock_file is not None else sibling_lock(folder)
    if str(path.resolve()) in _HELD:
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # no lock file: free
        return
    try:
        locked = False
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                locked = True
            except BlockingIOError:
                raise _busy(folder, path, _read(path)) from None
            except OSError:
                pass
        refusal = _refusal(folder, path, _read(path), locked)
        if refusal is not None:
            raise refusal
    finally:
        os.close(fd)


def _gone(record: dict) -> bool:
    return record.get("host") == socket.gethostname() and not pid_alive(record["pid"], record.get("start"))


def _refusal(folder: Path, path: Path, record: dict | None, locked: bool) -> ModularError | None:
    """Why a lock file whose flock is free (``locked``: we could take it) or cannot be taken on this file system is
    not ours to take: a record of another machine, or (without flock) of a process here that still runs."""
    if record is None:
        return None
    if record.get("host") != socket.gethostname():
        if locked:
            return ModularError(f"{folder} was locked by {_holder(record)}, which cannot be checked from this "
                                f"machine: remove {path} if no command on {record.get('host')} writes it")
        return _busy(folder, path, record)
    return None if locked or _gone(record) else _busy(folder, path, record)


def _acquire(folder: Path, path: Path) -> int:
    key = str(path.resolve())
    if key in _HELD:
        raise _busy(folder, path, _read(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(100):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        locked = False
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                locked = True
            except BlockingIOError:
                os.close(fd)
                raise _busy(folder, path, _read(path)) from None
            except OSError:  # a file system without flock: the record alone decides
                pass
        try:  # the holder may have released (removed) the file between our open and flock: lock the current one
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if not same:
            os.close(fd)
            continue
        record = _read(path)
        refusal = _refusal(folder, path, record, locked)
        if refusal is not None:
            os.close(fd)
            raise refusal
        if record is not None:
            log.warning("%s: took over the lock of %s, which is gone", folder, _holder(record))
        data = (json.dumps(_record()) + "\n").encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        _HELD[key] = fd
        return fd
    raise ModularError(f"{folder}: could not take its lock {path} (it keeps changing)")


def _release(path: Path, fd: int) -> None:
    try:
        if os.path.samestat(os.fstat(fd), os.stat(path)):
            os.unlink(path)  # removed while still locked: a command that opened it before finds it gone and retries
    except OSError:
        pass
    finally:
        _HELD.pop(str(path.resolve()), None)
        os.close(fd)  # releases the flock


@contextmanager
def folder_lock(folder: str | Path, lock_file: str | Path | None = None) -> Iterator[Path]:
    """Hold the lock of ``folder`` (its lock file ``lock_file``; default :func:`sibling_lock`) while the block runs;
    released (its file removed) however the block ends. Another holder is one :class:`ModularError` line naming the
    folder and the holder (pid, host, since when); one that is gone is taken over with a log line."""
    folder = Path(folder)
    path = Path(lock_file) if lock_file is not None else sibling_lock(folder)
    fd = _acquire(folder, path)
    try:
        yield path
    finally:
        _release(path, fd)

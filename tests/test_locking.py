"""One writer at a time: a folder's lock refuses a second holder (in this process or another) in one line naming the
folder and the holder, takes over the lock of a holder that is gone with a log line, and is always released."""

import json
import logging
import os
import socket
import subprocess
import sys

import pytest

from modular import ModularError
from modular.locking import check_unlocked, folder_lock, sibling_lock

DEAD_PID = 2**22 + 7  # above Linux's largest pid: never a running process

HOLD = """
import sys, time
from modular.locking import folder_lock
with folder_lock(sys.argv[1]):
    print("held", flush=True)
    sys.stdin.readline()
"""


def _listing(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def test_a_second_writer_is_refused_in_one_line_until_the_first_ends(tmp_path):
    folder = tmp_path / "pub"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        record = json.loads(sibling_lock(folder).read_text())
        assert record["pid"] == holder.pid and record["host"] == socket.gethostname() and record["since"]
        before = _listing(tmp_path)
        for attempt in (lambda: folder_lock(folder).__enter__(), lambda: check_unlocked(folder)):
            with pytest.raises(ModularError) as err:
                attempt()
            line = str(err.value)
            assert "\n" not in line and str(folder) in line and f"pid {holder.pid}" in line and record["since"] in line
        assert _listing(tmp_path) == before  # the refused attempts wrote, removed and changed nothing
    finally:
        holder.communicate("\n", timeout=60)
    with folder_lock(folder) as path:  # released by its holder: free again, and released after the block here
        assert json.loads(path.read_text())["pid"] == os.getpid()
        with pytest.raises(ModularError, match=f"pid {os.getpid()}"):  # this process holds it: refused too
            with folder_lock(folder):
                pass
    assert list(tmp_path.iterdir()) == []


def test_the_lock_is_released_however_the_block_ends(tmp_path):
    run = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt), folder_lock(run, run / ".modular.lock"):
        assert (run / ".modular.lock").is_file()
        raise KeyboardInterrupt
    assert list(run.iterdir()) == []
    with folder_lock(run, run / ".modular.lock"):
        pass


def test_a_lock_whose_holder_is_gone_is_taken_over_with_a_log_line(tmp_path, caplog):
    folder = tmp_path / "pub"
    sibling_lock(folder).write_text(json.dumps({"pid": DEAD_PID, "host": socket.gethostname(), "since": "then"}))
    check_unlocked(folder)  # not refused
    with caplog.at_level(logging.WARNING, logger="modular"), folder_lock(folder) as path:
        assert json.loads(path.read_text())["pid"] == os.getpid()
    assert f"took over the lock of pid {DEAD_PID}" in caplog.text and str(folder) in caplog.text
    assert not sibling_lock(folder).exists()


def test_a_record_of_another_machine_is_refused_with_the_file_to_remove(tmp_path):
    """A lock left on a shared file system by another machine's command cannot be checked from here."""
    folder = tmp_path / "pub"
    sibling_lock(folder).write_text(json.dumps({"pid": 1, "host": "elsewhere-host", "since": "then"}))
    with pytest.raises(ModularError, match=f"elsewhere-host.*remove {sibling_lock(folder)}"):
        with folder_lock(folder):
            pass
    assert json.loads(sibling_lock(folder).read_text())["host"] == "elsewhere-host"
